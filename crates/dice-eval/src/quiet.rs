//! A quiet host for timing: while any timed process holds its device alone, the compile stage's
//! process groups (a candidate's import and its compiler jobs) are stopped, and they go on when
//! the last exclusive window ends.
//!
//! Pinning (python/protocol.py `Timer.run`) keeps the timed process on cores of its own where the
//! machine has eight or more, but compilers still share its memory bandwidth, caches and the
//! PCIe link, and on smaller machines nothing is pinned at all. Stopping them costs the builds
//! only the windows' length (a build's time limit does not count it: [`Pauses`]). SANDBOX.md,
//! "Quiet timing", has what it changes on a loaded machine.

// Stopping and resuming process groups goes through libc.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// The compile stage's process groups, and the exclusive windows open now.
#[derive(Default)]
pub(crate) struct BuildGroups {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Exclusive windows open now, on all devices.
    windows: u32,
    groups: HashMap<i32, Arc<Pauses>>,
}

/// How long one build group has been stopped so far, for its time limits.
#[derive(Default)]
pub(crate) struct Pauses {
    state: Mutex<PauseState>,
}

#[derive(Default)]
struct PauseState {
    stopped: Duration,
    since: Option<Instant>,
}

impl Pauses {
    /// Time stopped so far, the stop in progress included.
    pub(crate) fn stopped(&self) -> Duration {
        let state = lock(&self.state);
        state.stopped + state.since.map_or(Duration::ZERO, |since| since.elapsed())
    }

    fn stop(&self, pgid: i32) {
        let mut state = lock(&self.state);
        if state.since.is_none() {
            signal_group(pgid, libc::SIGSTOP);
            state.since = Some(Instant::now());
        }
    }

    fn resume(&self, pgid: i32) {
        let mut state = lock(&self.state);
        if let Some(since) = state.since.take() {
            signal_group(pgid, libc::SIGCONT);
            state.stopped += since.elapsed();
        }
    }
}

impl BuildGroups {
    /// Adds the process group `pgid` of a compile-stage child until the returned guard drops;
    /// stopped at once while a window is open.
    pub(crate) fn register(&self, pgid: i32) -> BuildGroup<'_> {
        let pauses = Arc::new(Pauses::default());
        let mut state = lock(&self.state);
        if state.windows > 0 {
            pauses.stop(pgid);
        }
        state.groups.insert(pgid, pauses.clone());
        BuildGroup {
            groups: self,
            pgid,
            pauses,
        }
    }

    /// A quiet window: every build group is stopped until the last open window's guard drops
    /// (on every path out of timing, unwinding included).
    pub(crate) fn quiet(&self) -> QuietWindow<'_> {
        let mut state = lock(&self.state);
        state.windows += 1;
        if state.windows == 1 {
            for (&pgid, pauses) in &state.groups {
                pauses.stop(pgid);
            }
        }
        QuietWindow { groups: self }
    }
}

/// A compile-stage child's process group, stopped during exclusive windows.
pub(crate) struct BuildGroup<'a> {
    groups: &'a BuildGroups,
    pgid: i32,
    pauses: Arc<Pauses>,
}

impl BuildGroup<'_> {
    pub(crate) fn pauses(&self) -> Arc<Pauses> {
        self.pauses.clone()
    }
}

impl Drop for BuildGroup<'_> {
    /// Never leaves the group stopped: a child killed after this (its job ends) must be able
    /// to exit, and its id may be reused.
    fn drop(&mut self) {
        let mut state = lock(&self.groups.state);
        state.groups.remove(&self.pgid);
        self.pauses.resume(self.pgid);
    }
}

/// An open exclusive window's share in keeping the builds stopped.
pub(crate) struct QuietWindow<'a> {
    groups: &'a BuildGroups,
}

impl Drop for QuietWindow<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.groups.state);
        state.windows -= 1;
        if state.windows == 0 {
            for (&pgid, pauses) in &state.groups {
                pauses.resume(pgid);
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Signals a whole process group; one that has exited already is no error.
fn signal_group(pgid: i32, signal: i32) {
    if pgid > 0 {
        // SAFETY: kill(2) with a negative pid signals that process group only.
        unsafe { libc::kill(-pgid, signal) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Child, Command};

    /// A busy process group of its own, killed when dropped.
    struct Busy(Child);

    impl Busy {
        fn start() -> Busy {
            use std::os::unix::process::CommandExt;
            let child = Command::new("sh")
                .args(["-c", "while :; do :; done"])
                .process_group(0)
                .spawn()
                .unwrap();
            Busy(child)
        }

        /// Whether the process is stopped, as soon as the kernel says so (within a second).
        fn stopped(&self, expected: bool) -> bool {
            let stat = format!("/proc/{}/stat", self.0.id());
            for _ in 0..100 {
                let text = std::fs::read_to_string(&stat).unwrap();
                // pid (comm) state ...: the state follows the last parenthesis.
                let state = text[text.rfind(')').unwrap() + 2..].chars().next();
                if (state == Some('T')) == expected {
                    return expected;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            !expected
        }
    }

    impl Drop for Busy {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn builds_stop_for_the_windows_and_go_on_after_them() {
        let busy = Busy::start();
        let pgid = busy.0.id() as i32;
        let groups = BuildGroups::default();
        let group = groups.register(pgid);
        assert!(!busy.stopped(false));

        let first = groups.quiet();
        let second = groups.quiet();
        assert!(busy.stopped(true), "a build ran during a window");
        std::thread::sleep(Duration::from_millis(100));
        drop(first);
        assert!(
            busy.stopped(true),
            "a build ran while a window was still open"
        );
        drop(second);
        assert!(
            !busy.stopped(false),
            "a build stayed stopped after the windows"
        );
        let stopped = group.pauses().stopped();
        assert!(stopped >= Duration::from_millis(100), "{stopped:?}");

        // Dropped during a window: resumed; registered during one: stopped at once.
        let window = groups.quiet();
        drop(group);
        assert!(!busy.stopped(false), "an unregistered build stayed stopped");
        let again = groups.register(pgid);
        assert!(busy.stopped(true));
        // A window that ends by unwinding resumes the builds too.
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _window = window;
            panic!("timing failed");
        }));
        assert!(unwound.is_err());
        assert!(!busy.stopped(false), "a panic left the build stopped");
        drop(again);
        drop(busy);
        // A group that is gone is no error.
        let gone = groups.register(pgid);
        drop(groups.quiet());
        drop(gone);
    }
}
