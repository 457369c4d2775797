//! The fused decode kernels (`src/kernels/decode_ops.cu`) run on the CPU: the kernel source is
//! compiled as C++ against a small CUDA emulation (`kernel_emulation/`), one thread per CUDA
//! thread, and checked bit for bit against references that take candle's rounding steps
//! (residual add + RMSNorm, SiLU gate, qk-norm + RoPE + KV-cache write with unequal rows, for
//! f32/bf16/f16), including that cache slots other than the new tokens' are left untouched; the
//! greedy selection against a scan of the logits; the sampled selection against the running sum
//! of its weights in index order.
//! This checks the kernels' indexing and rounding where no GPU is present; on a GPU, what the
//! emulation cannot reproduce (rsqrtf, cosf, expf of the device) is the same code in both paths.
//!
//! Needs a C++20 compiler (`$CXX`, else `g++`); without one the test fails.

#[test]
fn decode_kernels_match_candles_rounding_on_the_cpu() {
    crate::common::run_emulated_kernel_check("check_decode_ops.cpp", &[]);
}
