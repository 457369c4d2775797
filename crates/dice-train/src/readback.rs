//! Device tensors read back into host memory through a page-locked staging buffer.
//!
//! Why: a read into pageable memory is staged by the driver through small pinned buffers of
//! its own, at about 2 GB/s on the H200, and for the whole read (4–9 s for the f32 masters of
//! a 1.7B model) the device-to-host copy engine is busy with it, so the small reads the
//! training's own kernels wait on (a rollout's sampled tokens, a loss) queue behind its
//! chunks: measured on the H200, a 16-sequence rollout ran ten times slower while a checkpoint
//! was read back that way (`bench/notes/rl-h200.md`). Into page-locked memory the device
//! writes at the link's speed, one staging buffer's worth at a time, and moving the values on
//! into the tensor's own memory is host work only.

use anyhow::Result;
use candle_core::{Device, Tensor};

/// f32 values the staging buffer holds (128 MiB): large enough that each transfer runs at the
/// link's speed, small enough to allocate in milliseconds.
#[cfg(feature = "cuda")]
const STAGING_ELEMENTS: usize = 32 << 20;

/// Reads device tensors back into host memory, reusing one page-locked staging buffer
/// (allocated at the first read) for every tensor it reads.
#[derive(Default)]
pub(crate) struct ReadBack {
    #[cfg(feature = "cuda")]
    staging: Option<cudarc::driver::PinnedHostSlice<f32>>,
}

impl ReadBack {
    /// A host copy of `tensor` that later changes of it do not reach (a CPU tensor is copied
    /// too).
    pub(crate) fn copy_to_host(&mut self, tensor: &Tensor) -> Result<Tensor> {
        if tensor.device().is_cpu() {
            return Ok(tensor.copy()?);
        }
        #[cfg(feature = "cuda")]
        if let Some(host) = self.read_f32_through_staging(tensor)? {
            return Ok(host);
        }
        Ok(tensor.to_device(&Device::Cpu)?)
    }

    /// `tensor` read back through the staging buffer on the calling thread's stream, when it
    /// is a contiguous f32 tensor of a CUDA device (what optimizer states are); `None` else.
    #[cfg(feature = "cuda")]
    fn read_f32_through_staging(&mut self, tensor: &Tensor) -> Result<Option<Tensor>> {
        use anyhow::anyhow;
        use candle_core::{DType, Storage};
        let Device::Cuda(device) = tensor.device() else {
            return Ok(None);
        };
        if tensor.dtype() != DType::F32 {
            return Ok(None);
        }
        let (storage, layout) = tensor.storage_and_layout();
        let (Storage::Cuda(storage), Some((start, end))) = (&*storage, layout.contiguous_offsets())
        else {
            return Ok(None);
        };
        let source = storage.as_cuda_slice::<f32>()?;
        let stream = device.cuda_stream();
        let driver = |what: &str, e: cudarc::driver::DriverError| anyhow!("{what} failed: {e:?}");
        let staging = page_locked(&mut self.staging, STAGING_ELEMENTS, &stream)
            .map_err(|e| driver("allocating page-locked host memory", e))?;
        let mut values = Vec::with_capacity(end - start);
        for from in (start..end).step_by(STAGING_ELEMENTS) {
            let to = (from + STAGING_ELEMENTS).min(end);
            // The copy's length is its destination's: a plain slice of the page-locked buffer
            // (which the driver knows as such), whose copy nothing waits for but this
            // synchronisation.
            let host = &mut staging
                .as_mut_slice()
                .map_err(|e| driver("waiting for the staging buffer", e))?[..to - from];
            stream
                .memcpy_dtoh(&source.slice(from..to), host)
                .map_err(|e| driver("reading a tensor back", e))?;
            stream
                .synchronize()
                .map_err(|e| driver("waiting for a read-back", e))?;
            values.extend_from_slice(host);
        }
        Ok(Some(Tensor::from_vec(
            values,
            tensor.shape(),
            &Device::Cpu,
        )?))
    }
}

/// The page-locked buffer of `len` elements in `slot`, allocated and zeroed the first time
/// (kept for every later read or write through it).
#[cfg(feature = "cuda")]
#[allow(unsafe_code)] // page-locked memory comes uninitialised from the driver
pub(crate) fn page_locked<
    'b,
    T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Default + Copy,
>(
    slot: &'b mut Option<cudarc::driver::PinnedHostSlice<T>>,
    len: usize,
    stream: &cudarc::driver::CudaStream,
) -> Result<&'b mut cudarc::driver::PinnedHostSlice<T>, cudarc::driver::DriverError> {
    if slot.is_none() {
        // SAFETY: zeroed below before anything reads it.
        let mut buffer = unsafe { stream.context().alloc_pinned_with_flags::<T>(len, 0) }?;
        buffer.as_mut_slice()?.fill(T::default());
        *slot = Some(buffer);
    }
    Ok(slot.as_mut().expect("allocated above"))
}
