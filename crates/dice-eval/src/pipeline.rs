//! Batches through the evaluator: compile stage on all cores, run stage on every device, one
//! store writer; on fork servers that outlive the pipeline.
//!
//! Threads: an intake adds each submitted batch's samples while the others work (a judge's batch
//! is the only one; an evaluator's arrive until it finishes); `jobs` builders claim the samples
//! that build (claims.rs: other processes may judge the same run), share one fork server with
//! CUDA hidden and feed the run queue in the order builds finish, beside one claimer that feeds
//! it the samples that need no build; each device (the CPU, or each visible GPU)
//! has one fork server and `runs_per_device` run slots (run_slot.rs), each with a candidate in
//! flight and the reference process of its problem; their untimed stages overlap, while timing
//! holds the device alone (gate.rs). A writer thread commits each finished sample in its own
//! transaction, drives the progress bar and tells an evaluator's caller (writer.rs).

use crate::audit;
use crate::batch::{Batch, BatchContext, Report, RunItem, Submission, Ticket};
use crate::claims::{Claims, Class};
use crate::config::{Audit, Device};
use crate::device_lock::DeviceLock;
use crate::gate::{DeviceGate, GateUse};
use crate::job::{Compiled, JobContext, Outcome};
use crate::lane::Lane;
use crate::outcome::{sha256_hex, Evaluated, Summary};
use crate::python::Runtime;
use crate::run_queue::{Producer, RunQueue};
use crate::run_slot::run_slot;
use crate::same_program::{FirstOrCopy, SamePrograms};
use crate::stage_build::{self, Built};
use crate::writer::{progress_bar, write_reports};
use crate::zygote::ZygoteSlot;
use anyhow::Result;
use dice_store::{ProblemRecord, SampleKey, Store, Verdict, WorkerId};
use indicatif::ProgressBar;
use std::collections::HashSet;
use std::path::Path;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::{Scope, ScopedJoinHandle};
use std::time::{Duration, Instant};

/// How soon the intake notices that a stage failed while it waits for submissions.
const POLL_STOPPED: Duration = Duration::from_millis(200);

/// What stays up from one batch to the next: the job context, the interpreter's scratch
/// directory, and the fork servers (each imported torch once).
pub(crate) struct Workers {
    pub ctx: JobContext,
    pub rt: Arc<Runtime>,
    /// The compile stage's, with CUDA hidden; started once a batch has something to build.
    pub build_zygote: Arc<ZygoteSlot>,
    /// One per device.
    pub device_zygotes: Vec<Arc<ZygoteSlot>>,
}

impl Workers {
    /// Evaluates `batch` into `store`, skipping samples already stored unless `force` (which
    /// deletes their results first); its timeline counts from `started`. Samples another process
    /// is judging in the same run are left to it.
    pub(crate) fn evaluate(
        &self,
        store: &mut Store,
        audit: Option<&dyn Audit>,
        batch: Batch,
        started: Instant,
    ) -> Result<Summary> {
        let (submit, submissions) = mpsc::channel();
        let ticket = Ticket(0);
        submit
            .send(Submission { ticket, batch })
            .expect("the receiver is here");
        drop(submit);
        self.run(store, audit, submissions, None, started)
    }

    /// Evaluates the batches that arrive on `submissions` into `store`, as `evaluate` does one,
    /// until that channel closes; what becomes of each sample goes to `results` as it is known.
    /// The samples of every batch flow through the same builders and run slots, so a batch
    /// submitted while others run starts at once, on warm fork servers and references.
    pub(crate) fn run(
        &self,
        store: &mut Store,
        audit: Option<&dyn Audit>,
        submissions: Receiver<Submission>,
        results: Option<Sender<Evaluated>>,
        started: Instant,
    ) -> Result<Summary> {
        let cfg = &self.ctx.cfg;
        let starts_before = self.fork_servers_started();
        let run_dir = cfg.db.parent().unwrap_or(Path::new("."));
        let lanes = self
            .device_zygotes
            .iter()
            .enumerate()
            .map(|(index, zygote)| {
                let lock = DeviceLock::new(run_dir, &device_name(cfg.device, index))?;
                let gate = DeviceGate::across_processes(lock);
                Ok(Lane::new(zygote.clone(), cfg.runs_per_device, gate))
            })
            .collect::<Result<Vec<Lane>>>()?;
        let shared = BatchContext::new(&self.ctx, &self.rt, started);
        // Builds, and run slots with a sample taken ahead each.
        let ahead = 2 * lanes.iter().map(Lane::slots).sum::<usize>();
        let claims = Claims::new(store, WorkerId::new(), cfg.jobs + ahead, ahead);
        let (report_tx, report_rx) = mpsc::channel();
        let (run_queue, run_tx) = RunQueue::new();
        let bar = progress_bar(cfg.progress, 0);
        let same = SamePrograms::default();
        let judged = std::thread::scope(|scope| {
            let (shared, claims, same) = (&shared, &claims, &same);
            let (stop_heartbeat, heartbeat_stopped) = mpsc::channel::<()>();
            let heartbeat = scope.spawn(move || claims.heartbeat(&heartbeat_stopped));
            let intake = {
                let (report_tx, bar) = (report_tx.clone(), bar.clone());
                scope.spawn(move || {
                    self.take_submissions(claims, shared, submissions, &report_tx, &bar)
                        .inspect_err(|_| claims.stop())
                })
            };
            let writer = scope.spawn(move || {
                write_reports(claims, shared, same, report_rx, audit, bar, results)
                    .inspect_err(|_| claims.stop())
            });
            let claimers = start_claimers(
                scope,
                shared,
                claims,
                same,
                &self.build_zygote,
                run_tx,
                report_tx.clone(),
            );
            let mut runners = Vec::new();
            for lane in &lanes {
                for index in 0..lane.slots() {
                    let (queue, report_tx) = (&run_queue, report_tx.clone());
                    runners.push(scope.spawn(move || {
                        run_slot(shared, lane, index, queue, &report_tx)
                            .inspect_err(|_| claims.stop())
                    }));
                }
            }
            drop(report_tx);
            let mut failures = Vec::new();
            let already_done = intake.join().expect("intake thread panicked");
            for c in claimers {
                if let Err(e) = c.join().expect("claimer thread panicked") {
                    failures.push(e);
                }
            }
            for r in runners {
                if let Err(e) = r.join().expect("run slot panicked") {
                    failures.push(e);
                }
            }
            let summary = writer.join().expect("store writer panicked");
            drop(stop_heartbeat);
            heartbeat.join().expect("heartbeat panicked");
            let already_done = already_done?;
            match failures.into_iter().next() {
                Some(e) => Err(e),
                None => summary.map(|mut s| {
                    s.already_done = already_done;
                    s
                }),
            }
        });
        // Whatever happened, no sample stays claimed (a failed batch leaves some unjudged).
        let released = claims.release_all();
        let judged_elsewhere = claims.judged_elsewhere();
        drop(claims);
        let mut summary = judged?;
        released?;
        summary.judged_elsewhere = judged_elsewhere;
        summary.copies = same.copies();
        summary.fork_servers_started = self.fork_servers_started() - starts_before;
        let mut gate = GateUse::default();
        for lane in &lanes {
            gate.add(&lane.gate.usage());
        }
        // The writer has set when the last outcome was stored.
        let timeline = &mut summary.timeline;
        timeline.samples = shared.len() - summary.already_done;
        timeline.wall_s = started.elapsed().as_secs_f64();
        timeline.first_sample_s = shared.first_sample.get().copied();
        gate.write_to(timeline);
        store.add_timeline(&summary.timeline)?;
        Ok(summary)
    }

    /// Adds each batch that arrives to the pipeline until `submissions` closes, then closes the
    /// intake: its problems to the store, its samples already stored (unless `force`, which
    /// forgets their results) straight to the writer, the others to be claimed. Returns how many
    /// were already stored.
    fn take_submissions(
        &self,
        claims: &Claims<'_>,
        shared: &BatchContext<'_>,
        submissions: Receiver<Submission>,
        reports: &Sender<Report>,
        bar: &ProgressBar,
    ) -> Result<usize> {
        let force = self.ctx.cfg.force;
        let mut already_done = 0;
        loop {
            let Submission { ticket, batch } = match submissions.recv_timeout(POLL_STOPPED) {
                Ok(submission) => submission,
                Err(RecvTimeoutError::Timeout) if !claims.stopped() => continue,
                Err(_) => break,
            };
            let keys: Vec<SampleKey> = batch
                .samples
                .iter()
                .map(|s| (s.level, s.problem_id, s.sample_id))
                .collect();
            let finished = if force {
                claims.forget(&keys)?;
                Default::default()
            } else {
                claims.store().finished()?
            };
            self.start_fork_servers_for(&batch, &finished);
            let mut problem_rows: Vec<_> = batch
                .problems
                .values()
                .map(|p| {
                    let record = ProblemRecord {
                        level: p.level,
                        problem_id: p.problem_id,
                        name: p.name.clone(),
                        reference_error: None,
                    };
                    (record, sha256_hex(&p.source))
                })
                .collect();
            problem_rows.sort_by_key(|(p, _)| (p.level, p.problem_id));
            claims.store().add_problems(&problem_rows)?;

            let (done, pending): (Vec<_>, Vec<_>) = shared
                .add(ticket, batch)
                .zip(keys)
                .partition(|(_, key)| finished.contains(key));
            already_done += done.len();
            for (i, _) in done {
                let _ = reports.send(Report::AlreadyStored(i));
            }
            bar.inc_length(pending.len() as u64);
            claims.add(pending.into_iter().map(|(i, key)| {
                let sample = shared.sample(i);
                let builds = sample.code.as_deref().is_some_and(stage_build::may_build);
                (i, key, if builds { Class::Build } else { Class::RunOnly })
            }));
        }
        claims.close();
        Ok(already_done)
    }

    /// A fork server that died since the last batch imports torch again while the others work,
    /// rather than when its first candidate needs it.
    fn start_fork_servers_for(&self, batch: &Batch, finished: &HashSet<SampleKey>) {
        let to_run: Vec<&[u8]> = batch
            .samples
            .iter()
            .filter(|s| !finished.contains(&(s.level, s.problem_id, s.sample_id)))
            .filter(|s| batch.problems[&(s.level, s.problem_id)].defect.is_none())
            .filter_map(|s| s.code.as_deref())
            .collect();
        if to_run.iter().any(|code| stage_build::may_build(code)) {
            self.build_zygote.start_early(&self.rt);
        }
        if !to_run.is_empty() {
            for zygote in &self.device_zygotes {
                zygote.start_early(&self.rt);
            }
        }
    }

    /// Fork servers started so far, restarts included.
    fn fork_servers_started(&self) -> usize {
        let slots = self.device_zygotes.iter().chain([&self.build_zygote]);
        slots.map(|zygote| zygote.starts()).sum()
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for zygote in self.device_zygotes.iter().chain([&self.build_zygote]) {
            zygote.stop();
        }
    }
}

/// The name of the device at `index`, the same in every process of the host: a GPU's is its
/// entry in CUDA_VISIBLE_DEVICES (an index or a UUID) when that is set.
fn device_name(device: Device, index: usize) -> String {
    if device == Device::Cpu {
        return "cpu".to_string();
    }
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default();
    let id = visible
        .split(',')
        .nth(index)
        .map(str::trim)
        .filter(|id| !id.is_empty())
        .map_or_else(|| index.to_string(), str::to_string);
    let id: String = id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("cuda-{id}")
}

/// `jobs` builders and one claimer of run-only samples ([`Class`]), which claim the batch's
/// samples one at a time and send each where it goes: samples without a run stage to the store
/// writer (no code; under `--strict`, programs a static rule rejects whatever they run), repeats
/// of a program to wait for its judgement (same_program.rs), the others through the compile
/// stage (when they build an extension) to the run queue.
fn start_claimers<'scope>(
    scope: &'scope Scope<'scope, '_>,
    shared: &'scope BatchContext<'_>,
    claims: &'scope Claims<'_>,
    same: &'scope SamePrograms,
    zygote: &'scope ZygoteSlot,
    run_tx: Producer<RunItem>,
    report_tx: Sender<Report>,
) -> Vec<ScopedJoinHandle<'scope, Result<()>>> {
    let builders = std::iter::repeat_n(Class::Build, shared.ctx.cfg.jobs.max(1));
    builders
        .chain([Class::RunOnly])
        .map(|class| {
            let (run_tx, report_tx) = (run_tx.clone(), report_tx.clone());
            scope.spawn(move || -> Result<()> {
                let intake = || -> Result<()> {
                    loop {
                        let next = claims.next(class)?;
                        for i in claims.take_judged_elsewhere() {
                            let _ = report_tx.send(Report::JudgedElsewhere(i));
                        }
                        let Some(i) = next else { return Ok(()) };
                        let sample = shared.sample(i);
                        let key = (sample.level, sample.problem_id);
                        if let Some(defect) = &shared.problem(key).defect {
                            let _ = report_tx.send(Report::ReferenceFailed(i, defect.clone()));
                            continue;
                        }
                        let Some(code) = sample.code.as_deref() else {
                            let message = "no code block could be extracted from the answer";
                            let outcome = Outcome::failed(
                                Verdict::NoCode,
                                message.to_string(),
                                String::new(),
                                vec![],
                                0.0,
                            );
                            let _ = report_tx.send(Report::Sample(i, Box::new(outcome)));
                            continue;
                        };
                        if !shared.ctx.cfg.judge_each_copy {
                            match same.first_or_copy(i, key, code, &sample.origin) {
                                FirstOrCopy::First => {}
                                FirstOrCopy::Waits => continue,
                                FirstOrCopy::Copy(report) => {
                                    let _ = report_tx.send(report);
                                    continue;
                                }
                            }
                        }
                        if shared.ctx.cfg.strict {
                            let problem = shared.problem(key);
                            if let Some(finding) = audit::rejected_before_running(&problem, code) {
                                let mut outcome = Outcome::failed(
                                    Verdict::Rejected,
                                    "not built or run: deceptive under --strict whatever it runs"
                                        .to_string(),
                                    String::new(),
                                    vec![],
                                    0.0,
                                );
                                outcome.findings.push(finding);
                                let _ = report_tx.send(Report::Sample(i, Box::new(outcome)));
                                continue;
                            }
                        }
                        if !stage_build::may_build(code) {
                            let compiled = Compiled::default();
                            run_tx.push(key, RunItem::new(i, compiled));
                            continue;
                        }
                        let z = zygote.get(shared.rt)?;
                        match stage_build::build(shared.ctx, &z, &sample, code)? {
                            Built::Ready(compiled) => run_tx.push(key, RunItem::new(i, compiled)),
                            Built::Failed(outcome) => {
                                let _ = report_tx.send(Report::Sample(i, outcome));
                            }
                        }
                    }
                };
                intake().inspect_err(|_| claims.stop())
            })
        })
        .collect()
}
