//! The run, problem and timing records that the report tests build their stores from.

use dice_store::{ProblemRecord, RunInfo, TimingStats};

/// A CUDA run on an H200 against eager PyTorch; `strict` as `dice eval --strict` sets it.
pub(crate) fn run(strict: bool) -> RunInfo {
    RunInfo {
        device: "cuda".into(),
        hardware: "NVIDIA H200".into(),
        torch_version: "2.11.0".into(),
        python_version: "3.12".into(),
        dice_version: "0.1.0".into(),
        correctness_trials: 5,
        perf_trials: 100,
        atol: 1e-2,
        rtol: 1e-2,
        baseline: "eager".into(),
        timing: "dice".into(),
        strict,
        source: "kernelbench".into(),
    }
}

pub(crate) fn problem(level: u32, problem_id: u32) -> ProblemRecord {
    ProblemRecord {
        level,
        problem_id,
        name: format!("{problem_id}_P"),
        reference_error: None,
    }
}

/// Timings of 100 trials that all took `mean_ms`.
pub(crate) fn timing(mean_ms: f64) -> TimingStats {
    TimingStats {
        mean_ms,
        median_ms: mean_ms,
        std_ms: 0.0,
        min_ms: mean_ms,
        max_ms: mean_ms,
        trials: 100,
    }
}
