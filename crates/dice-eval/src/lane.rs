//! One device during a batch: the fork server its run slots share, the gate that keeps timing
//! exclusive, the memory its problems in flight were promised, and each run slot's next sample
//! taken ahead.

use crate::batch::RunItem;
use crate::candidate::CandidateRun;
use crate::device_memory::DeviceMemory;
use crate::gate::DeviceGate;
use crate::stage_reference::StartedReference;
use crate::zygote::{Zygote, ZygoteSlot};
use std::sync::{Arc, Mutex, MutexGuard};

pub(crate) struct Lane {
    pub zygote: Arc<ZygoteSlot>,
    pub gate: DeviceGate,
    pub memory: DeviceMemory,
    aheads: Vec<Mutex<Option<Ahead>>>,
}

/// A run slot's next sample, taken from the queue while its current one runs (or taken now).
pub(crate) struct Ahead {
    pub item: RunItem,
    /// None when it was taken straight from the queue or they could not be started (they start
    /// in its turn).
    pub started: Option<Started>,
}

/// Processes started ahead for a sample, on the fork server `zygote`: its candidate, and its
/// problem's reference when that differs from the problem the slot was on.
pub(crate) struct Started {
    pub zygote: Arc<Zygote>,
    pub candidate: CandidateRun,
    pub reference: Option<StartedReference>,
}

impl Lane {
    pub(crate) fn new(zygote: Arc<ZygoteSlot>, slots: usize, gate: DeviceGate) -> Self {
        Lane {
            zygote,
            gate,
            memory: DeviceMemory::default(),
            aheads: (0..slots.max(1)).map(|_| Mutex::default()).collect(),
        }
    }

    /// Run slots of the device.
    pub(crate) fn slots(&self) -> usize {
        self.aheads.len()
    }

    /// Run slot `index`'s sample taken ahead.
    pub(crate) fn ahead(&self, index: usize) -> MutexGuard<'_, Option<Ahead>> {
        self.aheads[index]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A sample another slot took ahead and has not begun.
    pub(crate) fn steal(&self) -> Option<Ahead> {
        (0..self.aheads.len()).find_map(|i| self.ahead(i).take())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::Compiled;

    /// A slot out of work takes the samples other slots took ahead and have not begun, each once.
    #[test]
    fn an_idle_slot_takes_what_others_took_ahead() {
        let zygote = Arc::new(ZygoteSlot::for_device(&[], None));
        let lane = Lane::new(zygote, 3, DeviceGate::default());
        let ahead = |sample| Ahead {
            item: RunItem::new(sample, Compiled::default()),
            started: None,
        };
        *lane.ahead(2) = Some(ahead(7));
        *lane.ahead(1) = Some(ahead(9));
        let stolen: Vec<usize> = std::iter::from_fn(|| lane.steal())
            .map(|a| a.item.sample)
            .collect();
        assert_eq!(stolen, [9, 7]);
        assert!((0..3).all(|i| lane.ahead(i).is_none()));
    }
}
