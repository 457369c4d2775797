//! Verdicts, problem errors and bad input with pure-Python candidates (no extension builds, so
//! these run in seconds).

use crate::common::{machine_shared, test_config};
use dice_eval::{EvalProblem, EvalSample, Store, Verdict};
use std::time::Duration;

const RELU: &str = "
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)

def get_inputs():
    return [torch.randn(16, 256)]

def get_init_inputs():
    return []
";

/// Random inside forward and train-mode dropout: only symmetric seeding makes a copy correct.
const STOCHASTIC: &str = "
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.linear = nn.Linear(64, 32)
        self.dropout = nn.Dropout(p)

    def forward(self, x):
        return self.dropout(self.linear(x)) + torch.randn(x.shape[0], 32)

def get_inputs():
    return [torch.rand(8, 64)]

def get_init_inputs():
    return [0.2]
";

const NO_GET_INPUTS: &str = "
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return x

def get_init_inputs():
    return []
";

/// Finds the evaluator's control channel in its own process and claims success.
const FORGER: &str = "
import gc
import roles
channel = next(o for o in gc.get_objects() if isinstance(o, roles.Channel))
channel.send(event='failed', verdict='correct', message='trust me', phase='load')
";

fn relu_candidate(prelude: &str, forward: &str) -> Vec<u8> {
    format!(
        "import torch\nimport torch.nn as nn\n{prelude}\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        {forward}\n"
    )
    .into_bytes()
}

fn problem(level: u32, id: u32, source: &str) -> EvalProblem {
    EvalProblem {
        level,
        problem_id: id,
        name: format!("{id}_Test.py"),
        source: source.into(),
        defect: None,
    }
}

fn sample(problem_id: u32, sample_id: u32, code: Vec<u8>) -> EvalSample {
    EvalSample {
        level: 1,
        problem_id,
        sample_id,
        code: Some(code),
        origin: format!("test sample {problem_id}/{sample_id}"),
    }
}

#[test]
fn python_candidates_get_every_runtime_verdict() {
    let _machine = machine_shared();
    let mut non_utf8 = relu_candidate("", "return torch.relu(x)");
    non_utf8.extend_from_slice(b"NOTE = '\xff\xfe is not UTF-8'\n");
    let stochastic_copy = STOCHASTIC.replace("class Model(", "class ModelNew(");
    let cases: Vec<(u32, u32, Vec<u8>, Verdict)> = vec![
        (
            1,
            0,
            relu_candidate("", "return torch.clamp(x, min=0)"),
            Verdict::Correct,
        ),
        (
            1,
            1,
            relu_candidate("", "import os; os.abort()"),
            Verdict::Crashed,
        ),
        (
            1,
            2,
            relu_candidate("", "raise ValueError('bad forward')"),
            Verdict::RuntimeError,
        ),
        (
            1,
            3,
            b"import torch\nclass Other: pass\n".to_vec(),
            Verdict::LoadError,
        ),
        (
            1,
            4,
            relu_candidate("raise RuntimeError('module level')", "return x"),
            Verdict::LoadError,
        ),
        (1, 5, non_utf8, Verdict::LoadError),
        (
            1,
            6,
            relu_candidate("", "while True: pass"),
            Verdict::Timeout,
        ),
        (
            1,
            7,
            relu_candidate("", "return x.double()"),
            Verdict::OutputMismatch,
        ),
        (
            1,
            8,
            relu_candidate("import os", "os._exit(3)"),
            Verdict::Crashed,
        ),
        (
            1,
            9,
            relu_candidate("", "return (x * float('inf')).relu()"),
            Verdict::NanOrInf,
        ),
        (1, 10, FORGER.as_bytes().to_vec(), Verdict::RuntimeError),
        // Retried with the device to itself (the others wait), then judged like any error.
        (
            1,
            11,
            relu_candidate(
                "",
                "raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB')",
            ),
            Verdict::RuntimeError,
        ),
        (2, 0, stochastic_copy.into_bytes(), Verdict::Correct),
    ];
    let run = tempfile::tempdir().unwrap();
    let mut cfg = test_config(run.path());
    cfg.timeout = Duration::from_secs(8);
    // Several in flight, each slot starting its next candidate (and reference) ahead: every
    // verdict must come out the same as one at a time.
    cfg.runs_per_device = 3;
    cfg.look_ahead = true;
    let samples = cases
        .iter()
        .map(|(p, s, code, _)| sample(*p, *s, code.clone()))
        .collect();
    let problems = vec![problem(1, 1, RELU), problem(1, 2, STOCHASTIC)];
    let summary = dice_eval::evaluate(cfg, problems, samples, None).unwrap();
    let store = Store::open(&run.path().join("dice.db")).unwrap();
    let stored = store.samples().unwrap();
    for (p, s, _, expected) in &cases {
        let got = stored
            .iter()
            .find(|r| r.problem_id == *p && r.sample_id == *s)
            .unwrap();
        assert_eq!(
            got.verdict, *expected,
            "problem {p} sample {s}: {:?}\n{}",
            got.message, got.log_excerpt
        );
        assert_eq!(
            got.message.is_none(),
            *expected == Verdict::Correct,
            "{got:?}"
        );
        if *expected == Verdict::Correct {
            assert_eq!(got.trials_passed, 5);
            let (c, b) = (
                got.candidate_timing.as_ref().unwrap(),
                got.baseline_timing.as_ref().unwrap(),
            );
            // Every measurement's calls, a measurement made again included.
            let calls = 10 * (1 + got.timing_remeasures);
            assert_eq!((c.trials, b.trials), (calls, calls));
            assert!(c.min_ms <= c.median_ms && c.median_ms <= c.max_ms && c.mean_ms > 0.0);
            assert!((got.speedup.unwrap() - b.mean_ms / c.mean_ms).abs() < 1e-9);
        }
    }
    assert_eq!(summary.verdicts.values().sum::<usize>(), cases.len());
    let mismatch = stored
        .iter()
        .find(|r| r.verdict == Verdict::OutputMismatch)
        .unwrap();
    assert!(
        mismatch.message.as_ref().unwrap().contains("dtype"),
        "{mismatch:?}"
    );
    let crashed = stored
        .iter()
        .find(|r| (r.problem_id, r.sample_id) == (1, 1))
        .unwrap();
    assert!(
        crashed.message.as_ref().unwrap().contains("SIGABRT"),
        "{crashed:?}"
    );
}

#[test]
fn a_failing_reference_is_a_problem_error_and_a_chatty_candidate_is_bounded() {
    let _machine = machine_shared();
    let chatty = relu_candidate(
        "import sys\nsys.stdout.write('x' * (100 << 20))\nsys.stdout.flush()",
        "return torch.relu(x)",
    );
    let run = tempfile::tempdir().unwrap();
    let cfg = test_config(run.path());
    let problems = vec![problem(1, 1, RELU), problem(1, 2, NO_GET_INPUTS)];
    let samples = vec![
        sample(1, 0, chatty),
        sample(2, 0, relu_candidate("", "return x")),
    ];
    let summary = dice_eval::evaluate(cfg, problems, samples, None).unwrap();
    assert_eq!(summary.skipped, 1);
    assert_eq!(summary.reference_errors.len(), 1);
    assert!(
        summary.reference_errors[0].2.contains("get_inputs"),
        "{:?}",
        summary.reference_errors
    );

    let store = Store::open(&run.path().join("dice.db")).unwrap();
    let samples = store.samples().unwrap();
    assert_eq!(
        samples.len(),
        1,
        "the sample of the broken problem gets no verdict"
    );
    assert_eq!(
        samples[0].verdict,
        Verdict::Correct,
        "{:?}",
        samples[0].message
    );
    assert!(samples[0].log_excerpt.len() < 40 * 1024);
    assert!(samples[0].log_excerpt.contains("bytes omitted"));
    let problems = store.problems().unwrap();
    let broken = problems.iter().find(|p| p.problem_id == 2).unwrap();
    assert!(broken
        .reference_error
        .as_ref()
        .unwrap()
        .contains("get_inputs"));
    assert!(problems
        .iter()
        .find(|p| p.problem_id == 1)
        .unwrap()
        .reference_error
        .is_none());
}

#[test]
fn a_candidate_for_an_unknown_problem_is_refused_up_front() {
    let run = tempfile::tempdir().unwrap();
    let err = dice_eval::evaluate(
        test_config(run.path()),
        vec![problem(1, 1, RELU)],
        vec![sample(7, 0, relu_candidate("", "return x"))],
        None,
    )
    .unwrap_err();
    assert!(err.to_string().contains("level 1 problem 7"), "{err}");
}
