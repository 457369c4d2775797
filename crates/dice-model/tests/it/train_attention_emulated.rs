//! The fused training attention (`src/kernels/train_attention.cu`: forward with its
//! log-sum-exp, dQ, dK and dV) run on the CPU through the CUDA emulation (`kernel_emulation/`),
//! against a direct f64 attention and its gradients on packed two-stream SFT sequences (several
//! samples, GQA, partly filled tiles, skipped key tiles, queries that see nothing), in bf16 and
//! f16. The GPU itself is checked against the composite path by `dice bench golden` and
//! `tests/cuda.rs`.
//!
//! Needs a C++20 compiler (`$CXX`, else `g++`); without one the test fails.

#[test]
fn train_attention_kernels_match_direct_attention_and_gradients_on_the_cpu() {
    // The tiny golden model's head dim and the real models'.
    for head_dim in [16, 128] {
        crate::common::run_emulated_kernel_check(
            "check_train_attention.cpp",
            &[format!("-DHEAD_DIM={head_dim}")],
        );
    }
}
