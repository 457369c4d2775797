//! The fused training attention (`src/kernels/train_attention.cu`: forward with its
//! log-sum-exp, dQ, dK and dV) run on the CPU through the CUDA emulation (`kernel_emulation/`),
//! against a direct f64 attention and its gradients on packed two-stream SFT sequences (several
//! samples, GQA, partly filled tiles, skipped key tiles, queries that see nothing), in bf16 and
//! f16, with both of its paths: per-warp mma.sync with ldmatrix, and Hopper's warpgroup wgmma
//! reading B from 128-byte swizzled tiles through matrix descriptors (decoded by the emulation as
//! the GPU does). The GPU
//! itself is checked against the composite path by `dice bench golden` and `tests/cuda.rs`.
//!
//! Needs a C++20 compiler (`$CXX`, else `g++`); without one the test fails.

#[test]
fn train_attention_kernels_match_direct_attention_and_gradients_on_the_cpu() {
    // The portable path at the tiny golden model's head dim and the real models'; the wgmma
    // path (head dims of whole 128-byte rows) at the real models' (two swizzled atoms a row)
    // with the dK/dV kernel's half-tile query steps, and at 64 (one atom) with whole tiles
    // (`DICE_DKDV_QUERY_STEP=64`) and with the backward's products overlapped
    // (`DICE_ATTENTION_OVERLAP=1`: the emulation runs a wgmma only when a wait completes it, so
    // a product read or changed before its wait fails here).
    for (head_dim, wgmma, dkdv_queries, overlap) in [
        (16, 0, 32, 0),
        (128, 0, 32, 0),
        (128, 1, 32, 0),
        (64, 1, 64, 0),
        (64, 1, 32, 1),
    ] {
        crate::common::run_emulated_kernel_check(
            "check_train_attention.cpp",
            &[
                format!("-DHEAD_DIM={head_dim}"),
                format!("-DTRAIN_ATTENTION_WGMMA={wgmma}"),
                format!("-DDKDV_QUERY_STEP={dkdv_queries}"),
                format!("-DTRAIN_ATTENTION_OVERLAP={overlap}"),
            ],
        );
    }
}
