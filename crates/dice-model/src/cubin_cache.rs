//! Our kernels' cubins kept on disk between runs. NVRTC compiled every source at each start of a
//! process, so every command paid it before its first forward (on an H100 the first rollout of
//! a `dice train rl` process took 11.0 s, the second 0.4 s for the same 2,048 tokens, run
//! bench/runs/2026-12-05-c958933-h100: most of it the decoding kernels' compilation). A
//! cubin is stored under the SHA-256 of everything that makes it (the source and the headers it
//! includes, the options, the architecture, the NVRTC version) and read back by the next
//! process that asks for the same; a store is written whole under a temporary name and renamed,
//! so a reader never sees half of one.
//!
//! Where: `DICE_KERNEL_CACHE` (a folder, or `off`), else `$XDG_CACHE_HOME/dice/kernels`, else
//! `~/.cache/dice/kernels`. A cubin is a few hundred kilobytes, one per source and variant (head
//! dim), per dice version that changes the source: megabytes in all.

#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use anyhow::Result;
use sha2::{Digest, Sha256};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The environment variable naming the cache's folder (`off`: no cache).
pub const KERNEL_CACHE_ENV: &str = "DICE_KERNEL_CACHE";

/// A folder of cubins by key, or none (every cubin compiled).
#[derive(Debug, Clone)]
pub(crate) struct CubinCache {
    dir: Option<PathBuf>,
}

impl CubinCache {
    /// The cache the environment names (see the module's documentation).
    pub(crate) fn from_env() -> Self {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        Self {
            dir: folder(var(KERNEL_CACHE_ENV), var("XDG_CACHE_HOME"), var("HOME")),
        }
    }

    /// The key of a compilation from its inputs, each length-prefixed so that no two lists of
    /// parts share one.
    pub(crate) fn key(parts: &[&[u8]]) -> String {
        let mut hash = Sha256::new();
        for part in parts {
            hash.update((part.len() as u64).to_le_bytes());
            hash.update(part);
        }
        hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    fn path(&self, key: &str) -> Option<PathBuf> {
        self.dir
            .as_ref()
            .map(|dir| dir.join(format!("{key}.cubin")))
    }

    /// The cubin of `key`: read from the cache, or made by `compile` and stored for the next
    /// run (a cache that cannot be written is said once in the log and otherwise ignored).
    /// Also whether it came from the cache.
    pub(crate) fn get_or_compile(
        &self,
        key: &str,
        compile: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<(Vec<u8>, bool)> {
        let Some(path) = self.path(key) else {
            return Ok((compile()?, false));
        };
        if let Ok(cubin) = std::fs::read(&path) {
            if !cubin.is_empty() {
                return Ok((cubin, true));
            }
        }
        let cubin = compile()?;
        if let Err(e) = store(&path, &cubin) {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    "cannot keep compiled kernels in {} ({e:#}); they are compiled at every \
                     start (set {KERNEL_CACHE_ENV} to a writable folder, or to `off`)",
                    path.parent().unwrap_or(&path).display()
                );
            });
        }
        Ok((cubin, false))
    }

    /// Drops the cubin of `key` (one the driver refused), so that the next ask compiles it.
    pub(crate) fn forget(&self, key: &str) {
        if let Some(path) = self.path(key) {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// One source compiled by [`crate::precompile_kernels`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Precompiled {
    /// What the kernels are ("the training attention kernels").
    pub what: &'static str,
    /// NVRTC options beside the architecture (`-DHEAD_DIM=128`).
    pub options: Vec<String>,
    /// The architecture it was compiled for (`sm_90a`).
    pub target: String,
    /// Whether the cache held it already.
    pub cached: bool,
}

/// The folder the kernel cache uses, as the environment names it (`None`: no cache).
pub fn kernel_cache_folder() -> Option<PathBuf> {
    CubinCache::from_env().dir
}

/// The cache's folder from `DICE_KERNEL_CACHE`, `XDG_CACHE_HOME` and `HOME` (unset or empty:
/// `None`).
fn folder(
    named: Option<OsString>,
    xdg: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    match named {
        Some(value) if value == "off" => None,
        Some(value) => Some(PathBuf::from(value)),
        None => xdg
            .map(PathBuf::from)
            .or_else(|| home.map(|home| Path::new(&home).join(".cache")))
            .map(|base| base.join("dice").join("kernels")),
    }
}

/// Writes `bytes` to `path` whole: under a temporary name beside it, then renamed.
fn store(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let staging = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    std::fs::write(&staging, bytes)?;
    std::fs::rename(&staging, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&staging);
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    impl CubinCache {
        fn in_folder(dir: Option<PathBuf>) -> Self {
            Self { dir }
        }
    }

    #[test]
    fn the_folder_is_named_or_under_the_user_cache() {
        let os = |s: &str| Some(OsString::from(s));
        assert_eq!(folder(os("off"), os("/x"), os("/h")), None);
        assert_eq!(folder(os("/k"), os("/x"), os("/h")), Some("/k".into()));
        assert_eq!(
            folder(None, os("/x"), os("/h")),
            Some("/x/dice/kernels".into())
        );
        assert_eq!(
            folder(None, None, os("/h")),
            Some("/h/.cache/dice/kernels".into())
        );
        assert_eq!(folder(None, None, None), None);
    }

    #[test]
    fn keys_change_with_every_part_and_its_bounds() {
        let key = CubinCache::key(&[b"source", b"-DHEAD_DIM=128", b"sm_90"]);
        assert_eq!(key.len(), 64);
        assert_ne!(
            key,
            CubinCache::key(&[b"source", b"-DHEAD_DIM=64", b"sm_90"])
        );
        assert_ne!(
            key,
            CubinCache::key(&[b"source", b"-DHEAD_DIM=128", b"sm_80"])
        );
        assert_ne!(
            CubinCache::key(&[b"ab", b"c"]),
            CubinCache::key(&[b"a", b"bc"])
        );
        assert_eq!(
            key,
            CubinCache::key(&[b"source", b"-DHEAD_DIM=128", b"sm_90"])
        );
    }

    #[test]
    fn a_cubin_is_compiled_once_and_read_back_until_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CubinCache::in_folder(Some(dir.path().join("kernels")));
        let compiles = Cell::new(0);
        let compile = || {
            compiles.set(compiles.get() + 1);
            Ok(vec![1u8, 2, 3])
        };
        assert_eq!(
            cache.get_or_compile("k", compile).unwrap(),
            (vec![1, 2, 3], false)
        );
        assert_eq!(
            cache.get_or_compile("k", compile).unwrap(),
            (vec![1, 2, 3], true)
        );
        // Another process (another cache value on the same folder) reads it too.
        let other = CubinCache::in_folder(Some(dir.path().join("kernels")));
        assert!(other.get_or_compile("k", compile).unwrap().1);
        assert_eq!(compiles.get(), 1);
        cache.forget("k");
        assert!(!cache.get_or_compile("k", compile).unwrap().1);
        assert_eq!(compiles.get(), 2);
        // Nothing but the cubin is left in the folder (no staging files).
        let names: Vec<String> = std::fs::read_dir(dir.path().join("kernels"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["k.cubin"]);
    }

    #[test]
    fn no_cache_or_an_unwritable_one_compiles_every_time() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"not a folder").unwrap();
        for cache in [
            CubinCache::in_folder(None),
            CubinCache::in_folder(Some(file.join("kernels"))),
        ] {
            let compiles = Cell::new(0);
            let compile = || {
                compiles.set(compiles.get() + 1);
                Ok(vec![7u8])
            };
            for _ in 0..2 {
                assert_eq!(
                    cache.get_or_compile("k", compile).unwrap(),
                    (vec![7], false)
                );
            }
            assert_eq!(compiles.get(), 2);
        }
        // A failed compilation is an error and stores nothing.
        let cache = CubinCache::in_folder(Some(dir.path().join("kernels")));
        assert!(cache
            .get_or_compile("k", || anyhow::bail!("NVRTC says no"))
            .is_err());
        assert!(!dir.path().join("kernels").join("k.cubin").exists());
    }
}
