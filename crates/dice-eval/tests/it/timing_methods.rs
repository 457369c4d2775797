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
/// dice's rounds, a speedup, the run stored under its name.
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

/// The queued timing's hold after a round of the baseline (python/protocol.py `_adapt_hold`):
/// the 90th percentile of the round's enqueues with the margin, where the host was slower than in
/// its warm-ups; never below the warm-ups' hold nor above the cap; none without warm-ups.
#[test]
fn the_queued_timings_hold_follows_the_baselines_enqueues() {
    let runtime = dice_eval::python::Runtime::new(None).unwrap();
    let script = r#"
import protocol
def hold(walls, warm):
    timer = protocol.Timer.__new__(protocol.Timer)
    timer.host = [[w, w, 0, 0] for w in walls]
    timer.hold_ms = timer.warm_hold_ms = warm
    timer._adapt_hold()
    return round(timer.hold_ms, 6) if timer.hold_ms is not None else None
slow = [0.05] * 5 + [0.1] * 4 + [0.4]
print(hold(slow, 0.065), hold([0.01] * 10, 0.065), hold([3.0] * 10, 0.065),
      hold([3.0] * 10, 2.0), hold(slow, None), hold([], 0.065))
"#;
    let out = std::process::Command::new(&runtime.python)
        .current_dir(runtime.dir.path())
        .args(["-c", script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0.17 0.065 1.0 2.0 None 0.065"
    );
}
