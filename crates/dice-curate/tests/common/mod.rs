//! Judging settings shared by the curation tests: the build cache every test of curation uses
//! (`dice-curate-build-cache` under cargo's test folder), a short timeout, and the trials asked.

use dice_eval::EvalConfig;
use std::path::Path;
use std::time::Duration;

pub(crate) fn judging(correctness_trials: u32, perf_trials: u32, timing_rounds: u32) -> EvalConfig {
    let mut cfg = EvalConfig::new("unused".into(), "unused".into());
    cfg.build_cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dice-curate-build-cache");
    cfg.timeout = Duration::from_secs(60);
    cfg.correctness_trials = correctness_trials;
    cfg.perf_trials = perf_trials;
    cfg.timing_rounds = timing_rounds;
    cfg
}
