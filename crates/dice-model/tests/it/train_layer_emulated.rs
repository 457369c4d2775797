//! The fused element-wise kernels of the training layer (`src/kernels/train_layer.cu`: RMSNorm
//! with residual, the q/k heads' norm + RoPE, SwiGLU, each forward and backward) run on the CPU
//! through the CUDA emulation (`kernel_emulation/`), against a direct f64 forward and finite
//! differences of it, in f32, bf16 and f16. The whole fused layer is checked on the GPU against
//! the composite step by `tests/cuda.rs` and `dice bench golden`.
//!
//! Needs a C++20 compiler (`$CXX`, else `g++`); without one the test fails.

#[test]
fn train_layer_kernels_match_direct_references_and_finite_differences_on_the_cpu() {
    crate::common::run_emulated_kernel_check("check_train_layer.cpp", &[]);
}
