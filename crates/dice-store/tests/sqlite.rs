//! The SQLite store keeps what the evaluator writes, as reports read it back.

use dice_store::{
    BuildRecord, KernelProfile, LaunchedKernel, ProblemRecord, RunInfo, RunTimeline, SampleExtras,
    SampleRecord, Store, TimingStats, Verdict,
};
use serde_json::json;
use std::collections::HashSet;

fn info() -> RunInfo {
    RunInfo {
        device: "cpu".into(),
        hardware: "test CPU".into(),
        torch_version: "2.11.0".into(),
        python_version: "3.12".into(),
        dice_version: "0.1.0".into(),
        correctness_trials: 5,
        perf_trials: 10,
        atol: 1e-2,
        rtol: 1e-2,
        baseline: "eager".into(),
        strict: false,
        source: "kernelbench:examples".into(),
    }
}

fn correct_sample() -> SampleRecord {
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
        flags: vec!["no_custom_kernel".into()],
        deceptive: true,
        log_excerpt: "built".into(),
        wall_s: 3.5,
        stages: vec![("import".into(), 0.5), ("trials".into(), 1.0)],
    }
}

#[test]
fn samples_builds_and_timelines_read_back_as_written() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run/dice.db");
    let mut store = Store::open(&path).unwrap();
    assert_eq!(store.run_info().unwrap(), None);
    store
        .begin_run(&info(), &json!({"precision": "fp32"}), false)
        .unwrap();
    let problem = ProblemRecord {
        level: 1,
        problem_id: 1,
        name: "1_ReLU.py".into(),
        reference_error: None,
    };
    store
        .add_problems(&[(problem.clone(), "55".into())])
        .unwrap();
    store
        .set_reference_error(1, 1, Some("no get_inputs"))
        .unwrap();

    let sample = correct_sample();
    let profile = KernelProfile {
        default_stream: Some(7),
        custom_share: Some(0.75),
        kernels: vec![LaunchedKernel {
            name: "relu_kernel".into(),
            stream: Some(7),
            us: 3.0,
            calls: 1,
        }],
    };
    let build = BuildRecord {
        key: "k".into(),
        name: "relu".into(),
        ok: true,
        cached: false,
        wall_s: 40.0,
        log: "ninja".into(),
    };
    let extras = SampleExtras {
        origin: "candidates.jsonl:1".into(),
        candidate_wall_ms: Some(12.0),
        baseline_wall_ms: Some(22.0),
        builds: vec![build.clone()],
        kernels: Some(profile.clone()),
    };
    store.put_sample(&sample, &extras).unwrap();
    // Storing a sample again replaces it and its builds.
    store.put_sample(&sample, &extras).unwrap();
    let timeline = RunTimeline {
        samples: 1,
        wall_s: 9.0,
        ..RunTimeline::default()
    };
    store.add_timeline(&timeline).unwrap();
    drop(store);

    let store = Store::open(&path).unwrap();
    assert_eq!(store.run_info().unwrap(), Some(info()));
    assert_eq!(
        store.problems().unwrap(),
        [ProblemRecord {
            reference_error: Some("no get_inputs".into()),
            ..problem
        }]
    );
    assert_eq!(store.samples().unwrap(), [sample]);
    assert_eq!(store.finished().unwrap(), HashSet::from([(1, 1, 0)]));
    assert_eq!(store.builds().unwrap(), [build]);
    assert_eq!(store.kernel_profile(1, 1, 0).unwrap(), Some(profile));
    assert_eq!(store.kernel_profile(1, 1, 1).unwrap(), None);
    assert_eq!(store.timelines().unwrap(), [timeline]);
}

#[test]
fn a_run_resumed_with_other_settings_is_refused_unless_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(&dir.path().join("dice.db")).unwrap();
    let settings = json!({"precision": "fp32", "timing rounds": 10});
    store.begin_run(&info(), &settings, false).unwrap();
    store.begin_run(&info(), &settings, false).unwrap();

    let looser = RunInfo {
        atol: 0.5,
        hardware: "another CPU".into(),
        ..info()
    };
    let other = json!({"precision": "fp16", "timing rounds": 10});
    let err = store.begin_run(&looser, &other, false).unwrap_err();
    assert_eq!(
        err.to_string(),
        "this run was started with different settings (atol, precision); use --force to \
         re-evaluate everything with the new ones, or choose another --run directory"
    );
    store.begin_run(&looser, &other, true).unwrap();
    assert_eq!(store.run_info().unwrap(), Some(looser));
}
