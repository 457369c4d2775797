//! The device side of [`super`]'s update for a state offloaded to host memory: a CUDA
//! weight's gradient read back chunk by chunk into page-locked memory, and its rounded weights
//! written back from page-locked memory into the weight's own device memory.

use super::{
    f32_values_mut, with_state_values, with_storage_mut, GradValues, HostSlices, WeightOut,
};
use crate::readback::page_locked;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Storage, Tensor};
use dice_model::adamw::AdamWScalars;
use half::slice::HalfBitsSliceExt;
use half::{bf16, f16};

/// A device weight's update from its state in host memory, chunk by chunk through page-locked
/// buffers, two of each kind so that the copies run while the host computes: while chunk i is
/// updated on the host, chunk i − 1's rounded weights go from the other upload buffer into the
/// weight's device memory and then chunk i + 1's gradient is read back (in its own dtype) into
/// the other read-back buffer, in that order on the weight's stream. The buffers are allocated at the first
/// update and kept.
#[derive(Default)]
pub(crate) struct DeviceTransfer {
    grad16: [Pinned<u16>; 2],
    grad32: [Pinned<f32>; 2],
    out16: [Pinned<u16>; 2],
    out32: [Pinned<f32>; 2],
}

type Pinned<T> = Option<cudarc::driver::PinnedHostSlice<T>>;

/// Elements per chunk of [`DeviceTransfer`] (its f32 buffers are 32 MiB): small enough that
/// most weights of a large model span several chunks, so that their copies hide behind the
/// host's work, large enough that each copy runs at the link's speed.
const TRANSFER_CHUNK: usize = 8 << 20;

fn driver(what: &str, e: cudarc::driver::DriverError) -> candle_core::Error {
    candle_core::Error::msg(format!("{what} failed: {e:?}"))
}

/// The first `n` elements of a page-locked buffer of [`TRANSFER_CHUNK`] elements in `slot`,
/// allocated the first time.
fn pinned<'b, T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Default + Copy>(
    slot: &'b mut Pinned<T>,
    n: usize,
    stream: &cudarc::driver::CudaStream,
) -> candle_core::Result<&'b mut [T]> {
    let buffer = page_locked(slot, TRANSFER_CHUNK, stream)
        .map_err(|e| driver("allocating page-locked host memory", e))?;
    Ok(&mut buffer
        .as_mut_slice()
        .map_err(|e| driver("waiting for a page-locked buffer", e))?[..n])
}

impl DeviceTransfer {
    /// AdamW on `weight` (a contiguous CUDA tensor) from its device gradient and its f32
    /// master and moments in host memory.
    pub(crate) fn step(
        &mut self,
        weight: &Tensor,
        grad: &Tensor,
        [exp_avg, exp_avg_sq, master]: [&Tensor; 3],
        s: &AdamWScalars,
    ) -> candle_core::Result<()> {
        use candle_core::Device;
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
        let len = weight.elem_count();
        let chunks: Vec<(usize, usize)> = (0..len)
            .step_by(TRANSFER_CHUNK)
            .map(|from| (from, (from + TRANSFER_CHUNK).min(len)))
            .collect();
        // Queues a chunk's read-back; the event marks its end.
        let read_back = |transfer: &mut Self, (from, to): (usize, usize), buffer: usize| {
            transfer.queue_read_back(
                grad_storage,
                (grad_start + from)..(grad_start + to),
                buffer,
                &stream,
            )?;
            stream
                .record_event(None)
                .map_err(|e| driver("marking a gradient's read-back", e))
        };
        with_state_values([exp_avg, exp_avg_sq], |m, v| {
            with_storage_mut(master, |p, p_layout| {
                let p = f32_values_mut(p, p_layout)?;
                let mut arrival = match chunks.first() {
                    Some(&first) => Some(read_back(self, first, 0)?),
                    None => None,
                };
                for (i, &(from, to)) in chunks.iter().enumerate() {
                    let (buffer, n) = (i % 2, to - from);
                    // This chunk's gradient is here, and so is everything queued before its
                    // read-back: the upload of two chunks ago, the last to read this buffer
                    // pair's upload buffer. The last chunk's upload may still run.
                    if let Some(arrived) = arrival.take() {
                        arrived
                            .synchronize()
                            .map_err(|e| driver("waiting for a gradient's read-back", e))?;
                    }
                    if let Some(&next) = chunks.get(i + 1) {
                        arrival = Some(read_back(self, next, 1 - buffer)?);
                    }
                    let grad = read_back_values(
                        &mut self.grad16[buffer],
                        &mut self.grad32[buffer],
                        grad_storage.dtype(),
                        n,
                        &stream,
                    )?;
                    let out = match weight.dtype() {
                        DType::F32 => WeightOut::F32(pinned(&mut self.out32[buffer], n, &stream)?),
                        DType::BF16 => WeightOut::BF16(
                            pinned(&mut self.out16[buffer], n, &stream)?.reinterpret_cast_mut(),
                        ),
                        DType::F16 => WeightOut::F16(
                            pinned(&mut self.out16[buffer], n, &stream)?.reinterpret_cast_mut(),
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
                    weight.inplace_op1(&Upload {
                        from,
                        n,
                        out16: self.out16[buffer].as_ref(),
                        out32: self.out32[buffer].as_ref(),
                        stream: &stream,
                    })?;
                }
                // The weights' copies are done before the next step reads them (and before
                // the buffers are written again).
                stream
                    .synchronize()
                    .map_err(|e| driver("waiting for the weights' upload", e))
            })
        })
    }

    /// Queues the copy of the gradient's elements `source` into read-back buffer `buffer`
    /// (16-bit values as their bits).
    #[allow(unsafe_code)] // 16-bit device values copied as their bits
    fn queue_read_back(
        &mut self,
        grad: &candle_core::CudaStorage,
        source: std::ops::Range<usize>,
        buffer: usize,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> candle_core::Result<()> {
        let n = source.len();
        let out_of_bounds =
            || candle_core::Error::msg("internal error: a gradient chunk out of bounds");
        let queued = match grad.dtype() {
            DType::F32 => {
                let host = pinned(&mut self.grad32[buffer], n, stream)?;
                stream.memcpy_dtoh(&grad.as_cuda_slice::<f32>()?.slice(source), host)
            }
            DType::BF16 => {
                let host = pinned(&mut self.grad16[buffer], n, stream)?;
                let view = grad.as_cuda_slice::<bf16>()?.slice(source);
                // SAFETY: bf16 and u16 have one size; the values are copied as bits and read
                // back as bf16.
                let bits = unsafe { view.transmute::<u16>(n) }.ok_or_else(out_of_bounds)?;
                stream.memcpy_dtoh(&bits, host)
            }
            DType::F16 => {
                let host = pinned(&mut self.grad16[buffer], n, stream)?;
                let view = grad.as_cuda_slice::<f16>()?.slice(source);
                // SAFETY: as above, for f16.
                let bits = unsafe { view.transmute::<u16>(n) }.ok_or_else(out_of_bounds)?;
                stream.memcpy_dtoh(&bits, host)
            }
            other => candle_core::bail!("cannot optimize with a gradient of dtype {other:?}"),
        };
        queued.map_err(|e| driver("reading a gradient back", e))
    }
}

/// The first `n` values of a read-back buffer (`bits` for 16-bit gradients, `values` for
/// f32), once its copy is done, as a gradient of `dtype`.
fn read_back_values<'b>(
    bits: &'b mut Pinned<u16>,
    values: &'b mut Pinned<f32>,
    dtype: DType,
    n: usize,
    stream: &cudarc::driver::CudaStream,
) -> candle_core::Result<GradValues<'b>> {
    Ok(match dtype {
        DType::F32 => GradValues::F32(pinned(values, n, stream)?),
        DType::BF16 => {
            let bits: &'b [u16] = pinned(bits, n, stream)?;
            GradValues::BF16(bits.reinterpret_cast())
        }
        DType::F16 => {
            let bits: &'b [u16] = pinned(bits, n, stream)?;
            GradValues::F16(bits.reinterpret_cast())
        }
        other => candle_core::bail!("cannot optimize with a gradient of dtype {other:?}"),
    })
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
