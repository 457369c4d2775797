//! What the workspace's tests share, so each fixture is defined once: where the repository's test
//! data lives (`tests/data`, with its provenance in `tests/data/README.md`) and the one build cache
//! for candidates' extensions, so an extension that several tests build compiles once per suite
//! run; the tiny model checkpoint the CPU tests load (`checkpoint`, behind the feature of that
//! name), written once per suite run; and a PostgreSQL server of a test's own
//! ([`postgres::PostgresServer`]). A dev-dependency only: no library or binary of the workspace
//! links it.

#[cfg(feature = "checkpoint")]
pub mod checkpoint;
pub mod postgres;

use std::path::{Path, PathBuf};

/// The repository's root (two folders above this crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `tests/data` of the repository: KernelBench problems, DICE's released files, the SDAR
/// tokenizer and configs, the formula golden.
pub fn test_data() -> PathBuf {
    repo_root().join("tests/data")
}

/// `examples/` of the repository: the demo's problems and candidates.
pub fn examples_dir() -> PathBuf {
    repo_root().join("examples")
}

/// The build cache every test of every crate shares: `$DICE_CACHE` (the evaluator's own default) when the suite's
/// runner set `DICE_CACHE` (`scripts/test.sh` does), else `dice-test-builds` in the system's
/// temporary folder. Content-addressed, so sharing it never changes what a test checks.
pub fn shared_build_cache() -> PathBuf {
    match std::env::var_os("DICE_CACHE") {
        Some(cache) if !cache.is_empty() => PathBuf::from(cache),
        _ => std::env::temp_dir().join("dice-test-builds"),
    }
}
