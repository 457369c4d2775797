//! The AdamW update on CUDA (`optim.cu`): one kernel pass per tensor, in place on the f32
//! moments, the f32 masters and the compute weights, with the host update's operations in its
//! order (dice-train's `optim.rs`), so that a GPU step equals a CPU step bit for bit. It replaces
//! a dozen candle ops per tensor, each of which read and wrote the whole tensor in f32 and
//! allocated its result. Beside it, a gradient's sums of squares in f64 for the norm, in one read
//! of the gradient ([`square_sums`]). Both checked on the CPU through the CUDA emulation
//! (tests/it/optim_emulated.rs).

use super::device_ptr::{launch, Arg, Scalar};
use super::nvrtc::{self, dtype_index, PerDevice, Source};
use crate::adamw::AdamWScalars;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, DType, Device, Result, Tensor};
use std::sync::Arc;

pub(super) const SOURCE: Source = Source {
    text: include_str!("optim.cu"),
    file_name: c"optim.cu",
    what: "the optimizer's kernels",
    arch_specific: false,
};

/// `ADAMW_THREADS` and `SQUARE_SUM_THREADS` of `optim.cu`.
const THREADS: u32 = 256;
/// CTAs of a launch, which stride over the tensor: enough to fill any current GPU.
const CTAS: u32 = 1024;

/// `adamw_step_{f32,bf16,f16}` and `square_sums_{…}`, each in the order of [`dtype_index`].
struct Loaded {
    adamw_step: [CudaFunction; 3],
    square_sums: [CudaFunction; 3],
}

static LOADED: PerDevice<(), Loaded> = PerDevice::new();

fn load(dev: &CudaDevice) -> anyhow::Result<Loaded> {
    let module = nvrtc::load_module(dev, &SOURCE, &[])?;
    Ok(Loaded {
        adamw_step: nvrtc::by_dtype(&module, &SOURCE, "adamw_step")?,
        square_sums: nvrtc::by_dtype(&module, &SOURCE, "square_sums")?,
    })
}

/// `ctas` CTAs of [`THREADS`] threads, which stride over a tensor's elements.
fn strided_launch(ctas: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (ctas, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The kernels of `tensor`'s CUDA device and the index of its dtype among them; `None` for a
/// dtype they do not take or where they failed to build (said once, with what runs instead).
/// `what` names the kernel in the error for a tensor off CUDA.
fn kernels_for(tensor: &Tensor, what: &str) -> Result<Option<(Arc<Loaded>, usize)>> {
    let Device::Cuda(dev) = tensor.device() else {
        bail!("{what} runs on CUDA devices only");
    };
    let Some(slot) = dtype_index(tensor.dtype()) else {
        return Ok(None);
    };
    let loaded = LOADED.get(
        dev,
        (),
        "the optimizer's kernels are unavailable, AdamW and the gradient norm run as tensor \
         operations",
        || load(dev),
    );
    Ok(loaded.map(|kernels| (kernels, slot)))
}

/// One AdamW update in place on CUDA tensors of one weight: `exp_avg` and `exp_avg_sq` (f32),
/// `master` (f32, `None` when `weight` is f32 and its own master) and `weight` (rounded from
/// the master) from the f32 gradient `grad`; all contiguous, of one shape. `None` where the
/// kernel is not available on the device (the caller's tensor ops then run the update).
pub fn adamw_step(
    weight: &Tensor,
    master: Option<&Tensor>,
    [exp_avg, exp_avg_sq]: [&Tensor; 2],
    grad: &Tensor,
    s: &AdamWScalars,
) -> Result<Option<()>> {
    let Some((kernels, slot)) = kernels_for(weight, "the AdamW kernel")? else {
        return Ok(None);
    };
    let shape = weight.shape();
    let f32s = [Some(exp_avg), Some(exp_avg_sq), Some(grad), master];
    if f32s
        .iter()
        .flatten()
        .any(|t| t.dtype() != DType::F32 || t.shape() != shape)
        || (master.is_none() && weight.dtype() != DType::F32)
    {
        bail!("AdamW's state, gradient and master must be f32 tensors shaped as the weight");
    }
    let master = master.map_or(Arg::Null, |m| Arg::Whole(m, "the master weight"));
    let config = strided_launch(CTAS);
    // SAFETY: the pointers, count and scalars are the kernel's signature in order; every tensor
    // is contiguous (launch checks it) with the weight's element count, of the dtype the kernel
    // reads (checked above).
    unsafe {
        launch(
            &kernels.adamw_step[slot],
            config,
            &[
                Arg::Whole(weight, "the weight"),
                master,
                Arg::Whole(exp_avg, "the first moment"),
                Arg::Whole(exp_avg_sq, "the second moment"),
                Arg::Whole(grad, "the gradient"),
            ],
            &[
                Scalar::U64(shape.elem_count() as u64),
                Scalar::I32(i32::from(s.grad_factor.is_some())),
                Scalar::F32(s.grad_factor.unwrap_or(1.0)),
                Scalar::I32(i32::from(s.decay.is_some())),
                Scalar::F32(s.decay.unwrap_or(1.0)),
                Scalar::F32(s.one_minus_beta1),
                Scalar::F32(s.beta2),
                Scalar::F32(s.one_minus_beta2),
                Scalar::F32(s.bias_correction2_sqrt),
                Scalar::F32(s.eps),
                Scalar::F32(s.neg_step_size),
            ],
        )
    }?;
    Ok(Some(()))
}

/// Σ x² of the elements of the contiguous CUDA tensor `x` (f32, bf16 or f16) in f64, as partial
/// sums `[blocks]` on its device (nothing read back): their sum, in order, is the whole. `None`
/// where the kernel is not available for it (the caller sums with tensor ops).
pub fn square_sums(x: &Tensor) -> Result<Option<Tensor>> {
    let Some((kernels, slot)) = kernels_for(x, "the square-sum kernel")? else {
        return Ok(None);
    };
    let n = x.elem_count();
    let blocks = n.div_ceil(THREADS as usize).clamp(1, CTAS as usize);
    let partial = Tensor::zeros(blocks, DType::F64, x.device())?;
    let config = strided_launch(blocks as u32);
    // SAFETY: the pointers and count are the kernel's signature in order; `x` holds `n`
    // elements of the dtype of `slot`, `partial` one f64 per block (launch checks both
    // contiguous).
    unsafe {
        launch(
            &kernels.square_sums[slot],
            config,
            &[
                Arg::Whole(x, "the summed tensor"),
                Arg::Whole(&partial, "the partial sums"),
            ],
            &[Scalar::U64(n as u64)],
        )
    }?;
    Ok(Some(partial))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs wherever NVRTC loads (no GPU needed): the source must compile.
    #[test]
    fn the_kernel_compiles_with_nvrtc() {
        let cubin = nvrtc::compile_cubin(&SOURCE, &[], (9, 0)).unwrap();
        assert!(!cubin.is_empty());
    }
}
