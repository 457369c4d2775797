//! `dice eval`: evaluate candidate kernels against KernelBench problems or pairs.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use dice_eval::{
    Baseline, Batch, BuildSummary, Device, EvalConfig, EvalProblem, EvalSample, Judge, Precision,
    Shard, StaticAudit, Summary, Timing,
};
use dice_kernelbench::{
    load_candidates, load_pairs, Candidate, InvalidProblem, KernelBench, Problem,
};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Debug)]
pub(crate) struct EvalArgs {
    /// Candidate files, folders of `level_L_problem_ID_sample_S_kernel.py` files, or JSONL files.
    pub candidates: Vec<PathBuf>,
    /// The KernelBench problem tree (the folder holding level1/ … level4/).
    #[arg(
        long,
        value_name = "DIR",
        required_unless_present = "pairs",
        conflicts_with = "pairs"
    )]
    pub kernelbench: Option<PathBuf>,
    /// A PyTorch→CUDA pairs file (JSON or JSONL with pytorch_code and cuda_code) instead.
    #[arg(long, value_name = "FILE")]
    pub pairs: Option<PathBuf>,
    /// The run directory (created; holds dice.db); with --store, the run's name in the database.
    /// --stage build needs none.
    #[arg(long, value_name = "RUN_DIR", required_unless_present = "stage")]
    pub run: Option<PathBuf>,
    /// The SQLite store [default: RUN_DIR/dice.db].
    #[arg(long, value_name = "FILE", conflicts_with = "store")]
    pub db: Option<PathBuf>,
    /// A PostgreSQL database holding the run (postgres://USER@HOST:PORT/DB), named by --run:
    /// `dice eval` processes on any number of hosts started on one run judge its samples
    /// together, each sample once.
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// Where candidates and references run (cuda: torch with CUDA, and nvcc on PATH for CUDA
    /// candidates).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// Re-evaluate samples already in the store (and accept changed settings).
    #[arg(long)]
    pub force: bool,
    /// Which stages this worker runs.
    #[arg(long, value_enum, default_value_t = StageArg::All)]
    pub stage: StageArg,
    /// With --stage build, N workers split the samples: worker K (0 <= K < N, e.g. a Slurm
    /// array task id or a Kubernetes completion index) builds every Nth in the order of sample
    /// keys, from the Kth on [default: 0/1, all of them].
    #[arg(long, value_name = "K/N")]
    pub shard: Option<Shard>,
    #[command(flatten)]
    pub judge: JudgeArgs,
}

/// How candidates are judged: limits, parallelism, the interpreter, correctness and timing.
#[derive(Args, Clone, Debug)]
pub(crate) struct JudgeArgs {
    /// Seconds each run of a candidate may take (builds not included).
    #[arg(long, value_name = "SECS", default_value_t = 120)]
    pub timeout: u64,
    /// Seconds each extension build may take.
    #[arg(long, value_name = "SECS", default_value_t = 900)]
    pub compile_timeout: u64,
    /// Parallel builds [default: all CPU cores].
    #[arg(long, value_name = "N")]
    pub jobs: Option<usize>,
    /// Candidates in flight per device [default: 4 with --device cuda, 1 on the CPU]. Their
    /// process start, extension load and correctness trials overlap; timing always has the
    /// device to itself (the others wait between steps) and, on CUDA machines with 8 or more
    /// cores, two cores that no other process of the run uses. Each costs a candidate and a
    /// reference process on the device; 1 gives the quietest machine for timing.
    #[arg(long, value_name = "N")]
    pub runs_per_device: Option<usize>,
    /// Start no candidate process before its run slot is free. By default with --device cuda,
    /// each slot starts its next candidate's process (and that problem's reference process)
    /// while the current candidate runs, so that process start, CUDA context, imports and
    /// extension loads are off the critical path; on the CPU that start-up would compete with
    /// the wall-clock timing, so it is never done there.
    #[arg(long)]
    pub no_look_ahead: bool,
    /// Python with torch and ninja [default: $DICE_PYTHON, else the project's .dice/venv].
    #[arg(long, value_name = "PATH")]
    pub python: Option<PathBuf>,
    /// The extension build cache [default: $DICE_CACHE, else ~/.cache/dice/builds]. Beside the
    /// builds it keeps a precompiled torch/extension.h (~750 MB) for each host flag set built 8
    /// times or more, at most 4: later builds of the set compile their host code 2-2.5x faster.
    #[arg(long, value_name = "DIR")]
    pub build_cache: Option<PathBuf>,
    /// Correctness trials: forwards on fresh seeded inputs, each compared with the reference's
    /// output; a candidate is correct when all pass (at least 1).
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub correctness_trials: u32,
    /// Timed calls of each correct candidate and of its baseline (0: no timing).
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub perf_trials: u32,
    /// Rounds the timed calls of each side are made in (at most --perf-trials; under --timing
    /// dice the sides alternate round by round). The speedup's interval and the check of the
    /// candidate's clock against the evaluator's work over rounds, so more rounds make both
    /// surer, and a burst of load in one round weighs less.
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub timing_rounds: u32,
    /// Under --timing dice, the seconds one side's timed calls may take in one measurement: when
    /// the correctness trials, then the first round of each side, show calls so long that
    /// --perf-trials of them would take longer, the rounds make fewer calls (at least one each;
    /// from the first round on when the trials show it). Timing holds the device alone, so
    /// without a bound one slow program stops every other sample in flight for minutes; calls
    /// that long are timed precisely in a few. 0: always --perf-trials calls (as KernelBench's
    /// timing, which this never bounds).
    #[arg(long, value_name = "SECONDS", default_value_t = 2.0, value_parser = parse_seconds)]
    pub timing_budget: f64,
    /// Keep the machine quiet while a candidate is timed (the default): the compile stage's
    /// processes (imports, compiler jobs) are stopped during timing windows, for at most
    /// --quiet-timing-share of any 30 s, and go on after them, their time limit not counting the
    /// stop.
    #[arg(long, overrides_with = "no_quiet_timing")]
    pub quiet_timing: bool,
    /// Let builds run beside timing: cold batches finish sooner, timings of small kernels get
    /// noisier.
    #[arg(long, overrides_with = "quiet_timing")]
    pub no_quiet_timing: bool,
    /// The share of wall time builds may be stopped for timing, over any 30 s (0 to 1); past it,
    /// candidates are timed beside running builds, and each sample's stages say for how long. 1
    /// stops them for every timing window, however much that delays a cold batch.
    #[arg(long, value_name = "SHARE", default_value_t = 0.25, value_parser = parse_share)]
    pub quiet_timing_share: f64,
    /// Measure a candidate and its baseline again when the coefficient of variation (standard
    /// deviation / mean) of either side's timed calls is above this.
    #[arg(long, value_name = "CV", default_value_t = 0.15)]
    pub remeasure_above_cv: f64,
    /// Measurements made again at most, per candidate; the stored statistics pool the calls of
    /// every measurement, with the count.
    /// A candidate is also measured again while the evaluator's wall clock contradicts the
    /// times it reports (a forged clock contradicts every round; a burst of load, a few).
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub max_remeasures: u32,
    /// atol = rtol of the correctness check (KernelBench v0.1 / DICE: 1e-2).
    #[arg(
        long,
        value_name = "TOL",
        default_value_t = 1e-2,
        conflicts_with = "kernelbench_tolerance"
    )]
    pub tolerance: f64,
    /// Use KernelBench HEAD's per-precision tolerance instead (fp32 1e-4, fp16/bf16 1e-2).
    #[arg(long)]
    pub kernelbench_tolerance: bool,
    /// The dtype floating-point inputs and parameters are cast to, for the reference and the
    /// candidate alike [default: fp32].
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionArg>,
    /// What speedups are measured against.
    #[arg(long, value_enum, default_value_t = BaselineArg::Eager)]
    pub baseline: BaselineArg,
    /// How the timed calls are made. dice: candidate and baseline rounds interleaved, every call
    /// on inputs no call saw before (a sample of the timed outputs judged), L2 flushed before
    /// every call, speedups from the means of the calls. dice-queued (the default): the same,
    /// with every call on the GPU starting behind a spin as long as the baseline's enqueue of a
    /// call (1.5 times its 90th percentile, plus 20 us), so that the time is the device's work,
    /// not the host's launch path and its stalls (a program's host time beyond that still
    /// counts), and speedups on a GPU from the medians of the calls, which a rare host stall
    /// does not move. kernelbench: KernelBench's harness call for
    /// call (3 warm-ups, L2 flush and synchronisation before each of 100 calls, the first
    /// discarded, one input set, the candidate's calls then the baseline's, means to 3
    /// significant digits); kernelbench-v0.1: its form in DICE's paper (no flush, no
    /// synchronisation before a call, nothing discarded). crates/dice-eval/TIMING.md compares
    /// them.
    #[arg(long, value_enum, default_value_t = TimingArg::DiceQueued)]
    pub timing: TimingArg,
    /// Run each program with the problem file's globals (its constants, imports, `Model`), as
    /// KernelBench's harness does by exec'ing both into one namespace, so that Exec rates
    /// compare with papers that used it. By default a program sees only its own globals; one
    /// that fails on a name of the problem file is told so.
    #[arg(long)]
    pub kernelbench_namespace: bool,
    /// Count samples flagged as deceptive (static or run-time reward-hack findings) as
    /// incorrect; stored with the run, so reports score it strictly too. Also makes PyTorch
    /// compute in forward and a low share of GPU time in the program's own kernels errors. A
    /// program that a static rule makes deceptive whatever it runs is then neither built nor run:
    /// verdict `rejected` (which counts as not compiled; to know whether such programs compile,
    /// judge without --strict and score with `dice report --strict`).
    #[arg(long)]
    pub strict: bool,
    /// Fix the seed of the correctness trials' and the timing's inputs, to reproduce a run. By
    /// default each run draws its own (stored with the run and kept when it resumes), so that
    /// no program can carry the outputs of inputs it knows in advance; a fixed seed is public
    /// and gives up that defence. --input-seed 42 gives KernelBench's inputs.
    #[arg(long, value_name = "N")]
    pub input_seed: Option<u64>,
    /// Judge every sample, also one whose program an earlier sample brought for the same
    /// problem, byte for byte. By default such a repeat is neither built nor run: it gets a copy
    /// of the first one's judgement (its log says so), since judging it again would only draw
    /// the timing noise again. Use this to measure that noise.
    #[arg(long)]
    pub judge_each_copy: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum StageArg {
    /// Build, run, judge and time the candidates, storing their results.
    All,
    /// Only build the candidates' extensions into --build-cache, a folder that the judging
    /// workers share; needs no GPU and stores nothing else. With --device cuda the host needs
    /// nvcc, and TORCH_CUDA_ARCH_LIST set to the GPUs' architectures (9.0 for H100/H200).
    Build,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum PrecisionArg {
    Fp32,
    Fp16,
    Bf16,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum TimingArg {
    Dice,
    DiceQueued,
    Kernelbench,
    #[value(name = "kernelbench-v0.1")]
    KernelbenchV01,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum BaselineArg {
    Eager,
    TorchCompile,
}

pub(crate) fn run(a: EvalArgs) -> Result<()> {
    let (problems, invalid, candidates, source) = load_inputs(&a)?;
    for bad in &invalid {
        eprintln!(
            "warning: {}: {}; its candidates get no verdict",
            bad.path.display(),
            bad.reason
        );
    }
    let mut eval_problems: Vec<EvalProblem> = problems.into_iter().map(EvalProblem::from).collect();
    eval_problems.extend(invalid.iter().filter_map(EvalProblem::defective));
    let samples: Vec<EvalSample> = candidates.into_iter().map(EvalSample::from).collect();
    if samples.is_empty() {
        bail!("no candidates given");
    }
    if a.shard.is_some() && a.stage != StageArg::Build {
        bail!("--shard splits build workers: give it with --stage build");
    }
    if a.stage == StageArg::Build {
        if a.store.is_some() || a.db.is_some() {
            bail!("--stage build stores nothing: give it no --store or --db");
        }
        let mut cfg = EvalConfig::new(PathBuf::new(), source);
        apply_device_and_judging(&mut cfg, &a);
        cfg.progress = true;
        let cache = cfg.build_cache.display().to_string();
        let batch = Batch::new(eval_problems, samples)?;
        let summary = dice_eval::prebuild(cfg, batch, a.shard.unwrap_or(Shard::ALL))?;
        print_build_summary(&summary, &cache);
        return Ok(());
    }
    let cfg = config(&a, source)?;
    let results = match &cfg.postgres {
        Some((url, run)) => format!("run {run} in {url}"),
        None => cfg.db.display().to_string(),
    };
    let batch = Batch::new(eval_problems, samples)?;
    let audit = Arc::new(StaticAudit { strict: cfg.strict });
    let mut judge = Judge::start(cfg, Some(audit))?;
    let summary = judge.evaluate(batch)?;
    judge.shutdown();
    print_summary(&summary, &results);
    Ok(())
}

type Inputs = (Vec<Problem>, Vec<InvalidProblem>, Vec<Candidate>, String);

fn load_inputs(a: &EvalArgs) -> Result<Inputs> {
    if let Some(pairs) = &a.pairs {
        if !a.candidates.is_empty() {
            bail!("--pairs brings its own candidates; give no CANDIDATES with it");
        }
        let set = load_pairs(pairs)?;
        let source = format!("pairs:{}", pairs.display());
        return Ok((set.problems, set.invalid, set.candidates, source));
    }
    let dir = a
        .kernelbench
        .as_ref()
        .expect("clap requires --kernelbench without --pairs");
    if a.candidates.is_empty() {
        bail!("no CANDIDATES given (files, folders or JSONL files)");
    }
    let tree = KernelBench::open(dir)?;
    let scan = tree.scan(None)?;
    let candidates = load_candidates(&a.candidates)?;
    let source = format!("kernelbench:{}", tree.root().display());
    Ok((scan.problems, scan.invalid, candidates, source))
}

fn config(a: &EvalArgs, source: String) -> Result<EvalConfig> {
    let Some(run) = &a.run else {
        bail!("--run RUN_DIR is required to judge candidates (only --stage build goes without)");
    };
    let (local, postgres) = match &a.store {
        Some(url) => {
            let name = run.to_string_lossy().into_owned();
            // The run's files of this host (its device locks), shared by its processes here.
            let folder_name: String = name
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            let local = std::env::temp_dir().join(format!("dice-run-{folder_name}"));
            (local, Some((url.clone(), name)))
        }
        None => (run.clone(), None),
    };
    std::fs::create_dir_all(&local)
        .with_context(|| format!("cannot create {}", local.display()))?;
    let db = a.db.clone().unwrap_or_else(|| local.join("dice.db"));
    let mut cfg = EvalConfig::new(db, source);
    cfg.postgres = postgres;
    apply_device_and_judging(&mut cfg, a);
    cfg.force = a.force;
    cfg.progress = true;
    Ok(cfg)
}

/// The device, then the judging flags (the device decides some of their defaults).
fn apply_device_and_judging(cfg: &mut EvalConfig, a: &EvalArgs) {
    cfg.set_device(a.device);
    a.judge.apply(cfg);
}

impl JudgeArgs {
    /// Sets these flags' settings on `cfg`, whose device is set already (it decides the
    /// defaults of --runs-per-device and --no-look-ahead).
    pub(crate) fn apply(&self, cfg: &mut EvalConfig) {
        cfg.timeout = Duration::from_secs(self.timeout.max(1));
        cfg.compile_timeout = Duration::from_secs(self.compile_timeout.max(1));
        if let Some(jobs) = self.jobs {
            cfg.jobs = jobs.max(1);
        }
        if let Some(n) = self.runs_per_device {
            cfg.runs_per_device = n.max(1);
        }
        cfg.look_ahead &= !self.no_look_ahead;
        cfg.correctness_trials = self.correctness_trials.max(1);
        cfg.seed = self.input_seed;
        cfg.judge_each_copy = self.judge_each_copy;
        cfg.perf_trials = self.perf_trials;
        cfg.timing_rounds = self.timing_rounds;
        cfg.timing_budget =
            (self.timing_budget > 0.0).then(|| Duration::from_secs_f64(self.timing_budget));
        cfg.quiet_timing_share = if self.no_quiet_timing && !self.quiet_timing {
            0.0
        } else {
            self.quiet_timing_share
        };
        cfg.remeasure_above_cv = self.remeasure_above_cv;
        cfg.max_remeasures = self.max_remeasures;
        cfg.precision = match self.precision.unwrap_or(PrecisionArg::Fp32) {
            PrecisionArg::Fp32 => Precision::Fp32,
            PrecisionArg::Fp16 => Precision::Fp16,
            PrecisionArg::Bf16 => Precision::Bf16,
        };
        let tolerance = if self.kernelbench_tolerance {
            cfg.precision.kernelbench_tolerance()
        } else {
            self.tolerance
        };
        cfg.atol = tolerance;
        cfg.rtol = tolerance;
        cfg.baseline = match self.baseline {
            BaselineArg::Eager => Baseline::Eager,
            BaselineArg::TorchCompile => Baseline::TorchCompile,
        };
        cfg.timing = match self.timing {
            TimingArg::Dice => Timing::Dice,
            TimingArg::DiceQueued => Timing::DiceQueued,
            TimingArg::Kernelbench => Timing::KernelBench,
            TimingArg::KernelbenchV01 => Timing::KernelBenchV01,
        };
        cfg.kernelbench_namespace = self.kernelbench_namespace;
        if let Some(dir) = &self.build_cache {
            cfg.build_cache = dir.clone();
        }
        cfg.python = self.python.clone();
        cfg.strict = self.strict;
    }
}

/// A number of seconds, 0 or more.
fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(seconds) if seconds.is_finite() && seconds >= 0.0 => Ok(seconds),
        _ => Err(format!(
            "{s} is not a number of seconds (2, 0.5; 0 for none)"
        )),
    }
}

/// A share of wall time, from 0 to 1.
fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(share) if (0.0..=1.0).contains(&share) => Ok(share),
        _ => Err(format!(
            "{s} is not a share from 0 to 1 (0.25 for a quarter)"
        )),
    }
}

/// Prints what a `--stage build` worker did; `cache` is the build cache it filled.
fn print_build_summary(s: &BuildSummary, cache: &str) {
    println!(
        "{} samples in this shard: built {}, already cached {}, failed to build {}, no code {}, \
         nothing to build {}, rejected (--strict) {}",
        s.in_shard, s.built, s.already_cached, s.failed, s.no_code, s.nothing_to_build, s.rejected
    );
    println!("build cache: {cache}");
}

/// Prints what `s` judged; `results` says where they are stored.
pub(crate) fn print_summary(s: &Summary, results: &str) {
    let evaluated: usize = s.verdicts.values().sum();
    let counts: Vec<String> = s.verdicts.iter().map(|(v, n)| format!("{v} {n}")).collect();
    println!(
        "evaluated {evaluated} samples: {}",
        if counts.is_empty() {
            "-".into()
        } else {
            counts.join(", ")
        }
    );
    if s.already_done > 0 {
        println!(
            "{} samples were already in the store (use --force to re-evaluate)",
            s.already_done
        );
    }
    if s.judged_elsewhere > 0 {
        println!(
            "{} samples were judged by another dice eval on this run",
            s.judged_elsewhere
        );
    }
    if s.copies > 0 {
        println!(
            "{} samples repeated a program judged here for the same problem and got its \
             judgement (--judge-each-copy judges each)",
            s.copies
        );
    }
    for (level, problem_id, why) in &s.reference_errors {
        println!("level {level} problem {problem_id}: the reference failed, its samples get no verdict: {why}");
    }
    if s.skipped > 0 {
        println!(
            "{} samples skipped because their problem's reference failed",
            s.skipped
        );
    }
    let t = &s.timeline;
    if t.samples > 0 {
        let secs = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.1} s"));
        println!(
            "time: {:.1} s, the first sample began at {}, the last outcome at {}; {} timing \
             windows held the device alone for {:.1} s (waited for: {:.1} s; untimed steps \
             refused for {:.1} s); {} untimed steps held {:.1} s, waited {:.1} s, the longest {:.1} s",
            t.wall_s,
            secs(t.first_sample_s),
            secs(t.last_outcome_s),
            t.exclusive_windows,
            t.exclusive_s,
            t.exclusive_wait_s,
            t.gate_closed_s,
            t.untimed_steps,
            t.untimed_step_s,
            t.untimed_wait_s,
            t.longest_untimed_step_s
        );
    }
    println!("results: {results}");
}
