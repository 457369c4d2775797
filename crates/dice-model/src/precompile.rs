//! Our CUDA kernels compiled ahead of the runs that use them, into the kernel cache
//! ([`crate::cubin_cache`]): on a machine without a GPU (NVRTC needs none), for the GPU
//! machine's processes to read instead of compiling at their start.

use crate::cubin_cache::Precompiled;
use anyhow::Result;

/// Compiles our kernel sources for compute capability `arch` (`(9, 0)` for an H100 or H200),
/// the attention kernels for each head dim of `head_dims`, into the kernel cache that GPU
/// processes read ([`crate::KERNEL_CACHE_ENV`]): on a machine without a GPU, ahead of the runs of a
/// machine that will have one. Needs a CUDA build (NVRTC).
pub fn precompile_kernels(head_dims: &[usize], arch: (i32, i32)) -> Result<Vec<Precompiled>> {
    #[cfg(feature = "cuda")]
    {
        crate::kernels::precompile(head_dims, arch)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (head_dims, arch);
        anyhow::bail!(
            "compiling kernels needs NVRTC: use the CUDA build of dice (scripts/build-cuda.sh)"
        )
    }
}
