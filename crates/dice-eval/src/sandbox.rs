//! Who sandboxed children run as (python/sandbox.py confines them; SANDBOX.md says what that
//! isolates): user ids and process limits; and the build cache, which no sandbox user may write.

// Process control (fork, setuid, signals, process groups) goes through libc.
#![allow(unsafe_code)]

use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};

/// The group of every sandbox user: it owns nothing.
const SANDBOX_GID: u32 = 64001;
/// Processes (threads included) of one extension build: ninja, compilers.
const BUILD_NPROC: u64 = 4096;
/// Processes (threads included) of one candidate: torch's thread pools, CUDA's helper threads.
const RUN_NPROC: u64 = 512;
const FIRST_UID: u32 = 100_000;
const UIDS_PER_EVALUATION: u32 = 256;
/// Evaluations of one process that get blocks of their own before the blocks are taken again:
/// more than run at once in any process (a test binary runs dozens, several at a time).
const BLOCKS_PER_PROCESS: u32 = 256;
/// Processes, by their id, that get blocks of their own: the largest id is below 2^31.
const PROCESS_SLOTS: u32 = 4096;
/// The first ids of an evaluation's block go to builders, the others to candidates.
const BUILDER_UIDS: u32 = 64;

/// The user ids of one evaluation, taken in turn: builders (which compile extensions for the
/// evaluator) and candidates (compile and run stage) never share one, and neither a concurrent
/// process nor the remains of the previous one (a fork bomb's processes take a moment to die)
/// count towards a process's limit or can reach its files. Concurrent evaluations (tests,
/// several runs on one machine) get different ids too.
#[derive(Debug)]
pub(crate) struct SandboxUsers {
    base: u32,
    builders: AtomicU32,
    candidates: AtomicU32,
}

impl SandboxUsers {
    pub(crate) fn new() -> SandboxUsers {
        static EVALUATIONS: AtomicU32 = AtomicU32::new(0);
        let nth = EVALUATIONS.fetch_add(1, Ordering::SeqCst) % BLOCKS_PER_PROCESS;
        let pid = std::process::id() % PROCESS_SLOTS;
        SandboxUsers {
            base: FIRST_UID + (pid * BLOCKS_PER_PROCESS + nth) * UIDS_PER_EVALUATION,
            builders: AtomicU32::new(0),
            candidates: AtomicU32::new(0),
        }
    }

    /// The next extension build: it writes only its own job folder.
    pub(crate) fn builder(&self) -> Value {
        let nth = self.builders.fetch_add(1, Ordering::SeqCst);
        let uid = self.base + nth % BUILDER_UIDS;
        json!({"uid": uid, "gid": SANDBOX_GID, "nproc": BUILD_NPROC, "umask": 0o077})
    }

    /// The next candidate process, in either stage: reads the build cache only.
    pub(crate) fn candidate(&self) -> Value {
        let nth = self.candidates.fetch_add(1, Ordering::SeqCst);
        let uid = self.base + BUILDER_UIDS + nth % (UIDS_PER_EVALUATION - BUILDER_UIDS);
        json!({"uid": uid, "gid": SANDBOX_GID, "nproc": RUN_NPROC, "umask": 0o077})
    }
}

/// Creates the build cache and, when the evaluator runs as root (sandboxed children then drop
/// to other users), makes it the evaluator's alone: its folder writable by no one else, and
/// entries that a sandbox user owns (an older evaluator let the compile stage write the cache)
/// removed. An unprivileged evaluator's children stay its own user.
pub(crate) fn prepare(build_cache: &Path) -> Result<()> {
    std::fs::create_dir_all(build_cache)
        .with_context(|| format!("cannot create the build cache {}", build_cache.display()))?;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(());
    }
    own_cache(build_cache).with_context(|| {
        format!(
            "taking the build cache {} back from the sandbox users",
            build_cache.display()
        )
    })
}

fn own_cache(dir: &Path) -> Result<()> {
    std::os::unix::fs::lchown(dir, Some(0), Some(0))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        if meta.uid() != 0 || meta.mode() & 0o022 != 0 {
            let path = entry.path();
            if meta.is_dir() {
                std::fs::remove_dir_all(&path)?;
            } else {
                std::fs::remove_file(&path)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builders_and_candidates_get_users_of_their_own() {
        let users = SandboxUsers::new();
        let ids: std::collections::BTreeSet<_> = [
            users.builder(),
            users.builder(),
            users.candidate(),
            users.candidate(),
        ]
        .iter()
        .map(|user| user["uid"].as_u64())
        .collect();
        assert_eq!(ids.len(), 4, "{ids:?}");
        assert_ne!(SandboxUsers::new().base, users.base);
    }
}
