//! One judge, several batches: what training loops do thousands of times. Later batches run on
//! the fork servers that earlier ones started. Slow on a cold build cache: the examples' C++
//! extension compiles once (~60 s on 2 cores).

mod common;

use common::*;
use dice_eval::{Batch, Judge, SampleRecord, Store, Verdict};
use std::collections::BTreeMap;

#[test]
fn a_judge_keeps_its_fork_servers_warm_across_batches() {
    let run = tempfile::tempdir().unwrap();
    let documented = documented_verdicts();
    let batches = [[(1, 0), (1, 1)], [(2, 0), (1, 6)]];
    let mut judge = Judge::start(test_config(run.path()), None).unwrap();
    let mut summaries = Vec::new();
    for keys in batches {
        let samples = keys.iter().map(|&(p, s)| example(p, s)).collect();
        let batch = Batch::new(example_problems(), samples).unwrap();
        let summary = judge.evaluate(batch).unwrap();
        let got: BTreeMap<(u32, u32), Verdict> = summary
            .records
            .iter()
            .map(|r| ((r.problem_id, r.sample_id), r.verdict))
            .collect();
        let expected: BTreeMap<(u32, u32), Verdict> =
            keys.iter().map(|key| (*key, documented[key])).collect();
        assert_eq!(got, expected, "{:#?}", summary.records);
        summaries.push(summary);
    }
    judge.shutdown();

    // The first batch started the compile stage's fork server (the device's started with the
    // judge); the second found both alive.
    assert!(summaries[0].fork_servers_started >= 1, "{:?}", summaries[0]);
    assert_eq!(summaries[1].fork_servers_started, 0, "{:?}", summaries[1]);
    let store = Store::open(&run.path().join("dice.db")).unwrap();
    // Timings come back from the store's JSON within a rounding of where they were.
    let outcome = |r: &SampleRecord| {
        let key = (r.problem_id, r.sample_id, r.code_hash.clone());
        (key, r.verdict, r.message.clone(), r.trials_passed)
    };
    let judged: Vec<_> = summaries
        .iter()
        .flat_map(|s| &s.records)
        .map(outcome)
        .collect();
    let stored: Vec<_> = store.samples().unwrap().iter().map(outcome).collect();
    assert_eq!(stored, judged);
    let timelines = store.timelines().unwrap();
    assert_eq!(timelines.len(), 2, "one timeline per batch");
    assert!(timelines.iter().all(|t| t.samples == 2), "{timelines:?}");
}
