//! Timing exclusivity on one device while several candidates are in flight on it.
//!
//! Each untimed step that touches the device (constructing a candidate's or a reference's model,
//! one correctness trial and its judgement, the profiled rerun) holds a shared pass; timing holds the exclusive one, so no
//! other process of the evaluation works on the device while a candidate or its baseline is
//! timed. Steps are short, so timing waits at most for the steps already running; std's RwLock on
//! Linux blocks new readers while a writer waits, so timing never starves. Process start-up,
//! imports and extension loads run outside any pass.

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

#[derive(Default)]
pub struct DeviceGate(RwLock<()>);

/// How one evaluation reaches its device.
pub enum Access<'a> {
    /// Beside other evaluations: a shared pass per untimed step, the exclusive one to time.
    Shared(&'a DeviceGate),
    /// The device to itself for the whole evaluation (a retry after running out of device
    /// memory beside others); the exclusive pass is held here.
    Alone(#[expect(dead_code, reason = "held, never read")] RwLockWriteGuard<'a, ()>),
}

impl<'a> Access<'a> {
    pub fn new(gate: &'a DeviceGate, alone: bool) -> Self {
        if alone {
            Access::Alone(gate.0.write().unwrap_or_else(|p| p.into_inner()))
        } else {
            Access::Shared(gate)
        }
    }

    /// A pass for one untimed step (None: the whole evaluation is already alone).
    pub fn untimed(&self) -> Option<RwLockReadGuard<'a, ()>> {
        match self {
            Access::Shared(gate) => Some(gate.0.read().unwrap_or_else(|p| p.into_inner())),
            Access::Alone(_) => None,
        }
    }

    /// The device alone, for timing.
    pub fn timed(&self) -> Option<RwLockWriteGuard<'a, ()>> {
        match self {
            Access::Shared(gate) => Some(gate.0.write().unwrap_or_else(|p| p.into_inner())),
            Access::Alone(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
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
}
