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
mod gemm;
mod nvrtc;
pub(crate) mod optim;
mod train_attention;
mod train_layer;

pub(crate) use block_attention::BlockAttention;
pub(crate) use train_attention::TrainAttention;
pub(crate) use train_layer::TrainLayer;

/// Compiles every kernel source of ours for compute capability `arch`, the attention kernels for
/// each head dim of `head_dims`, into the cubin cache (cubin_cache.rs): what a GPU process then
/// reads instead of compiling. Needs NVRTC, not a GPU.
pub(crate) fn precompile(
    head_dims: &[usize],
    arch: (i32, i32),
) -> anyhow::Result<Vec<crate::cubin_cache::Precompiled>> {
    let mut jobs: Vec<(&nvrtc::Source, Vec<String>)> = vec![
        (&decode_ops::SOURCE, Vec::new()),
        (&train_layer::SOURCE, Vec::new()),
        (&optim::SOURCE, Vec::new()),
    ];
    for &head_dim in head_dims {
        jobs.push((
            &block_attention::SOURCE,
            block_attention::compile_options(head_dim).to_vec(),
        ));
        jobs.push((
            &train_attention::SOURCE,
            train_attention::compile_options(head_dim).to_vec(),
        ));
    }
    jobs.into_iter()
        .map(|(source, options)| {
            let cached = nvrtc::precompile(source, &options, arch)?;
            Ok(crate::cubin_cache::Precompiled {
                what: source.what,
                target: nvrtc::target(source, arch),
                options,
                cached,
            })
        })
        .collect()
}
