//! `ingest` then `verify` through the real evaluator on C++ CPU pairs: a fast pair, a slow one, a
//! wrong one, a deceptive one, an exact duplicate and a problem without a kernel, each landing
//! where it should; verifying again changes nothing.

use dice_curate::{ingest, verify, RunDir, DEFAULT_MIN_SPEEDUP};
use dice_eval::EvalConfig;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

fn judging() -> EvalConfig {
    let mut cfg = EvalConfig::new("unused".into(), "unused".into());
    cfg.build_cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dice-curate-build-cache");
    cfg.timeout = Duration::from_secs(60);
    cfg.correctness_trials = 3;
    cfg.perf_trials = 40;
    cfg.timing_rounds = 4;
    cfg
}

#[test]
fn each_fixture_pair_lands_where_it_should() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/verify_pairs.json");
    let tmp = tempfile::tempdir().unwrap();
    let run = RunDir::new(tmp.path().join("run"));
    let ingested = ingest(&run, &[fixture], dice_curate::dedup::DEFAULT_THRESHOLD).unwrap();
    assert_eq!(
        (
            ingested.kept,
            ingested.exact_duplicates,
            ingested.near_duplicates
        ),
        (5, 1, 0)
    );
    assert_eq!(ingested.problem_only, 1);

    let summary = verify(&run, judging(), DEFAULT_MIN_SPEEDUP).unwrap();
    let pairs = run.read_pairs().unwrap();
    let verified = run.read_verified().unwrap();
    let by_origin: BTreeMap<String, &dice_curate::VerifiedPair> = verified
        .iter()
        .map(|v| {
            let pair = pairs.iter().find(|p| p.id == v.id).unwrap();
            (pair.origin.rsplit('#').next().unwrap().to_string(), v)
        })
        .collect();
    for (origin, v) in &by_origin {
        println!(
            "pair #{origin}: {:?} {:?} [{:?}, {:?}] {:?}",
            v.verdict, v.speedup, v.speedup_low, v.speedup_high, v.reason
        );
    }
    assert_eq!(
        summary.pairs, 4,
        "the problem without a kernel is not judged"
    );
    let fast = by_origin["0"];
    assert!(fast.kept, "{fast:?}");
    assert!(fast.speedup_low.unwrap() >= DEFAULT_MIN_SPEEDUP);
    let slow = by_origin["1"];
    assert_eq!(slow.verdict.as_deref(), Some("correct"));
    assert!(
        slow.reason
            .as_deref()
            .unwrap()
            .starts_with("speedup below threshold"),
        "{slow:?}"
    );
    let wrong = by_origin["2"];
    assert!(
        wrong
            .reason
            .as_deref()
            .unwrap()
            .starts_with("verdict: output_mismatch"),
        "{wrong:?}"
    );
    let deceptive = by_origin["3"];
    assert_eq!(deceptive.verdict.as_deref(), Some("correct"));
    assert!(
        deceptive
            .reason
            .as_deref()
            .unwrap()
            .starts_with("deceptive"),
        "{deceptive:?}"
    );
    assert_eq!(summary.kept, 1);
    assert_eq!(summary.speedups_correct.len(), 3);
    assert_eq!(summary.speedups_kept.len(), 1);

    // Every pair is in the store: verifying again judges nothing and writes the same file.
    let first = std::fs::read(run.verified()).unwrap();
    assert_eq!(
        verify(&run, judging(), DEFAULT_MIN_SPEEDUP).unwrap(),
        summary
    );
    assert_eq!(std::fs::read(run.verified()).unwrap(), first);
}
