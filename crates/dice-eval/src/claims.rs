//! This batch's claims on its samples, so that several evaluating processes (on one host or
//! many) share one run: each sample is claimed before it is built or run, its result is stored
//! only by its claim's holder, a heartbeat renews the claims while the batch works, and what is
//! left is released when it ends. A sample another worker holds is passed over and asked for
//! again later: it is judged there, or taken over here once its worker stopped renewing (killed:
//! at once when it ran on this host), so every process ends when the batch's samples are all
//! judged. Samples are added as batches are submitted; the intake ends once it is closed and
//! every sample was taken. A worker holds only
//! as many samples as it can work on (builds and run slots, with one taken ahead each), so that
//! a worker joining later gets its share.
//!
//! Samples that build and samples that go straight to a run slot are claimed apart ([`Class`]),
//! by the builders and by a claimer of their own, within the worker's one limit: claimed from one
//! queue by the builders, the run-only samples (identity candidates, programs without an
//! extension) waited for a free builder, so while every builder compiled, the run slots ran
//! nothing (the first minute of a cold batch of the 99 pairs with their identities:
//! bench/notes/eval-h200.md, session 37). Run-only samples take at most two a run slot, and only
//! room no builder is waiting for: builds are a cold batch's long pole.

use anyhow::Result;
use dice_store::{SampleExtras, SampleKey, SampleRecord, Store, WorkerId};
use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// How long a claim lasts without renewal: a killed worker's samples wait this long.
const LEASE: Duration = Duration::from_secs(60);
/// How often claims are renewed: several renewals fit in a lease, so a busy store or a loaded
/// host does not lose them.
const HEARTBEAT: Duration = Duration::from_secs(10);
/// How often samples other workers hold are asked for again.
const POLL: Duration = Duration::from_secs(1);

/// What a sample needs before it runs, which says who claims it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    /// An extension built by the compile stage.
    Build,
    /// Nothing: it goes to a run slot (or straight to the store) as claimed.
    RunOnly,
}

pub(crate) struct Claims<'s> {
    store: Mutex<&'s mut Store>,
    worker: WorkerId,
    /// Claimed samples without an outcome yet, at most, and of them run-only ones.
    in_flight: usize,
    run_only: usize,
    queue: Mutex<Queue>,
    /// Signalled when a claimed sample gets its outcome, or the intake stops.
    room: Condvar,
}

struct Queue {
    /// Samples not claimed yet, by index (`BatchContext::sample`), in the order they came.
    unclaimed: Vec<(usize, SampleKey, Class)>,
    /// Claimed samples without an outcome yet, and how many of them are run-only.
    in_hand: HashMap<SampleKey, Class>,
    run_only_in_hand: usize,
    /// Builders waiting for room while samples to build are left: room that comes free is
    /// theirs before the run-only claimer's.
    builders_waiting: usize,
    /// Samples another worker judged during the batch.
    judged_elsewhere: usize,
    /// Those of them not yet handed to [`Claims::take_judged_elsewhere`].
    judged_elsewhere_new: Vec<usize>,
    /// No samples will be added.
    closed: bool,
    /// No more claims: a stage failed.
    stopped: bool,
}

impl<'s> Claims<'s> {
    /// Claims as `worker`, with at most `in_flight` claimed samples awaiting their outcome, of
    /// them at most `run_only` of [`Class::RunOnly`]; for samples [`Claims::add`]ed until
    /// [`Claims::close`].
    pub(crate) fn new(
        store: &'s mut Store,
        worker: WorkerId,
        in_flight: usize,
        run_only: usize,
    ) -> Self {
        let queue = Queue {
            unclaimed: Vec::new(),
            in_hand: HashMap::new(),
            run_only_in_hand: 0,
            builders_waiting: 0,
            judged_elsewhere: 0,
            judged_elsewhere_new: Vec::new(),
            closed: false,
            stopped: false,
        };
        Claims {
            store: Mutex::new(store),
            worker,
            in_flight: in_flight.max(1),
            run_only: run_only.clamp(1, in_flight.max(1)),
            queue: Mutex::new(queue),
            room: Condvar::new(),
        }
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The store, for writes that need no claim (problems, reference errors).
    pub(crate) fn store(&self) -> MutexGuard<'_, &'s mut Store> {
        self.store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Samples to claim, by index, after those added before.
    pub(crate) fn add(&self, samples: impl IntoIterator<Item = (usize, SampleKey, Class)>) {
        self.queue().unclaimed.extend(samples);
        self.room.notify_all();
    }

    /// No more samples will be added: [`Claims::next`] ends once those added are taken.
    pub(crate) fn close(&self) {
        self.queue().closed = true;
        self.room.notify_all();
    }

    /// The next sample of `class` this worker claimed, by index; None once the intake is closed
    /// and every sample of the class added is claimed here or judged, or the intake stopped.
    /// Waits while this worker has its hands full of the class, while no sample of it is left to
    /// claim, and while all that are left are held by other workers.
    pub(crate) fn next(&self, class: Class) -> Result<Option<usize>> {
        let left = |queue: &Queue| queue.unclaimed.iter().any(|&(_, _, c)| c == class);
        loop {
            {
                let mut queue = self.queue();
                while !queue.stopped
                    && if left(&queue) {
                        !self.has_room(&queue, class)
                    } else {
                        !queue.closed
                    }
                {
                    let for_room = class == Class::Build && left(&queue);
                    queue.builders_waiting += usize::from(for_room);
                    queue = self
                        .room
                        .wait(queue)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    queue.builders_waiting -= usize::from(for_room);
                }
                if queue.stopped || !left(&queue) {
                    return Ok(None);
                }
                let wanted: Vec<SampleKey> = queue
                    .unclaimed
                    .iter()
                    .filter(|&&(_, _, c)| c == class)
                    .map(|&(_, key, _)| key)
                    .collect();
                let claimed = self.store().claim(&self.worker, &wanted, 1, LEASE)?;
                let queue = &mut *queue;
                queue.unclaimed.retain(|&(i, key, _)| {
                    let elsewhere = claimed.finished.contains(&key);
                    if elsewhere {
                        queue.judged_elsewhere += 1;
                        queue.judged_elsewhere_new.push(i);
                    }
                    !elsewhere
                });
                if let Some(&((level, problem_id, sample_id), ref taken_over)) =
                    claimed.samples.first()
                {
                    if let Some(from) = taken_over {
                        tracing::warn!(
                            "level {level} problem {problem_id} sample {sample_id}: taken over \
                             from worker {from}, which ended or stopped renewing its claim"
                        );
                    }
                    let key = (level, problem_id, sample_id);
                    let at = queue
                        .unclaimed
                        .iter()
                        .position(|&(_, k, _)| k == key)
                        .expect("a claimed sample was asked for");
                    queue.in_hand.insert(key, class);
                    queue.run_only_in_hand += usize::from(class == Class::RunOnly);
                    return Ok(Some(queue.unclaimed.remove(at).0));
                }
                if !left(queue) {
                    continue;
                }
            }
            std::thread::sleep(POLL);
        }
    }

    /// Whether this worker may claim one more sample of `class` now.
    fn has_room(&self, queue: &Queue, class: Class) -> bool {
        let in_hand = queue.in_hand.len();
        match class {
            Class::Build => in_hand < self.in_flight,
            Class::RunOnly => {
                queue.run_only_in_hand < self.run_only
                    && in_hand + queue.builders_waiting < self.in_flight
            }
        }
    }

    /// Samples another worker judged, by index, since the last call.
    pub(crate) fn take_judged_elsewhere(&self) -> Vec<usize> {
        std::mem::take(&mut self.queue().judged_elsewhere_new)
    }

    /// Stores a claimed sample's result and ends its claim; false when the claim was lost (this
    /// worker stalled past its lease and another took the sample over): nothing is stored then.
    pub(crate) fn put(&self, record: &SampleRecord, extras: &SampleExtras) -> Result<bool> {
        let stored = self
            .store()
            .put_claimed_sample(&self.worker, record, extras);
        self.outcome_given((record.level, record.problem_id, record.sample_id));
        stored
    }

    /// Gives the claim on sample `key` back without a result (its problem's reference
    /// failed), for a later run or another worker to judge.
    pub(crate) fn release(&self, key: SampleKey) -> Result<()> {
        let released = self.store().release_claims(&self.worker, Some(key));
        self.outcome_given(key);
        released
    }

    fn outcome_given(&self, key: SampleKey) {
        let mut queue = self.queue();
        if queue.in_hand.remove(&key) == Some(Class::RunOnly) {
            queue.run_only_in_hand -= 1;
        }
        // Claimers of both classes wait on `room`.
        self.room.notify_all();
    }

    /// No more claims: a stage failed, so the samples it held may never get their outcome.
    pub(crate) fn stop(&self) {
        self.queue().stopped = true;
        self.room.notify_all();
    }

    pub(crate) fn stopped(&self) -> bool {
        self.queue().stopped
    }

    /// Renews this worker's claims every [`HEARTBEAT`] until `stop` is dropped. A failed
    /// renewal is retried at the next beat: only a lease that runs out loses the claims.
    pub(crate) fn heartbeat(&self, stop: &Receiver<()>) {
        while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(HEARTBEAT) {
            if let Err(e) = self.store().renew_claims(&self.worker, LEASE) {
                tracing::warn!("cannot renew the claims of worker {}: {e:#}", self.worker);
            }
        }
    }

    /// Deletes the results of `samples`, to judge them again.
    pub(crate) fn forget(&self, samples: &[SampleKey]) -> Result<()> {
        self.store().forget_samples(&self.worker, samples)
    }

    /// Gives back every claim still held (samples a failing batch left unjudged).
    pub(crate) fn release_all(&self) -> Result<()> {
        self.store().release_claims(&self.worker, None)
    }

    /// Samples another worker judged while this batch ran.
    pub(crate) fn judged_elsewhere(&self) -> usize {
        self.queue().judged_elsewhere
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store in a folder of its own (kept beside it).
    fn open_store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("dice.db")).unwrap();
        (dir, store)
    }

    fn claims_of(store: &mut Store, in_flight: usize, run_only: usize) -> Claims<'_> {
        let claims = Claims::new(store, WorkerId::new(), in_flight, run_only);
        claims.add([
            (0, key(0), Class::Build),
            (1, key(1), Class::Build),
            (2, key(2), Class::RunOnly),
            (3, key(3), Class::RunOnly),
        ]);
        claims.close();
        claims
    }

    fn key(sample_id: u32) -> SampleKey {
        (1, 1, sample_id)
    }

    /// A run-only sample is claimed past the builds queued before it, within the worker's limit
    /// and its class's, and the intake of one class ends while the other still has samples.
    #[test]
    fn samples_that_build_and_run_only_ones_are_claimed_apart() {
        let (_dir, mut store) = open_store();
        let claims = claims_of(&mut store, 3, 1);
        assert_eq!(claims.next(Class::Build).unwrap(), Some(0));
        assert_eq!(
            claims.next(Class::RunOnly).unwrap(),
            Some(2),
            "behind a build"
        );
        std::thread::scope(|scope| {
            let waiting = scope.spawn(|| claims.next(Class::RunOnly).unwrap());
            std::thread::sleep(Duration::from_millis(50));
            assert!(!waiting.is_finished(), "claimed past its class's limit");
            claims.release(key(2)).unwrap();
            assert_eq!(waiting.join().unwrap(), Some(3));
        });
        assert_eq!(claims.next(Class::RunOnly).unwrap(), None);
        assert_eq!(claims.next(Class::Build).unwrap(), Some(1));
        assert_eq!(claims.queue().in_hand.len(), 3);
    }

    /// Room that comes free goes to a builder waiting for it, not to the run-only claimer.
    #[test]
    fn a_waiting_builder_gets_the_room_before_run_only_samples() {
        let (_dir, mut store) = open_store();
        let claims = claims_of(&mut store, 2, 2);
        assert_eq!(claims.next(Class::Build).unwrap(), Some(0));
        assert_eq!(claims.next(Class::RunOnly).unwrap(), Some(2));
        std::thread::scope(|scope| {
            let builder = scope.spawn(|| claims.next(Class::Build).unwrap());
            while claims.queue().builders_waiting == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            let run_only = scope.spawn(|| claims.next(Class::RunOnly).unwrap());
            claims.release(key(2)).unwrap();
            assert_eq!(builder.join().unwrap(), Some(1));
            std::thread::sleep(Duration::from_millis(50));
            assert!(!run_only.is_finished(), "past the worker's limit");
            claims.release(key(0)).unwrap();
            assert_eq!(run_only.join().unwrap(), Some(3));
        });
    }
}
