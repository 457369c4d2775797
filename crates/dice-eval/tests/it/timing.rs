//! Timing that a candidate cannot forge and a loaded machine does not turn into a false alarm:
//! the evaluator's clock against the candidate's, and the speedup's interval.

use crate::common::{example, example_problems, machine_alone, test_config};
use dice_eval::{EvalProblem, EvalSample, SampleRecord, Store, Verdict};
use std::process::{Child, Command};

/// A matrix product the CPU times in well under a millisecond.
const MATMUL: &str = "
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, a, b):
        return a @ b

def get_inputs():
    return [torch.randn(256, 128), torch.randn(128, 128)]

def get_init_inputs():
    return []
";

/// A correct product after 20 ms of sleep a call, whose module code rewrites the harness's clock
/// in its own process: every timed call reports 1 us. Its true time is far above what load adds
/// to the baseline's rounds: a forger of a millisecond a call (the product one row at a time)
/// once went unseen on CI's two cores, whose baseline rounds had milliseconds a call of
/// scheduling delay (runtime.rs `check_clock` clears what that range covers).
const FORGED_CLOCK: &str = "
import itertools
import sys
import time
import torch
import torch.nn as nn

harness = sys.modules['protocol']
ticks = itertools.count()
harness.perf_counter_ns = lambda: next(ticks) * 1000

class ModelNew(nn.Module):
    def forward(self, a, b):
        time.sleep(0.02)
        return a @ b
";

/// The same product one row at a time, honest about its time.
const ROWS: &str = "
import torch
import torch.nn as nn

class ModelNew(nn.Module):
    def forward(self, a, b):
        return torch.stack([row @ b for row in a])
";

/// The product, after 40 ms of sleep a call.
const SLOW: &str = "
import time
import torch
import torch.nn as nn

class ModelNew(nn.Module):
    def forward(self, a, b):
        time.sleep(0.04)
        return a @ b
";

fn matmul_problem() -> Vec<EvalProblem> {
    vec![EvalProblem {
        level: 1,
        problem_id: 1,
        name: "1_Matmul.py".into(),
        source: MATMUL.into(),
        defect: None,
    }]
}

fn sample(problem_id: u32, sample_id: u32, code: &str) -> EvalSample {
    EvalSample {
        level: 1,
        problem_id,
        sample_id,
        code: Some(code.as_bytes().to_vec()),
        origin: format!("timing test {problem_id}/{sample_id}"),
    }
}

fn stored(run: &std::path::Path) -> Vec<SampleRecord> {
    Store::open(&run.join("dice.db"))
        .unwrap()
        .samples()
        .unwrap()
}

fn timer_inconsistent(r: &SampleRecord) -> bool {
    r.flags.iter().any(|f| f == "timer_inconsistent")
}

#[test]
fn a_forged_clock_is_caught_and_earns_no_speedup() {
    // Alone, as in the binary of its own it had: other tests' load widens the baseline's range
    // of overheads, and under enough of it the forged clock goes unseen.
    let _machine = machine_alone();
    let run = tempfile::tempdir().unwrap();
    let problems = matmul_problem();
    let samples = vec![sample(1, 0, FORGED_CLOCK), sample(1, 1, ROWS)];
    // A run whose baseline was itself preempted for milliseconds (some of its calls a hundred
    // times its median: another process's burst, on this suite's two cores) widens the
    // baseline's spread past what a forged clock of a 0.07 ms call can show; such a run proves
    // nothing either way and is made once more, in a fresh folder. An undisturbed run must
    // catch the forger.
    let disturbed = |r: &SampleRecord| {
        r.baseline_timing
            .as_ref()
            .is_some_and(|t| t.max_ms > 20.0 * t.median_ms)
    };
    let mut records = Vec::new();
    for attempt in 0..2 {
        let folder = run.path().join(format!("attempt-{attempt}"));
        std::fs::create_dir_all(&folder).unwrap();
        let mut cfg = test_config(&folder);
        cfg.perf_trials = 20;
        cfg.timing_rounds = 5;
        dice_eval::evaluate(cfg, problems.clone(), samples.clone(), None).unwrap();
        records = stored(&folder);
        if timer_inconsistent(&records[0]) || !disturbed(&records[0]) {
            break;
        }
        eprintln!(
            "the baseline was preempted ({:?}): run again",
            records[0].baseline_timing
        );
    }
    let (forger, honest) = (&records[0], &records[1]);
    assert_eq!(forger.verdict, Verdict::Correct, "{forger:?}");
    let reported = forger.candidate_timing.as_ref().unwrap();
    assert!(
        reported.mean_ms < 0.0011,
        "the clock was not forged: {reported:?}"
    );
    assert!(timer_inconsistent(forger), "{forger:#?}");
    assert!(forger.deceptive);
    assert_eq!(forger.speedup_interval, None);
    // Measured again for as long as allowed: every round contradicts it, not a burst of load.
    assert_eq!(forger.timing_remeasures, 2, "{forger:#?}");

    assert_eq!(honest.verdict, Verdict::Correct, "{honest:?}");
    assert!(!timer_inconsistent(honest), "{honest:#?}");
    let interval = honest.speedup_interval.unwrap();
    let speedup = honest.speedup.unwrap();
    assert!(
        interval.low <= speedup && speedup <= interval.high,
        "{honest:#?}"
    );
    assert!(honest.timing_remeasures <= 2);
    // The forger's speedup comes from the evaluator's clock, nowhere near the thousands its own
    // clock claims. (Its 20 ms of sleep a call is a hundred times the baseline's call on a quiet
    // machine; on a loaded one the baseline's mean is dominated by preemption, so the bound is
    // only the order of magnitude.)
    let forged = forger.speedup.unwrap();
    let claimed = forger.baseline_timing.as_ref().unwrap().mean_ms / reported.mean_ms;
    assert!(
        forged < 10.0 && forged < claimed / 100.0,
        "{forged} against a claimed {claimed}: {forger:#?}"
    );
    eprintln!(
        "forged clock: reported {:.4} ms/call, speedup {:.3} by the evaluator's clock; honest: \
         speedup {speedup:.3} [{:.3}, {:.3}], {} re-measurements",
        reported.mean_ms,
        forger.speedup.unwrap(),
        interval.low,
        interval.high,
        honest.timing_remeasures
    );
}

/// Busy loops on every core, ended when dropped.
struct Hog(Vec<Child>);

impl Hog {
    fn start() -> Hog {
        let cores = std::thread::available_parallelism().map_or(2, std::num::NonZero::get);
        let loops = (0..cores)
            .map(|_| {
                Command::new("sh")
                    .args(["-c", "while :; do :; done"])
                    .spawn()
                    .unwrap()
            })
            .collect();
        Hog(loops)
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Calls of 40 ms under a 0.2 s budget: the correctness trials already show the candidate's
/// calls that slow, so every round of the 20 calls planned in 5 makes one call from the first
/// (before the trials sized the plan, the first round made 4 and spent 0.16 s), on both sides
/// alike, in every measurement; the speedup still rests on both sides' calls: the slow
/// candidate is judged slower than the baseline (not by how much: on the suite's loaded 2
/// cores the baseline's 0.2 ms matmul once measured a median of 27 ms, a speedup of 0.73).
#[test]
fn slow_calls_are_timed_within_the_budget() {
    let run = tempfile::tempdir().unwrap();
    let mut cfg = test_config(run.path());
    cfg.perf_trials = 20;
    cfg.timing_rounds = 5;
    cfg.timing_budget = Some(std::time::Duration::from_millis(200));
    dice_eval::evaluate(cfg, matmul_problem(), vec![sample(1, 0, SLOW)], None).unwrap();
    let r = &stored(run.path())[0];
    assert_eq!(r.verdict, Verdict::Correct, "{r:?}");
    let calls = 5 * (1 + r.timing_remeasures);
    assert_eq!(r.candidate_timing.as_ref().unwrap().trials, calls, "{r:#?}");
    assert_eq!(r.baseline_timing.as_ref().unwrap().trials, calls, "{r:#?}");
    assert!(r.speedup.unwrap() < 1.0, "{r:#?}");
}

/// Honest C++ candidates timed with every core busy: rounds are slowed unevenly, none of them
/// may read as a forged clock.
#[test]
fn honest_cpu_candidates_beside_a_cpu_hog_keep_their_clock() {
    // The hog would slow other tests' candidates past their timeouts.
    let _machine = machine_alone();
    let run = tempfile::tempdir().unwrap();
    let mut cfg = test_config(run.path());
    cfg.perf_trials = 50;
    cfg.timing_rounds = 10;
    let samples = vec![example(1, 0), example(2, 0)];
    let hog = Hog::start();
    dice_eval::evaluate(cfg, example_problems(), samples, None).unwrap();
    drop(hog);
    let records = stored(run.path());
    assert_eq!(records.len(), 2);
    for r in &records {
        assert_eq!(r.verdict, Verdict::Correct, "{r:?}");
        assert!(!timer_inconsistent(r), "{r:#?}");
        let interval = r.speedup_interval.unwrap();
        let cv = |t: &Option<dice_eval::TimingStats>| t.as_ref().map(|t| t.std_ms / t.mean_ms);
        eprintln!(
            "problem {} beside the hog: speedup {:.3} [{:.3}, {:.3}], cv {:?} / {:?}, {} re-measurements",
            r.problem_id,
            r.speedup.unwrap(),
            interval.low,
            interval.high,
            cv(&r.candidate_timing),
            cv(&r.baseline_timing),
            r.timing_remeasures
        );
    }
}
