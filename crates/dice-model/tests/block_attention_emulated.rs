//! The fused decode attention kernel (`src/kernels/block_attention.cu`) run on the CPU: the
//! kernel source is compiled as C++ against a small CUDA emulation (`kernel_emulation/`), one
//! thread per CUDA thread, and checked against a direct f64 attention with the masks of
//! `masks::cached_block_mask` (decoding blocks, block-causal prefill, unequal rows, key splits
//! with their merge, f32/bf16/f16). This checks the kernel's indexing, masking and online softmax
//! where no GPU is present; the GPU itself is checked by `tests/cuda.rs` and `dice bench golden`.
//!
//! Needs a C++20 compiler (`$CXX`, else `g++`); without one the test says so and passes.

use std::path::Path;
use std::process::Command;

#[test]
fn block_attention_kernel_matches_direct_attention_on_the_cpu() {
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "g++".to_string());
    if Command::new(&compiler).arg("--version").output().is_err() {
        eprintln!("no C++ compiler `{compiler}`: the emulated kernel check did not run");
        return;
    }
    let harness = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/kernel_emulation/check_block_attention.cpp");
    let out = tempfile::tempdir().unwrap();
    // The tiny golden model's head dim and the real models'.
    for head_dim in [16, 128] {
        let binary = out.path().join(format!("check_{head_dim}"));
        let build = Command::new(&compiler)
            .args(["-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas"])
            .arg(format!("-DHEAD_DIM={head_dim}"))
            .arg(&harness)
            .arg("-o")
            .arg(&binary)
            .output()
            .unwrap();
        assert!(
            build.status.success(),
            "the emulated kernel does not compile:\n{}",
            String::from_utf8_lossy(&build.stderr)
        );
        let run = Command::new(&binary).output().unwrap();
        let report = String::from_utf8_lossy(&run.stdout);
        println!("{report}");
        assert!(
            run.status.success(),
            "head dim {head_dim}: the kernel differs from direct attention:\n{report}"
        );
    }
}
