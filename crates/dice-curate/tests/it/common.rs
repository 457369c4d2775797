//! What the curation tests share: the fixture's pairs, and judging settings (the suite's one
//! build cache, a short timeout, the trials asked).

use dice_eval::EvalConfig;
use dice_test_support::shared_build_cache;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `tests/fixtures/verify_pairs.json`: C++ CPU pairs (fast, slow, wrong, deceptive, a duplicate,
/// a problem without a kernel) whose kernels share one C++ source.
pub(crate) fn verify_pairs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/verify_pairs.json")
}

pub(crate) fn judging(correctness_trials: u32, perf_trials: u32, timing_rounds: u32) -> EvalConfig {
    let mut cfg = EvalConfig::new("unused".into(), "unused".into());
    cfg.build_cache = shared_build_cache();
    cfg.timeout = Duration::from_secs(60);
    cfg.correctness_trials = correctness_trials;
    cfg.perf_trials = perf_trials;
    cfg.timing_rounds = timing_rounds;
    cfg
}
