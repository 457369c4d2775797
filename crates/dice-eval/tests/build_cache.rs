//! The content-addressed build cache: concurrent builds of one key compile once, and evaluating
//! the same code again never compiles. Slow: one cold build (~60 s on 2 cores).

mod common;

use common::*;
use dice_eval::Store;

#[test]
fn one_source_compiles_once_across_concurrent_builds_and_runs() {
    let cache = tempfile::tempdir().unwrap();
    let relu = example(1, 0);
    let twins: Vec<_> = (0..2)
        .map(|i| dice_eval::EvalSample {
            sample_id: i,
            origin: format!("copy {i}"),
            ..relu.clone()
        })
        .collect();
    let mut builds_per_run = Vec::new();
    for _ in 0..2 {
        let run = tempfile::tempdir().unwrap();
        let mut cfg = test_config(run.path());
        cfg.build_cache = cache.path().to_path_buf();
        cfg.jobs = 2;
        cfg.perf_trials = 0;
        let summary = dice_eval::evaluate(cfg, example_problems(), twins.clone(), None).unwrap();
        assert_eq!(
            summary.verdicts.get(&dice_eval::Verdict::Correct),
            Some(&2),
            "{summary:?}"
        );
        builds_per_run.push(
            Store::open(&run.path().join("dice.db"))
                .unwrap()
                .builds()
                .unwrap(),
        );
    }
    let compiled = |run: usize| builds_per_run[run].iter().filter(|b| !b.cached).count();
    assert_eq!(compiled(0), 1, "{:?}", builds_per_run[0]);
    assert_eq!(compiled(1), 0, "{:?}", builds_per_run[1]);
    assert!(builds_per_run.iter().flatten().all(|b| b.ok));
    let keys: std::collections::BTreeSet<_> = builds_per_run
        .iter()
        .flatten()
        .map(|b| b.key.clone())
        .collect();
    assert_eq!(keys.len(), 1);
    let entries: Vec<_> = std::fs::read_dir(cache.path().join("tmp"))
        .unwrap()
        .collect();
    assert!(
        entries.is_empty(),
        "a temporary build directory was left behind"
    );
}
