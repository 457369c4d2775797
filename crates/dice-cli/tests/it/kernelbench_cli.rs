//! `dice kernelbench` as a user runs it on the formula golden's tiny checkpoint (whose answers
//! hold no valid code: the path is what is tested), resumed and started over; and `dice report`
//! setting its run beside a `dice eval` run of the examples.

use crate::common::{dice, path_arg};
use crate::example_runs::problem2_candidates;
use dice_eval::Store;
use dice_test_support::checkpoint::{formula_tiny, FORMULA_TINY};
use dice_test_support::{examples_dir, shared_build_cache};
use serde_json::Value;
use std::path::Path;
use std::process::Output;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `dice kernelbench` on level 1 of the examples, 8 new tokens per answer.
fn kernelbench(run: &Path, extra: &[&str]) -> Output {
    let examples_tree = examples_dir().join("kernelbench");
    let cache = shared_build_cache();
    let mut args = vec![
        "kernelbench",
        "--model",
        path_arg(formula_tiny()),
        "--kernelbench",
        path_arg(&examples_tree),
        "--levels",
        "1",
        "--device",
        "cpu",
        "--max-new-tokens",
        "8",
        "--no-stop",
        "--build-cache",
        path_arg(&cache),
        "--run",
        path_arg(run),
    ];
    args.extend(extra);
    dice(&args)
}

fn succeeded(out: &Output) -> String {
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
}

fn stored_keys(run: &Path) -> Vec<(u32, u32, u32)> {
    let store = Store::open(&run.join("dice.db")).unwrap();
    let mut keys: Vec<_> = store
        .samples()
        .unwrap()
        .iter()
        .map(|s| (s.level, s.problem_id, s.sample_id))
        .collect();
    keys.sort();
    keys
}

#[test]
fn runs_end_to_end_resumes_and_starts_over() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let stdout = succeeded(&kernelbench(&run, &["--samples", "2"]));
    assert!(stdout.contains("evaluated 4 samples"), "{stdout}");
    assert!(stdout.contains("| Exec | 0.0% | 0.0% |"), "{stdout}");
    assert_eq!(
        stored_keys(&run),
        [(1, 1, 0), (1, 1, 1), (1, 2, 0), (1, 2, 1)]
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
    let level1 = &report["runs"][0]["levels"]["1"];
    assert_eq!(
        (level1["problems"].as_u64(), level1["samples"].as_u64()),
        (Some(2), Some(4))
    );
    assert_eq!(report["runs"][0]["label"], FORMULA_TINY);
    assert!(std::fs::read_to_string(run.join("report.md"))
        .unwrap()
        .contains("## Level 1"));
    let html = std::fs::read_to_string(run.join("report.html")).unwrap();
    assert_eq!(html.matches("<svg").count(), 3);

    let candidates = std::fs::read(run.join("candidates.jsonl")).unwrap();
    let again = kernelbench(&run, &["--samples", "2"]);
    let stdout = succeeded(&again);
    assert!(
        text(&again.stderr).contains("every candidate is in the run folder already"),
        "{}",
        text(&again.stderr)
    );
    assert!(stdout.contains("evaluated 0 samples"), "{stdout}");
    assert!(
        stdout.contains("4 samples were already in the store"),
        "{stdout}"
    );
    assert_eq!(
        std::fs::read(run.join("candidates.jsonl")).unwrap(),
        candidates
    );

    let changed = kernelbench(&run, &["--samples", "2", "--seed", "5"]);
    assert!(!changed.status.success());
    let err = text(&changed.stderr);
    assert!(err.contains("other settings (seed)"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");

    let stdout = succeeded(&kernelbench(&run, &["--seed", "5", "--force"]));
    assert!(stdout.contains("evaluated 2 samples"), "{stdout}");
    assert_eq!(stored_keys(&run), [(1, 1, 0), (1, 2, 0)]);
}

#[test]
fn report_sets_a_kernelbench_run_beside_an_eval_run() {
    let _judging = crate::common::away_from_hostile_programs();
    let dir = tempfile::tempdir().unwrap();
    let generated = dir.path().join("generated");
    succeeded(&kernelbench(&generated, &[]));
    let judged = dir.path().join("judged");
    let candidates = problem2_candidates(dir.path());
    let examples_tree = examples_dir().join("kernelbench");
    let cache = shared_build_cache();
    succeeded(&dice(&[
        "eval",
        path_arg(&candidates),
        "--kernelbench",
        path_arg(&examples_tree),
        "--run",
        path_arg(&judged),
        "--build-cache",
        path_arg(&cache),
        "--timeout",
        "20",
        "--perf-trials",
        "4",
    ]));
    let (a, b) = (path_arg(&generated), path_arg(&judged));
    // What the judge found, for a failure's reader: the report counts a deceptive sample 0 out.
    let judged_samples = Store::open(&judged.join("dice.db"))
        .unwrap()
        .samples()
        .unwrap();
    for sample in &judged_samples {
        eprintln!(
            "judged sample {}/{}: {:?} deceptive={} flags={:?} speedup={:?} {:?}",
            sample.problem_id,
            sample.sample_id,
            sample.verdict,
            sample.deceptive,
            sample.flags,
            sample.speedup,
            sample.message
        );
    }

    let md = succeeded(&dice(&["report", a, b]));
    assert!(
        md.contains(&format!(
            "| metric | {a} **raw** | {a} robust | {b} **raw** | {b} robust |"
        )),
        "{md}"
    );
    // Problem 2's sample 0 is correct, problem 1 has no candidate in the eval run.
    assert!(
        md.contains("| Exec | 0.0% | 0.0% | 50.0% | 50.0% |"),
        "{md}"
    );

    let html_path = dir.path().join("side-by-side.html");
    let out = dice(&[
        "report",
        a,
        b,
        "--format",
        "html",
        "-o",
        path_arg(&html_path),
    ]);
    succeeded(&out);
    let html = std::fs::read_to_string(&html_path).unwrap();
    assert_eq!(html.matches("<svg").count(), 3);
    assert!(html.contains(&format!("<th colspan=\"2\">{b}</th>")));

    for (args, expected) in [
        (vec!["report", a, b, "--format", "csv"], "takes one run"),
        (
            vec!["report", a, b, "--fast-p", "1"],
            "--fast-p applies to one run",
        ),
        (
            vec!["report", a, path_arg(dir.path())],
            "has no dice results",
        ),
    ] {
        let out = dice(&args);
        assert!(!out.status.success());
        let err = text(&out.stderr);
        assert!(
            err.contains(expected) && err.trim().lines().count() == 1,
            "{err}"
        );
    }
}
