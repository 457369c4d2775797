//! Timing exclusivity on one device while several candidates are in flight on it.
//!
//! Each untimed step that touches the device (constructing a candidate's or a reference's model,
//! one correctness trial, the judgement of one output, the profiled rerun with its profiler's
//! start) holds a shared pass; timing holds the exclusive one, so no other process of the
//! evaluation works on the device while a candidate or its baseline is timed. Steps are short
//! (a trial and its judgement are two steps, so a timer waits for one of them): timing waits at
//! most for the steps already running. std's RwLock on Linux blocks new readers while a writer
//! waits, so timing never starves.
//!
//! Timers take their turns one at a time, and the steps of an evaluation whose steps hold the
//! device long (multi-GB outputs: [`LONG_STEP`]) take theirs between timers: such a step waits
//! for the timer holding the device, not for every timer queued behind it. Queued all at once,
//! seven timers of a second or two each kept every such step of a cold batch waiting 5-17 s,
//! about 95 s of each of its largest programs (bench/notes/eval-h200.md, session 36); in turns,
//! a timer waits for the long steps that asked before the last timer went, and a long step for
//! the timer holding the device and at most one more.
//! Other processes evaluating the same run share the device through its file lock
//! (device_lock.rs), taken after this one.
//! Process start-up, imports and extension loads run outside any pass. The gate records its
//! exclusive windows, the waits for them, and how long it was closed to untimed steps
//! ([`GateUse`]).

use crate::device_lock::DeviceLock;
use dice_store::RunTimeline;
use std::collections::VecDeque;
use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

/// An untimed step that held the device this long makes its evaluation's later steps long ones.
pub(crate) const LONG_STEP: Duration = Duration::from_secs(1);

#[derive(Default)]
pub(crate) struct DeviceGate {
    lock: RwLock<()>,
    /// The device's lock across the processes evaluating the run.
    across_processes: Option<DeviceLock>,
    record: Mutex<Record>,
    /// Wakes the long steps and timers waiting for their turn (`Record::turns`).
    turn: Condvar,
}

/// The gate's use so far, what it needs to measure how long it is closed, and the turns of
/// long steps and timers.
#[derive(Default)]
struct Record {
    used: GateUse,
    /// Exclusive passes closing the gate or holding it now, and since when there have been any.
    wanted: u32,
    closed_since: Option<Instant>,
    turns: Turns,
}

/// Long steps and timers waiting for their turn, in their order of asking, the long steps
/// running, and how many timers have had their turn.
#[derive(Default)]
struct Turns {
    next_ticket: u64,
    waiting: VecDeque<Waiting>,
    long_steps: u32,
    timers_gone: u64,
}

struct Waiting {
    ticket: u64,
    turn: Turn,
    /// Timers gone, not counting those still past their turn, when it asked: a long step may
    /// go before the timers waiting once a timer went after it asked.
    timers_gone_before: u64,
}

#[derive(Clone, Copy, PartialEq)]
enum Turn {
    LongStep,
    Timer,
}

impl Turns {
    /// A ticket for `turn`, asked with `timers` past their turn.
    fn ask(&mut self, turn: Turn, timers: u32) -> u64 {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let timers_gone_before = self.timers_gone.saturating_sub(u64::from(timers));
        self.waiting.push_back(Waiting {
            ticket,
            turn,
            timers_gone_before,
        });
        ticket
    }

    /// Whether a waiting long step has had a timer go since it asked, so that no later timer
    /// goes before it.
    fn is_due(&self, waiting: &Waiting) -> bool {
        waiting.turn == Turn::LongStep && self.timers_gone > waiting.timers_gone_before
    }

    /// Whether `ticket` may go, with `timers` past their turn (closing the gate or holding it):
    /// a long step once no timer is and either only long steps asked before it or a timer went
    /// since it asked; a timer once no timer is, no long step runs or is due, and no timer asked
    /// before it.
    fn may_go(&self, ticket: u64, timers: u32) -> bool {
        let Some(asking) = self.waiting.iter().find(|w| w.ticket == ticket) else {
            return true;
        };
        let mut before = self.waiting.iter().take_while(|w| w.ticket != ticket);
        match asking.turn {
            Turn::LongStep => {
                timers == 0 && (self.is_due(asking) || before.all(|w| w.turn == Turn::LongStep))
            }
            Turn::Timer => {
                timers == 0
                    && self.long_steps == 0
                    && !self.waiting.iter().any(|w| self.is_due(w))
                    && before.all(|w| w.turn == Turn::LongStep)
            }
        }
    }

    fn leave(&mut self, ticket: u64, turn: Turn) {
        self.waiting.retain(|w| w.ticket != ticket);
        if turn == Turn::Timer {
            self.timers_gone += 1;
        }
    }
}

/// The longest time one evaluation's untimed steps held the device so far, which says whether
/// its next step is a long one ([`LONG_STEP`]). Shared with the passes, which add to it when
/// given back.
#[derive(Clone, Default)]
pub(crate) struct StepHistory(Arc<AtomicU64>);

impl StepHistory {
    fn is_long(&self) -> bool {
        Duration::from_nanos(self.0.load(Ordering::Relaxed)) >= LONG_STEP
    }

    fn held(&self, held: Duration) {
        let nanos = u64::try_from(held.as_nanos()).unwrap_or(u64::MAX);
        self.0.fetch_max(nanos, Ordering::Relaxed);
    }
}

/// How the gate was used: what the run's wall time gave to timing, its queue, and the untimed
/// steps a timer waits for.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct GateUse {
    /// Exclusive windows (one per timed candidate, or per evaluation alone).
    pub windows: u32,
    /// Time inside them.
    pub held: Duration,
    /// Time evaluations waited for them, summed over the waiting evaluations.
    pub waited: Duration,
    /// Wall time during which an exclusive pass was held or asked for: no new untimed step could
    /// start on the device then.
    pub closed: Duration,
    /// Untimed steps (shared passes), the time they held their pass, the longest of them (what a
    /// timer may have to wait for), and the time they waited for it.
    pub steps: u32,
    pub step_held: Duration,
    pub longest_step: Duration,
    pub step_waited: Duration,
}

impl GateUse {
    /// Adds another device's use.
    pub(crate) fn add(&mut self, other: &GateUse) {
        self.windows += other.windows;
        self.held += other.held;
        self.waited += other.waited;
        self.closed += other.closed;
        self.steps += other.steps;
        self.step_held += other.step_held;
        self.longest_step = self.longest_step.max(other.longest_step);
        self.step_waited += other.step_waited;
    }

    /// Sets the gate's fields of a run's timeline (in seconds).
    pub(crate) fn write_to(&self, timeline: &mut RunTimeline) {
        timeline.exclusive_windows = self.windows;
        timeline.exclusive_s = self.held.as_secs_f64();
        timeline.exclusive_wait_s = self.waited.as_secs_f64();
        timeline.gate_closed_s = self.closed.as_secs_f64();
        timeline.untimed_steps = self.steps;
        timeline.untimed_step_s = self.step_held.as_secs_f64();
        timeline.untimed_wait_s = self.step_waited.as_secs_f64();
        timeline.longest_untimed_step_s = self.longest_step.as_secs_f64();
    }
}

impl DeviceGate {
    /// A gate that also holds `lock` for every pass.
    pub(crate) fn across_processes(lock: DeviceLock) -> Self {
        DeviceGate {
            across_processes: Some(lock),
            ..DeviceGate::default()
        }
    }

    pub(crate) fn usage(&self) -> GateUse {
        self.lock_record().used
    }

    fn lock_record(&self) -> MutexGuard<'_, Record> {
        self.record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits for the turn of a `turn` asked now; returns the record, the turn taken, and how
    /// long it waited for others' turns.
    fn take_turn(&self, turn: Turn) -> (MutexGuard<'_, Record>, Duration) {
        let mut r = self.lock_record();
        let timers = r.wanted;
        let ticket = r.turns.ask(turn, timers);
        let mut waited = Duration::ZERO;
        while !r.turns.may_go(ticket, r.wanted) {
            let asleep = Instant::now();
            r = self
                .turn
                .wait(r)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            waited += asleep.elapsed();
        }
        r.turns.leave(ticket, turn);
        // Those behind may go now too (long steps behind a long step).
        self.turn.notify_all();
        (r, waited)
    }

    fn shared(&self, history: Option<&StepHistory>) -> SharedPass<'_> {
        let asked = Instant::now();
        let long = history.is_some_and(StepHistory::is_long);
        if long {
            self.take_turn(Turn::LongStep).0.turns.long_steps += 1;
        }
        let guard = self
            .lock
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let file = self.across_processes.as_ref().and_then(DeviceLock::shared);
        let since = Instant::now();
        self.lock_record().used.step_waited += since - asked;
        SharedPass {
            gate: self,
            since,
            long,
            history: history.cloned(),
            _guard: guard,
            _file: file,
        }
    }

    fn exclusive(&self) -> Exclusive<'_> {
        let asked = Instant::now();
        {
            // The gate closes to new steps once the timer's turn came, not while the long steps
            // before it end.
            let (mut r, turn_waited) = self.take_turn(Turn::Timer);
            r.wanted += 1;
            r.closed_since.get_or_insert(asked + turn_waited);
        }
        let guard = self
            .lock
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let file = self
            .across_processes
            .as_ref()
            .and_then(DeviceLock::exclusive);
        let since = Instant::now();
        self.lock_record().used.waited += since - asked;
        Exclusive {
            gate: self,
            since,
            _guard: guard,
            _file: file,
        }
    }
}

/// The device alone; its use is recorded when given back.
pub(crate) struct Exclusive<'a> {
    gate: &'a DeviceGate,
    since: Instant,
    _guard: RwLockWriteGuard<'a, ()>,
    _file: Option<File>,
}

impl Drop for Exclusive<'_> {
    fn drop(&mut self) {
        let now = Instant::now();
        let mut r = self.gate.lock_record();
        r.used.windows += 1;
        r.used.held += now - self.since;
        r.wanted -= 1;
        self.gate.turn.notify_all();
        if r.wanted == 0 {
            if let Some(since) = r.closed_since.take() {
                r.used.closed += now - since;
            }
        }
    }
}

/// A pass for one untimed step; its use is recorded when given back.
pub(crate) struct SharedPass<'a> {
    gate: &'a DeviceGate,
    since: Instant,
    /// Taken in its turn (a long step's).
    long: bool,
    history: Option<StepHistory>,
    _guard: RwLockReadGuard<'a, ()>,
    _file: Option<File>,
}

impl Drop for SharedPass<'_> {
    fn drop(&mut self) {
        let held = self.since.elapsed();
        if let Some(history) = &self.history {
            history.held(held);
        }
        let mut r = self.gate.lock_record();
        let u = &mut r.used;
        u.steps += 1;
        u.step_held += held;
        u.longest_step = u.longest_step.max(held);
        if self.long {
            r.turns.long_steps -= 1;
            self.gate.turn.notify_all();
        }
    }
}

/// How one evaluation reaches its device.
pub(crate) enum Access<'a> {
    /// Beside other evaluations: a shared pass per untimed step, the exclusive one to time.
    Shared(&'a DeviceGate),
    /// The device to itself for the whole evaluation (a retry after running out of device
    /// memory beside others); the exclusive pass is held here.
    Alone(#[expect(dead_code, reason = "held, never read")] Exclusive<'a>),
}

impl<'a> Access<'a> {
    pub(crate) fn new(gate: &'a DeviceGate, alone: bool) -> Self {
        if alone {
            Access::Alone(gate.exclusive())
        } else {
            Access::Shared(gate)
        }
    }

    /// A pass for one untimed step (None: the whole evaluation is already alone).
    pub(crate) fn untimed(&self) -> Option<SharedPass<'a>> {
        match self {
            Access::Shared(gate) => Some(gate.shared(None)),
            Access::Alone(_) => None,
        }
    }

    /// A pass for one untimed step of the evaluation of `history`, a long step's turn taken
    /// where its earlier steps held the device long (None: the evaluation is already alone).
    pub(crate) fn untimed_step(&self, history: &StepHistory) -> Option<SharedPass<'a>> {
        match self {
            Access::Shared(gate) => Some(gate.shared(Some(history))),
            Access::Alone(_) => None,
        }
    }

    /// The device alone, for timing.
    pub(crate) fn timed(&self) -> Option<Exclusive<'a>> {
        match self {
            Access::Shared(gate) => Some(gate.exclusive()),
            Access::Alone(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// While one evaluation times, no other holds any pass; untimed steps overlap; an evaluation
    /// alone keeps everyone else out.
    #[test]
    fn timing_excludes_everything_else() {
        let gate = Arc::new(DeviceGate::default());
        let inside = Arc::new(AtomicUsize::new(0));
        let overlapped = Arc::new(AtomicUsize::new(0));
        let violations = Arc::new(AtomicUsize::new(0));
        let enter = |inside: &AtomicUsize, seen: &AtomicUsize| {
            if inside.fetch_add(1, Ordering::SeqCst) > 0 {
                seen.fetch_add(1, Ordering::SeqCst);
            }
        };
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let (gate, inside) = (gate.clone(), inside.clone());
                let (overlapped, violations) = (overlapped.clone(), violations.clone());
                std::thread::spawn(move || {
                    for _ in 0..5 {
                        let access = Access::new(&gate, t == 3);
                        let step = access.untimed();
                        let alone = step.is_none();
                        enter(&inside, if alone { &violations } else { &overlapped });
                        std::thread::sleep(Duration::from_millis(5));
                        inside.fetch_sub(1, Ordering::SeqCst);
                        drop(step);
                        let timed = access.timed();
                        enter(&inside, &violations);
                        std::thread::sleep(Duration::from_millis(2));
                        inside.fetch_sub(1, Ordering::SeqCst);
                        drop(timed);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(violations.load(Ordering::SeqCst), 0);
        assert!(
            overlapped.load(Ordering::SeqCst) > 0,
            "untimed steps never overlapped"
        );
    }

    /// A timer asking while a long step runs leaves the gate open to short steps until that step
    /// ends; a long step asking after the timer comes after its window; short steps make no
    /// evaluation's steps long.
    #[test]
    fn long_steps_and_timers_take_turns() {
        let gate = Arc::new(DeviceGate::default());
        let slow = StepHistory::default();
        slow.held(LONG_STEP);
        let quick = StepHistory::default();
        quick.held(LONG_STEP / 2);
        assert!(slow.is_long() && !quick.is_long());
        let access = Access::new(&gate, false);
        let long_step = access.untimed_step(&slow).unwrap();
        // 1 inside the timer's window, 2 once it is about to end.
        let window = Arc::new(AtomicUsize::new(0));
        let timer = {
            let (gate, window) = (gate.clone(), window.clone());
            std::thread::spawn(move || {
                let access = Access::new(&gate, false);
                let alone = access.timed();
                window.store(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(30));
                window.store(2, Ordering::SeqCst);
                drop(alone);
            })
        };
        wait_until_queued(&gate, Turn::Timer);
        let short = access.untimed_step(&quick);
        assert_eq!(window.load(Ordering::SeqCst), 0, "timed beside a long step");
        drop(short);
        let second = {
            let (gate, window, slow) = (gate.clone(), window.clone(), slow.clone());
            std::thread::spawn(move || {
                let access = Access::new(&gate, false);
                let _step = access.untimed_step(&slow);
                window.load(Ordering::SeqCst)
            })
        };
        wait_until_queued(&gate, Turn::LongStep);
        assert!(
            !second.is_finished(),
            "a long step went before the timer that asked first"
        );
        drop(long_step);
        timer.join().unwrap();
        assert_eq!(second.join().unwrap(), 2);
        assert_eq!(gate.lock_record().turns.long_steps, 0);
    }

    /// A long step asking while a timer holds the device goes when that timer ends, before the
    /// timers queued behind it; a long step asking while it runs goes after the next timer.
    #[test]
    fn long_steps_wait_for_one_timer_not_the_whole_queue() {
        let gate = Arc::new(DeviceGate::default());
        let slow = StepHistory::default();
        slow.held(LONG_STEP);
        let order = Arc::new(Mutex::new(Vec::new()));
        let record = |order: &Mutex<Vec<&'static str>>, what| order.lock().unwrap().push(what);
        let first_timer = Access::new(&gate, false).timed();
        let spawn = |what: &'static str, long: bool| {
            let (gate, order, slow) = (gate.clone(), order.clone(), slow.clone());
            std::thread::spawn(move || {
                let access = Access::new(&gate, false);
                if long {
                    let _step = access.untimed_step(&slow);
                    record(&order, what);
                    std::thread::sleep(Duration::from_millis(30));
                } else {
                    let _alone = access.timed();
                    record(&order, what);
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        };
        let queued_timer = spawn("queued timer", false);
        wait_until_queued(&gate, Turn::Timer);
        let long_step = spawn("long step", true);
        wait_until_queued(&gate, Turn::LongStep);
        drop(first_timer);
        // The long step runs before the queued timer; a long step asking now waits for it.
        while order.lock().unwrap().is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
        let later_long_step = spawn("later long step", true);
        for t in [queued_timer, long_step, later_long_step] {
            t.join().unwrap();
        }
        assert_eq!(
            *order.lock().unwrap(),
            ["long step", "queued timer", "later long step"]
        );
        let r = gate.lock_record();
        assert_eq!((r.turns.long_steps, r.turns.timers_gone), (0, 2));
        assert!(r.turns.waiting.is_empty());
    }

    /// Returns once a `turn` waits at `gate`.
    fn wait_until_queued(gate: &DeviceGate, turn: Turn) {
        while !gate
            .lock_record()
            .turns
            .waiting
            .iter()
            .any(|w| w.turn == turn)
        {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A timer waits for the untimed step in flight; the gate is closed from its asking to its
    /// giving back, and the window is what it held.
    #[test]
    fn exclusive_windows_and_their_queue_are_recorded() {
        let gate = Arc::new(DeviceGate::default());
        let access = Access::new(&gate, false);
        let step = access.untimed();
        let timer = {
            let gate = gate.clone();
            std::thread::spawn(move || {
                let access = Access::new(&gate, false);
                let alone = access.timed();
                std::thread::sleep(Duration::from_millis(30));
                drop(alone);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        drop(step);
        timer.join().unwrap();
        let used = gate.usage();
        assert_eq!(used.windows, 1);
        assert!(used.held >= Duration::from_millis(30), "{used:?}");
        assert!(used.waited >= Duration::from_millis(20), "{used:?}");
        assert!(used.closed >= used.held + used.waited, "{used:?}");
        assert!(used.closed < Duration::from_secs(5), "{used:?}");
        assert_eq!(used.steps, 1);
        assert!(used.longest_step >= Duration::from_millis(50), "{used:?}");
        assert_eq!(used.step_held, used.longest_step);

        let mut total = GateUse::default();
        total.add(&used);
        total.add(&used);
        assert_eq!(total.windows, 2);
        assert_eq!(total.closed, used.closed * 2);
        assert_eq!(total.longest_step, used.longest_step);
    }
}
