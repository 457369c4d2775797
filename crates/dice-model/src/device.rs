//! CUDA devices as dice uses them: one stream per device, freed memory kept for reuse.

use anyhow::Result;
use candle_core::Device;

/// CUDA device `ordinal` with cudarc's event tracking off (see [`set_cuda_event_tracking`]) and
/// its memory pool keeping what is freed (see [`keep_freed_memory`]; `DICE_KEEP_POOL=0` leaves
/// CUDA's default, the baseline). Fails when the binary lacks the `cuda` feature or the GPU is
/// not visible.
pub fn cuda_device(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda(ordinal)?;
    set_cuda_event_tracking(&device, false);
    if std::env::var("DICE_KEEP_POOL").map_or(true, |v| v != "0") {
        keep_freed_memory(&device)?;
    }
    Ok(device)
}

/// Keeps the memory `device`'s buffers free in its stream-ordered pool instead of handing it
/// back to the driver at every synchronization (CUDA's default release threshold is 0). A
/// training step allocates and frees tens of GiB; with the default, the synchronization that
/// ends a step empties the pool and the next step maps all of it again, on the host, between
/// its kernels. The pool's idle memory still counts as free where dice measures free memory
/// ([`crate::memory::free_and_total`]). Nothing to do on other devices.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)] // the driver's pool attributes have no safe wrapper in cudarc
pub fn keep_freed_memory(device: &Device) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    if let Device::Cuda(cuda) = device {
        let pool = memory_pool(cuda.cuda_stream().context())?;
        let mut threshold = u64::MAX;
        // SAFETY: `pool` is the device's live pool and the attribute takes a u64.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        }
        .result()
        .map_err(|e| anyhow::anyhow!("cannot set the CUDA memory pool's release threshold: {e}"))?;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn keep_freed_memory(_device: &Device) -> Result<()> {
    Ok(())
}

/// The memory pool `cuMemAllocAsync` draws the buffers of `context`'s device from.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)] // a driver query with no safe wrapper in cudarc
fn memory_pool(
    context: &candle_core::cuda_backend::cudarc::driver::CudaContext,
) -> Result<candle_core::cuda_backend::cudarc::driver::sys::CUmemoryPool> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let mut pool = std::ptr::null_mut();
    // SAFETY: the out pointer is valid and the device handle is the context's own.
    unsafe { sys::cuDeviceGetMemPool(&mut pool, context.cu_device()) }
        .result()
        .map_err(|e| anyhow::anyhow!("cannot find the CUDA device's memory pool: {e}"))?;
    Ok(pool)
}

/// Bytes the memory pool of `context`'s device holds without a buffer in them: free for dice's
/// next allocations though the driver counts them as used.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)] // driver queries with no safe wrapper in cudarc
pub(crate) fn pool_idle_bytes(
    context: &candle_core::cuda_backend::cudarc::driver::CudaContext,
) -> Result<u64> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use sys::CUmemPool_attribute::{
        CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT as RESERVED, CU_MEMPOOL_ATTR_USED_MEM_CURRENT as USED,
    };
    let pool = memory_pool(context)?;
    let [mut reserved, mut used] = [0u64; 2];
    for (attribute, value) in [(RESERVED, &mut reserved), (USED, &mut used)] {
        // SAFETY: `pool` is live and both attributes are u64s.
        unsafe { sys::cuMemPoolGetAttribute(pool, attribute, (value as *mut u64).cast()) }
            .result()
            .map_err(|e| anyhow::anyhow!("cannot read the CUDA memory pool's size: {e}"))?;
    }
    Ok(reserved.saturating_sub(used))
}

/// Every visible CUDA device, in ordinal order, each as [`cuda_device`] makes it.
#[cfg(feature = "cuda")]
pub fn cuda_devices() -> Result<Vec<Device>> {
    let count = candle_core::cuda_backend::cudarc::driver::CudaContext::device_count()
        .map_err(|e| anyhow::anyhow!("cannot count the CUDA devices: {e:?}"))?;
    anyhow::ensure!(count > 0, "no CUDA device is visible");
    (0..count as usize).map(cuda_device).collect()
}

/// Without the `cuda` feature: the same error as [`cuda_device`].
#[cfg(not(feature = "cuda"))]
pub fn cuda_devices() -> Result<Vec<Device>> {
    Ok(vec![cuda_device(0)?])
}

/// Turns cudarc's event tracking on or off for the buffers `device` allocates from now on
/// (nothing to do on other devices). Tracked buffers carry two CUDA events, created and
/// destroyed with every allocation, that only synchronize once the context runs several
/// streams; candle's device runs one and dice never adds another, so they are pure overhead.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)] // candle's switch of the event tracking is unsafe by its contract
pub fn set_cuda_event_tracking(device: &Device, on: bool) {
    if let Device::Cuda(cuda) = device {
        // SAFETY: with a single stream no buffer is ever used across streams, the only case
        // the events order.
        unsafe {
            if on {
                cuda.cuda_stream().context().enable_event_tracking();
            } else {
                cuda.disable_event_tracking();
            }
        }
    }
}

/// Without the `cuda` feature no CUDA device can exist.
#[cfg(not(feature = "cuda"))]
pub fn set_cuda_event_tracking(_device: &Device, _on: bool) {}

/// Whether `device` tracks its buffers' uses with CUDA events (false off CUDA).
#[cfg(feature = "cuda")]
pub fn cuda_event_tracking(device: &Device) -> bool {
    matches!(device, Device::Cuda(cuda) if cuda.is_event_tracking())
}

#[cfg(not(feature = "cuda"))]
pub fn cuda_event_tracking(_device: &Device) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_device_never_tracks_events() {
        set_cuda_event_tracking(&Device::Cpu, true);
        assert!(!cuda_event_tracking(&Device::Cpu));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_cuda_feature_asking_for_a_gpu_is_an_error() {
        assert!(cuda_device(0).is_err());
    }
}
