//! The SQLite store keeps what the evaluator writes, as reports read it back.

use crate::records::correct_sample;
use dice_store::{
    BuildRecord, KernelProfile, LaunchedKernel, ProblemRecord, RunInfo, RunTimeline, SampleExtras,
    SampleRecord, Store, Verdict,
};
use dice_store::{SampleKey, WorkerId};
use serde_json::json;
use std::collections::HashSet;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

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
        timing: "dice".into(),
        strict: false,
        source: "kernelbench:examples".into(),
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
    assert_eq!(store.run_info().unwrap(), Some(looser.clone()));

    // A setting the run began without (an older dice) was off: it resumes with the setting
    // null, and not with it on.
    let newer = json!({"precision": "fp16", "timing rounds": 10, "timing budget s": null});
    store.begin_run(&looser, &newer, false).unwrap();
    store.begin_run(&looser, &other, true).unwrap();
    let on = json!({"precision": "fp16", "timing rounds": 10, "timing budget s": 2.0});
    let err = store.begin_run(&looser, &on, false).unwrap_err();
    assert!(err.to_string().contains("(timing budget s)"), "{err}");
}

/// A store of a release before speedup intervals and re-measurements reads back without them,
/// and keeps them from then on.
#[test]
fn a_store_without_the_timing_columns_is_upgraded() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dice.db");
    let mut store = Store::open(&path).unwrap();
    store
        .put_sample(&correct_sample(), &SampleExtras::default())
        .unwrap();
    drop(store);
    let old = rusqlite::Connection::open(&path).unwrap();
    for column in ["speedup_low", "speedup_high", "timing_remeasures"] {
        old.execute_batch(&format!("ALTER TABLE samples DROP COLUMN {column}"))
            .unwrap();
    }
    drop(old);

    let mut store = Store::open(&path).unwrap();
    let read = store.samples().unwrap();
    assert_eq!(
        (read[0].speedup_interval, read[0].timing_remeasures),
        (None, 0)
    );
    store
        .put_sample(&correct_sample(), &SampleExtras::default())
        .unwrap();
    assert_eq!(store.samples().unwrap(), [correct_sample()]);
}

fn sample_key(sample_id: u32) -> SampleKey {
    (1, 1, sample_id)
}

fn sample(sample_id: u32) -> SampleRecord {
    SampleRecord {
        sample_id,
        ..correct_sample()
    }
}

/// Two workers on one run judge disjoint samples; a result is stored once, by its claim's
/// holder; an expired lease is taken over, a renewed one is not.
#[test]
fn workers_share_a_run_through_claims() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dice.db");
    let (mut a, mut b) = (Store::open(&path).unwrap(), Store::open(&path).unwrap());
    let (alice, bob) = (WorkerId::new(), WorkerId::new());
    let lease = Duration::from_secs(60);
    let wanted: Vec<SampleKey> = (0..3).map(sample_key).collect();

    let first = a.claim(&alice, &wanted, 2, lease).unwrap();
    assert_eq!(
        first.samples,
        [(sample_key(0), None), (sample_key(1), None)]
    );
    let second = b.claim(&bob, &wanted, 3, lease).unwrap();
    assert_eq!(second.samples, [(sample_key(2), None)]);
    assert_eq!(b.claim_holders().unwrap().len(), 2);

    let extras = SampleExtras::default();
    assert!(!b.put_claimed_sample(&bob, &sample(0), &extras).unwrap());
    assert!(a.put_claimed_sample(&alice, &sample(0), &extras).unwrap());
    assert!(!a.put_claimed_sample(&alice, &sample(0), &extras).unwrap());
    let later = b.claim(&bob, &wanted, 3, lease).unwrap();
    assert_eq!(later.finished, [sample_key(0)]);
    assert_eq!(later.samples, [(sample_key(2), None)], "only its own");

    // Alice stops renewing (killed): her claim on sample 1 expires and Bob takes it over.
    assert_eq!(a.renew_claims(&alice, Duration::ZERO).unwrap(), 1);
    let taken = b.claim(&bob, &wanted, 3, lease).unwrap();
    assert_eq!(
        taken.samples,
        [(sample_key(1), Some(alice.clone())), (sample_key(2), None)]
    );
    assert!(!a.put_claimed_sample(&alice, &sample(1), &extras).unwrap());
    assert!(b.put_claimed_sample(&bob, &sample(1), &extras).unwrap());
    assert_eq!(b.renew_claims(&bob, lease).unwrap(), 1);
    assert!(a
        .claim(&alice, &wanted, 3, lease)
        .unwrap()
        .samples
        .is_empty());

    b.release_claims(&bob, None).unwrap();
    assert!(b.claim_holders().unwrap().is_empty());
    let ids: Vec<u32> = a.samples().unwrap().iter().map(|s| s.sample_id).collect();
    assert_eq!(ids, [0, 1]);
}

/// --force forgets results, but never while another worker is judging the run, and settings are
/// not replaced under it either.
#[test]
fn results_are_not_forgotten_under_another_worker() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dice.db");
    let mut store = Store::open(&path).unwrap();
    let settings = json!({"precision": "fp32"});
    store.begin_run(&info(), &settings, false).unwrap();
    store
        .put_sample(&sample(0), &SampleExtras::default())
        .unwrap();
    let (alice, bob) = (WorkerId::new(), WorkerId::new());
    let lease = Duration::from_secs(60);
    store.claim(&alice, &[sample_key(1)], 1, lease).unwrap();

    let err = store.forget_samples(&bob, &[sample_key(0)]).unwrap_err();
    let expected = format!(
        "another dice eval (worker {alice}) is judging this run now; let it finish, or stop it, \
         before re-evaluating with --force"
    );
    assert_eq!(err.to_string(), expected);
    let looser = RunInfo {
        atol: 0.5,
        ..info()
    };
    let err = store.begin_run(&looser, &settings, true).unwrap_err();
    assert_eq!(err.to_string(), expected);
    store.forget_samples(&alice, &[sample_key(0)]).unwrap();
    assert!(store.samples().unwrap().is_empty());
    store.release_claims(&alice, Some(sample_key(1))).unwrap();
    store.begin_run(&looser, &settings, true).unwrap();
}

/// Reports open stores read-only: a missing or empty store is an error that says what to do
/// (and stays empty), a store of an earlier release is read without being upgraded on disk,
/// and a store whose WAL index cannot be made (a read-only folder) is still read.
#[test]
fn stores_are_read_without_being_changed() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    let path = run.join("dice.db");
    let no_results = |why: &str| {
        format!(
            "{} has no dice results ({why}): run `dice eval` first",
            run.display()
        )
    };
    let err = Store::open_read_only(&path).err().unwrap();
    assert_eq!(
        err.to_string(),
        no_results(&format!("no {}", path.display()))
    );
    std::fs::write(&path, b"").unwrap();
    let err = Store::open_read_only(&path).err().unwrap();
    assert_eq!(
        err.to_string(),
        no_results(&format!("{} is empty", path.display()))
    );
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
    std::fs::remove_file(&path).unwrap();

    let mut store = Store::open(&path).unwrap();
    store.begin_run(&info(), &json!({}), false).unwrap();
    store
        .put_sample(&sample(0), &SampleExtras::default())
        .unwrap();
    drop(store);
    let old = rusqlite::Connection::open(&path).unwrap();
    old.execute_batch("ALTER TABLE samples DROP COLUMN stages; DROP TABLE invocations")
        .unwrap();
    drop(old);
    let before = std::fs::read(&path).unwrap();
    let store = Store::open_read_only(&path).unwrap();
    let read = store.samples().unwrap();
    assert_eq!(read[0].stages, []);
    assert_eq!(read[0].verdict, Verdict::Correct);
    assert!(store.timelines().unwrap().is_empty());
    assert!(store.claim_holders().is_ok());
    drop(store);
    assert_eq!(std::fs::read(&path).unwrap(), before, "the file changed");

    // A folder without write permission: SQLite could not make its WAL index there (root
    // could, and must not either).
    let index = run.join("dice.db-shm");
    if index.exists() {
        std::fs::remove_file(&index).unwrap();
    }
    let listing = || {
        let mut names: Vec<_> = std::fs::read_dir(&run)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        names
    };
    let files = listing();
    let writable = std::fs::metadata(&run).unwrap().permissions();
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o555)).unwrap();
    let read = Store::open_read_only(&path).map(|store| store.samples().unwrap().len());
    assert_eq!(listing(), files);
    std::fs::set_permissions(&run, writable.clone()).unwrap();
    assert_eq!(read.unwrap(), 1);

    // Results still in the write-ahead log cannot be read there.
    std::fs::write(run.join("dice.db-wal"), b"frames").unwrap();
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o555)).unwrap();
    let err = Store::open_read_only(&path).err();
    std::fs::set_permissions(&run, writable).unwrap();
    assert!(
        err.unwrap().to_string().contains("not yet merged"),
        "the log was ignored"
    );
}
