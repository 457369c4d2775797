//! Shared test helpers: the repository's test data, the formula golden and its checkpoint
//! (from dice-test-support), max-abs-diff comparisons, and the build and run of the emulated
//! kernel checks.

use candle_core::{DType, Tensor};
use dice_model::golden::Measurement;
use std::path::PathBuf;

pub(crate) use dice_test_support::checkpoint::{formula_golden, formula_golden_dir, formula_tiny};
pub(crate) use dice_test_support::test_data;

/// Prints every measurement and asserts that each is within its f32 tolerance.
pub(crate) fn assert_within_f32_tolerances(measurements: &[Measurement]) {
    for m in measurements {
        println!(
            "{}: max diff {:.3e} (tolerance {:.0e})",
            m.name, m.max_diff, m.tolerance
        );
    }
    let failed: Vec<String> = measurements
        .iter()
        .filter(|m| !m.passes_f32())
        .map(|m| format!("{} {:e} > {:e}", m.name, m.max_diff, m.tolerance))
        .collect();
    assert!(
        failed.is_empty(),
        "outside the golden's tolerances: {failed:?}"
    );
}

/// `relative` in the optional large data folder named by `DICE_SHARED`, which the tests that
/// read it (ignored by default) need: they fail without it.
pub(crate) fn dice_shared(relative: &str) -> PathBuf {
    let root = std::env::var_os("DICE_SHARED")
        .expect("DICE_SHARED is not set: point it at the folder holding the optional data");
    let path = PathBuf::from(root).join(relative);
    assert!(path.exists(), "{} does not exist", path.display());
    path
}

pub(crate) fn read_json(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
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

pub(crate) fn u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Builds a `tests/kernel_emulation/` harness (our CUDA source compiled as C++ against the CPU
/// emulation of CUDA) with the extra compiler `defines`, runs it and asserts that it exits 0;
/// prints its report. Needs a C++20 compiler (`$CXX`, else `g++`).
pub(crate) fn run_emulated_kernel_check(harness: &str, defines: &[String]) {
    use std::process::Command;
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "g++".to_string());
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/kernel_emulation")
        .join(harness);
    let out = tempfile::tempdir().unwrap();
    let binary = out.path().join("check");
    let build = Command::new(&compiler)
        .args(["-std=c++20", "-O1", "-Wno-unknown-pragmas"])
        .args(defines)
        .arg(&source)
        .arg("-o")
        .arg(&binary)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run the C++ compiler `{compiler}` (set CXX to a C++20 compiler): {e}")
        });
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
