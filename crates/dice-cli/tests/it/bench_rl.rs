//! `dice bench rl` on the formula golden's tiny config with one CPU C++ task, judged on the
//! CPU: recorded programs of known outcome judged for real, pipelined and back to back.

use crate::common::{away_from_hostile_programs, dice, path_arg, stderr};
use dice_test_support::{examples_dir, shared_build_cache, test_data};
use serde_json::Value;

/// A ReLU extension on the CPU, short so that its replay stays small.
const RELU: &str = r#"import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""
#include <torch/extension.h>

torch::Tensor relu(torch::Tensor x) {
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    const float* in = xc.data_ptr<float>();
    float* out = y.data_ptr<float>();
    for (int64_t i = 0; i < xc.numel(); ++i) out[i] = in[i] > 0.f ? in[i] : 0.f;
    return y;
}
"""

ext = load_inline(name="dice_bench_rl_relu", cpp_sources=source, functions=["relu"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu(x)
"#;

#[test]
fn a_step_judges_recorded_programs_pipelined_and_back_to_back() {
    let _honest = away_from_hostile_programs();
    let dir = tempfile::tempdir().unwrap();
    let reference =
        std::fs::read_to_string(examples_dir().join("kernelbench/level1/1_ReLU.py")).unwrap();
    let tasks = dir.path().join("tasks.json");
    let task = serde_json::json!([{
        "id": 1,
        "pytorch_code": reference,
        "cuda_code": RELU,
        "prompt": "<|im_start|>user\nWrite relu.<|im_end|>\n<|im_start|>assistant\n",
    }]);
    std::fs::write(&tasks, task.to_string()).unwrap();
    let config = test_data().join("sdar/golden/formula/config.json");
    let tokenizer = test_data().join("sdar");
    let json = dir.path().join("bench.json");
    let out = dice(&[
        "bench",
        "rl",
        "--config",
        path_arg(&config),
        "--tasks",
        path_arg(&tasks),
        "--tokenizer",
        path_arg(&tokenizer),
        "--tasks-per-step",
        "1",
        "--samples-per-task",
        "4",
        "--max-tokens",
        "512",
        "--device",
        "cpu",
        "--judge-device",
        "cpu",
        "--out",
        path_arg(&dir.path().join("work")),
        // The suite's shared cache: the second run builds nothing the first did not (the
        // bench's own caches are for measuring, which a test does not).
        "--build-cache",
        path_arg(&shared_build_cache()),
        "--json",
        path_arg(&json),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{stdout}", stderr(&out));
    eprintln!("{stdout}");
    // Each run's phases on stderr as it ends, so that a benchmark cut short shows the first.
    let log = stderr(&out);
    for name in ["pipelined", "back-to-back"] {
        assert!(
            log.contains(&format!("{name} step done: rollout ")),
            "{log}"
        );
    }
    let bench: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(
        (bench["tasks"].as_u64(), bench["samples"].as_u64()),
        (Some(1), Some(4))
    );
    // Correct passes, the #error does not build: the group's rewards differ and it is kept.
    let reward = bench["reward_mean"].as_f64().unwrap();
    assert!(reward > 0.0 && reward < 1.0, "{bench}");
    assert_eq!(bench["groups_kept"], 1, "{bench}");
    let outcomes = bench["outcomes"].as_array().unwrap();
    let outcome = |variant: &str| {
        let o = outcomes.iter().find(|o| o["variant"] == variant).unwrap();
        (
            o["samples"].as_u64(),
            o["passed"].as_u64(),
            o["reward_sum"].as_f64(),
        )
    };
    assert_eq!(outcome("correct"), (Some(1), Some(1), Some(1.0)), "{bench}");
    assert_eq!(
        outcome("compile-error"),
        (Some(1), Some(0), Some(0.0)),
        "{bench}"
    );
    for unrewarded in ["wrong-result", "hack"] {
        assert_eq!(outcome(unrewarded).2, Some(0.0), "{unrewarded}: {bench}");
    }
    assert_eq!(bench["learned"], true);
    assert!(bench["replay_samples"].as_u64().unwrap() > 0);
    assert!(bench["tokens"].as_u64().unwrap() > 4 * 100);
    for run in ["pipelined", "back_to_back"] {
        for phase in ["rollout", "judge", "update", "step"] {
            assert!(
                bench[run][phase].as_f64().unwrap() > 0.0,
                "{run} {phase}: {bench}"
            );
        }
    }
    assert!(stdout.contains("| pipelined |") && stdout.contains("| back to back |"));
    assert!(stdout.contains("pipelined speedup"), "{stdout}");
}
