//! A device's timing lock across processes: several `dice eval` working on one run (claims.rs)
//! share its devices, and a candidate timed in one must not run beside another's steps.
//!
//! Two files per device in `RUN_DIR/locks/`, a folder only the evaluator's user may enter, so
//! that no candidate can hold them: `DEVICE.lock`, held shared by each untimed step and
//! exclusively by timing (gate.rs takes them after its own lock), and `DEVICE.turnstile`, held
//! by a timer while it waits, so that steps starting meanwhile in other processes queue behind
//! it instead of starving it. Each pass opens its own descriptor: a flock belongs to an open
//! file, and the passes of one process overlap.

use anyhow::{Context, Result};
use std::fs::{DirBuilder, File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

pub(crate) struct DeviceLock {
    lock: PathBuf,
    turnstile: PathBuf,
    /// Whether a failure to lock was reported (once: timing goes on without the lock).
    warned: AtomicBool,
}

impl DeviceLock {
    /// The lock of `device` (`cpu`, `cuda0`, …) for the run in `run_dir`.
    pub(crate) fn new(run_dir: &Path, device: &str) -> Result<DeviceLock> {
        let dir = run_dir.join("locks");
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("cannot create the device locks' folder {}", dir.display()))?;
        let lock = DeviceLock {
            lock: dir.join(format!("{device}.lock")),
            turnstile: dir.join(format!("{device}.turnstile")),
            warned: AtomicBool::new(false),
        };
        for path in [&lock.lock, &lock.turnstile] {
            open(path).with_context(|| format!("cannot create {}", path.display()))?;
        }
        Ok(lock)
    }

    /// Held while an untimed step runs (None: the lock failed, reported once).
    pub(crate) fn shared(&self) -> Option<File> {
        self.take(|file| {
            self.through_turnstile()?;
            file.lock_shared()
        })
    }

    /// Held while a candidate or its baseline is timed (None: the lock failed, reported once).
    pub(crate) fn exclusive(&self) -> Option<File> {
        self.take(|file| {
            let turnstile = open(&self.turnstile)?;
            turnstile.lock()?;
            file.lock()
        })
    }

    /// Waits for a timer of another process that is waiting or timing.
    fn through_turnstile(&self) -> std::io::Result<()> {
        open(&self.turnstile)?.lock()
    }

    fn take(&self, lock: impl FnOnce(&File) -> std::io::Result<()>) -> Option<File> {
        let taken = open(&self.lock).and_then(|file| lock(&file).map(|()| file));
        match taken {
            Ok(file) => Some(file),
            Err(e) => {
                if !self.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "cannot lock {}: {e}; timings may be disturbed by other evaluations of \
                         this run",
                        self.lock.display()
                    );
                }
                None
            }
        }
    }
}

fn open(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    use std::time::Duration;

    /// Passes of two "processes" (two locks on the same files): steps share, timing excludes.
    #[test]
    fn timing_excludes_the_steps_of_other_processes() {
        let dir = tempfile::tempdir().unwrap();
        let mine = DeviceLock::new(dir.path(), "cpu").unwrap();
        let theirs = Arc::new(DeviceLock::new(dir.path(), "cpu").unwrap());
        let step = mine.shared().unwrap();
        drop(theirs.shared().unwrap());

        let timed = Arc::new(AtomicUsize::new(0));
        let timer = {
            let (theirs, timed) = (theirs.clone(), timed.clone());
            std::thread::spawn(move || {
                let window = theirs.exclusive().unwrap();
                timed.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(100));
                drop(window);
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(timed.load(Ordering::SeqCst), 0, "timed beside a step");
        drop(step);
        // A step asked for while the timer waits or times comes after its window.
        std::thread::sleep(Duration::from_millis(20));
        let next = mine.shared().unwrap();
        assert_eq!(timed.load(Ordering::SeqCst), 1);
        drop(next);
        timer.join().unwrap();
        let mode = std::fs::metadata(dir.path().join("locks")).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o700
        );
    }
}
