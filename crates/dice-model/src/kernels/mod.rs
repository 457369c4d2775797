//! Hand-written CUDA kernels, compiled at run time with NVRTC (the `cuda` feature): the fused
//! decoding forward's building blocks (`crate::sdar`'s `fused` module).

mod block_attention;
pub(crate) mod decode_ops;
mod device_ptr;
mod nvrtc;

pub(crate) use block_attention::BlockAttention;
