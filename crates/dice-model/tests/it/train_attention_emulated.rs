//! The fused training attention (`src/kernels/train_attention.cu`: forward with its
//! log-sum-exp, dQ, dK and dV) run on the CPU through the CUDA emulation (`kernel_emulation/`),
//! against a direct f64 attention and its gradients on packed two-stream SFT sequences (several
//! samples, GQA, partly filled tiles, skipped key tiles, queries that see nothing), in bf16 and
//! f16, with both of its paths: per-warp mma.sync with ldmatrix, and Hopper's warpgroup wgmma
//! reading B from 128-byte swizzled tiles through matrix descriptors (decoded by the emulation as
//! the GPU does); both backwards: dQ from kept dS (the default) and recomputed
//! (`DICE_ATTENTION_KEEP_DS=0`); the wgmma forward with and without its overlap. The GPU
//! itself is checked against the composite path by `dice bench golden` and `tests/cuda.rs`.
//!
//! Needs a C++20 compiler (`$CXX`, else `g++`); without one the test fails.

#[test]
fn train_attention_kernels_match_direct_attention_and_gradients_on_the_cpu() {
    // The portable path at the tiny golden model's head dim and the real models'; the wgmma
    // path (head dims of whole 128-byte rows) at the real models' (two swizzled atoms a row) and
    // at 64 (one atom). The emulation runs a wgmma only when a wait completes it, so a product
    // read or changed before its wait fails here. dQ from kept dS takes one query head a CTA or
    // two of a GQA group (DICE_ATTENTION_DQ_HEADS), each on both paths; the wgmma forward runs
    // with and without its overlap (DICE_ATTENTION_FORWARD_OVERLAP).
    for (head_dim, wgmma, dq_heads, forward_overlap) in
        [(16, 0, 2, 0), (128, 0, 1, 0), (128, 1, 2, 1), (64, 1, 1, 0)]
    {
        crate::common::run_emulated_kernel_check(
            "check_train_attention.cpp",
            &[
                format!("-DHEAD_DIM={head_dim}"),
                format!("-DTRAIN_ATTENTION_WGMMA={wgmma}"),
                format!("-DDQ_FROM_DS_MAX_HEADS={dq_heads}"),
                format!("-DFORWARD_OVERLAP={forward_overlap}"),
            ],
        );
    }
}
