//! One batch through the evaluator: compile stage on all cores, run stage on every device, one
//! store writer; on fork servers that outlive the batch.
//!
//! Threads: `jobs` builders share one fork server with CUDA hidden and feed the run queue in the
//! order builds finish; each device (the CPU, or each visible GPU) has one fork server and
//! `runs_per_device` run slots (run_slot.rs), each with a candidate in flight and the reference
//! process of its problem; their untimed stages overlap, while timing holds the device alone
//! (gate.rs). A writer thread commits each finished sample in its own transaction and drives the
//! progress bar (writer.rs).

use crate::batch::{Batch, BatchContext, Report, RunItem};
use crate::config::{Audit, EvalSample};
use crate::gate::GateUse;
use crate::job::{Compiled, JobContext, Outcome};
use crate::lane::Lane;
use crate::python::Runtime;
use crate::run_queue::{Producer, RunQueue};
use crate::run_slot::run_slot;
use crate::stage_build::{self, Built};
use crate::writer::{progress_bar, sha256_hex, write_reports, Summary};
use crate::zygote::ZygoteSlot;
use anyhow::Result;
use dice_store::{ProblemRecord, Store, Verdict};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{Scope, ScopedJoinHandle};
use std::time::Instant;

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
    /// Evaluates `batch` into `store`, skipping samples already stored unless `force`; its
    /// timeline counts from `started`.
    pub(crate) fn evaluate(
        &self,
        store: &mut Store,
        audit: Option<&dyn Audit>,
        batch: Batch,
        started: Instant,
    ) -> Result<Summary> {
        let cfg = &self.ctx.cfg;
        let starts_before = self.fork_servers_started();
        let finished = if cfg.force {
            Default::default()
        } else {
            store.finished()?
        };
        let Batch { problems, samples } = batch;
        let already_done = samples
            .iter()
            .filter(|s| finished.contains(&(s.level, s.problem_id, s.sample_id)))
            .count();
        let pending: Vec<EvalSample> = samples
            .into_iter()
            .filter(|s| !finished.contains(&(s.level, s.problem_id, s.sample_id)))
            .collect();

        // Samples without a run stage are reported now; the others go to the compile stage or
        // straight to the run queue.
        let (report_tx, report_rx) = mpsc::channel();
        let (run_queue, run_tx) = RunQueue::new();
        let mut to_build = Vec::new();
        let mut to_run = 0;
        for (i, s) in pending.iter().enumerate() {
            if let Some(defect) = &problems[&(s.level, s.problem_id)].defect {
                let _ = report_tx.send(Report::ReferenceFailed(i, defect.clone()));
                continue;
            }
            let Some(code) = &s.code else {
                let message = "no code block could be extracted from the answer".to_string();
                let outcome = Outcome::failed(Verdict::NoCode, message, String::new(), vec![], 0.0);
                let _ = report_tx.send(Report::Sample(i, Box::new(outcome)));
                continue;
            };
            if stage_build::may_build(code) {
                to_build.push(i);
            } else {
                let item = RunItem {
                    sample: i,
                    compiled: Compiled::default(),
                };
                run_tx.push((s.level, s.problem_id), item);
            }
            to_run += 1;
        }
        // A fork server that died since the last batch imports torch again while the others
        // work, rather than when its first candidate needs it.
        if !to_build.is_empty() {
            self.build_zygote.start_early(&self.rt);
        }
        if to_run > 0 {
            for zygote in &self.device_zygotes {
                zygote.start_early(&self.rt);
            }
        }

        let mut problem_rows: Vec<_> = problems
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
        store.add_problems(&problem_rows)?;

        let lanes: Vec<Lane> = self
            .device_zygotes
            .iter()
            .map(|zygote| Lane::new(zygote.clone(), cfg.runs_per_device))
            .collect();
        let shared = BatchContext {
            ctx: &self.ctx,
            rt: &self.rt,
            problems,
            samples: pending,
            started,
            first_sample: OnceLock::new(),
        };
        let mut summary = std::thread::scope(|scope| {
            let (shared, store) = (&shared, &mut *store);
            let bar = progress_bar(cfg.progress, shared.samples.len());
            let writer = scope.spawn(move || write_reports(store, shared, report_rx, audit, bar));
            let builders = start_builders(
                scope,
                shared,
                &self.build_zygote,
                to_build,
                run_tx,
                report_tx.clone(),
            );
            let mut runners = Vec::new();
            for lane in &lanes {
                for index in 0..lane.slots() {
                    let (queue, report_tx) = (&run_queue, report_tx.clone());
                    runners.push(
                        scope.spawn(move || run_slot(shared, lane, index, queue, &report_tx)),
                    );
                }
            }
            drop(report_tx);
            let mut failures = Vec::new();
            for b in builders {
                if let Err(e) = b.join().expect("builder thread panicked") {
                    failures.push(e);
                }
            }
            for r in runners {
                if let Err(e) = r.join().expect("run slot panicked") {
                    failures.push(e);
                }
            }
            let summary = writer.join().expect("store writer panicked")?;
            match failures.into_iter().next() {
                Some(e) => Err(e),
                None => Ok(summary),
            }
        })?;
        summary.already_done = already_done;
        summary.fork_servers_started = self.fork_servers_started() - starts_before;
        let mut gate = GateUse::default();
        for lane in &lanes {
            gate.add(&lane.gate.usage());
        }
        // The writer has set when the last outcome was stored.
        let timeline = &mut summary.timeline;
        timeline.samples = shared.samples.len();
        timeline.wall_s = started.elapsed().as_secs_f64();
        timeline.first_sample_s = shared.first_sample.get().copied();
        gate.write_to(timeline);
        store.add_timeline(&summary.timeline)?;
        Ok(summary)
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

fn start_builders<'scope>(
    scope: &'scope Scope<'scope, '_>,
    shared: &'scope BatchContext<'_>,
    zygote: &'scope ZygoteSlot,
    to_build: Vec<usize>,
    run_tx: Producer<RunItem>,
    report_tx: Sender<Report>,
) -> Vec<ScopedJoinHandle<'scope, Result<()>>> {
    if to_build.is_empty() {
        return Vec::new();
    }
    let threads = shared.ctx.cfg.jobs.clamp(1, to_build.len());
    let queue = Arc::new(Mutex::new(to_build.into_iter()));
    (0..threads)
        .map(|_| {
            let queue = queue.clone();
            let (run_tx, report_tx) = (run_tx.clone(), report_tx.clone());
            scope.spawn(move || -> Result<()> {
                loop {
                    let Some(i) = queue.lock().unwrap().next() else {
                        return Ok(());
                    };
                    let z = zygote.get(shared.rt)?;
                    let sample = &shared.samples[i];
                    let code = sample
                        .code
                        .as_deref()
                        .expect("only samples with code are built");
                    match stage_build::build(shared.ctx, &z, sample, code)? {
                        Built::Ready(compiled) => run_tx.push(
                            (sample.level, sample.problem_id),
                            RunItem {
                                sample: i,
                                compiled,
                            },
                        ),
                        Built::Failed(outcome) => {
                            let _ = report_tx.send(Report::Sample(i, outcome));
                        }
                    }
                }
            })
        })
        .collect()
}
