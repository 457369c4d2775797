//! The judge: a handle that evaluates batches of candidates into one run store, its interpreter
//! checked once and its fork servers (torch imported once each) and build cache kept warm from
//! one batch to the next. `dice eval` judges one batch; callers that submit batches while others
//! run use an [`crate::Evaluator`], which serves them from a judge.

use crate::batch::{Batch, Submission};
use crate::config::{Audit, Device, EvalConfig, EvalProblem, EvalSample};
use crate::job::JobContext;
use crate::outcome::{Evaluated, Summary};
use crate::pipeline::Workers;
use crate::python::{Probe, PythonInfo, Runtime};
use crate::sandbox;
use crate::zygote::ZygoteSlot;
use anyhow::{bail, Context, Result};
use dice_store::{RunInfo, Store};
use serde_json::json;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

/// Judges batches of candidates into the store at `cfg.db`, one batch after another.
///
/// ```no_run
/// # fn judge_all(cfg: dice_eval::EvalConfig, batches: Vec<dice_eval::Batch>) -> anyhow::Result<()> {
/// let mut judge = dice_eval::Judge::start(cfg, None)?;
/// for batch in batches {
///     let summary = judge.evaluate(batch)?;
///     for record in &summary.records {
///         println!("{} {}: {}", record.problem_id, record.sample_id, record.verdict);
///     }
/// }
/// judge.shutdown();
/// # Ok(())
/// # }
/// ```
pub struct Judge {
    workers: Workers,
    store: Store,
    audit: Option<Arc<dyn Audit>>,
    /// When the judge started, until its first batch takes it as its own start (the interpreter
    /// check and the fork servers' start-up count in that batch's timeline).
    started: Option<Instant>,
}

impl Judge {
    /// Opens the store, checks the interpreter (torch, ninja; on CUDA the GPUs and nvcc) while
    /// the devices' fork servers import torch, and records the run's settings: a run resumed with
    /// other settings is refused unless `cfg.force`. `audit` runs on every finished sample
    /// before it is stored.
    pub fn start(cfg: EvalConfig, audit: Option<Arc<dyn Audit>>) -> Result<Judge> {
        let started = Instant::now();
        let mut store = match &cfg.postgres {
            Some((url, run)) => Store::open_postgres(url, run)?,
            None => Store::open(&cfg.db)?,
        };
        let rt = Arc::new(Runtime::new(cfg.python.as_deref())?);
        sandbox::prepare(&cfg.build_cache)?;
        let probe = rt.start_probe(Probe::for_device(cfg.device))?;

        // Off the timed cores before any fork server starts: a fork server inherits this
        // process's cores, and its forks (a process with torch imported: milliseconds of page
        // tables each) preempted timed calls when it could run on theirs.
        if cfg.device == Device::Cuda {
            crate::job::process_core_split();
        }
        // The fork servers import torch while the interpreter is checked, not after it: each
        // import takes seconds, and the first candidate needs its device's fork server ready.
        let zygote_env = vec![("DICE_DEVICE".to_string(), cfg.device.as_str().to_string())];
        let build_zygote = Arc::new(ZygoteSlot::for_builds(cfg.device));
        let start_device = |gpu| {
            let zygote = Arc::new(ZygoteSlot::for_device(&zygote_env, gpu));
            zygote.start_early(&rt);
            zygote
        };
        let mut device_zygotes = vec![start_device((cfg.device == Device::Cuda).then_some(0))];
        let info = probe.output()?;
        if cfg.device == Device::Cuda {
            if info.gpus.is_empty() {
                bail!("--device cuda: no GPU is visible");
            }
            device_zygotes.extend((1..info.gpus.len()).map(|gpu| start_device(Some(gpu))));
        }
        let (seed, recorded) = run_seed(&store, &cfg)?;
        let mut settings = run_settings(&cfg);
        if recorded {
            settings["seed"] = json!(seed);
        }
        store.begin_run(&run_info(&cfg, &info), &settings, cfg.force)?;
        keep_private(&cfg.db);
        let env = job_env(&cfg, &info);
        let workers = Workers {
            ctx: JobContext::new(cfg, rt.jobs_dir(), env, seed),
            rt,
            build_zygote,
            device_zygotes,
        };
        Ok(Judge {
            workers,
            store,
            audit,
            started: Some(started),
        })
    }

    /// Evaluates `batch`, skipping samples already stored unless `cfg.force`; the records of
    /// those it evaluated are in the summary and in the store.
    pub fn evaluate(&mut self, batch: Batch) -> Result<Summary> {
        let started = self.started.take().unwrap_or_else(Instant::now);
        self.workers
            .evaluate(&mut self.store, self.audit.as_deref(), batch, started)
    }

    /// Evaluates the batches that arrive on `submissions`, one pipeline for all of them, until
    /// that channel closes; each sample's outcome goes to `results` (an [`crate::Evaluator`]).
    pub(crate) fn serve(
        mut self,
        submissions: Receiver<Submission>,
        results: Sender<Evaluated>,
    ) -> Result<Summary> {
        let started = self.started.take().unwrap_or_else(Instant::now);
        self.workers.run(
            &mut self.store,
            self.audit.as_deref(),
            submissions,
            Some(results),
            started,
        )
    }

    /// Ends the fork servers (waiting for any still starting) and removes the scratch directory;
    /// dropping the judge does the same.
    pub fn shutdown(self) {}
}

/// Evaluates `samples` against `problems` into the store at `cfg.db` with a judge of its own,
/// skipping samples already stored unless `cfg.force`.
pub fn evaluate(
    cfg: EvalConfig,
    problems: Vec<EvalProblem>,
    samples: Vec<EvalSample>,
    audit: Option<Arc<dyn Audit>>,
) -> Result<Summary> {
    let batch = Batch::new(problems, samples)?;
    Judge::start(cfg, audit)?.evaluate(batch)
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
        timing: cfg.timing.as_str().to_string(),
        strict: cfg.strict,
        source: cfg.source.clone(),
    }
}

/// Settings outside [`RunInfo`] that still change verdicts or timings.
fn run_settings(cfg: &EvalConfig) -> serde_json::Value {
    json!({
        "precision": cfg.precision.as_str(),
        "timing rounds": cfg.timing_rounds,
        "timing budget s": cfg.timing_budget.map(|b| b.as_secs_f64()),
        "kernelbench namespace": cfg.kernelbench_namespace,
    })
}

/// The run's seed (python/protocol.py `Seeds`), and whether its settings record it: `--input-seed`,
/// else the seed the run began with, else one drawn from the OS now, so that no program can be
/// written for the inputs it will get. A run begun before seeds were drawn keeps KernelBench's,
/// unrecorded, so that it resumes with the inputs its samples were judged on.
fn run_seed(store: &Store, cfg: &EvalConfig) -> Result<(u64, bool)> {
    if let Some(seed) = cfg.seed {
        return Ok((seed, true));
    }
    Ok(match store.run()? {
        Some((_, settings)) => match settings["seed"].as_u64() {
            Some(seed) => (seed, true),
            None => (KERNELBENCH_SEED, false),
        },
        None => (drawn_seed()?, true),
    })
}

/// python/protocol.py `SEED`.
const KERNELBENCH_SEED: u64 = 42;

/// 63 random bits: the timing seeds are the seed and the next, and SQLite's integers are signed.
fn drawn_seed() -> Result<u64> {
    let mut bytes = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("cannot draw the run's seed from /dev/urandom")?;
    Ok(u64::from_le_bytes(bytes) >> 1)
}

/// The store holds the run's seed: readable by the evaluator's user alone, not by the users
/// candidates run as (the database's journal files get its mode from SQLite). Best effort: a
/// store of another owner keeps its mode.
fn keep_private(db: &Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut path = db.as_os_str().to_owned();
        path.push(suffix);
        let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
    }
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
