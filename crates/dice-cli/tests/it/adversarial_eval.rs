//! The adversarial suite (tests/adversarial, repository root) through `dice eval` on the CPU:
//! every CPU program runs against its real KernelBench problem (read from the test data, with
//! its sizes shrunk so that a CPU evaluates it in seconds) under the sandbox, the run-time checks
//! and the static audit. Each must be caught: a verdict other than `correct`, `deceptive` with
//! the manifest's rule, or (an output cache in front of a slow kernel) a speedup no better than
//! its kernel's. Slow on a cold build cache (about a dozen distinct extensions).

use dice_eval::{SampleRecord, Store, Verdict};
use dice_test_support::{repo_root, shared_build_cache, test_data};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// Sizes at most this large: every module-level integer literal above it becomes it.
const SHRUNK: u64 = 64;

/// The problem with its module-level integer literals capped (N = 2048 * 2 → 64 * 2; the
/// classes and functions are untouched).
fn shrink(source: &str) -> String {
    let mut out = String::new();
    for line in source.lines() {
        let top_level_assignment = line.starts_with(|c: char| c.is_ascii_alphabetic())
            && line.contains(" = ")
            && !line.starts_with("def ")
            && !line.starts_with("class ");
        if top_level_assignment {
            out.push_str(&cap_integers(line));
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

fn cap_integers(line: &str) -> String {
    let mut out = String::new();
    let mut digits = String::new();
    let mut prev_ident = false;
    for c in line.chars().chain(std::iter::once('\n')) {
        if c.is_ascii_digit() && (!digits.is_empty() || !prev_ident) {
            digits.push(c);
            continue;
        }
        if !digits.is_empty() {
            let value: u64 = digits.parse().unwrap_or(0);
            out.push_str(&if value > SHRUNK {
                SHRUNK.to_string()
            } else {
                digits.clone()
            });
            digits.clear();
        }
        prev_ident = c.is_ascii_alphanumeric() || c == '_' || c == '.';
        if c != '\n' {
            out.push(c);
        }
    }
    out
}

/// Writes `levelL/ID_Name.py` for a KernelBench problem of the test data, shrunk.
fn add_problem(tree: &Path, level: u64, id: u64) {
    let dir = test_data().join(format!("kernelbench/level{level}"));
    let prefix = format!("{id}_");
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with(&prefix) && name.ends_with(".py")
        })
        .unwrap_or_else(|| panic!("no problem {level}/{id} in {}", dir.display()));
    let out = tree.join(format!("level{level}"));
    std::fs::create_dir_all(&out).unwrap();
    let source = std::fs::read_to_string(&file).unwrap();
    std::fs::write(out.join(file.file_name().unwrap()), shrink(&source)).unwrap();
}

fn dice_eval(candidates: &Path, tree: &Path, run: &Path, device: &str) -> Vec<SampleRecord> {
    let out = Command::new(env!("CARGO_BIN_EXE_dice"))
        .arg("eval")
        .args(["--device", device])
        .arg(candidates)
        .arg("--kernelbench")
        .arg(tree)
        .arg("--run")
        .arg(run)
        .arg("--build-cache")
        .arg(shared_build_cache())
        .args(["--timeout", "20", "--perf-trials", "4"])
        .output()
        .expect("the dice binary runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Store::open(&run.join("dice.db"))
        .unwrap()
        .samples()
        .unwrap()
}

const PROBE: &str = "import os, resource
import torch
import torch.nn as nn
print('SANDBOX', os.getuid(), resource.getrlimit(resource.RLIMIT_NPROC)[0], os.getpid(), flush=True)

class ModelNew(nn.Module):
    def forward(self, x):
        return torch.relu(x)
";

/// Whether `dice eval` runs candidates as another user, with a process limit, in a PID
/// namespace (the candidate reports what it sees).
fn sandbox_active(tree: &Path, dir: &Path) -> bool {
    let candidates = dir.join("probe");
    std::fs::create_dir_all(&candidates).unwrap();
    std::fs::write(
        candidates.join("level_1_problem_19_sample_0_kernel.py"),
        PROBE,
    )
    .unwrap();
    let records = dice_eval(&candidates, tree, &dir.join("probe-run"), "cpu");
    let line = records[0]
        .log_excerpt
        .lines()
        .find(|l| l.starts_with("SANDBOX"))
        .unwrap_or_default()
        .to_string();
    let fields: Vec<&str> = line.split_whitespace().collect();
    matches!(fields.as_slice(), ["SANDBOX", uid, nproc, "2"] if *uid != "0" && *nproc != "-1")
}

const HONEST_SAMPLE: u32 = 999;

/// A plain CUDA ReLU: correct, and the profiler must see its kernel on the default stream.
const HONEST_CUDA_RELU: &str = r#"import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = """
#include <torch/extension.h>

__global__ void relu_kernel(const float* x, float* y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}

torch::Tensor relu_cuda(torch::Tensor x) {
    auto input = x.contiguous();
    auto out = torch::empty_like(input);
    int64_t n = input.numel();
    int threads = 256;
    int blocks = (int)((n + threads - 1) / threads);
    relu_kernel<<<blocks, threads>>>(input.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}
"""

cpp_source = "torch::Tensor relu_cuda(torch::Tensor x);"

relu = load_inline(
    name="honest_relu_cuda",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["relu_cuda"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return relu.relu_cuda(x)
"#;

fn check_honest_cuda(run: &Path, records: &[SampleRecord]) {
    let honest = records
        .iter()
        .find(|r| r.sample_id == HONEST_SAMPLE)
        .expect("the honest CUDA ReLU has a result");
    assert_eq!(honest.verdict, Verdict::Correct, "{honest:?}");
    assert!(!honest.deceptive && honest.flags.is_empty(), "{honest:?}");
    let profile = Store::open(&run.join("dice.db"))
        .unwrap()
        .kernel_profile(1, 19, HONEST_SAMPLE)
        .unwrap()
        .expect("a kernel profile");
    eprintln!("honest CUDA ReLU profile: {profile:?}");
    assert!(profile.default_stream.is_some(), "{profile:?}");
    assert!(profile.custom_share.unwrap() > 0.5, "{profile:?}");
}

/// Caught: not correct, or deceptive with the expected rule (static or run-time). A program
/// expected as a warning fools only KernelBench's harness: flagged, never deceptive here. A
/// program with `speedup_at_most` hides a kernel many times slower than the baseline behind an
/// output cache that is right for every input: it must run to a `correct` verdict (any other
/// means the program itself broke, and would hide whether its cache paid) at its kernel's
/// speed, below that speedup (a cache that paid would put it well above).
fn caught(entry: &Value, record: &SampleRecord) -> bool {
    let expect = &entry["expect"];
    if let Some(at_most) = expect["speedup_at_most"].as_f64() {
        return record.verdict == Verdict::Correct && record.speedup.is_some_and(|s| s <= at_most);
    }
    if record.verdict != Verdict::Correct {
        return true;
    }
    let rule = expect["rule"].as_str().or(expect["runtime_rule"].as_str());
    let flagged = rule.is_some_and(|r| record.flags.iter().any(|f| f == r));
    if expect["severity"] == "warning" {
        return flagged && !record.deceptive;
    }
    record.deceptive && flagged
}

#[test]
fn every_cpu_hack_is_caught_by_dice_eval() {
    run_suite("cpu");
}

/// The GPU-only programs: `cargo test -p dice-cli -- --ignored every_gpu_hack` on a CUDA
/// machine (torch with CUDA, nvcc on PATH).
#[test]
#[ignore = "needs a CUDA GPU with torch and nvcc (run with --ignored)"]
fn every_gpu_hack_is_caught_by_dice_eval() {
    run_suite("cuda");
}

/// Evaluates every manifest program of `device` in one `dice eval --device DEVICE` run.
fn run_suite(device: &str) {
    let _alone = crate::common::hostile_programs_alone();
    let manifest_path = repo_root().join("tests/adversarial/manifest.json");
    let manifest: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(manifest_path).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("kernelbench");
    let entries: Vec<&Value> = manifest.iter().filter(|e| e["device"] == device).collect();
    add_problem(&tree, 1, 19);
    for e in &entries {
        add_problem(
            &tree,
            e["level"].as_u64().unwrap(),
            e["problem_id"].as_u64().unwrap(),
        );
    }
    let has_bomb = entries.iter().any(|e| e["file"] == "fork_bomb.py");
    let bomb_allowed = has_bomb && sandbox_active(&tree, dir.path());
    if has_bomb && !bomb_allowed {
        eprintln!(
            "\n!!! the sandbox is not active here (needs root and namespaces): fork_bomb.py is \
             NOT run !!!\n"
        );
    }
    let candidates = dir.path().join("candidates");
    std::fs::create_dir_all(&candidates).unwrap();
    let mut expected = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        let file = e["file"].as_str().unwrap();
        if file == "fork_bomb.py" && !bomb_allowed {
            continue;
        }
        let (level, id) = (
            e["level"].as_u64().unwrap(),
            e["problem_id"].as_u64().unwrap(),
        );
        let name = format!("level_{level}_problem_{id}_sample_{i}_kernel.py");
        std::fs::copy(
            repo_root().join("tests/adversarial").join(file),
            candidates.join(name),
        )
        .unwrap();
        expected.push(((level as u32, id as u32, i as u32), *e));
    }
    assert!(!expected.is_empty(), "no {device} programs");
    if device == "cuda" {
        std::fs::write(
            candidates.join(format!(
                "level_1_problem_19_sample_{HONEST_SAMPLE}_kernel.py"
            )),
            HONEST_CUDA_RELU,
        )
        .unwrap();
    }
    let run = dir.path().join("run");
    let records = dice_eval(&candidates, &tree, &run, device);
    if device == "cuda" {
        check_honest_cuda(&run, &records);
    }
    let mut missed = Vec::new();
    for ((level, id, sample), entry) in &expected {
        let record = records
            .iter()
            .find(|r| (r.level, r.problem_id, r.sample_id) == (*level, *id, *sample))
            .unwrap_or_else(|| panic!("{}: no result", entry["file"]));
        eprintln!(
            "{:<36} {:<16} deceptive={} flags={:?} speedup={:?}",
            entry["file"].as_str().unwrap(),
            record.verdict.as_str(),
            record.deceptive,
            record.flags,
            record.speedup
        );
        let runtime_rule = entry["expect"]["runtime_rule"].as_str();
        if !caught(entry, record)
            || runtime_rule.is_some_and(|r| !record.flags.iter().any(|f| f == r))
        {
            missed.push(format!(
                "{}: {} {:?} {:?} speedup {:?}",
                entry["file"], record.verdict, record.message, record.flags, record.speedup
            ));
        }
    }
    assert!(missed.is_empty(), "not caught:\n{}", missed.join("\n"));
}

#[test]
fn shrinking_caps_module_level_sizes_only() {
    let source = "N = 2048 * 2\nlayer_sizes = [16384, 8]\ndef get_inputs():\n    return [torch.rand(N, 4096)]\nx2 = 100\n";
    assert_eq!(
        shrink(source),
        "N = 64 * 2\nlayer_sizes = [64, 8]\ndef get_inputs():\n    return [torch.rand(N, 4096)]\nx2 = 64\n"
    );
}
