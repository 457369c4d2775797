//! `dice eval --stage build`: a worker that only builds candidates' extensions into the shared
//! build cache, for `dice eval` workers on GPU hosts to find there. It needs no GPU: its compile
//! stage is the evaluator's own (stage_build.rs), with CUDA hidden as always. It stores no
//! verdicts and claims no samples; the cache is the shared state, and its entries are published
//! whole under their content key behind a per-key lock (build_cache.rs), so builders on several
//! hosts sharing one folder never build a key twice at the same time nor see half an entry.
//! Failed builds are entries too: the run stage then gives their candidates compile_error at once.
//!
//! Several builders split a batch by [`Shard`]: builder K of N takes every Nth sample in the
//! order of sample keys, from the Kth on. A builder that dies leaves its share to the GPU
//! workers, which build what they miss themselves.

use crate::audit;
use crate::batch::Batch;
use crate::config::{Device, EvalConfig, EvalSample};
use crate::job::JobContext;
use crate::python::{Probe, Runtime};
use crate::sandbox;
use crate::stage_build::{self, Built};
use crate::writer::progress_bar;
use crate::zygote::ZygoteSlot;
use anyhow::{bail, Result};
use serde_json::json;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Builder `index` of `count` (0 ≤ index < count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl Shard {
    /// The whole batch.
    pub const ALL: Shard = Shard { index: 0, count: 1 };

    fn takes(self, position: usize) -> bool {
        position % self.count == self.index
    }
}

impl FromStr for Shard {
    type Err = String;

    /// `K/N`, as a Slurm array task id or a Kubernetes completion index and the worker count.
    fn from_str(s: &str) -> Result<Shard, String> {
        let shard = s.split_once('/').and_then(|(k, n)| {
            let (index, count) = (k.trim().parse().ok()?, n.trim().parse().ok()?);
            Some(Shard { index, count })
        });
        match shard {
            Some(shard) if shard.index < shard.count => Ok(shard),
            _ => Err(format!(
                "{s} is not a shard K/N with 0 <= K < N (0/4 for the first of four builders)"
            )),
        }
    }
}

/// What a build worker did with its share of the batch, in samples.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BuildSummary {
    /// Samples of the batch in this worker's shard.
    pub in_shard: usize,
    /// At least one of its extensions was built here, and all of them are usable.
    pub built: usize,
    /// Every extension it loads was in the cache already.
    pub already_cached: usize,
    /// An extension failed to build or ran out of time (cached as such, but for a transient
    /// failure).
    pub failed: usize,
    /// No code block could be extracted from the answer.
    pub no_code: usize,
    /// It builds no extension, or its problem could not be read: nothing for the cache.
    pub nothing_to_build: usize,
    /// Under `strict`, a static rule makes it deceptive whatever it runs: the judges neither
    /// build nor run it (verdict `rejected`), so neither does this worker.
    pub rejected: usize,
}

/// Builds the extensions of `batch`'s samples in `shard` into `cfg.build_cache`, `cfg.jobs` at
/// a time. With `Device::Cuda` the host needs nvcc but no GPU, and `TORCH_CUDA_ARCH_LIST` set
/// to the GPU workers' architectures: it is part of every build's key.
pub fn prebuild(cfg: EvalConfig, batch: Batch, shard: Shard) -> Result<BuildSummary> {
    if cfg.device == Device::Cuda && std::env::var_os("TORCH_CUDA_ARCH_LIST").is_none() {
        bail!(
            "--stage build --device cuda: set TORCH_CUDA_ARCH_LIST to the GPU workers' \
             architectures (9.0 for H100/H200), so that the builds get the keys they look up"
        );
    }
    let rt = Runtime::new(cfg.python.as_deref())?;
    sandbox::prepare(&cfg.build_cache)?;
    let probe = rt.start_probe(match cfg.device {
        Device::Cpu => Probe::Cpu,
        Device::Cuda => Probe::CudaBuilds,
    })?;
    probe.output()?;
    let zygote = ZygoteSlot::for_builds(cfg.device);

    let mut samples: Vec<&EvalSample> = batch.samples.iter().collect();
    samples.sort_by_key(|s| (s.level, s.problem_id, s.sample_id));
    let mine: Vec<&EvalSample> = samples
        .into_iter()
        .enumerate()
        .filter(|(position, _)| shard.takes(*position))
        .map(|(_, s)| s)
        .collect();
    let bar = progress_bar(cfg.progress, mine.len());
    let jobs = cfg.jobs.max(1);
    // Builds need no seed and see no environment of the GPUs: TORCH_CUDA_ARCH_LIST is this
    // process's own, which the builders inherit.
    let ctx = JobContext::new(cfg, rt.jobs_dir(), json!({}), 0);
    let summary = Mutex::new(BuildSummary {
        in_shard: mine.len(),
        ..BuildSummary::default()
    });
    let next = AtomicUsize::new(0);
    let built = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..jobs)
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    while let Some(sample) = mine.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let problem = batch.problems.get(&(sample.level, sample.problem_id));
                        let counted = build_one(&ctx, &rt, &zygote, sample, problem)?;
                        counted(&mut summary.lock().expect("no builder panicked"));
                        bar.inc(1);
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().expect("builder thread panicked"))
    });
    bar.finish_and_clear();
    zygote.stop();
    built?;
    Ok(summary.into_inner().expect("no builder panicked"))
}

/// Runs `sample`'s compile stage when it has one; returns where it counts.
fn build_one(
    ctx: &JobContext,
    rt: &Runtime,
    zygote: &ZygoteSlot,
    sample: &EvalSample,
    problem: Option<&crate::config::EvalProblem>,
) -> Result<fn(&mut BuildSummary)> {
    let Some(code) = sample.code.as_deref() else {
        return Ok(|s| s.no_code += 1);
    };
    let Some(problem) = problem.filter(|p| p.defect.is_none()) else {
        return Ok(|s| s.nothing_to_build += 1);
    };
    if ctx.cfg.strict && audit::rejected_before_running(problem, code).is_some() {
        return Ok(|s| s.rejected += 1);
    }
    if !stage_build::may_build(code) {
        return Ok(|s| s.nothing_to_build += 1);
    }
    let z = zygote.get(rt)?;
    Ok(match stage_build::build(ctx, &z, sample, code)? {
        Built::Failed(_) => |s| s.failed += 1,
        Built::Ready(compiled) if compiled.builds.is_empty() => |s| s.nothing_to_build += 1,
        Built::Ready(compiled) if compiled.builds.iter().all(|b| b.cached) => {
            |s| s.already_cached += 1
        }
        Built::Ready(_) => |s| s.built += 1,
    })
}
