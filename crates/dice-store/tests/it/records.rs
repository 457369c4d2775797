//! A sample record with every field set, for the stores' tests.

use dice_store::{SampleRecord, SpeedupInterval, TimingStats, Verdict};

pub(crate) fn correct_sample() -> SampleRecord {
    let timing = |mean_ms: f64| TimingStats {
        mean_ms,
        median_ms: mean_ms,
        std_ms: 0.1,
        min_ms: mean_ms - 0.1,
        max_ms: mean_ms + 0.1,
        trials: 10,
    };
    SampleRecord {
        level: 1,
        problem_id: 1,
        sample_id: 0,
        code_hash: Some("ab12".into()),
        verdict: Verdict::Correct,
        message: None,
        max_abs_error: Some(0.0),
        max_rel_error: Some(0.0),
        trials_passed: 5,
        candidate_timing: Some(timing(1.0)),
        baseline_timing: Some(timing(2.0)),
        speedup: Some(2.0),
        speedup_interval: Some(SpeedupInterval {
            low: 1.8,
            high: 2.3,
        }),
        timing_remeasures: 1,
        flags: vec!["no_custom_kernel".into()],
        deceptive: true,
        log_excerpt: "built".into(),
        wall_s: 3.5,
        stages: vec![("import".into(), 0.5), ("trials".into(), 1.0)],
    }
}
