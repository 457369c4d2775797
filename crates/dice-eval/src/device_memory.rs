//! Device memory promised to the problems in flight on one GPU.
//!
//! A run slot's reference process reports what it holds on the device (and will hold once its
//! expected outputs are computed); the slot then reserves twice that, for the reference and one
//! candidate of the problem, before the candidate touches the device. A problem that does not fit
//! beside the others waits, in the order of asking, with its reference closed; one larger than the
//! device waits until nothing else is reserved. Slots give their reservation back with their
//! reference, and give it back early (at their next sample) while someone waits, so a large
//! problem is never starved by a stream of small ones. What a problem's program needed is
//! remembered: its next reference (another sample's, on any slot) reserves before it touches the
//! device instead of after.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};

/// Share of the device's memory that reservations may take: CUDA contexts, cuBLAS workspaces and
/// allocator slack of every process come on top of what torch reports.
const USABLE_SHARE: f64 = 0.9;

#[derive(Default)]
pub(crate) struct DeviceMemory {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// Usable bytes, known once a process of the device reported the device's size.
    capacity: Option<u64>,
    reserved: u64,
    next_ticket: u64,
    waiting: VecDeque<u64>,
    /// The reservation a reference of each program (by its source's hash) needed.
    needs: HashMap<String, u64>,
}

impl State {
    fn fits(&self, bytes: u64) -> bool {
        self.reserved == 0
            || self
                .capacity
                .is_some_and(|c| self.reserved.saturating_add(bytes) <= c)
    }
}

/// Bytes held for one problem in flight; given back when dropped.
pub(crate) struct Reservation<'a> {
    memory: &'a DeviceMemory,
    bytes: u64,
}

impl Reservation<'_> {
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut state = self.memory.lock();
        state.reserved -= self.bytes;
        self.memory.changed.notify_all();
    }
}

impl DeviceMemory {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records the device's size (every process of a device reports the same).
    pub(crate) fn set_device_total(&self, total: u64) {
        let mut state = self.lock();
        if state.capacity.is_none() {
            state.capacity = Some((total as f64 * USABLE_SHARE) as u64);
            self.changed.notify_all();
        }
    }

    /// `bytes` now, if nobody waits before us and they fit.
    pub(crate) fn try_reserve(&self, bytes: u64) -> Option<Reservation<'_>> {
        let mut state = self.lock();
        if !state.waiting.is_empty() || !state.fits(bytes) {
            return None;
        }
        state.reserved += bytes;
        Some(Reservation {
            memory: self,
            bytes,
        })
    }

    /// `bytes` once every earlier asker was served and they fit (`u64::MAX`: the device alone).
    pub(crate) fn reserve(&self, bytes: u64) -> Reservation<'_> {
        let mut state = self.lock();
        let ticket = state.next_ticket;
        state.next_ticket += 1;
        state.waiting.push_back(ticket);
        while state.waiting.front() != Some(&ticket) || !state.fits(bytes) {
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        state.waiting.pop_front();
        state.reserved += bytes;
        self.changed.notify_all();
        Reservation {
            memory: self,
            bytes,
        }
    }

    /// Records what a reference of `program` (its source's hash) needs.
    pub(crate) fn remember_need(&self, program: &str, bytes: u64) {
        self.lock().needs.insert(program.to_string(), bytes);
    }

    /// What a reference of `program` needed when one last ran on this device.
    pub(crate) fn known_need(&self, program: &str) -> Option<u64> {
        self.lock().needs.get(program).copied()
    }

    /// Whether someone waits for memory: holders give theirs back at their next sample.
    pub(crate) fn has_waiters(&self) -> bool {
        !self.lock().waiting.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    const GB: u64 = 1 << 30;

    #[test]
    fn reservations_beyond_the_device_wait_for_room() {
        let memory = DeviceMemory::default();
        memory.set_device_total(100 * GB);
        let a = memory.try_reserve(50 * GB).expect("fits");
        assert!(memory.try_reserve(50 * GB).is_none(), "90 GB usable");
        let b = memory.try_reserve(30 * GB).expect("fits");
        let granted = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let _big = memory.reserve(60 * GB);
                granted.store(true, Ordering::SeqCst);
            });
            while !memory.has_waiters() {
                std::thread::sleep(Duration::from_millis(5));
            }
            // Someone waits: a small request that would fit must queue behind them.
            assert!(memory.try_reserve(GB).is_none());
            drop(b);
            std::thread::sleep(Duration::from_millis(50));
            assert!(!granted.load(Ordering::SeqCst), "50 + 60 > 90");
            drop(a);
        });
        assert!(granted.load(Ordering::SeqCst));
        assert_eq!(memory.lock().reserved, 0);
    }

    #[test]
    fn the_whole_device_waits_until_nothing_is_reserved() {
        let memory = DeviceMemory::default();
        let small = memory
            .try_reserve(GB)
            .expect("an empty device takes anything");
        let granted = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let _all = memory.reserve(u64::MAX);
                granted.store(true, Ordering::SeqCst);
                assert!(memory.try_reserve(1).is_none());
            });
            std::thread::sleep(Duration::from_millis(50));
            assert!(!granted.load(Ordering::SeqCst));
            drop(small);
        });
        assert!(granted.load(Ordering::SeqCst));
        assert!(memory.try_reserve(GB).is_some());
    }

    /// What a program's reference needed is what its next reference reserves ahead; another
    /// program's is not known, and a later measure replaces an earlier one.
    #[test]
    fn a_programs_need_is_known_to_its_next_reference() {
        let memory = DeviceMemory::default();
        assert_eq!(memory.known_need("a"), None);
        memory.remember_need("a", 35 * GB);
        memory.remember_need("b", 3 * GB);
        assert_eq!(memory.known_need("a"), Some(35 * GB));
        memory.remember_need("a", 36 * GB);
        assert_eq!(memory.known_need("a"), Some(36 * GB));
        assert_eq!(memory.known_need("c"), None);
        let r = memory
            .try_reserve(36 * GB)
            .expect("an empty device takes anything");
        assert_eq!(r.bytes(), 36 * GB);
    }
}
