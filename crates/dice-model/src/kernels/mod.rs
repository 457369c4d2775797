//! Hand-written CUDA kernels, compiled at run time with NVRTC (the `cuda` feature).

#[cfg(feature = "cuda")]
mod block_attention;
#[cfg(feature = "cuda")]
pub(crate) use block_attention::BlockAttention;

#[cfg(not(feature = "cuda"))]
mod cpu_only {
    use crate::config::SdarConfig;
    use candle_core::{DType, Device, Result, Tensor};

    /// Without the `cuda` feature there is no fused attention: no forward ever gets one.
    pub(crate) enum BlockAttention {}

    impl BlockAttention {
        pub(crate) fn plan(
            _device: &Device,
            _dtype: DType,
            _cfg: &SdarConfig,
            _lens: &[usize],
            _tokens: usize,
        ) -> anyhow::Result<Option<Self>> {
            Ok(None)
        }

        pub(crate) fn attend(&self, _q: &Tensor, _k: &Tensor, _v: &Tensor) -> Result<Tensor> {
            match *self {}
        }
    }
}
#[cfg(not(feature = "cuda"))]
pub(crate) use cpu_only::BlockAttention;
