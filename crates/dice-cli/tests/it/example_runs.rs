//! Evaluating the built-in examples (`examples/`, `dice_test_support::examples_dir`): their
//! candidates, the verdicts stored, the summary printed.

use dice_eval::{Store, Verdict};
use dice_test_support::examples_dir;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Output};

/// The examples' lines for problem 2 (a correct fused kernel, a raw answer without code, the
/// renamed reference) as their own JSONL file.
pub(crate) fn problem2_candidates(dir: &Path) -> PathBuf {
    let all = std::fs::read_to_string(examples_dir().join("candidates.jsonl")).unwrap();
    let lines: Vec<&str> = all
        .lines()
        .filter(|l| l.contains("\"problem_id\": 2") || l.contains("\"problem_id\":2"))
        .collect();
    assert_eq!(lines.len(), 3, "the examples changed");
    let path = dir.join("problem2.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// Each stored sample's verdict by (problem, sample) (for the tests that run several workers).
pub(crate) fn verdicts(store: &Store) -> BTreeMap<(u32, u32), Verdict> {
    let samples = store.samples().unwrap();
    samples
        .iter()
        .map(|s| ((s.problem_id, s.sample_id), s.verdict))
        .collect()
}

/// The number N of "evaluated N samples", or of a line "N samples were {what}" (0 without one).
pub(crate) fn samples(stdout: &str, what: &str) -> usize {
    let line = stdout.lines().find_map(|l| match what {
        "evaluated" => l.strip_prefix("evaluated "),
        _ => l
            .strip_suffix(what)
            .and_then(|l| l.strip_suffix(" samples were ")),
    });
    line.map_or(0, |l| l.split(' ').next().unwrap().parse().unwrap())
}

/// The standard output and error of a `dice` process that must succeed, once it ended.
pub(crate) fn finished(child: Child) -> (String, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    );
    assert!(status.success(), "{stdout}\n{stderr}");
    (stdout, stderr)
}
