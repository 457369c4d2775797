//! The AdamW update on CUDA (`optim.cu`): one kernel pass per tensor, in place on the f32
//! moments, the f32 masters and the compute weights, with the host update's operations in its
//! order (dice-train's `optim.rs`), so that a GPU step equals a CPU step bit for bit. It replaces
//! a dozen candle ops per tensor, each of which read and wrote the whole tensor in f32 and
//! allocated its result. Checked on the CPU through the CUDA emulation
//! (tests/it/optim_emulated.rs).

use super::device_ptr::tensor_ptr;
use super::nvrtc::{self, dtype_index, PerDevice, Source};
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{bail, DType, Device, Result, Tensor};

const SOURCE: Source = Source {
    text: include_str!("optim.cu"),
    file_name: c"optim.cu",
    what: "the AdamW kernel",
};

/// `ADAMW_THREADS` of `optim.cu`.
const THREADS: u32 = 256;
/// CTAs of a launch, which stride over the tensor: enough to fill any current GPU.
const CTAS: u32 = 1024;

/// `adamw_step_{f32,bf16,f16}`, in the order of [`dtype_index`].
struct Loaded([CudaFunction; 3]);

static LOADED: PerDevice<(), Loaded> = PerDevice::new();

fn load(dev: &CudaDevice) -> anyhow::Result<Loaded> {
    let module = nvrtc::load_module(dev, &SOURCE, &[])?;
    Ok(Loaded(nvrtc::by_dtype(&module, &SOURCE, "adamw_step")?))
}

/// The f32 scalars of one AdamW step, as the host update takes them.
#[derive(Debug, Clone, Copy)]
pub struct AdamWScalars {
    /// `1 − lr·wd`, when there is weight decay.
    pub decay: Option<f32>,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub bias_correction2_sqrt: f32,
    pub eps: f32,
    /// `−lr / (1 − β1ᵗ)`.
    pub neg_step_size: f32,
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
    let Device::Cuda(dev) = weight.device() else {
        bail!("the AdamW kernel runs on CUDA devices only");
    };
    let Some(slot) = dtype_index(weight.dtype()) else {
        return Ok(None);
    };
    let Some(kernels) = LOADED.get(
        dev,
        (),
        "the AdamW kernel is unavailable, AdamW runs as tensor operations",
        || load(dev),
    ) else {
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
    let stream = dev.cuda_stream();
    let named = [
        (Some(weight), "the weight"),
        (master, "the master weight"),
        (Some(exp_avg), "the first moment"),
        (Some(exp_avg_sq), "the second moment"),
        (Some(grad), "the gradient"),
    ];
    let guards: Vec<_> = named
        .iter()
        .map(|(t, what)| t.map(|t| (t.storage_and_layout(), *what)))
        .collect();
    let mut ptrs = Vec::with_capacity(guards.len());
    for guard in &guards {
        ptrs.push(match guard {
            Some(((storage, layout), what)) => {
                let (ptr, record) = tensor_ptr((storage, layout), what, &stream)?;
                (ptr, Some(record))
            }
            None => (0, None),
        });
    }
    let n = shape.elem_count() as u64;
    let decays = i32::from(s.decay.is_some());
    let decay = s.decay.unwrap_or(1.0);
    let mut launch = stream.launch_builder(&kernels.0[slot]);
    for (ptr, _) in &ptrs {
        launch.arg(ptr);
    }
    launch
        .arg(&n)
        .arg(&decays)
        .arg(&decay)
        .arg(&s.one_minus_beta1)
        .arg(&s.beta2)
        .arg(&s.one_minus_beta2)
        .arg(&s.bias_correction2_sqrt)
        .arg(&s.eps)
        .arg(&s.neg_step_size);
    let config = LaunchConfig {
        grid_dim: (CTAS, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the pointers, count and scalars are the kernel's signature in order; every tensor
    // is contiguous (tensor_ptr checked it) with `n` elements of the dtype the kernel reads.
    unsafe { launch.launch(config) }.w()?;
    drop(ptrs);
    drop(guards);
    Ok(Some(()))
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
