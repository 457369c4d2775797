//! One judge, several batches: what training loops do thousands of times. Later batches run on
//! the fork servers that earlier ones started; an evaluator takes them while others run. Slow on
//! a cold build cache: the examples' C++ extension compiles once (~60 s on 2 cores).

use crate::common::*;
use dice_eval::{Batch, Evaluator, Judge, SampleOutcome, SampleRecord, Store, Ticket, Verdict};
use std::collections::BTreeMap;

/// The examples' batches, a judge's two and an evaluator's two: batches of the same samples.
const BATCHES: [&[(u32, u32)]; 2] = [&[(1, 0), (1, 1)], &[(2, 0), (1, 6), (2, 1)]];

fn batch(keys: &[(u32, u32)]) -> Batch {
    let samples = keys.iter().map(|&(p, s)| example(p, s)).collect();
    Batch::new(example_problems(), samples).unwrap()
}

/// (problem, sample) → what the judgement decided, timings aside: so are the flags of the timing
/// checks (`timer_inconsistent` fires on a loaded machine now and then).
fn verdicts(records: &[SampleRecord]) -> BTreeMap<(u32, u32), (Verdict, u32)> {
    records
        .iter()
        .map(|r| ((r.problem_id, r.sample_id), (r.verdict, r.trials_passed)))
        .collect()
}

/// One judge through both batches (the batch path), then an evaluator given the second batch
/// while it judges the first: the same verdicts, streamed as each sample is stored.
#[test]
fn a_judge_keeps_its_fork_servers_warm_and_an_evaluator_streams_the_same_verdicts() {
    let _machine = machine_shared();
    let judged = judge_one_batch_after_another();
    let streamed = stream_batches_submitted_while_others_run();
    assert_eq!(verdicts(&streamed), verdicts(&judged));
}

/// Returns the judge's records of both batches.
fn judge_one_batch_after_another() -> Vec<SampleRecord> {
    let run = tempfile::tempdir().unwrap();
    let documented = documented_verdicts();
    let mut judge = Judge::start(test_config(run.path()), None).unwrap();
    let mut summaries = Vec::new();
    for keys in BATCHES {
        let summary = judge.evaluate(batch(keys)).unwrap();
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
    let sizes: Vec<usize> = timelines.iter().map(|t| t.samples).collect();
    assert_eq!(sizes, BATCHES.map(<[_]>::len), "{timelines:?}");
    summaries.into_iter().flat_map(|s| s.records).collect()
}

/// Submits the second batch once the first sample of the first came back (which a handle that
/// answered only at the end could not give), and returns the records as they streamed back.
fn stream_batches_submitted_while_others_run() -> Vec<SampleRecord> {
    let run = tempfile::tempdir().unwrap();
    let mut evaluator = Evaluator::start(test_config(run.path()), None).unwrap();
    let first = evaluator.submit(batch(BATCHES[0])).unwrap();
    let earliest = evaluator.next().unwrap().unwrap();
    assert_eq!(earliest.ticket, first);
    let second = evaluator.submit(batch(BATCHES[1])).unwrap();
    assert_ne!(first, second);
    let mut outcomes = vec![earliest];
    while let Some(evaluated) = evaluator.next().unwrap() {
        outcomes.push(evaluated);
    }
    let submitted: usize = BATCHES.iter().map(|b| b.len()).sum();
    assert_eq!(outcomes.len(), submitted);
    // A problem id names one problem for the evaluator's whole run.
    let mut changed = example_problems();
    changed[0]
        .source
        .extend_from_slice(b"\n# another version\n");
    let refused = evaluator
        .submit(Batch::new(changed, vec![]).unwrap())
        .unwrap_err();
    assert!(
        refused.to_string().contains("another source"),
        "{refused:#}"
    );
    let summary = evaluator.finish().unwrap();

    let tickets: BTreeMap<(u32, u32), Ticket> = outcomes
        .iter()
        .map(|o| ((o.sample.1, o.sample.2), o.ticket))
        .collect();
    let expected_tickets: BTreeMap<(u32, u32), Ticket> = [first, second]
        .into_iter()
        .zip(BATCHES)
        .flat_map(|(ticket, keys)| keys.iter().map(move |&key| (key, ticket)))
        .collect();
    assert_eq!(
        tickets, expected_tickets,
        "each sample once, with its ticket"
    );
    let streamed: Vec<SampleRecord> = outcomes
        .into_iter()
        .map(|o| match o.outcome {
            SampleOutcome::Judged(record) => *record,
            other => panic!("{:?}: {other:?}", o.sample),
        })
        .collect();
    assert!(streamed
        .iter()
        .all(|r| (r.verdict == Verdict::Correct) == r.speedup.is_some()));

    // Stored once each, as streamed, with one timeline for the evaluator's whole run.
    let store = Store::open(&run.path().join("dice.db")).unwrap();
    assert_eq!(verdicts(&store.samples().unwrap()), verdicts(&streamed));
    let mut counts = BTreeMap::new();
    for r in &streamed {
        *counts.entry(r.verdict).or_default() += 1;
    }
    assert_eq!(summary.verdicts, counts);
    assert!(summary.records.is_empty(), "they streamed back instead");
    let timelines = store.timelines().unwrap();
    assert_eq!(timelines.len(), 1, "one timeline per evaluator");
    assert_eq!(timelines[0].samples, streamed.len());
    streamed
}
