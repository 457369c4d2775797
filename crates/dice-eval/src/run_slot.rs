//! A run slot: one candidate in flight on a device at a time, with the reference process of its
//! problem kept for the problem's next candidate; outcomes go to the store writer as their
//! processes exit. A slot takes samples until the run queue ends, and (with `look_ahead`) starts
//! its next sample's processes while the current one runs.

use crate::batch::{BatchContext, Report, RunItem};
use crate::candidate::spawn_candidate;
use crate::config::{EvalProblem, EvalSample};
use crate::device_memory::Reservation;
use crate::gate::Access;
use crate::job::Compiled;
use crate::lane::{Ahead, Lane, Started};
use crate::outcome::sha256_hex;
use crate::run_queue::{ProblemKey, RunQueue};
use crate::stage_reference::{Reference, ReferenceFailed, RunError, StartedReference};
use crate::stage_run::{self, Unsettled};
use crate::zygote::Zygote;
use anyhow::Result;
use dice_store::Verdict;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::thread::Scope;
use std::time::Instant;

pub(crate) fn run_slot(
    shared: &BatchContext<'_>,
    lane: &Lane,
    index: usize,
    queue: &RunQueue<RunItem>,
    reports: &Sender<Report>,
) -> Result<()> {
    // Processes end in the background, beside the slot's next sample.
    std::thread::scope(|background| {
        let mut slot = RunSlot {
            shared,
            lane,
            queue,
            reports,
            background,
            zygote: None,
            reference: None,
            reservation: None,
            index,
        };
        let result = slot.run_all();
        slot.close_reference();
        result
    })
}

/// How a sample's process ran out of device memory.
#[derive(Debug, PartialEq)]
enum MemoryShortage {
    /// It could not make its CUDA context (python/roles.py device_setup): nothing of the
    /// program had run; another process filled the device meanwhile (typically a reference
    /// building large outputs before its footprint was known and reserved).
    AtSetup,
    /// Its own allocations failed.
    InItsWork,
}

fn out_of_device_memory(result: &Result<Unsettled, RunError>) -> Option<MemoryShortage> {
    let message = match result {
        Ok(u) if matches!(u.outcome.verdict, Verdict::RuntimeError | Verdict::Crashed) => {
            u.outcome.message.as_deref().unwrap_or_default()
        }
        Err(RunError::Reference(failed)) => &failed.0,
        _ => return None,
    };
    let out_of_memory = [
        // torch's caching allocator (torch.OutOfMemoryError)
        "CUDA out of memory",
        // the CUDA runtime's cudaErrorMemoryAllocation as torch words it (a context made on a
        // full device: python/roles.py device_setup)
        "CUDA error: out of memory",
        "CUBLAS_STATUS_ALLOC_FAILED",
        "cudaErrorMemoryAllocation",
    ]
    .iter()
    .any(|m| message.contains(m));
    out_of_memory.then(|| {
        if message.contains("setting up the device: ") {
            MemoryShortage::AtSetup
        } else {
            MemoryShortage::InItsWork
        }
    })
}

/// Times a sample crowded out at its device setup goes back to the queue like any other before
/// it runs alone.
const CROWDED_OUT_RETRIES: u32 = 2;

/// One candidate in flight on a device, the reference process of the problem it is on, and the
/// device memory promised to both; (with `look_ahead`) the slot's next sample, its processes
/// already starting, waits in its lane.
struct RunSlot<'a, 'e> {
    shared: &'a BatchContext<'a>,
    lane: &'a Lane,
    queue: &'a RunQueue<RunItem>,
    reports: &'a Sender<Report>,
    /// Where processes that are done with end (killing one with a CUDA context takes about
    /// half a second) and where outcomes wait for their process's output.
    background: &'a Scope<'a, 'e>,
    zygote: Option<Arc<Zygote>>,
    reference: Option<(ProblemKey, Result<Reference, ReferenceFailed>)>,
    reservation: Option<Reservation<'a>>,
    /// The slot's place in its lane (where its sample taken ahead waits).
    index: usize,
}

/// Device memory of one process beyond what torch's allocator reports: CUDA context, cuBLAS
/// workspaces.
const PROCESS_OVERHEAD_BYTES: u64 = 1 << 30;

impl<'a, 'e> RunSlot<'a, 'e> {
    /// Takes samples until the queue ends.
    fn run_all(&mut self) -> Result<()> {
        let shared = self.shared;
        loop {
            if self.reservation.is_some() && self.lane.memory.has_waiters() {
                self.close_reference();
            }
            let Some(Ahead { item, started }) = self.next() else {
                return Ok(());
            };
            shared
                .first_sample
                .get_or_init(|| shared.started.elapsed().as_secs_f64());
            let sample = shared.sample(item.sample);
            let sample = &*sample;
            // One retry with a fresh fork server when the evaluator itself failed.
            let mut result = self.run(sample, item.compiled.clone(), item.alone, started);
            if let Err(RunError::Evaluator(e)) = &result {
                tracing::warn!("{}: restarting the worker after: {e:#}", sample.origin);
                self.reset();
                result = self.run(sample, item.compiled.clone(), item.alone, None);
            }
            // Device memory may have run out because of the others in flight: not the
            // candidate's fault (nor the reference's) until it happens with the device to itself.
            let shortage = if !item.alone && shared.ctx.cfg.runs_per_device > 1 {
                out_of_device_memory(&result)
            } else {
                None
            };
            if let Some(shortage) = shortage {
                // Crowded out before anything of it ran, it goes back to the queue as it was: the
                // memory that crowded it out is usually given back long before its turn comes
                // again. Out of memory in its own work, it runs again alone behind the samples
                // queued now: holding the device for its whole evaluation, it would hold all of
                // theirs too (a program of 8 GB outputs held every other sample of a batch for
                // its last 90 s: bench/notes/eval-h200.md, session 27). Alone, it also stops every
                // sample asking for memory after it until the device is empty, so a sample that
                // was only crowded out does not go alone until it was crowded out again and
                // again (eight of them held a batch's end for two minutes: session 35).
                let again = if shortage == MemoryShortage::AtSetup
                    && item.crowded_out < CROWDED_OUT_RETRIES
                {
                    tracing::info!(
                        "{}: crowded out of device memory at its setup; again after the samples \
                         queued now",
                        sample.origin
                    );
                    RunItem {
                        crowded_out: item.crowded_out + 1,
                        ..item
                    }
                } else {
                    tracing::info!(
                        "{}: out of device memory beside others; again alone, after the samples \
                         queued now",
                        sample.origin
                    );
                    RunItem {
                        alone: true,
                        ..item
                    }
                };
                if let Ok(failed) = result {
                    failed.settle();
                }
                self.forget_failed_reference();
                let (key, _, _) = shared.problem_and_code(sample);
                self.queue.requeue(key, again);
                continue;
            }
            match result {
                Ok(unsettled) => {
                    let reports = self.reports.clone();
                    let report = move || {
                        let outcome = unsettled.settle();
                        let _ = reports.send(Report::Sample(item.sample, Box::new(outcome)));
                    };
                    // With device memory short, the candidate's is given back before the slot
                    // goes on.
                    if self.lane.memory.has_waiters() {
                        report();
                    } else {
                        self.background.spawn(report);
                    }
                }
                Err(RunError::Reference(failed)) => {
                    let _ = self
                        .reports
                        .send(Report::ReferenceFailed(item.sample, failed.0));
                }
                Err(RunError::Evaluator(e)) => {
                    return Err(e.context(format!("evaluating {}", sample.origin)))
                }
            }
        }
    }

    /// The slot's next sample: the one it took ahead, else the queue's, else one that another
    /// slot of the device took ahead and has not begun (so that no slot idles at the end of a
    /// run while another still has two samples to go); waits for the queue while none is ready.
    fn next(&mut self) -> Option<Ahead> {
        let prefer = self.reference.as_ref().map(|(key, _)| *key);
        let from_queue = |item| Ahead {
            item,
            started: None,
        };
        // Its own lock is released before `steal` takes each slot's in turn.
        let own = self.lane.ahead(self.index).take();
        own.or_else(|| self.queue.take_ready(prefer).map(from_queue))
            .or_else(|| self.lane.steal())
            .or_else(|| self.queue.take(prefer).map(from_queue))
    }

    /// Closes the reference in the background; the device memory promised to its problem is
    /// given back once its process has exited.
    fn close_reference(&mut self) {
        let reference = self.reference.take();
        let reservation = self.reservation.take();
        if reference.is_none() && reservation.is_none() {
            return;
        }
        self.background.spawn(move || {
            if let Some((_, Ok(r))) = reference {
                r.close();
            }
            drop(reservation);
        });
    }

    /// A reference that failed is started again by the next run of its problem.
    fn forget_failed_reference(&mut self) {
        if matches!(self.reference, Some((_, Err(_)))) {
            self.reference = None;
        }
    }

    /// Gives up the reference, the processes started ahead and the fork server (for every slot
    /// of the device).
    fn reset(&mut self) {
        self.close_reference();
        if let Some(ahead) = self.lane.ahead(self.index).as_mut() {
            ahead.started = None;
        }
        if let Some(z) = self.zygote.take() {
            self.lane.zygote.discard(&z);
        }
    }

    /// Evaluates `sample`, with the processes `early` started ahead for it if any; with
    /// `exclusive`, nothing else runs on the device meanwhile.
    fn run(
        &mut self,
        sample: &EvalSample,
        compiled: Compiled,
        exclusive: bool,
        early: Option<Started>,
    ) -> Result<Unsettled, RunError> {
        let ctx = self.shared.ctx;
        let zygote = self
            .lane
            .zygote
            .get(self.shared.rt)
            .map_err(RunError::Evaluator)?;
        if !self
            .zygote
            .as_ref()
            .is_some_and(|z| Arc::ptr_eq(z, &zygote))
        {
            // The reference was forked by a fork server that is gone.
            self.close_reference();
            self.zygote = Some(zygote.clone());
        }
        // Processes of a fork server that is gone are dropped (killed) and started again.
        let early = early.filter(|e| Arc::ptr_eq(&e.zygote, &zygote));
        let (key, problem, code) = self.shared.problem_and_code(sample);
        if exclusive {
            // Alone in memory too: every other slot of the device gives its problem's back first.
            self.close_reference();
            self.reservation = Some(self.lane.memory.reserve(u64::MAX));
        }
        let access = Access::new(&self.lane.gate, exclusive);
        // The candidate starts (fork, CUDA, import, extension load) while the reference does.
        let (candidate, started_reference) = match early {
            Some(Started {
                mut candidate,
                reference,
                ..
            }) => {
                candidate.restart_clock();
                (candidate, reference)
            }
            None => (spawn_candidate(ctx, &zygote, &problem, code)?, None),
        };
        let job = candidate.child.dir().display();
        tracing::info!(target: "dice_eval::stages", "{job}: {}", sample.origin);
        let mut reference_s = None;
        if self.reference.as_ref().is_none_or(|(k, _)| *k != key) {
            if !exclusive {
                self.close_reference();
            }
            let started = Instant::now();
            let result = self.start_reference(&zygote, &problem, &access, started_reference)?;
            reference_s = Some(started.elapsed().as_secs_f64());
            if result.is_ok() {
                let _ = self.reports.send(Report::ReferenceOk(key));
            }
            self.reference = Some((key, result));
        }
        if let Some((_, Err(failed))) = &self.reference {
            return Err(RunError::Reference(failed.clone()));
        }
        self.look_ahead(&zygote, key);
        let Some((_, Ok(reference))) = &mut self.reference else {
            unreachable!("set above, and not a failure")
        };
        let result = stage_run::run_candidate(ctx, &access, reference, candidate, compiled);
        if let Err(RunError::Reference(failed)) = &result {
            self.close_reference();
            self.reference = Some((key, Err(failed.clone())));
        } else if reference.is_lost() {
            // The candidate's output brought its judge down: the problem's next candidate gets
            // a reference of its own.
            self.close_reference();
        }
        result.map(|mut unsettled| {
            if let Some(s) = reference_s {
                unsettled
                    .outcome
                    .stages
                    .insert(0, ("reference".to_string(), s));
            }
            unsettled
        })
    }

    /// Starts the reference of `problem` and, on a GPU, reserves device memory for it and one
    /// candidate (unless the slot already holds the whole device). Where a reference of the same
    /// program ran on the device before, what it needed is reserved before this one touches the
    /// device: a reference building gigabytes of outputs unreserved crowded out the processes
    /// starting beside it (bench/notes/eval-h200.md, session 35). Otherwise, and where it needs
    /// more than was reserved, the reservation follows its construction: when that does not fit
    /// beside the problems in flight, the reference is closed while the slot waits, then started
    /// again.
    fn start_reference(
        &mut self,
        zygote: &Zygote,
        problem: &EvalProblem,
        access: &Access<'_>,
        mut started: Option<StartedReference>,
    ) -> Result<Result<Reference, ReferenceFailed>, RunError> {
        let ctx = self.shared.ctx;
        let memory = &self.lane.memory;
        let program = sha256_hex(&problem.source);
        // The whole device, reserved for a sample run alone, is kept whatever happens here.
        let held_before = self.reservation.is_some();
        loop {
            if self.reservation.is_none() {
                if let Some(need) = memory.known_need(&program) {
                    self.reservation = Some(self.reserve(problem, need));
                }
            }
            let started = match started.take() {
                Some(s) => s,
                None => Reference::spawn(ctx, zygote, problem)?,
            };
            let reference = match started.construct(ctx, problem, access) {
                Ok(r) => r,
                Err(e) => {
                    if !held_before {
                        self.reservation = None;
                    }
                    return match e {
                        RunError::Reference(failed) => Ok(Err(failed)),
                        e => Err(e),
                    };
                }
            };
            let Some(footprint) = reference.footprint() else {
                return Ok(Ok(reference));
            };
            memory.set_device_total(footprint.device_total);
            let need = 2 * (footprint.bytes + PROCESS_OVERHEAD_BYTES);
            memory.remember_need(&program, need);
            if self.reservation.as_ref().is_some_and(|r| r.bytes() >= need) {
                return Ok(Ok(reference));
            }
            // The smaller promise goes back before the larger is asked for.
            self.reservation = None;
            if let Some(reservation) = memory.try_reserve(need) {
                self.reservation = Some(reservation);
                return Ok(Ok(reference));
            }
            reference.close();
            self.reservation = Some(self.reserve(problem, need));
        }
    }

    /// `need` bytes of the device's memory for `problem`, waiting (said in the log) while earlier
    /// askers are served or it does not fit.
    fn reserve(&self, problem: &EvalProblem, need: u64) -> Reservation<'a> {
        let memory = &self.lane.memory;
        memory.try_reserve(need).unwrap_or_else(|| {
            tracing::info!(
                "{}: waits for {:.1} GiB of device memory",
                problem.name,
                need as f64 / f64::from(1 << 30)
            );
            memory.reserve(need)
        })
    }

    /// With `look_ahead`, takes the slot's next sample now (of the `current` problem if one is
    /// ready, else the oldest ready) and starts its processes, so that their start-up, imports
    /// and extension loads overlap the current sample instead of following it.
    fn look_ahead(&mut self, zygote: &Arc<Zygote>, current: ProblemKey) {
        if !self.shared.ctx.cfg.look_ahead || self.lane.ahead(self.index).is_some() {
            return;
        }
        let Some(item) = self.queue.try_take(Some(current)) else {
            return;
        };
        let ctx = self.shared.ctx;
        let sample = self.shared.sample(item.sample);
        let (key, problem, code) = self.shared.problem_and_code(&sample);
        let started = spawn_candidate(ctx, zygote, &problem, code).and_then(|candidate| {
            let reference = (key != current)
                .then(|| Reference::spawn(ctx, zygote, &problem))
                .transpose()?;
            Ok(Started {
                zygote: zygote.clone(),
                candidate,
                reference,
            })
        });
        if let Err(RunError::Evaluator(e)) = &started {
            tracing::warn!("{}: could not start ahead: {e:#}", sample.origin);
        }
        *self.lane.ahead(self.index) = Some(Ahead {
            item,
            started: started.ok(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process that could not make its CUDA context on a device full of the batch's other
    /// processes (python/roles.py device_setup) was crowded out; one whose allocations failed ran
    /// out of device memory in its own work (its sample runs again alone). An exit that says
    /// nothing of memory is neither.
    #[test]
    fn a_device_too_full_for_a_process_is_out_of_device_memory() {
        let failed = |why: &str| Err(RunError::Reference(ReferenceFailed(why.to_string())));
        for (why, shortage) in [
            (
                "importing the problem: setting up the device: AcceleratorError: CUDA error: out \
                 of memory",
                MemoryShortage::AtSetup,
            ),
            (
                "running the reference: OutOfMemoryError: CUDA out of memory. Tried to allocate \
                 8.00 GiB",
                MemoryShortage::InItsWork,
            ),
        ] {
            assert_eq!(out_of_device_memory(&failed(why)), Some(shortage), "{why}");
        }
        let exited = "importing the problem: the reference exited with status 70";
        assert_eq!(out_of_device_memory(&failed(exited)), None);
    }
}
