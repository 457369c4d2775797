//! KernelBench's timing methods (`--timing kernelbench`, `kernelbench-v0.1`) and its shared
//! namespace (`--kernelbench-namespace`), through the real evaluator on the CPU.

use crate::common::{example, example_problems, machine_shared, test_config};
use dice_eval::{EvalProblem, EvalSample, SampleRecord, Store, Timing, Verdict};

/// The C++ ReLU example timed by each of KernelBench's methods: the run says which, every timed
/// call is counted, and the means are reported as KernelBench rounds them.
#[test]
fn kernelbench_methods_time_the_cpp_example() {
    let _machine = machine_shared();
    for timing in [Timing::KernelBench, Timing::KernelBenchV01] {
        let run = tempfile::tempdir().unwrap();
        let mut cfg = test_config(run.path());
        cfg.timing = timing;
        cfg.perf_trials = 20;
        cfg.timing_rounds = 3;
        let summary =
            dice_eval::evaluate(cfg, example_problems(), vec![example(1, 0)], None).unwrap();
        let record = &summary.records[0];
        assert_eq!(record.verdict, Verdict::Correct, "{record:?}");
        for stats in [&record.candidate_timing, &record.baseline_timing] {
            let stats = stats.as_ref().unwrap();
            assert_eq!(stats.trials, 20, "{timing:?}: {stats:?}");
            let rounded: f64 = format!("{:.2e}", stats.mean_ms).parse().unwrap();
            assert_eq!(stats.mean_ms, rounded, "{timing:?}: {stats:?}");
        }
        assert!(record.speedup.is_some_and(|s| s > 0.0), "{record:?}");
        let store = Store::open(&run.path().join("dice.db")).unwrap();
        assert_eq!(store.run_info().unwrap().unwrap().timing, timing.as_str());
    }
}

/// `--timing dice-queued` through the evaluator on the CPU, where there is no device to hold:
/// dice's rounds (the baseline's first), a speedup, the run stored under its name.
#[test]
fn the_queued_timing_judges_the_cpp_example_with_dice_rounds() {
    let _machine = machine_shared();
    let run = tempfile::tempdir().unwrap();
    let mut cfg = test_config(run.path());
    cfg.timing = Timing::DiceQueued;
    let trials = cfg.perf_trials;
    let summary = dice_eval::evaluate(cfg, example_problems(), vec![example(1, 0)], None).unwrap();
    let record = &summary.records[0];
    assert_eq!(record.verdict, Verdict::Correct, "{record:?}");
    for stats in [&record.candidate_timing, &record.baseline_timing] {
        let stats = stats.as_ref().unwrap();
        assert!(stats.trials >= trials, "{stats:?}");
    }
    assert!(record.speedup.is_some_and(|s| s > 0.0), "{record:?}");
    let store = Store::open(&run.path().join("dice.db")).unwrap();
    assert_eq!(store.run_info().unwrap().unwrap().timing, "dice-queued");
}

/// `scale` and `batch` are the problem's globals; KernelBench's harness gives them to the
/// program, dice by default does not.
const SCALE: &str = "
import torch
import torch.nn as nn

scale = 2.0
batch = 16

class Model(nn.Module):
    def forward(self, x):
        return x * scale

def get_inputs():
    return [torch.randn(batch, 64)]

def get_init_inputs():
    return []
";

/// Uses the problem's `scale` in forward.
const USES_SCALE: &str = "
import torch.nn as nn

class ModelNew(nn.Module):
    def forward(self, x):
        return x * scale
";

/// Subclasses the problem's `Model` when it is imported.
const SUBCLASSES_MODEL: &str = "
class ModelNew(Model):
    pass
";

/// Rebinds a constant of the problem, which under KernelBench shrinks its inputs; a copy of the
/// namespace leaves the problem's `get_inputs` as it was.
const REBINDS_BATCH: &str = "
import torch.nn as nn

batch = 1

class ModelNew(nn.Module):
    def forward(self, x):
        return x * scale
";

fn judge(kernelbench_namespace: bool) -> Vec<SampleRecord> {
    let run = tempfile::tempdir().unwrap();
    let mut cfg = test_config(run.path());
    cfg.kernelbench_namespace = kernelbench_namespace;
    cfg.perf_trials = 0;
    let problem = EvalProblem {
        level: 1,
        problem_id: 1,
        name: "1_Scale.py".into(),
        source: SCALE.into(),
        defect: None,
    };
    let samples = [USES_SCALE, SUBCLASSES_MODEL, REBINDS_BATCH]
        .iter()
        .enumerate()
        .map(|(i, code)| EvalSample {
            level: 1,
            problem_id: 1,
            sample_id: i as u32,
            code: Some(code.as_bytes().to_vec()),
            origin: format!("sample {i}"),
        })
        .collect();
    dice_eval::evaluate(cfg, vec![problem], samples, None)
        .unwrap()
        .records
}

#[test]
fn isolated_programs_are_told_which_problem_global_they_miss() {
    let _machine = machine_shared();
    let records = judge(false);
    let expected = [
        (Verdict::RuntimeError, "scale"),
        (Verdict::LoadError, "Model"),
        (Verdict::RuntimeError, "scale"),
    ];
    for (record, (verdict, name)) in records.iter().zip(expected) {
        let message = record.message.as_deref().unwrap_or_default();
        assert_eq!(record.verdict, verdict, "{record:?}");
        assert!(
            message.contains(&format!("`{name}` is a global of the problem file"))
                && message.contains("--kernelbench-namespace"),
            "{message}"
        );
    }
}

#[test]
fn the_kernelbench_namespace_gives_programs_the_problem_globals() {
    let _machine = machine_shared();
    for record in judge(true) {
        assert_eq!(record.verdict, Verdict::Correct, "{record:?}");
    }
}
