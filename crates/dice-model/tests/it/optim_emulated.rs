//! The AdamW kernel (`src/kernels/optim.cu`) run on the CPU through the CUDA emulation
//! (`kernel_emulation/`), against dice-train's host update written out in plain f32 operations:
//! equal bit for bit, f32 weights and bf16/f16 weights with f32 masters, with and without
//! weight decay.
//!
//! Needs a C++20 compiler (`$CXX`, else `g++`); without one the test fails.

#[test]
fn the_adamw_kernel_equals_the_host_update_bit_for_bit_on_the_cpu() {
    crate::common::run_emulated_kernel_check("check_optim.cpp", &[]);
}
