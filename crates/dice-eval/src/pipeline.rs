//! One batch through the evaluator: compile stage on all cores, run stage on every device, one
//! store writer; on fork servers that outlive the batch.
//!
//! Threads: `jobs` builders claim samples (claims.rs: other processes may judge the same run),
//! share one fork server with CUDA hidden and feed the run queue in the order builds finish; each device (the CPU, or each visible GPU) has one fork server and
//! `runs_per_device` run slots (run_slot.rs), each with a candidate in flight and the reference
//! process of its problem; their untimed stages overlap, while timing holds the device alone
//! (gate.rs). A writer thread commits each finished sample in its own transaction and drives the
//! progress bar (writer.rs).

use crate::batch::{Batch, BatchContext, Report, RunItem};
use crate::claims::Claims;
use crate::config::{Audit, Device, EvalSample};
use crate::device_lock::DeviceLock;
use crate::gate::{DeviceGate, GateUse};
use crate::job::{Compiled, JobContext, Outcome};
use crate::lane::Lane;
use crate::python::Runtime;
use crate::run_queue::{Producer, RunQueue};
use crate::run_slot::run_slot;
use crate::stage_build::{self, Built};
use crate::writer::{progress_bar, sha256_hex, write_reports, Summary};
use crate::zygote::ZygoteSlot;
use anyhow::Result;
use dice_store::{ProblemRecord, SampleKey, Store, Verdict, WorkerId};
use std::path::Path;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, OnceLock};
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
        let cfg = &self.ctx.cfg;
        let starts_before = self.fork_servers_started();
        let worker = WorkerId::new();
        let Batch { problems, samples } = batch;
        let finished = if cfg.force {
            let keys: Vec<SampleKey> = samples
                .iter()
                .map(|s| (s.level, s.problem_id, s.sample_id))
                .collect();
            store.forget_samples(&worker, &keys)?;
            Default::default()
        } else {
            store.finished()?
        };
        let already_done = samples
            .iter()
            .filter(|s| finished.contains(&(s.level, s.problem_id, s.sample_id)))
            .count();
        let pending: Vec<EvalSample> = samples
            .into_iter()
            .filter(|s| !finished.contains(&(s.level, s.problem_id, s.sample_id)))
            .collect();

        // A fork server that died since the last batch imports torch again while the others
        // work, rather than when its first candidate needs it.
        let to_run: Vec<&[u8]> = pending
            .iter()
            .filter(|s| problems[&(s.level, s.problem_id)].defect.is_none())
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
        let shared = BatchContext {
            ctx: &self.ctx,
            rt: &self.rt,
            problems,
            samples: pending,
            started,
            first_sample: OnceLock::new(),
        };
        // Builds, and run slots with a sample taken ahead each.
        let in_flight = cfg.jobs + 2 * lanes.iter().map(Lane::slots).sum::<usize>();
        let claims = Claims::new(store, worker, &shared, in_flight);
        let (report_tx, report_rx) = mpsc::channel();
        let (run_queue, run_tx) = RunQueue::new();
        let judged = std::thread::scope(|scope| {
            let (shared, claims) = (&shared, &claims);
            let (stop_heartbeat, heartbeat_stopped) = mpsc::channel::<()>();
            let heartbeat = scope.spawn(move || claims.heartbeat(&heartbeat_stopped));
            let bar = progress_bar(cfg.progress, shared.samples.len());
            let writer = scope.spawn(move || {
                write_reports(claims, shared, report_rx, audit, bar).inspect_err(|_| claims.stop())
            });
            let builders = start_builders(
                scope,
                shared,
                claims,
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
            let summary = writer.join().expect("store writer panicked");
            drop(stop_heartbeat);
            heartbeat.join().expect("heartbeat panicked");
            match failures.into_iter().next() {
                Some(e) => Err(e),
                None => summary,
            }
        });
        // Whatever happened, no sample stays claimed (a failed batch leaves some unjudged).
        let released = claims.release_all();
        let judged_elsewhere = claims.judged_elsewhere();
        drop(claims);
        let mut summary = judged?;
        released?;
        summary.already_done = already_done;
        summary.judged_elsewhere = judged_elsewhere;
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

/// `jobs` threads that claim the batch's samples one at a time and send each where it goes:
/// samples without a run stage to the store writer, the others through the compile stage (when
/// they build an extension) to the run queue.
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

fn start_builders<'scope>(
    scope: &'scope Scope<'scope, '_>,
    shared: &'scope BatchContext<'_>,
    claims: &'scope Claims<'_>,
    zygote: &'scope ZygoteSlot,
    run_tx: Producer<RunItem>,
    report_tx: Sender<Report>,
) -> Vec<ScopedJoinHandle<'scope, Result<()>>> {
    let threads = shared.ctx.cfg.jobs.min(shared.samples.len());
    (0..threads)
        .map(|_| {
            let (run_tx, report_tx) = (run_tx.clone(), report_tx.clone());
            scope.spawn(move || -> Result<()> {
                let intake = || -> Result<()> {
                    while let Some(i) = claims.next()? {
                        let sample = &shared.samples[i];
                        let key = (sample.level, sample.problem_id);
                        if let Some(defect) = &shared.problems[&key].defect {
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
                        if !stage_build::may_build(code) {
                            let compiled = Compiled::default();
                            run_tx.push(
                                key,
                                RunItem {
                                    sample: i,
                                    compiled,
                                },
                            );
                            continue;
                        }
                        let z = zygote.get(shared.rt)?;
                        match stage_build::build(shared.ctx, &z, sample, code)? {
                            Built::Ready(compiled) => run_tx.push(
                                key,
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
                    Ok(())
                };
                intake().inspect_err(|_| claims.stop())
            })
        })
        .collect()
}
