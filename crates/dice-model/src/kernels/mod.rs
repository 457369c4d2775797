//! Hand-written CUDA kernels, compiled at run time with NVRTC (the `cuda` feature): the fused
//! decoding forward's building blocks (`crate::sdar`'s `fused` module), the training
//! attention's forward and backward, and the training layer's element-wise steps forward and
//! backward (`crate::sdar`'s `training` module); and the optimizer's AdamW update (`optim`, for
//! dice-train).

// Launching NVRTC kernels through cudarc's raw API and handing it device addresses is unsafe by
// nature; each launch states its contract where it happens.
#![allow(unsafe_code)]

mod block_attention;
pub(crate) mod decode_ops;
mod device_ptr;
mod nvrtc;
pub(crate) mod optim;
mod train_attention;
mod train_layer;

pub(crate) use block_attention::BlockAttention;
pub(crate) use train_attention::TrainAttention;
pub(crate) use train_layer::TrainLayer;
