//! A run slot: one candidate in flight on a device at a time, with the reference process of its
//! problem kept for the problem's next candidate; outcomes go to the store writer as their
//! processes exit. A slot takes samples until the run queue ends, and (with `look_ahead`) starts
//! its next sample's processes while the current one runs.

use crate::batch::{BatchContext, Report, RunItem};
use crate::candidate::spawn_candidate;
use crate::config::{EvalProblem, EvalSample};
use crate::device_memory::Reservation;
use crate::gate::Access;
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
    /// Its own allocations failed: the reference's process (`of_reference`) or the candidate's,
    /// which wanted `demand` where torch's message says how much.
    InItsWork {
        of_reference: bool,
        demand: Option<ProcessDemand>,
    },
}

/// What a process that ran out of device memory held and asked for, from torch's
/// `OutOfMemoryError` ("Tried to allocate 8.00 GiB. … this process has 20.01 GiB memory in
/// use."); the second is missing where the message was cut (it lists every other process first).
#[derive(Debug, PartialEq, Clone, Copy)]
struct ProcessDemand {
    tried: u64,
    in_use: Option<u64>,
}

impl ProcessDemand {
    fn from_message(message: &str) -> Option<Self> {
        Some(ProcessDemand {
            tried: size_after(message, "Tried to allocate ")?,
            in_use: size_after(message, "this process has "),
        })
    }
}

impl std::fmt::Display for MemoryShortage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (of_reference, demand) = match self {
            MemoryShortage::AtSetup => return f.write_str("at its CUDA context"),
            MemoryShortage::InItsWork {
                of_reference,
                demand,
            } => (*of_reference, demand),
        };
        f.write_str(if of_reference {
            "the reference"
        } else {
            "the candidate"
        })?;
        match demand {
            Some(ProcessDemand {
                tried,
                in_use: Some(in_use),
            }) => write!(
                f,
                " held {:.1} GiB and asked for {:.1} GiB more",
                gib(*in_use),
                gib(*tried)
            ),
            Some(ProcessDemand {
                tried,
                in_use: None,
            }) => {
                write!(f, " asked for {:.1} GiB", gib(*tried))
            }
            None => f.write_str(" ran out"),
        }
    }
}

/// The size torch's allocator wrote right after `marker` ("8.00 GiB", "512.00 MiB", "0 bytes").
fn size_after(message: &str, marker: &str) -> Option<u64> {
    let rest = &message[message.find(marker)? + marker.len()..];
    let mut words = rest.split_whitespace();
    let number: f64 = words.next()?.parse().ok()?;
    let unit = match words.next()?.trim_end_matches(['.', ',', ';']) {
        "bytes" | "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    Some((number * unit) as u64)
}

fn out_of_device_memory(result: &Result<Unsettled, RunError>) -> Option<MemoryShortage> {
    let (message, of_reference) = match result {
        Ok(u) if matches!(u.outcome.verdict, Verdict::RuntimeError | Verdict::Crashed) => {
            (u.outcome.message.as_deref().unwrap_or_default(), false)
        }
        Err(RunError::Reference(failed)) => (failed.0.as_str(), true),
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
            MemoryShortage::InItsWork {
                of_reference,
                demand: ProcessDemand::from_message(message),
            }
        }
    })
}

/// The device memory to reserve for a problem whose reference or candidate ran out of memory
/// in its own work beside others while `held` was reserved for both: the process that failed
/// as large as it held plus what it asked for, a quarter more for what it would have asked for
/// next, beside the other process's share (the reference's half of `held`; a reference that
/// failed stands for both). None where the message did not say what the process wanted.
fn retry_reservation(held: u64, shortage: &MemoryShortage) -> Option<u64> {
    let MemoryShortage::InItsWork {
        of_reference,
        demand: Some(demand),
    } = shortage
    else {
        return None;
    };
    let process = demand.in_use.unwrap_or(held / 2) + demand.tried;
    let process = process + process / 4;
    let other = if *of_reference || held == 0 {
        process
    } else {
        held / 2
    };
    Some((other + process).max(held))
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

fn gib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1 << 30)
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
            let mut result = self.run(sample, &item, started);
            if let Err(RunError::Evaluator(e)) = &result {
                tracing::warn!("{}: restarting the worker after: {e:#}", sample.origin);
                self.reset();
                result = self.run(sample, &item, None);
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
                // again. Out of memory in its own work, it goes back with what it wanted
                // reserved for its problem: the reservation, from its reference's footprint,
                // counts a candidate as large as the reference, and a candidate with large
                // intermediates outgrows it. Where torch did not say what it wanted, or it ran out
                // again, it runs again alone behind the samples queued now: holding the device
                // for its whole evaluation, it holds all of theirs too (a program of 8 GB outputs
                // held every other sample of a batch for 85 s: bench/notes/eval-h200.md,
                // sessions 27 and 36). Alone, it also stops every sample asking for memory after
                // it until the device is empty, so a sample that was only crowded out does not go
                // alone until it was crowded out again and again (eight of them held a batch's
                // end for two minutes: session 35).
                let held = self.reservation.as_ref().map_or(0, Reservation::bytes);
                let larger = item
                    .device_memory
                    .is_none()
                    .then(|| retry_reservation(held, &shortage))
                    .flatten();
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
                } else if let Some(bytes) = larger {
                    tracing::info!(
                        "{}: out of device memory beside others ({shortage}, {:.1} GiB reserved \
                         for both); again with {:.1} GiB reserved, after the samples \
                         queued now",
                        sample.origin,
                        gib(held),
                        gib(bytes)
                    );
                    RunItem {
                        device_memory: Some(bytes),
                        ..item
                    }
                } else {
                    tracing::info!(
                        "{}: out of device memory beside others ({shortage}); again alone, \
                         after the samples queued now",
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

    /// Evaluates `sample` (`item`'s), with the processes `early` started ahead for it if any;
    /// with `item.alone`, nothing else runs on the device meanwhile.
    fn run(
        &mut self,
        sample: &EvalSample,
        item: &RunItem,
        early: Option<Started>,
    ) -> Result<Unsettled, RunError> {
        let exclusive = item.alone;
        let floor = item.device_memory.unwrap_or(0);
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
        // A reference kept with less memory reserved than this sample needs starts again (after
        // the larger reservation is granted).
        let held = self.reservation.as_ref().map_or(0, Reservation::bytes);
        if self.reference.as_ref().is_none_or(|(k, _)| *k != key) || held < floor {
            if !exclusive {
                self.close_reference();
            }
            let started = Instant::now();
            let result =
                self.start_reference(&zygote, &problem, &access, started_reference, floor)?;
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
        let result =
            stage_run::run_candidate(ctx, &access, reference, candidate, item.compiled.clone());
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
    /// again. At least `floor` bytes are reserved (a sample that outgrew its problem's share).
    fn start_reference(
        &mut self,
        zygote: &Zygote,
        problem: &EvalProblem,
        access: &Access<'_>,
        mut started: Option<StartedReference>,
        floor: u64,
    ) -> Result<Result<Reference, ReferenceFailed>, RunError> {
        let ctx = self.shared.ctx;
        let memory = &self.lane.memory;
        let program = sha256_hex(&problem.source);
        // The whole device, reserved for a sample run alone, is kept whatever happens here.
        let held_before = self.reservation.is_some();
        loop {
            if self.reservation.is_none() {
                let need = memory.known_need(&program).unwrap_or(0).max(floor);
                if need > 0 {
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
            let need = need.max(floor);
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
                gib(need)
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

    const GIB: u64 = 1 << 30;

    /// A process that could not make its CUDA context on a device full of the batch's other
    /// processes (python/roles.py device_setup) was crowded out; one whose allocations failed ran
    /// out of device memory in its own work, with what it held and asked for where torch's
    /// message says so (cut before "this process has", only the request). An exit that says
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
                 8.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 2.06 GiB is free. \
                 Process 4242 has 3.10 GiB memory in use. Including non-PyTorch memory, this \
                 process has 20.50 GiB memory in use. Of the allocated memory 18.00 GiB is \
                 allocated by PyTorch, and 1.2 GiB is reserved by PyTorch but unallocated.",
                MemoryShortage::InItsWork {
                    of_reference: true,
                    demand: Some(ProcessDemand {
                        tried: 8 * GIB,
                        in_use: Some(20 * GIB + GIB / 2),
                    }),
                },
            ),
            (
                "running the reference: OutOfMemoryError: CUDA out of memory. Tried to allocate \
                 512.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which 0 bytes is free. \
                 Process 4242 has 3.10 GiB memory in use. Process 4243 has",
                MemoryShortage::InItsWork {
                    of_reference: true,
                    demand: Some(ProcessDemand {
                        tried: GIB / 2,
                        in_use: None,
                    }),
                },
            ),
            (
                "running the reference: RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED",
                MemoryShortage::InItsWork {
                    of_reference: true,
                    demand: None,
                },
            ),
        ] {
            assert_eq!(out_of_device_memory(&failed(why)), Some(shortage), "{why}");
        }
        let exited = "importing the problem: the reference exited with status 70";
        assert_eq!(out_of_device_memory(&failed(exited)), None);
    }

    /// A candidate that outgrew its half of the problem's reservation gets the reference's half
    /// beside what it held and asked for, a quarter more; a reference that ran out stands for
    /// both processes; never less than was held. Without torch's figures, or crowded out at its
    /// setup, no larger reservation is known (the sample runs alone, or is only requeued).
    #[test]
    fn a_sample_out_of_memory_in_its_work_asks_for_what_it_wanted() {
        let candidate = |tried, in_use| MemoryShortage::InItsWork {
            of_reference: false,
            demand: Some(ProcessDemand { tried, in_use }),
        };
        // The 8 GiB outputs' program of session 36: 35 GiB reserved from its reference.
        assert_eq!(
            retry_reservation(36 * GIB, &candidate(8 * GIB, Some(20 * GIB))),
            Some(18 * GIB + 35 * GIB)
        );
        // Its share of what was held stands in for what it held, where the message was cut.
        assert_eq!(
            retry_reservation(36 * GIB, &candidate(12 * GIB, None)),
            Some(18 * GIB + 37 * GIB + GIB / 2)
        );
        assert_eq!(
            retry_reservation(40 * GIB, &candidate(GIB, Some(GIB))),
            Some(40 * GIB),
            "others filled the device: at least as much again"
        );
        let reference = MemoryShortage::InItsWork {
            of_reference: true,
            demand: Some(ProcessDemand {
                tried: 4 * GIB,
                in_use: Some(4 * GIB),
            }),
        };
        assert_eq!(retry_reservation(0, &reference), Some(20 * GIB));
        let unsaid = MemoryShortage::InItsWork {
            of_reference: false,
            demand: None,
        };
        assert_eq!(retry_reservation(36 * GIB, &unsaid), None);
        assert_eq!(retry_reservation(36 * GIB, &MemoryShortage::AtSetup), None);
        assert_eq!(
            candidate(8 * GIB, Some(20 * GIB)).to_string(),
            "the candidate held 20.0 GiB and asked for 8.0 GiB more"
        );
    }
}
