//! CUDA devices as dice uses them: one stream per device.

use anyhow::Result;
use candle_core::Device;

/// CUDA device `ordinal` with cudarc's event tracking off (see [`set_cuda_event_tracking`]).
/// Fails when the binary lacks the `cuda` feature or the GPU is not visible.
pub fn cuda_device(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda(ordinal)?;
    set_cuda_event_tracking(&device, false);
    Ok(device)
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
