//! The device side of [`super`]'s update for a state offloaded to host memory: a CUDA
//! weight's gradient read back chunk by chunk into page-locked memory, and its rounded weights
//! written back from page-locked memory into the weight's own device memory.

use super::{
    f32_values_mut, with_state_values, with_storage_mut, GradValues, HostSlices, WeightOut,
};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};
use dice_model::adamw::AdamWScalars;
use half::{bf16, f16};

/// A device weight's update from its state in host memory: its gradient read back chunk by
/// chunk (in its own dtype) into a page-locked buffer, each chunk updated on the host, its
/// rounded weights written from a second page-locked buffer into the weight's device memory.
/// The buffers are allocated at the first update and kept.
#[derive(Default)]
pub(crate) struct DeviceTransfer {
    grad16: Option<cudarc::driver::PinnedHostSlice<u16>>,
    grad32: Option<cudarc::driver::PinnedHostSlice<f32>>,
    out16: Option<cudarc::driver::PinnedHostSlice<u16>>,
    out32: Option<cudarc::driver::PinnedHostSlice<f32>>,
}

/// Elements per chunk of [`DeviceTransfer`] (its f32 buffers are 128 MiB): large enough that
/// each copy runs at the link's speed and each chunk's pass fills the cores.
const TRANSFER_CHUNK: usize = 32 << 20;

fn driver(what: &str, e: cudarc::driver::DriverError) -> candle_core::Error {
    candle_core::Error::msg(format!("{what} failed: {e:?}"))
}

/// A page-locked buffer of [`TRANSFER_CHUNK`] elements in `slot`, allocated the first time.
#[allow(unsafe_code)] // page-locked memory comes uninitialised from the driver
fn pinned<'b, T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Default + Copy>(
    slot: &'b mut Option<cudarc::driver::PinnedHostSlice<T>>,
    stream: &cudarc::driver::CudaStream,
) -> candle_core::Result<&'b mut [T]> {
    if slot.is_none() {
        // SAFETY: filled before it is read: the buffer is zeroed right after.
        let mut buffer = unsafe {
            stream
                .context()
                .alloc_pinned_with_flags::<T>(TRANSFER_CHUNK, 0)
        }
        .map_err(|e| driver("allocating page-locked host memory", e))?;
        buffer
            .as_mut_slice()
            .map_err(|e| driver("waiting for a page-locked buffer", e))?
            .fill(T::default());
        *slot = Some(buffer);
    }
    let buffer = slot.as_mut().expect("allocated above");
    buffer
        .as_mut_slice()
        .map_err(|e| driver("waiting for a page-locked buffer", e))
}

impl DeviceTransfer {
    /// AdamW on `weight` (a contiguous CUDA tensor) from its device gradient and its f32
    /// master and moments in host memory.
    #[allow(unsafe_code)] // 16-bit device values copied as their bits
    pub(crate) fn step(
        &mut self,
        weight: &Tensor,
        grad: &Tensor,
        [exp_avg, exp_avg_sq, master]: [&Tensor; 3],
        s: &AdamWScalars,
    ) -> candle_core::Result<()> {
        use candle_core::{DType, Device};
        use half::slice::HalfBitsSliceExt;
        let Device::Cuda(device) = weight.device() else {
            candle_core::bail!("internal error: a device update of a host weight")
        };
        let stream = device.cuda_stream();
        let grad = grad.contiguous()?;
        let (grad_storage, grad_layout) = grad.storage_and_layout();
        let (Storage::Cuda(grad_storage), Some((grad_start, _))) =
            (&*grad_storage, grad_layout.contiguous_offsets())
        else {
            candle_core::bail!("internal error: the gradient of a CUDA weight is not on it")
        };
        let (weight_dtype, grad_dtype) = (weight.dtype(), grad.dtype());
        let len = weight.elem_count();
        with_state_values([exp_avg, exp_avg_sq], |m, v| {
            with_storage_mut(master, |p, p_layout| {
                let p = f32_values_mut(p, p_layout)?;
                for from in (0..len).step_by(TRANSFER_CHUNK) {
                    let to = (from + TRANSFER_CHUNK).min(len);
                    let n = to - from;
                    let source = (grad_start + from)..(grad_start + to);
                    // The chunk's gradient, its copy waited for.
                    let grad = match grad_dtype {
                        DType::F32 => {
                            let host = &mut pinned(&mut self.grad32, &stream)?[..n];
                            let view = grad_storage.as_cuda_slice::<f32>()?.slice(source);
                            stream
                                .memcpy_dtoh(&view, host)
                                .map_err(|e| driver("reading a gradient back", e))?;
                            GradValues::F32(host)
                        }
                        DType::BF16 | DType::F16 => {
                            let host = &mut pinned(&mut self.grad16, &stream)?[..n];
                            let view = match grad_dtype {
                                DType::BF16 => {
                                    let view = grad_storage.as_cuda_slice::<bf16>()?.slice(source);
                                    // SAFETY: bf16 and u16 have one size; the values are
                                    // copied as bits and read back as bf16.
                                    unsafe { view.transmute::<u16>(n) }
                                }
                                _ => {
                                    let view = grad_storage.as_cuda_slice::<f16>()?.slice(source);
                                    // SAFETY: as above, for f16.
                                    unsafe { view.transmute::<u16>(n) }
                                }
                            }
                            .ok_or_else(|| {
                                candle_core::Error::msg(
                                    "internal error: a gradient chunk out of bounds",
                                )
                            })?;
                            stream
                                .memcpy_dtoh(&view, host)
                                .map_err(|e| driver("reading a gradient back", e))?;
                            if grad_dtype == DType::BF16 {
                                GradValues::BF16(host.reinterpret_cast())
                            } else {
                                GradValues::F16(host.reinterpret_cast())
                            }
                        }
                        other => {
                            candle_core::bail!("cannot optimize with a gradient of dtype {other:?}")
                        }
                    };
                    stream
                        .synchronize()
                        .map_err(|e| driver("waiting for a gradient's read-back", e))?;
                    // The upload buffer is free: the copy from it before this chunk's
                    // read-back on the same stream is done.
                    let out = match weight_dtype {
                        DType::F32 => WeightOut::F32(&mut pinned(&mut self.out32, &stream)?[..n]),
                        DType::BF16 => WeightOut::BF16(
                            pinned(&mut self.out16, &stream)?[..n].reinterpret_cast_mut(),
                        ),
                        DType::F16 => WeightOut::F16(
                            pinned(&mut self.out16, &stream)?[..n].reinterpret_cast_mut(),
                        ),
                        other => {
                            candle_core::bail!("cannot optimize a weight of dtype {other:?}")
                        }
                    };
                    HostSlices {
                        grad,
                        exp_avg: &mut m[from..to],
                        exp_avg_sq: &mut v[from..to],
                        master: &mut p[from..to],
                        out,
                    }
                    .update(s);
                    let upload = Upload {
                        from,
                        n,
                        out16: self.out16.as_ref(),
                        out32: self.out32.as_ref(),
                        stream: &stream,
                    };
                    weight.inplace_op1(&upload)?;
                }
                // The weights' copies are done before the next step reads them (and
                // before the buffers are written again).
                stream
                    .synchronize()
                    .map_err(|e| driver("waiting for the weights' upload", e))
            })
        })
    }
}

/// Writes a chunk of rounded weights from [`DeviceTransfer`]'s upload buffer into elements
/// `from..from + n` of a CUDA weight, asynchronously on `stream`.
struct Upload<'b> {
    from: usize,
    n: usize,
    out16: Option<&'b cudarc::driver::PinnedHostSlice<u16>>,
    out32: Option<&'b cudarc::driver::PinnedHostSlice<f32>>,
    stream: &'b std::sync::Arc<cudarc::driver::CudaStream>,
}

impl InplaceOp1 for Upload<'_> {
    fn name(&self) -> &'static str {
        "offloaded-weight-upload"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("internal error: an upload to a host weight")
    }

    #[allow(unsafe_code)] // 16-bit device values written as their bits
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<()> {
        use candle_core::DType;
        let Some((start, _)) = layout.contiguous_offsets() else {
            candle_core::bail!("internal error: the optimizer expects contiguous weights")
        };
        let range = (start + self.from)..(start + self.from + self.n);
        let missing = || candle_core::Error::msg("internal error: no rounded weights to upload");
        let copied = match storage.dtype() {
            DType::F32 => {
                let host = &self
                    .out32
                    .ok_or_else(missing)?
                    .as_slice()
                    .map_err(|e| driver("waiting for a page-locked buffer", e))?[..self.n];
                let mut view = storage.as_cuda_slice_mut::<f32>()?.slice_mut(range);
                self.stream.memcpy_htod(host, &mut view)
            }
            dtype => {
                let host = &self
                    .out16
                    .ok_or_else(missing)?
                    .as_slice()
                    .map_err(|e| driver("waiting for a page-locked buffer", e))?[..self.n];
                let out_of_bounds =
                    || candle_core::Error::msg("internal error: a weight chunk out of bounds");
                match dtype {
                    DType::BF16 => {
                        let mut view = storage.as_cuda_slice_mut::<bf16>()?.slice_mut(range);
                        // SAFETY: bf16 and u16 have one size; the bits written are bf16 values.
                        let mut bits = unsafe { view.transmute_mut::<u16>(self.n) }
                            .ok_or_else(out_of_bounds)?;
                        self.stream.memcpy_htod(host, &mut bits)
                    }
                    DType::F16 => {
                        let mut view = storage.as_cuda_slice_mut::<f16>()?.slice_mut(range);
                        // SAFETY: as above, for f16.
                        let mut bits = unsafe { view.transmute_mut::<u16>(self.n) }
                            .ok_or_else(out_of_bounds)?;
                        self.stream.memcpy_htod(host, &mut bits)
                    }
                    other => candle_core::bail!("cannot optimize a weight of dtype {other:?}"),
                }
            }
        };
        copied.map_err(|e| driver("writing weights to the device", e))
    }
}
