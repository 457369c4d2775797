//! Candidates ready to run (built, or needing no build), in the order they became ready, with a
//! preference for the problem whose reference process a run slot already has.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};

pub(crate) type ProblemKey = (u32, u32);

pub(crate) struct RunQueue<T> {
    state: Mutex<State<T>>,
    changed: Condvar,
}

struct State<T> {
    items: VecDeque<(ProblemKey, T)>,
    producers: usize,
    /// Takers blocked in [`RunQueue::take`].
    waiting: usize,
}

/// A handle that may add items; the queue ends when every producer is dropped and it is empty.
pub(crate) struct Producer<T> {
    queue: Arc<RunQueue<T>>,
}

impl<T> RunQueue<T> {
    /// A queue with one producer, returned beside it.
    pub(crate) fn new() -> (Arc<RunQueue<T>>, Producer<T>) {
        let queue = Arc::new(RunQueue {
            state: Mutex::new(State {
                items: VecDeque::new(),
                producers: 1,
                waiting: 0,
            }),
            changed: Condvar::new(),
        });
        let producer = Producer {
            queue: queue.clone(),
        };
        (queue, producer)
    }

    /// The oldest item of `prefer`'s problem, else the oldest item; waits while producers remain.
    /// None once the queue is empty and closed.
    pub(crate) fn take(&self, prefer: Option<ProblemKey>) -> Option<T> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            if let Some(item) = state.pop(prefer) {
                return Some(item);
            }
            if state.producers == 0 {
                return None;
            }
            state.waiting += 1;
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            state.waiting -= 1;
        }
    }

    /// What [`RunQueue::take`] would return at once, without waiting for producers.
    pub(crate) fn take_ready(&self, prefer: Option<ProblemKey>) -> Option<T> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop(prefer)
    }

    /// An item for later, taken now (a run slot's look-ahead): like [`RunQueue::take`] without
    /// waiting, and None while another taker waits, since an idle slot should run it first.
    pub(crate) fn try_take(&self, prefer: Option<ProblemKey>) -> Option<T> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if state.waiting > 0 {
            return None;
        }
        state.pop(prefer)
    }
}

impl<T> RunQueue<T> {
    /// Puts a taken item back, behind every item queued now (a sample to retry once the others
    /// have started); its taker takes again, so the queue cannot have ended without it.
    pub(crate) fn requeue(&self, key: ProblemKey, item: T) {
        self.push_back(key, item);
    }

    fn push_back(&self, key: ProblemKey, item: T) {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        state.items.push_back((key, item));
        self.changed.notify_all();
    }
}

impl<T> State<T> {
    fn pop(&mut self, prefer: Option<ProblemKey>) -> Option<T> {
        let at = prefer
            .and_then(|key| self.items.iter().position(|(k, _)| *k == key))
            .or((!self.items.is_empty()).then_some(0))?;
        self.items.remove(at).map(|(_, item)| item)
    }
}

impl<T> Producer<T> {
    pub(crate) fn push(&self, key: ProblemKey, item: T) {
        self.queue.push_back(key, item);
    }
}

impl<T> Clone for Producer<T> {
    fn clone(&self) -> Self {
        let mut state = self
            .queue
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        state.producers += 1;
        Producer {
            queue: self.queue.clone(),
        }
    }
}

impl<T> Drop for Producer<T> {
    fn drop(&mut self) {
        let mut state = self
            .queue
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        state.producers -= 1;
        self.queue.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefers_the_slot_problem_then_takes_the_oldest() {
        let (queue, producer) = RunQueue::new();
        producer.push((1, 1), "a");
        producer.push((1, 2), "b");
        producer.push((1, 1), "c");
        assert_eq!(queue.take(Some((1, 2))), Some("b"));
        assert_eq!(queue.try_take(Some((1, 9))), Some("a"));
        assert_eq!(queue.take(None), Some("c"));
        producer.push((1, 3), "d");
        producer.push((1, 4), "e");
        assert_eq!(queue.take_ready(Some((1, 4))), Some("e"));
        assert_eq!(queue.take_ready(None), Some("d"));
        assert_eq!(queue.take_ready(None), None, "empty, though not closed");
        assert_eq!(queue.try_take(None), None, "empty, though not closed");
        drop(producer);
        assert_eq!(queue.take(None), None);
    }

    /// An item put back comes after the items queued then, and is still taken after the last
    /// producer is gone.
    #[test]
    fn a_requeued_item_comes_after_the_queued_ones_even_once_closed() {
        let (queue, producer) = RunQueue::new();
        producer.push((1, 1), "a");
        producer.push((1, 2), "b");
        let taken = queue.take(None).unwrap();
        queue.requeue((1, 1), taken);
        drop(producer);
        assert_eq!(queue.take(Some((1, 1))), Some("a"), "its problem preferred");
        queue.requeue((1, 1), "a");
        assert_eq!(queue.take(None), Some("b"));
        assert_eq!(queue.take(None), Some("a"));
        assert_eq!(queue.take(None), None);
    }

    #[test]
    fn a_waiting_taker_gets_later_items_before_a_look_ahead_then_the_end() {
        let (queue, producer) = RunQueue::new();
        let second = producer.clone();
        let taker = {
            let queue = queue.clone();
            std::thread::spawn(move || (queue.take(None), queue.take(None), queue.take(None)))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        second.push((0, 8), 8);
        assert_eq!(queue.try_take(None), None, "the waiting taker comes first");
        second.push((0, 7), 7);
        drop(second);
        drop(producer);
        assert_eq!(taker.join().unwrap(), (Some(8), Some(7), None));
    }
}
