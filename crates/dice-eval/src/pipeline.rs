//! The evaluator: compile stage on all cores, run stage on every device, one store writer.
//!
//! Threads: `jobs` builders share one fork server with CUDA hidden and feed the run queue in the
//! order builds finish; each device (the CPU, or each visible GPU) has one fork server and
//! `runs_per_device` run slots, each with a candidate in flight and the reference process of its
//! problem; their untimed stages overlap, while timing holds the device alone (gate.rs). A writer
//! thread commits each finished sample in its own transaction and drives the progress bar. Fork
//! servers start while the interpreter is checked; finished processes end in the background.

use crate::config::{Audit, Device, EvalConfig, EvalProblem, EvalSample};
use crate::device_memory::{DeviceMemory, Reservation};
use crate::gate::{Access, DeviceGate, GateUse};
use crate::job::{Compiled, JobContext, Outcome};
use crate::python::{PythonInfo, Runtime};
use crate::record::{ProblemRecord, RunInfo, RunTimeline, SampleRecord};
use crate::run_queue::{ProblemKey, Producer, RunQueue};
use crate::sandbox;
use crate::stage_build::{self, Built};
use crate::stage_run::{
    self, CandidateRun, Reference, ReferenceFailed, RunError, StartedReference, Unsettled,
};
use crate::store::{SampleExtras, Store};
use crate::verdict::Verdict;
use crate::zygote::Zygote;
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::Scope;
use std::time::Instant;

/// What a run did, for the closing summary.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    /// Samples evaluated in this invocation, per verdict.
    pub verdicts: BTreeMap<Verdict, usize>,
    /// Samples already in the store and not re-evaluated.
    pub already_done: usize,
    /// Samples left without a verdict because their problem's reference failed.
    pub skipped: usize,
    /// (level, problem_id, why) of problems whose reference failed.
    pub reference_errors: Vec<(u32, u32, String)>,
    /// Where this invocation's wall time went (also stored with the run).
    pub timeline: RunTimeline,
}

enum Report {
    Sample(usize, Box<Outcome>),
    ReferenceOk(ProblemKey),
    ReferenceFailed(usize, String),
}

struct RunItem {
    sample: usize,
    compiled: Compiled,
}

struct Shared {
    ctx: JobContext,
    rt: Arc<Runtime>,
    problems: HashMap<ProblemKey, EvalProblem>,
    samples: Vec<EvalSample>,
    /// When the evaluation started, and how long after that the first sample began.
    started: Instant,
    first_sample: OnceLock<f64>,
}

impl Shared {
    /// A sample's problem key, its problem, and its code (run samples always have code).
    fn problem_and_code<'s>(
        &'s self,
        sample: &'s EvalSample,
    ) -> (ProblemKey, &'s EvalProblem, &'s [u8]) {
        let key = (sample.level, sample.problem_id);
        let code = sample
            .code
            .as_deref()
            .expect("only samples with code are run");
        (key, &self.problems[&key], code)
    }
}

/// Evaluates `samples` against `problems` into the store at `cfg.db`, skipping samples already
/// stored unless `cfg.force`.
pub fn evaluate(
    cfg: EvalConfig,
    problems: Vec<EvalProblem>,
    samples: Vec<EvalSample>,
    audit: Option<Arc<dyn Audit>>,
) -> Result<Summary> {
    let started = Instant::now();
    let problems: HashMap<ProblemKey, EvalProblem> = problems
        .into_iter()
        .map(|p| ((p.level, p.problem_id), p))
        .collect();
    if let Some(s) = samples
        .iter()
        .find(|s| !problems.contains_key(&(s.level, s.problem_id)))
    {
        bail!(
            "{}: level {} problem {} is not among the problems given",
            s.origin,
            s.level,
            s.problem_id
        );
    }
    std::fs::create_dir_all(&cfg.build_cache).with_context(|| {
        format!(
            "cannot create the build cache {}",
            cfg.build_cache.display()
        )
    })?;
    let mut store = Store::open(&cfg.db)?;
    let finished = if cfg.force {
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

    let rt = Arc::new(Runtime::new(cfg.python.as_deref())?);
    sandbox::prepare(&cfg.build_cache)?;
    let probe = rt.start_probe(cfg.device == Device::Cuda)?;

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

    // The fork servers import torch while the interpreter is checked, not after it: each import
    // takes seconds, and the first candidate needs both fork servers ready.
    let zygote_env = vec![("DICE_DEVICE".to_string(), cfg.device.as_str().to_string())];
    let mut build_env = zygote_env.clone();
    build_env.push(("CUDA_VISIBLE_DEVICES".to_string(), String::new()));
    let build_zygote = Arc::new(ZygoteSlot::new(build_env, "zygote-build.log".to_string()));
    if !to_build.is_empty() {
        build_zygote.start_early(&rt);
    }
    let start_lane = |gpu| {
        let lane = Arc::new(Lane::new(&zygote_env, gpu, cfg.runs_per_device));
        if to_run > 0 {
            lane.zygote.start_early(&rt);
        }
        lane
    };
    let mut lanes = vec![start_lane((cfg.device == Device::Cuda).then_some(0))];
    let info: PythonInfo = probe.output()?;
    if cfg.device == Device::Cuda {
        if info.gpus.is_empty() {
            bail!("--device cuda: no GPU is visible");
        }
        lanes.extend((1..info.gpus.len()).map(|gpu| start_lane(Some(gpu))));
    }
    store.begin_run(&run_info(&cfg, &info), &run_settings(&cfg), cfg.force)?;
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

    let jobs_dir = rt.jobs_dir();
    let shared = Arc::new(Shared {
        ctx: JobContext::new(cfg.clone(), jobs_dir, job_env(&cfg, &info)),
        rt,
        problems,
        samples: pending,
        started,
        first_sample: OnceLock::new(),
    });

    let writer = {
        let shared = shared.clone();
        let bar = progress_bar(cfg.progress, shared.samples.len());
        std::thread::spawn(move || write_reports(store, &shared, report_rx, audit, bar))
    };
    let builders = start_builders(&shared, build_zygote, to_build, run_tx, report_tx.clone());
    let mut runners = Vec::new();
    for lane in &lanes {
        for index in 0..lane.aheads.len() {
            let (shared, lane, queue) = (shared.clone(), lane.clone(), run_queue.clone());
            let report_tx = report_tx.clone();
            runners.push(std::thread::spawn(move || {
                run_slot(&shared, &lane, index, &queue, &report_tx)
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
    let (mut summary, mut store) = writer.join().expect("store writer panicked")?;
    summary.already_done = already_done;
    if let Some(e) = failures.into_iter().next() {
        return Err(e);
    }
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

fn run_info(cfg: &EvalConfig, info: &PythonInfo) -> RunInfo {
    let hardware = match cfg.device {
        Device::Cpu => info.cpu.clone(),
        Device::Cuda => {
            let names: Vec<_> = info.gpus.iter().map(|g| g.name.as_str()).collect();
            names.join(", ")
        }
    };
    RunInfo {
        device: cfg.device.as_str().to_string(),
        hardware,
        torch_version: info.torch.clone(),
        python_version: info.python.clone(),
        dice_version: env!("CARGO_PKG_VERSION").to_string(),
        correctness_trials: cfg.correctness_trials,
        perf_trials: cfg.perf_trials,
        atol: cfg.atol,
        rtol: cfg.rtol,
        baseline: cfg.baseline.as_str().to_string(),
        strict: cfg.strict,
        source: cfg.source.clone(),
    }
}

/// Settings outside [`RunInfo`] that still change verdicts or timings.
fn run_settings(cfg: &EvalConfig) -> serde_json::Value {
    json!({"precision": cfg.precision.as_str(), "timing rounds": cfg.timing_rounds})
}

/// The environment of every child: extensions are built for the GPUs of this machine.
fn job_env(cfg: &EvalConfig, info: &PythonInfo) -> serde_json::Value {
    let mut env = serde_json::Map::new();
    if cfg.device == Device::Cuda && std::env::var_os("TORCH_CUDA_ARCH_LIST").is_none() {
        let mut archs: Vec<_> = info.gpus.iter().map(|g| g.arch.clone()).collect();
        archs.sort();
        archs.dedup();
        env.insert("TORCH_CUDA_ARCH_LIST".to_string(), archs.join(";").into());
    }
    serde_json::Value::Object(env)
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

type Worker = std::thread::JoinHandle<Result<()>>;

fn start_builders(
    shared: &Arc<Shared>,
    zygote: Arc<ZygoteSlot>,
    to_build: Vec<usize>,
    run_tx: Producer<RunItem>,
    report_tx: Sender<Report>,
) -> Vec<Worker> {
    if to_build.is_empty() {
        return Vec::new();
    }
    let threads = shared.ctx.cfg.jobs.clamp(1, to_build.len());
    let queue = Arc::new(Mutex::new(to_build.into_iter()));
    (0..threads)
        .map(|_| {
            let (shared, queue, zygote) = (shared.clone(), queue.clone(), zygote.clone());
            let (run_tx, report_tx) = (run_tx.clone(), report_tx.clone());
            std::thread::spawn(move || -> Result<()> {
                loop {
                    let Some(i) = queue.lock().unwrap().next() else {
                        return Ok(());
                    };
                    let z = zygote.get(&shared.rt)?;
                    let sample = &shared.samples[i];
                    let code = sample
                        .code
                        .as_deref()
                        .expect("only samples with code are built");
                    match stage_build::build(&shared.ctx, &z, sample, code)? {
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

/// A fork server started on first use, and again once it died or was given up.
struct ZygoteSlot {
    env: Vec<(String, String)>,
    log_name: String,
    current: Mutex<Option<Arc<Zygote>>>,
}

impl ZygoteSlot {
    fn new(env: Vec<(String, String)>, log_name: String) -> Self {
        ZygoteSlot {
            env,
            log_name,
            current: Mutex::default(),
        }
    }

    fn get(&self, rt: &Runtime) -> Result<Arc<Zygote>> {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(z) = current.as_ref().filter(|z| z.is_alive()) {
            return Ok(z.clone());
        }
        let z = Arc::new(Zygote::start(rt, &self.env, &self.log_name)?);
        *current = Some(z.clone());
        Ok(z)
    }

    /// Starts the fork server now, in the background, so that it is ready (or being started)
    /// when first needed; a start that fails is tried again, and reported, by that `get`.
    fn start_early(self: &Arc<Self>, rt: &Arc<Runtime>) {
        let (slot, rt) = (self.clone(), rt.clone());
        std::thread::spawn(move || slot.get(&rt));
    }

    /// The next `get` starts a fresh fork server, unless another caller already replaced `z`.
    fn discard(&self, z: &Arc<Zygote>) {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if current.as_ref().is_some_and(|c| Arc::ptr_eq(c, z)) {
            *current = None;
        }
    }
}

/// One device: the fork server its run slots share, the gate that keeps timing exclusive, the
/// memory its problems in flight were promised, and each run slot's next sample taken ahead.
struct Lane {
    zygote: Arc<ZygoteSlot>,
    gate: DeviceGate,
    memory: DeviceMemory,
    aheads: Vec<Mutex<Option<Ahead>>>,
}

impl Lane {
    fn new(zygote_env: &[(String, String)], gpu: Option<usize>, slots: usize) -> Self {
        let mut env = zygote_env.to_vec();
        let log_name = match gpu {
            Some(i) => {
                env.push(("CUDA_VISIBLE_DEVICES".to_string(), i.to_string()));
                format!("zygote-gpu{i}.log")
            }
            None => "zygote-cpu.log".to_string(),
        };
        Lane {
            zygote: Arc::new(ZygoteSlot::new(env, log_name)),
            gate: DeviceGate::default(),
            memory: DeviceMemory::default(),
            aheads: (0..slots.max(1)).map(|_| Mutex::default()).collect(),
        }
    }

    /// Run slot `index`'s sample taken ahead.
    fn ahead(&self, index: usize) -> MutexGuard<'_, Option<Ahead>> {
        self.aheads[index].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A sample another slot took ahead and has not begun.
    fn steal(&self) -> Option<Ahead> {
        (0..self.aheads.len()).find_map(|i| self.ahead(i).take())
    }
}

fn run_slot(
    shared: &Shared,
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

fn out_of_device_memory(result: &Result<Unsettled, RunError>) -> bool {
    let message = match result {
        Ok(u) if matches!(u.outcome.verdict, Verdict::RuntimeError | Verdict::Crashed) => {
            u.outcome.message.as_deref().unwrap_or_default()
        }
        Err(RunError::Reference(failed)) => &failed.0,
        _ => return false,
    };
    [
        "CUDA out of memory",
        "CUBLAS_STATUS_ALLOC_FAILED",
        "cudaErrorMemoryAllocation",
    ]
    .iter()
    .any(|m| message.contains(m))
}

/// One candidate in flight on a device, the reference process of the problem it is on, and the
/// device memory promised to both; (with `look_ahead`) the slot's next sample, its processes
/// already starting, waits in its lane.
struct RunSlot<'a, 'e> {
    shared: &'a Shared,
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

/// A run slot's next sample, taken from the queue while its current one runs (or taken now).
struct Ahead {
    item: RunItem,
    /// None when it was taken straight from the queue or they could not be started (they start
    /// in its turn).
    started: Option<Started>,
}

/// Processes started ahead for a sample, on the fork server `zygote`: its candidate, and its
/// problem's reference when that differs from the problem the slot was on.
struct Started {
    zygote: Arc<Zygote>,
    candidate: CandidateRun,
    reference: Option<StartedReference>,
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
            let sample = &shared.samples[item.sample];
            // One retry with a fresh fork server when the evaluator itself failed.
            let mut result = self.run(sample, item.compiled.clone(), false, started);
            if let Err(RunError::Evaluator(e)) = &result {
                tracing::warn!("{}: restarting the worker after: {e:#}", sample.origin);
                self.reset();
                result = self.run(sample, item.compiled.clone(), false, None);
            }
            // Device memory may have run out because of the others in flight: not the
            // candidate's fault (nor the reference's) until it happens with the device to itself.
            if shared.ctx.cfg.runs_per_device > 1 && out_of_device_memory(&result) {
                tracing::info!(
                    "{}: out of device memory beside others; again alone",
                    sample.origin
                );
                if let Ok(failed) = result {
                    failed.settle();
                }
                self.forget_failed_reference();
                result = self.run(sample, item.compiled, true, None);
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
        let ctx = &self.shared.ctx;
        let zygote = self
            .lane
            .zygote
            .get(&self.shared.rt)
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
            None => (
                stage_run::spawn_candidate(ctx, &zygote, problem, code)?,
                None,
            ),
        };
        let mut reference_s = None;
        if self.reference.as_ref().is_none_or(|(k, _)| *k != key) {
            if !exclusive {
                self.close_reference();
            }
            let started = Instant::now();
            let result = self.start_reference(&zygote, problem, &access, started_reference)?;
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
    /// candidate (unless the slot already holds the whole device). When that does not fit beside
    /// the problems in flight, the reference is closed while the slot waits, then started again.
    fn start_reference(
        &mut self,
        zygote: &Zygote,
        problem: &EvalProblem,
        access: &Access<'_>,
        mut started: Option<StartedReference>,
    ) -> Result<Result<Reference, ReferenceFailed>, RunError> {
        let ctx = &self.shared.ctx;
        loop {
            let started = match started.take() {
                Some(s) => s,
                None => Reference::spawn(ctx, zygote, problem)?,
            };
            let reference = match started.construct(ctx, problem, access) {
                Ok(r) => r,
                Err(RunError::Reference(failed)) => return Ok(Err(failed)),
                Err(e) => return Err(e),
            };
            let Some(footprint) = reference.footprint().filter(|_| self.reservation.is_none())
            else {
                return Ok(Ok(reference));
            };
            let memory = &self.lane.memory;
            memory.set_device_total(footprint.device_total);
            let need = 2 * (footprint.bytes + PROCESS_OVERHEAD_BYTES);
            if let Some(reservation) = memory.try_reserve(need) {
                self.reservation = Some(reservation);
                return Ok(Ok(reference));
            }
            tracing::info!(
                "{}: waits for {:.1} GiB of device memory",
                problem.name,
                need as f64 / f64::from(1 << 30)
            );
            reference.close();
            self.reservation = Some(memory.reserve(need));
        }
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
        let ctx = &self.shared.ctx;
        let sample = &self.shared.samples[item.sample];
        let (key, problem, code) = self.shared.problem_and_code(sample);
        let started =
            stage_run::spawn_candidate(ctx, zygote, problem, code).and_then(|candidate| {
                let reference = (key != current)
                    .then(|| Reference::spawn(ctx, zygote, problem))
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

fn progress_bar(show: bool, len: usize) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

fn write_reports(
    mut store: Store,
    shared: &Shared,
    reports: Receiver<Report>,
    audit: Option<Arc<dyn Audit>>,
    bar: ProgressBar,
) -> Result<(Summary, Store)> {
    let mut summary = Summary::default();
    let mut failed_problems: BTreeMap<ProblemKey, String> = BTreeMap::new();
    for report in reports {
        match report {
            Report::ReferenceOk(key) => {
                store.set_reference_error(key.0, key.1, None)?;
                failed_problems.remove(&key);
            }
            Report::ReferenceFailed(i, why) => {
                let s = &shared.samples[i];
                store.set_reference_error(s.level, s.problem_id, Some(&why))?;
                failed_problems.insert((s.level, s.problem_id), why);
                summary.skipped += 1;
                bar.inc(1);
            }
            Report::Sample(i, outcome) => {
                let sample = &shared.samples[i];
                let problem = &shared.problems[&(sample.level, sample.problem_id)];
                let (mut record, extras) = into_record(sample, *outcome);
                if let Some(audit) = &audit {
                    audit.audit(problem, sample, &mut record);
                }
                store
                    .put_sample(&record, &extras)
                    .with_context(|| format!("storing the result of {}", sample.origin))?;
                *summary.verdicts.entry(record.verdict).or_default() += 1;
                summary.timeline.last_outcome_s = Some(shared.started.elapsed().as_secs_f64());
                bar.inc(1);
            }
        }
        bar.set_message(progress_message(&summary));
    }
    bar.finish();
    summary.reference_errors = failed_problems
        .into_iter()
        .map(|((l, p), why)| (l, p, why))
        .collect();
    Ok((summary, store))
}

fn progress_message(summary: &Summary) -> String {
    let mut parts: Vec<String> = summary
        .verdicts
        .iter()
        .map(|(v, n)| format!("{v} {n}"))
        .collect();
    if summary.skipped > 0 {
        parts.push(format!("skipped {}", summary.skipped));
    }
    parts.join(" · ")
}

fn into_record(sample: &EvalSample, o: Outcome) -> (SampleRecord, SampleExtras) {
    let speedup = match (&o.candidate_timing, &o.baseline_timing) {
        (Some(c), Some(b)) if o.verdict == Verdict::Correct && c.mean_ms > 0.0 => {
            Some(b.mean_ms / c.mean_ms)
        }
        _ => None,
    };
    let mut flags: Vec<String> = o.findings.iter().map(|f| f.rule.id().to_string()).collect();
    flags.sort();
    flags.dedup();
    let deceptive = o
        .findings
        .iter()
        .any(|f| f.severity == dice_audit::Severity::Error);
    let mut log = o.log;
    for f in &o.findings {
        log.push_str(&format!("\n[dice-eval] {}: {}", f.rule.id(), f.message));
    }
    let record = SampleRecord {
        level: sample.level,
        problem_id: sample.problem_id,
        sample_id: sample.sample_id,
        code_hash: sample.code.as_deref().map(sha256_hex),
        verdict: o.verdict,
        message: o.message,
        max_abs_error: o.max_abs_error,
        max_rel_error: o.max_rel_error,
        trials_passed: o.trials_passed,
        candidate_timing: o.candidate_timing,
        baseline_timing: o.baseline_timing,
        speedup,
        flags,
        deceptive,
        log_excerpt: log,
        wall_s: o.wall_s,
        stages: o.stages,
    };
    let extras = SampleExtras {
        origin: sample.origin.clone(),
        candidate_wall_ms: o.candidate_wall_ms,
        baseline_wall_ms: o.baseline_wall_ms,
        builds: o.builds,
        kernels: o.kernels,
    };
    (record, extras)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slot out of work takes the samples other slots took ahead and have not begun, each once.
    #[test]
    fn an_idle_slot_takes_what_others_took_ahead() {
        let lane = Lane::new(&[], None, 3);
        let ahead = |sample| Ahead {
            item: RunItem {
                sample,
                compiled: Compiled::default(),
            },
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
