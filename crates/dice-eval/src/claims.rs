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

use anyhow::Result;
use dice_store::{SampleExtras, SampleKey, SampleRecord, Store, WorkerId};
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

pub(crate) struct Claims<'s> {
    store: Mutex<&'s mut Store>,
    worker: WorkerId,
    /// Claimed samples without an outcome yet, at most.
    in_flight: usize,
    queue: Mutex<Queue>,
    /// Signalled when a claimed sample gets its outcome, or the intake stops.
    room: Condvar,
}

struct Queue {
    /// Samples not claimed yet, by index (`BatchContext::sample`), in the order they came.
    unclaimed: Vec<(usize, SampleKey)>,
    /// Claimed samples without an outcome yet.
    in_hand: usize,
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
    /// Claims as `worker`, with at most `in_flight` claimed samples awaiting their outcome; for
    /// samples [`Claims::add`]ed until [`Claims::close`].
    pub(crate) fn new(store: &'s mut Store, worker: WorkerId, in_flight: usize) -> Self {
        let queue = Queue {
            unclaimed: Vec::new(),
            in_hand: 0,
            judged_elsewhere: 0,
            judged_elsewhere_new: Vec::new(),
            closed: false,
            stopped: false,
        };
        Claims {
            store: Mutex::new(store),
            worker,
            in_flight: in_flight.max(1),
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
    pub(crate) fn add(&self, samples: impl IntoIterator<Item = (usize, SampleKey)>) {
        self.queue().unclaimed.extend(samples);
        self.room.notify_all();
    }

    /// No more samples will be added: [`Claims::next`] ends once those added are taken.
    pub(crate) fn close(&self) {
        self.queue().closed = true;
        self.room.notify_all();
    }

    /// The next sample this worker claimed, by index; None once the intake is closed and every
    /// sample added is claimed here or judged, or the intake stopped. Waits while this worker
    /// has its hands full, while no sample is left to claim, and while all that are left are
    /// held by other workers.
    pub(crate) fn next(&self) -> Result<Option<usize>> {
        loop {
            {
                let mut queue = self.queue();
                while !queue.stopped
                    && (queue.in_hand >= self.in_flight
                        || (queue.unclaimed.is_empty() && !queue.closed))
                {
                    queue = self
                        .room
                        .wait(queue)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
                if queue.stopped || queue.unclaimed.is_empty() {
                    return Ok(None);
                }
                let wanted: Vec<SampleKey> = queue.unclaimed.iter().map(|&(_, key)| key).collect();
                let claimed = self.store().claim(&self.worker, &wanted, 1, LEASE)?;
                let queue = &mut *queue;
                queue.unclaimed.retain(|&(i, key)| {
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
                        .position(|&(_, k)| k == key)
                        .expect("a claimed sample was asked for");
                    queue.in_hand += 1;
                    return Ok(Some(queue.unclaimed.remove(at).0));
                }
                if queue.unclaimed.is_empty() {
                    continue;
                }
            }
            std::thread::sleep(POLL);
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
        self.outcome_given();
        stored
    }

    /// Gives the claim on sample `key` back without a result (its problem's reference
    /// failed), for a later run or another worker to judge.
    pub(crate) fn release(&self, key: SampleKey) -> Result<()> {
        let released = self.store().release_claims(&self.worker, Some(key));
        self.outcome_given();
        released
    }

    fn outcome_given(&self) {
        self.queue().in_hand -= 1;
        self.room.notify_one();
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
