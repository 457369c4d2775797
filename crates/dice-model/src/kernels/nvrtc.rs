//! Run-time compilation of our CUDA sources with NVRTC and their loading, once per device.
//!
//! A source is compiled for the device's own architecture, to a cubin (a cubin loads on any
//! driver that runs that GPU, whereas PTX newer than the driver does not).

use crate::cubin_cache::CubinCache;
use anyhow::Context;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule, DriverError};
use candle_core::cuda_backend::cudarc::nvrtc::{self, Ptx};
use candle_core::cuda_backend::{CudaDevice, DeviceId};
use candle_core::DType;
use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::hash::Hash;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

/// One CUDA source file of ours.
pub(crate) struct Source {
    pub(crate) text: &'static str,
    pub(crate) file_name: &'static CStr,
    /// What the kernels are, for error messages ("the block attention kernel").
    pub(crate) what: &'static str,
    /// Compiled for the architecture-specific target where there is one (sm_90a on a Hopper
    /// device: wgmma), which such a source detects (`__CUDA_ARCH_FEAT_SM90_ALL`); unless
    /// `DICE_ARCH_SPECIFIC=0` asks for the portable target, to compare the two.
    pub(crate) arch_specific: bool,
}

/// NVRTC's `--gpu-architecture` for `source` on compute capability `arch`.
pub(crate) fn target(source: &Source, (major, minor): (i32, i32)) -> String {
    let specific = source.arch_specific
        && (major, minor) == (9, 0)
        && std::env::var("DICE_ARCH_SPECIFIC").as_deref() != Ok("0");
    format!("sm_{major}{minor}{}", if specific { "a" } else { "" })
}

/// The headers our sources include, by the name they include them with.
const HEADERS: [(&CStr, &str); 4] = [
    (c"half.cuh", include_str!("half.cuh")),
    (c"mma.cuh", include_str!("mma.cuh")),
    (c"warp.cuh", include_str!("warp.cuh")),
    (c"wgmma.cuh", include_str!("wgmma.cuh")),
];

/// Compiles `source` with the extra NVRTC `options` to a cubin for compute capability `arch`.
pub(crate) fn compile_cubin(
    source: &Source,
    options: &[String],
    arch: (i32, i32),
) -> anyhow::Result<Vec<u8>> {
    use nvrtc::result;
    let what = source.what;
    let text = CString::new(source.text).context("the kernel source holds a NUL byte")?;
    let header_texts = HEADERS
        .iter()
        .map(|(_, text)| CString::new(*text).context("a kernel header holds a NUL byte"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let headers: Vec<*const c_char> = header_texts.iter().map(|h| h.as_ptr()).collect();
    let header_names: Vec<*const c_char> = HEADERS.iter().map(|(name, _)| name.as_ptr()).collect();
    let mut program = std::mem::MaybeUninit::uninit();
    // SAFETY: every pointer is a NUL-terminated string alive until the call returns (NVRTC
    // copies them); the two arrays hold `HEADERS.len()` entries.
    let program = unsafe {
        nvrtc::sys::nvrtcCreateProgram(
            program.as_mut_ptr(),
            text.as_ptr(),
            source.file_name.as_ptr(),
            HEADERS.len() as i32,
            headers.as_ptr(),
            header_names.as_ptr(),
        )
        .result()
        .map(|()| program.assume_init())
    }
    .map_err(|e| anyhow::anyhow!("NVRTC cannot create the program of {what}: {e:?}"))?;
    let mut options = options.to_vec();
    let target = target(source, arch);
    options.push(format!("--gpu-architecture={target}"));
    // SAFETY: `program` was created above and is destroyed only at the end of this function.
    let cubin = unsafe {
        match result::compile_program(program, &options) {
            Ok(()) => {
                let mut size = 0usize;
                nvrtc::sys::nvrtcGetCUBINSize(program, &mut size)
                    .result()
                    .and_then(|()| {
                        let mut cubin = vec![0u8; size];
                        nvrtc::sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr().cast())
                            .result()
                            .map(|()| cubin)
                    })
                    .map_err(|e| anyhow::anyhow!("NVRTC compiled {what} but gave no cubin: {e:?}"))
            }
            Err(e) => {
                let log = result::get_program_log(program)
                    .map(|log| CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned())
                    .unwrap_or_default();
                Err(anyhow::anyhow!(
                    "NVRTC cannot compile {what} for {target} ({e:?}): {log}"
                ))
            }
        }
    };
    // SAFETY: created above, not destroyed before.
    let _ = unsafe { result::destroy_program(program) };
    cubin
}

/// A CUDA driver error while loading `what`, as an error for the user.
pub(crate) fn driver_error(what: &'static str) -> impl Fn(DriverError) -> anyhow::Error {
    move |e| anyhow::anyhow!("CUDA driver error while loading {what}: {e:?}")
}

/// The device's compute capability.
pub(crate) fn arch(dev: &CudaDevice, what: &'static str) -> anyhow::Result<(i32, i32)> {
    dev.cuda_stream()
        .context()
        .compute_capability()
        .map_err(driver_error(what))
}

/// NVRTC's version, part of a cubin's cache key (its ptxas makes the machine code).
fn nvrtc_version() -> anyhow::Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers, written before the call returns.
    unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| anyhow::anyhow!("NVRTC cannot say its version: {e:?}"))?;
    Ok((major, minor))
}

/// The on-disk cache of cubins (cubin_cache.rs), as the environment names it.
fn cubin_cache() -> &'static CubinCache {
    static CACHE: OnceLock<CubinCache> = OnceLock::new();
    CACHE.get_or_init(CubinCache::from_env)
}

/// The cubin cache's key of `source` compiled with `options` for `arch`: everything that
/// makes the cubin (the source, the headers it may include, the options, the architecture,
/// NVRTC's version).
fn cache_key(source: &Source, options: &[String], arch: (i32, i32)) -> anyhow::Result<String> {
    let (nvrtc_major, nvrtc_minor) = nvrtc_version()?;
    let mut parts: Vec<&[u8]> = vec![source.text.as_bytes()];
    parts.extend(
        HEADERS
            .iter()
            .flat_map(|(name, text)| [name.to_bytes(), text.as_bytes()]),
    );
    let setting = format!(
        "{options:?} {} nvrtc {nvrtc_major}.{nvrtc_minor}",
        target(source, arch)
    );
    parts.push(setting.as_bytes());
    Ok(CubinCache::key(&parts))
}

/// Puts the cubin of `source` compiled with `options` for `arch` in the cubin cache, with no
/// device needed (NVRTC compiles for any architecture); whether it was there already.
pub(crate) fn precompile(
    source: &Source,
    options: &[String],
    arch: (i32, i32),
) -> anyhow::Result<bool> {
    let key = cache_key(source, options, arch)?;
    let (_, cached) =
        cubin_cache().get_or_compile(&key, || compile_cubin(source, options, arch))?;
    Ok(cached)
}

/// Compiles `source` for `dev` (or reads the cubin an earlier run compiled from the same
/// inputs) and loads it there.
pub(crate) fn load_module(
    dev: &CudaDevice,
    source: &Source,
    options: &[String],
) -> anyhow::Result<Arc<CudaModule>> {
    let arch = arch(dev, source.what)?;
    let key = cache_key(source, options, arch)?;
    let cache = cubin_cache();
    let load = |cubin: Vec<u8>| {
        dev.cuda_stream()
            .context()
            .load_module(Ptx::from_binary(cubin))
    };
    let compile = || compile_cubin(source, options, arch);
    let (cubin, cached) = cache.get_or_compile(&key, compile)?;
    let loaded = match load(cubin) {
        // A cached cubin the driver refuses (damaged on disk) is compiled again.
        Err(_) if cached => {
            cache.forget(&key);
            load(cache.get_or_compile(&key, compile)?.0)
        }
        loaded => loaded,
    };
    loaded.map_err(driver_error(source.what))
}

/// Kernels `{name}_f32`, `{name}_bf16` and `{name}_f16` of `module` (loaded from `source`), in
/// the order of [`dtype_index`].
pub(crate) fn by_dtype(
    module: &Arc<CudaModule>,
    source: &Source,
    name: &str,
) -> anyhow::Result<[CudaFunction; 3]> {
    let function = |dtype: &str| {
        module
            .load_function(&format!("{name}_{dtype}"))
            .map_err(driver_error(source.what))
    };
    Ok([function("f32")?, function("bf16")?, function("f16")?])
}

/// Kernels loaded per device and `K` (a head dim, say), built on first use; `None` where they
/// failed to build, which is warned about once.
pub(crate) struct PerDevice<K, V>(OnceLock<Mutex<Built<K, V>>>);

type Built<K, V> = HashMap<(DeviceId, K), Option<Arc<V>>>;

impl<K: Eq + Hash, V> PerDevice<K, V> {
    pub(crate) const fn new() -> Self {
        Self(OnceLock::new())
    }

    /// The kernels for `key` on `dev`, built by `load` the first time they are asked for. On
    /// failure the warning says what runs instead: `fallback`.
    pub(crate) fn get(
        &self,
        dev: &CudaDevice,
        key: K,
        fallback: &str,
        load: impl FnOnce() -> anyhow::Result<V>,
    ) -> Option<Arc<V>> {
        let mut cache = self
            .0
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        cache
            .entry((dev.id(), key))
            .or_insert_with(|| match load() {
                Ok(loaded) => Some(Arc::new(loaded)),
                Err(e) => {
                    tracing::warn!("{fallback}: {e:#}");
                    None
                }
            })
            .clone()
    }
}

/// Where a dtype's kernel sits in our per-dtype arrays: every source instantiates its kernels
/// for f32, bf16 and f16, in that order.
pub(crate) fn dtype_index(dtype: DType) -> Option<usize> {
    match dtype {
        DType::F32 => Some(0),
        DType::BF16 => Some(1),
        DType::F16 => Some(2),
        _ => None,
    }
}
