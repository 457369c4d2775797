//! The fused training attention (`src/kernels/train_attention.cu`: forward with its
//! log-sum-exp, dQ, dK and dV) run on the CPU through the CUDA emulation (`kernel_emulation/`),
//! against a direct f64 attention and its gradients on packed two-stream SFT sequences (several
//! samples, GQA, partly filled tiles, skipped key tiles, queries that see nothing): in bf16 and
//! f16 with both of its paths, per-warp mma.sync with ldmatrix and Hopper's warpgroup wgmma
//! reading B from 128-byte swizzled tiles through matrix descriptors (decoded by the emulation as
//! the GPU does), and both backwards, dQ from kept dS (the default) and recomputed
//! (`DICE_ATTENTION_KEEP_DS=0`); in f32 (kernels without tensor cores) at f32's precision. The
//! GPU itself is checked against the composite path by `dice bench golden` and `tests/cuda.rs`.
//!
//! Needs a C++20 compiler (`$CXX`, else `g++`); without one the test fails.

#[test]
fn train_attention_kernels_match_direct_attention_and_gradients_on_the_cpu() {
    // The portable path at the tiny golden model's head dim and the real models'; the wgmma
    // path (head dims of whole 128-byte rows) at the real models' (two swizzled atoms a row) and
    // at 64 (one atom). The emulation runs a wgmma only when a wait completes it, so a product
    // read or changed before its wait fails here. dQ from kept dS takes two query heads a CTA
    // (groups of 2) and one (groups of 1 and 3), on both paths.
    for (head_dim, wgmma) in [(16, 0), (128, 0), (128, 1), (64, 1)] {
        crate::common::run_emulated_kernel_check(
            "check_train_attention.cpp",
            &[
                format!("-DHEAD_DIM={head_dim}"),
                format!("-DTRAIN_ATTENTION_WGMMA={wgmma}"),
            ],
        );
    }
}
