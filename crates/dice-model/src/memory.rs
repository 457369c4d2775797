//! Device memory as the CUDA driver reports it: free and total now, and the peak of a piece of
//! work.
//!
//! candle frees device memory as tensors drop, so a reading after the work misses the transient
//! peak inside it. A sampler thread polls the driver's used-memory figure (`cuMemGetInfo`,
//! device-wide: on a GPU that runs only this process it is the process's usage, CUDA context
//! included) every millisecond while the work runs and keeps the maximum. Memory the device's
//! pool keeps without a buffer in it (dice keeps freed memory pooled:
//! [`crate::device::keep_freed_memory`]) counts as free in both.

use candle_core::Device;

/// Polls device memory in the background until [`PeakMemory::finish`].
pub struct PeakMemory {
    #[cfg(feature = "cuda")]
    sampler: Option<cuda::Sampler>,
}

impl PeakMemory {
    /// Starts sampling `device`; on the CPU nothing is sampled and [`PeakMemory::finish`]
    /// returns `None`.
    pub fn start(device: &Device) -> anyhow::Result<Self> {
        #[cfg(feature = "cuda")]
        {
            let sampler = match device {
                Device::Cuda(dev) => Some(cuda::Sampler::start(dev)?),
                _ => None,
            };
            Ok(Self { sampler })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = device;
            Ok(Self {})
        }
    }

    /// Stops sampling; returns the highest device memory in use seen, in bytes.
    pub fn finish(self) -> Option<u64> {
        #[cfg(feature = "cuda")]
        {
            self.sampler.map(cuda::Sampler::finish)
        }
        #[cfg(not(feature = "cuda"))]
        {
            None
        }
    }
}

/// Free and total bytes of `device`'s memory as the CUDA driver reports them (device-wide);
/// `None` off CUDA.
pub fn free_and_total(device: &Device) -> anyhow::Result<Option<(u64, u64)>> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        let (free, total) = cuda::free_and_total(&dev.cuda_stream())?;
        return Ok(Some((free, total)));
    }
    let _ = device;
    Ok(None)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::CudaStream;
    use candle_core::cuda_backend::CudaDevice;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    use std::thread::JoinHandle;
    use std::time::Duration;

    /// The driver's free and total bytes, the pool's idle bytes counted as free.
    pub(super) fn free_and_total(stream: &Arc<CudaStream>) -> anyhow::Result<(u64, u64)> {
        let context = stream.context();
        let (free, total) = context.mem_get_info()?;
        let idle = crate::device::pool_idle_bytes(context)?;
        Ok(((free as u64 + idle).min(total as u64), total as u64))
    }

    fn used(stream: &Arc<CudaStream>) -> anyhow::Result<u64> {
        let (free, total) = free_and_total(stream)?;
        Ok(total - free)
    }

    pub(super) struct Sampler {
        stop: Arc<AtomicBool>,
        peak: Arc<AtomicU64>,
        thread: JoinHandle<()>,
    }

    impl Sampler {
        pub(super) fn start(dev: &CudaDevice) -> anyhow::Result<Self> {
            let stream = dev.cuda_stream();
            let peak = Arc::new(AtomicU64::new(used(&stream)?));
            let stop = Arc::new(AtomicBool::new(false));
            let thread = {
                let (peak, stop) = (peak.clone(), stop.clone());
                std::thread::spawn(move || {
                    if stream.context().bind_to_thread().is_err() {
                        return;
                    }
                    while !stop.load(Ordering::Relaxed) {
                        if let Ok(u) = used(&stream) {
                            peak.fetch_max(u, Ordering::Relaxed);
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                })
            };
            Ok(Self { stop, peak, thread })
        }

        pub(super) fn finish(self) -> u64 {
            self.stop.store(true, Ordering::Relaxed);
            let _ = self.thread.join();
            self.peak.load(Ordering::Relaxed)
        }
    }
}
