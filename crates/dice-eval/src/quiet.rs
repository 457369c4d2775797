//! A quiet host for timing, within a bound: while any timed process holds its device alone, the
//! compile stage's process groups (a candidate's import and its compiler jobs) are stopped, as
//! long as they have been stopped for at most a share of the last [`SPAN`]; past it, the timing
//! windows go on beside running builds until the share is free again.
//!
//! Pinning (python/protocol.py `Timer.run`) keeps the timed process on cores of its own where the
//! machine has eight or more, but compilers still share its memory bandwidth, caches and the
//! PCIe link, and on smaller machines nothing is pinned at all. Stopping the builds for every
//! window starves them when windows follow each other (a cold batch with several candidates in
//! flight per device: bench/runs/2026-12-01-328bf66-h200), hence the share. A build's time limit
//! does not count its stops ([`Pauses`]). Each window tells how long builds were stopped and how
//! long they ran beside it ([`Beside`]), for the sample's record. TIMING.md, "Builds beside
//! timing", has the measurements.

// Stopping and resuming process groups goes through libc.
#![allow(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// The sliding window over which the share of stopped time is counted: long enough to hold
/// several timing windows (a second or two each on a GPU), short enough that a build is never
/// starved for long.
pub(crate) const SPAN: Duration = Duration::from_secs(30);

/// The compile stage's process groups, and the exclusive windows open now.
pub(crate) struct BuildGroups {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when the builds go on, so that the cap's watch ends with the stop it watched.
    resumed: Condvar,
}

struct State {
    /// The share of `span` builds may be stopped (0: never, 1: for every window).
    share: f64,
    /// [`SPAN`], but for tests.
    span: Duration,
    /// Exclusive windows open now, on all devices.
    windows: u32,
    groups: HashMap<i32, Arc<Pauses>>,
    /// Whether the builds are stopped now (whether or not any is registered).
    stopped: bool,
    /// Counts stops, so that a watch of the cap knows its stop from a later one.
    stops: u64,
    /// Since when the host has been as it is (`builds()`).
    since: Instant,
    /// Time with builds stopped, and with builds running, since the start.
    totals: Beside,
    /// Periods with builds stopped that end within the last `span`, oldest first.
    recent_stops: VecDeque<(Instant, Instant)>,
    /// How long the last window lasted: a stop begins only when the share left covers as much.
    last_window: Duration,
}

/// Whether compile-stage processes exist, and whether they are stopped.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Builds {
    None,
    Running,
    Stopped,
}

/// How long builds were stopped, and how long they ran, beside a timing window.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Beside {
    pub stopped: Duration,
    pub running: Duration,
}

impl std::ops::Sub for Beside {
    type Output = Beside;

    fn sub(self, earlier: Beside) -> Beside {
        Beside {
            stopped: self.stopped.saturating_sub(earlier.stopped),
            running: self.running.saturating_sub(earlier.running),
        }
    }
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

impl State {
    fn builds(&self) -> Builds {
        match (self.groups.is_empty(), self.stopped) {
            (true, _) => Builds::None,
            (false, false) => Builds::Running,
            (false, true) => Builds::Stopped,
        }
    }

    /// Counts the time since the last change, as the host was, before a change.
    fn account(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.since);
        match self.builds() {
            Builds::None => {}
            Builds::Running => self.totals.running += elapsed,
            Builds::Stopped => {
                self.totals.stopped += elapsed;
                self.recent_stops.push_back((self.since, now));
            }
        }
        self.since = now;
        let start = now.checked_sub(self.span);
        while let Some(&(_, end)) = self.recent_stops.front() {
            if start.is_some_and(|start| end < start) {
                self.recent_stops.pop_front();
            } else {
                break;
            }
        }
    }

    /// The totals as of `now`, the period in progress included.
    fn totals_at(&mut self, now: Instant) -> Beside {
        self.account(now);
        self.totals
    }

    /// How much longer builds may be stopped from `now` on: the share of `span` less the time
    /// they were stopped within the last `span`. Stopped time grows at most as fast as the
    /// clock, so stopping for no longer than this keeps every `span` within the share.
    fn share_left(&mut self, now: Instant) -> Duration {
        self.account(now);
        let start = now.checked_sub(self.span);
        let used: Duration = self
            .recent_stops
            .iter()
            .map(|&(from, to)| {
                let from = start.map_or(from, |start| from.max(start));
                to.saturating_duration_since(from)
            })
            .sum();
        self.allowed().saturating_sub(used)
    }

    /// Whether a window opening at `now` may stop the builds.
    fn may_stop(&mut self, now: Instant) -> bool {
        if self.share >= 1.0 {
            return true;
        }
        let allowed = self.allowed();
        !allowed.is_zero() && self.share_left(now) >= self.last_window.min(allowed)
    }

    fn allowed(&self) -> Duration {
        self.span.mul_f64(self.share)
    }

    fn stop_all(&mut self, now: Instant) {
        self.account(now);
        self.stopped = true;
        self.stops += 1;
        for (&pgid, pauses) in &self.groups {
            pauses.stop(pgid);
        }
    }

    fn resume_all(&mut self, now: Instant) {
        self.account(now);
        self.stopped = false;
        for (&pgid, pauses) in &self.groups {
            pauses.resume(pgid);
        }
    }
}

impl BuildGroups {
    /// Build groups that timing windows stop for at most `share` (0 to 1) of every [`SPAN`].
    pub(crate) fn new(share: f64) -> BuildGroups {
        BuildGroups::with_span(share, SPAN)
    }

    fn with_span(share: f64, span: Duration) -> BuildGroups {
        let state = State {
            share: share.clamp(0.0, 1.0),
            span,
            windows: 0,
            groups: HashMap::new(),
            stopped: false,
            stops: 0,
            since: Instant::now(),
            totals: Beside::default(),
            recent_stops: VecDeque::new(),
            last_window: Duration::ZERO,
        };
        BuildGroups {
            shared: Arc::new(Shared {
                state: Mutex::new(state),
                resumed: Condvar::new(),
            }),
        }
    }

    /// Adds the process group `pgid` of a compile-stage child until the returned guard drops;
    /// stopped at once while the builds are stopped.
    pub(crate) fn register(&self, pgid: i32) -> BuildGroup<'_> {
        let pauses = Arc::new(Pauses::default());
        let mut state = lock(&self.shared.state);
        state.account(Instant::now());
        if state.stopped {
            pauses.stop(pgid);
        }
        state.groups.insert(pgid, pauses.clone());
        BuildGroup {
            groups: self,
            pgid,
            pauses,
        }
    }

    /// A timing window: the builds are stopped, if the share allows, until the last open
    /// window's guard drops (on every path out of timing, unwinding included) or the share is
    /// used up.
    pub(crate) fn quiet(&self) -> QuietWindow<'_> {
        let now = Instant::now();
        let mut state = lock(&self.shared.state);
        state.windows += 1;
        if !state.stopped && state.may_stop(now) {
            state.stop_all(now);
            if state.share < 1.0 {
                let (shared, stop) = (self.shared.clone(), state.stops);
                let watch = std::thread::Builder::new()
                    .name("quiet-share".into())
                    .spawn(move || watch_share(&shared, stop));
                // Unwatched, a stop could outlast the share: the builds go on instead.
                if let Err(e) = watch {
                    tracing::warn!("builds are not stopped for timing: cannot start a thread: {e}");
                    state.resume_all(now);
                }
            }
        }
        let start = state.totals_at(now);
        QuietWindow {
            groups: self,
            opened: now,
            start,
        }
    }
}

/// Resumes the builds of stop number `stop` when it would take more than the share of the span;
/// ends when they go on.
fn watch_share(shared: &Shared, stop: u64) {
    let mut state = lock(&shared.state);
    loop {
        if !state.stopped || state.stops != stop {
            return;
        }
        let now = Instant::now();
        let left = state.share_left(now);
        if left.is_zero() {
            state.resume_all(now);
            return;
        }
        state = shared
            .resumed
            .wait_timeout(state, left)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}

/// A compile-stage child's process group, stopped during timing windows.
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
        let mut state = lock(&self.groups.shared.state);
        state.account(Instant::now());
        state.groups.remove(&self.pgid);
        self.pauses.resume(self.pgid);
    }
}

/// An open timing window: its share in keeping the builds stopped, and what they did beside it.
pub(crate) struct QuietWindow<'a> {
    groups: &'a BuildGroups,
    opened: Instant,
    start: Beside,
}

impl QuietWindow<'_> {
    /// How long builds were stopped, and how long they ran, since the window opened.
    pub(crate) fn beside(&self) -> Beside {
        let mut state = lock(&self.groups.shared.state);
        state.totals_at(Instant::now()) - self.start
    }
}

impl Drop for QuietWindow<'_> {
    fn drop(&mut self) {
        let now = Instant::now();
        let mut state = lock(&self.groups.shared.state);
        state.windows -= 1;
        state.last_window = now - self.opened;
        if state.windows == 0 && state.stopped {
            state.resume_all(now);
            self.groups.shared.resumed.notify_all();
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
        let groups = BuildGroups::new(1.0);
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

    /// Reads the process's state every millisecond for `length`, while `work` runs: the times
    /// at which it was stopped, and at which it was seen at all.
    fn watch_states(busy: &Busy, length: Duration, work: impl FnOnce()) -> Vec<(Duration, bool)> {
        let stat = format!("/proc/{}/stat", busy.0.id());
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let watcher = s.spawn(|| {
                let started = Instant::now();
                let mut seen = Vec::new();
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let text = std::fs::read_to_string(&stat).unwrap();
                    let state = text[text.rfind(')').unwrap() + 2..].chars().next();
                    seen.push((started.elapsed(), state == Some('T')));
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert!(started.elapsed() >= length);
                seen
            });
            work();
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            watcher.join().unwrap()
        })
    }

    #[test]
    fn back_to_back_windows_stop_builds_for_the_share_at_most() {
        let busy = Busy::start();
        let (share, span) = (0.3, Duration::from_millis(500));
        let groups = BuildGroups::with_span(share, span);
        let group = groups.register(busy.0.id() as i32);
        let length = Duration::from_secs(2);
        let mut beside = Beside::default();
        let mut windows = Duration::ZERO;
        let seen = watch_states(&busy, length, || {
            let started = Instant::now();
            // A device's timing windows, one after the other, as in a cold batch.
            while started.elapsed() < length {
                let window = groups.quiet();
                let opened = Instant::now();
                std::thread::sleep(Duration::from_millis(40));
                let b = window.beside();
                windows += opened.elapsed();
                drop(window);
                beside.stopped += b.stopped;
                beside.running += b.running;
            }
        });
        // Over every span the watcher saw whole, the builds were stopped for the share at
        // most (a little more for the watcher's and the signals' delays on a loaded machine).
        let mut worst: f64 = 0.0;
        for (i, &(from, _)) in seen.iter().enumerate() {
            let within: Vec<bool> = seen[i..]
                .iter()
                .take_while(|(at, _)| *at < from + span)
                .map(|&(_, stopped)| stopped)
                .collect();
            if seen.last().unwrap().0 < from + span {
                break;
            }
            let stopped = within.iter().filter(|&&s| s).count();
            worst = worst.max(stopped as f64 / within.len() as f64);
        }
        assert!(worst <= share + 0.15, "stopped {worst:.2} of a span");
        let all = seen.iter().filter(|(_, s)| *s).count() as f64 / seen.len() as f64;
        assert!(all > share / 2.0, "the share went unused: stopped {all:.2}");
        // Each window says how long builds were stopped and how long they ran beside it (the
        // windows' sum is measured around them, so it carries every window's scheduling delays:
        // a loaded 2-core machine adds tens of milliseconds over the ~45 windows).
        let accounted = beside.stopped + beside.running;
        assert!(
            windows.abs_diff(accounted) < Duration::from_millis(100),
            "{windows:?} against {beside:?}"
        );
        let stopped = group.pauses().stopped();
        assert!(
            stopped.abs_diff(beside.stopped) < Duration::from_millis(100),
            "{stopped:?} against {beside:?}"
        );
        assert!(
            !busy.stopped(false),
            "a build stayed stopped after the windows"
        );
    }

    #[test]
    fn no_share_never_stops_builds_and_says_they_ran() {
        let busy = Busy::start();
        let groups = BuildGroups::new(0.0);
        let _group = groups.register(busy.0.id() as i32);
        let window = groups.quiet();
        std::thread::sleep(Duration::from_millis(50));
        assert!(!busy.stopped(false), "a build was stopped");
        let beside = window.beside();
        assert_eq!(beside.stopped, Duration::ZERO);
        assert!(beside.running >= Duration::from_millis(50), "{beside:?}");
    }
}
