//! Who sandboxed children run as (python/sandbox.py confines them; SANDBOX.md says what that
//! isolates): user ids, process limits, and the permissions that let compile-stage users write
//! the build cache while run-stage users may only read it.

// Process control (fork, setuid, signals, process groups) goes through libc.
#![allow(unsafe_code)]

use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};

/// The group owning the build cache; compile-stage users belong to it.
const CACHE_GID: u32 = 64000;
/// The group of run-stage users: the cache is only world-readable to them.
const RUN_GID: u32 = 64001;
/// Processes (threads included) of all concurrent builds of one evaluation: ninja, compilers.
const BUILD_NPROC: u64 = 4096;
/// Processes (threads included) of one candidate: torch's thread pools, CUDA's helper threads.
const RUN_NPROC: u64 = 512;
const FIRST_UID: u32 = 100_000;
const UIDS_PER_EVALUATION: u32 = 16;

/// The user ids of one evaluation: one for its builds, and the others in turn for its candidates,
/// so that neither a concurrent candidate nor the remains of the previous one (a fork bomb's
/// processes take a moment to die) count towards a candidate's process limit. Concurrent
/// evaluations (tests, several runs on one machine) get different ids too.
#[derive(Debug)]
pub(crate) struct SandboxUsers {
    base: u32,
    runs: AtomicU32,
}

impl SandboxUsers {
    pub(crate) fn new() -> SandboxUsers {
        static EVALUATIONS: AtomicU32 = AtomicU32::new(0);
        let nth = EVALUATIONS.fetch_add(1, Ordering::SeqCst) % 16;
        let pid = std::process::id() % 4096;
        SandboxUsers {
            base: FIRST_UID + (pid * 16 + nth) * UIDS_PER_EVALUATION,
            runs: AtomicU32::new(0),
        }
    }

    /// Compile stage: may write the build cache (group-writable, umask 002).
    pub(crate) fn build(&self) -> Value {
        json!({"uid": self.base, "gid": CACHE_GID, "nproc": BUILD_NPROC, "umask": 0o002})
    }

    /// Run stage, the next candidate: reads the cache only.
    pub(crate) fn run(&self) -> Value {
        let nth = self.runs.fetch_add(1, Ordering::SeqCst);
        let uid = self.base + 1 + nth % (UIDS_PER_EVALUATION - 1);
        json!({"uid": uid, "gid": RUN_GID, "nproc": RUN_NPROC, "umask": 0o077})
    }
}

/// When the evaluator runs as root (sandboxed children then drop to other users), gives the build
/// cache to the compile stage's group. An unprivileged evaluator's children stay its own user.
pub(crate) fn prepare(build_cache: &Path) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(());
    }
    share_cache(build_cache).with_context(|| {
        format!(
            "giving the build cache {} to the sandbox",
            build_cache.display()
        )
    })
}

/// Group CACHE_GID, group-writable (setgid folders keep new entries in the group), readable by
/// everyone; idempotent, so concurrent evaluators sharing one cache agree.
fn share_cache(dir: &Path) -> Result<()> {
    let meta = std::fs::symlink_metadata(dir)?;
    if meta.file_type().is_symlink() {
        return Ok(());
    }
    chown_group(dir)?;
    let mode = meta.permissions().mode() & 0o7777;
    let wanted = if meta.is_dir() {
        mode | 0o2775
    } else {
        mode | 0o664
    };
    if wanted != mode {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(wanted))?;
    }
    if meta.is_dir() {
        for entry in std::fs::read_dir(dir)? {
            share_cache(&entry?.path())?;
        }
    }
    Ok(())
}

fn chown_group(path: &Path) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: a valid NUL-terminated path; uid -1 keeps the owner.
    if unsafe { libc::lchown(c.as_ptr(), u32::MAX, CACHE_GID) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_differ_per_stage_and_candidate() {
        let users = SandboxUsers::new();
        let ids = [
            users.build()["uid"].as_u64(),
            users.run()["uid"].as_u64(),
            users.run()["uid"].as_u64(),
        ];
        assert!(
            ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2],
            "{ids:?}"
        );
        assert_ne!(users.build()["gid"], users.run()["gid"]);
        assert_ne!(SandboxUsers::new().base, users.base);
    }
}
