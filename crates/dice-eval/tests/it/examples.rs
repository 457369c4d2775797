//! End to end on the project's examples: every verdict class from real C++ candidates.
//! Slow: the first run in a checkout compiles the examples' extension (~60 s on 2 cores).

use crate::common::*;
use dice_eval::{Store, Verdict};
use std::collections::BTreeMap;

#[test]
fn examples_get_their_documented_verdicts_and_are_not_redone() {
    let _machine = machine_shared();
    let run = tempfile::tempdir().unwrap();
    let summary = dice_eval::evaluate(
        test_config(run.path()),
        example_problems(),
        example_samples(),
        None,
    )
    .unwrap();
    let store = Store::open(&run.path().join("dice.db")).unwrap();
    let samples = store.samples().unwrap();
    let got: BTreeMap<(u32, u32), Verdict> = samples
        .iter()
        .map(|s| ((s.problem_id, s.sample_id), s.verdict))
        .collect();
    assert_eq!(got, documented_verdicts(), "{samples:#?}");
    assert_eq!(summary.verdicts.values().sum::<usize>(), got.len());
    let compile_error = samples
        .iter()
        .find(|s| s.verdict == Verdict::CompileError)
        .unwrap();
    assert!(
        compile_error.message.as_ref().unwrap().contains("error"),
        "{compile_error:?}"
    );
    assert!(
        compile_error.log_excerpt.contains("FAILED"),
        "the build log is kept"
    );
    // Where the time went, stored in the order the stages ran.
    let correct = samples
        .iter()
        .find(|s| s.verdict == Verdict::Correct)
        .unwrap();
    let names: Vec<&str> = correct.stages.iter().map(|(n, _)| n.as_str()).collect();
    let at = |stage: &str| names.iter().position(|n| *n == stage);
    assert!(
        at("import") < at("trials") && at("trials") < at("timing") && at("import").is_some(),
        "{names:?}"
    );
    assert!(correct.stages.iter().all(|(_, s)| *s >= 0.0));
    // Where the invocation's time went as a whole: start-up, then the exclusive windows.
    let t = &summary.timeline;
    assert_eq!(t.samples, got.len());
    let first = t.first_sample_s.expect("a sample began");
    let last = t.last_outcome_s.expect("an outcome was stored");
    assert!(0.0 < first && first < last && last <= t.wall_s, "{t:?}");
    let timed = samples
        .iter()
        .filter(|s| s.candidate_timing.is_some())
        .count();
    assert!(t.exclusive_windows as usize >= timed, "{t:?}");
    assert!(
        t.exclusive_s > 0.0 && t.gate_closed_s >= t.exclusive_s,
        "{t:?}"
    );
    // Each timed candidate's correctness trials took a pass apiece.
    let trials = test_config(run.path()).correctness_trials as usize;
    assert!(t.untimed_steps as usize >= timed * trials, "{t:?}");
    assert!(0.0 < t.longest_untimed_step_s && t.longest_untimed_step_s <= t.untimed_step_s);

    let again = dice_eval::evaluate(
        test_config(run.path()),
        example_problems(),
        example_samples(),
        None,
    )
    .unwrap();
    assert_eq!(again.already_done, got.len());
    assert!(again.verdicts.is_empty());
    assert_eq!(again.timeline.samples, 0);
    assert_eq!(again.timeline.first_sample_s, None);
    let stored: Vec<_> = store.timelines().unwrap();
    assert_eq!(stored.len(), 2, "one timeline per invocation");
    assert_eq!(stored[0].exclusive_windows, t.exclusive_windows);
    assert!((stored[0].wall_s - t.wall_s).abs() < 1e-9);
    assert_eq!(store.samples().unwrap(), samples);
}
