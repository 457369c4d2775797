//! The fused decode attention kernel (`src/kernels/block_attention.cu`) run on the CPU: the
//! kernel source is compiled as C++ against a small CUDA emulation (`kernel_emulation/`), one
//! thread per CUDA thread, and checked against a direct f64 attention with the masks of
//! `masks::cached_block_mask` (decoding blocks, block-causal prefill, unequal rows, key splits
//! with their merge, f32/bf16/f16). This checks the kernel's indexing, masking and online softmax
//! where no GPU is present; the GPU itself is checked by `tests/cuda.rs` and `dice bench golden`.
//!
//! Needs a C++20 compiler (`$CXX`, else `g++`); without one the test fails.

#[test]
fn block_attention_kernel_matches_direct_attention_on_the_cpu() {
    // The tiny golden model's head dim and the real models', with the stages the launcher
    // compiles for (block_attention.rs, MMA_STAGES).
    for head_dim in [16, 128] {
        crate::common::run_emulated_kernel_check(
            "check_block_attention.cpp",
            &[format!("-DHEAD_DIM={head_dim}"), "-DMMA_STAGES=3".into()],
        );
    }
}
