//! The built-in examples (`examples/`) and the build cache that the tests evaluating them share
//! with the evaluator's tests (target/tmp/dice-eval-build-cache).

use std::path::{Path, PathBuf};

pub(crate) fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

pub(crate) fn build_cache() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("dice-eval-build-cache")
}

/// The examples' lines for problem 2 (a correct fused kernel, a raw answer without code, the
/// renamed reference) as their own JSONL file (not every test binary with this module uses it).
#[allow(dead_code)]
pub(crate) fn problem2_candidates(dir: &Path) -> PathBuf {
    let all = std::fs::read_to_string(examples().join("candidates.jsonl")).unwrap();
    let lines: Vec<&str> = all
        .lines()
        .filter(|l| l.contains("\"problem_id\": 2") || l.contains("\"problem_id\":2"))
        .collect();
    assert_eq!(lines.len(), 3, "the examples changed");
    let path = dir.join("problem2.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}
