//! Shared test helpers: where `shared/` is, max-abs-diff comparisons, and the build and run of
//! the emulated kernel checks.
#![allow(dead_code)] // each test binary uses a different subset

use candle_core::{DType, Tensor};
use std::path::PathBuf;

pub fn shared_dir() -> PathBuf {
    std::env::var_os("DICE_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"))
}

pub fn tiny_dir() -> PathBuf {
    shared_dir().join("sdar/golden/tiny")
}

pub fn read_json(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

pub fn cases() -> serde_json::Value {
    read_json(&tiny_dir().join("cases.json"))
}

pub fn expected(name: &str) -> Tensor {
    let all = candle_core::safetensors::load(
        tiny_dir().join("expected.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    all.get(name)
        .unwrap_or_else(|| panic!("expected.safetensors has no {name}"))
        .clone()
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

pub fn u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Builds a `tests/kernel_emulation/` harness (our CUDA source compiled as C++ against the CPU
/// emulation of CUDA) with the extra compiler `defines`, runs it and asserts that it exits 0;
/// prints its report. Needs a C++20 compiler (`$CXX`, else `g++`): without one it says so and
/// returns.
pub fn run_emulated_kernel_check(harness: &str, defines: &[String]) {
    use std::process::Command;
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "g++".to_string());
    if Command::new(&compiler).arg("--version").output().is_err() {
        eprintln!("no C++ compiler `{compiler}`: the emulated kernel check did not run");
        return;
    }
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/kernel_emulation")
        .join(harness);
    let out = tempfile::tempdir().unwrap();
    let binary = out.path().join("check");
    let build = Command::new(&compiler)
        .args(["-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas"])
        .args(defines)
        .arg(&source)
        .arg("-o")
        .arg(&binary)
        .output()
        .unwrap();
    assert!(
        build.status.success(),
        "{harness} {defines:?} does not compile:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = Command::new(&binary).output().unwrap();
    let report = String::from_utf8_lossy(&run.stdout);
    println!("{report}");
    assert!(
        run.status.success(),
        "{harness} {defines:?}: the emulated kernels differ from their references:\n{report}"
    );
}
