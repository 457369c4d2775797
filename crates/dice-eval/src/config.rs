//! What to evaluate and how: the evaluator's inputs and settings.

use dice_kernelbench::{Candidate, InvalidProblem, Problem};
use dice_store::{KernelProfile, SampleRecord};
use std::path::PathBuf;
use std::time::Duration;

/// Where work runs: candidates' programs, a model, a trainer's ranks. The one device enum of
/// the workspace: the CLI's `--device` flags parse into it (clap's `ValueEnum` behind the `clap`
/// feature) and configuration files name it in lower case.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// The CPU: C++ candidates, CPU models and trainers (tests, machines without a GPU).
    #[default]
    Cpu,
    /// NVIDIA GPUs through CUDA.
    Cuda,
}

impl Device {
    pub fn as_str(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            other => Err(format!("unknown device '{other}': expected cpu or cuda")),
        }
    }
}

/// What a candidate's speed is compared with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Baseline {
    Eager,
    TorchCompile,
}

impl Baseline {
    pub fn as_str(self) -> &'static str {
        match self {
            Baseline::Eager => "eager",
            Baseline::TorchCompile => "torch_compile",
        }
    }
}

/// How timed calls are made and summarised (crates/dice-eval/TIMING.md compares them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timing {
    /// dice's own: candidate and baseline rounds interleaved, every call on inputs of its own
    /// copied into fixed buffers, a sample of the timed calls judged, the L2 flushed before
    /// every call, garbage collection paused.
    Dice,
    /// dice's, with every timed call on the device starting behind a spin as long as the
    /// baseline's enqueue of a call with a margin (python/protocol.py `HOLD_FACTOR`): both
    /// sides' launches are queued before the start event runs, so the events time the device's
    /// work alone, not the host's launch path and its stalls (bench/notes/eval-h200.md, session
    /// 34: such a spin outside the evaluator, per-call CV 0.05 where dice's was 0.29 on the same
    /// host). The hold follows the baseline's enqueues round by round (`_adapt_hold`). A
    /// candidate's host time beyond the baseline's margin still counts. The baseline's rounds
    /// come first, to set the hold. On a GPU its speedup divides medians (stats.rs
    /// `Statistic`); on the CPU, with no launch queue to hold, it is `Dice`. The default
    /// (TIMING.md says why).
    DiceQueued,
    /// KernelBench HEAD's `cuda_event` harness (KB spec §3): the candidate's calls, then the
    /// baseline's as `measure_ref_program_time` makes them; one input set; means to 3
    /// significant digits.
    KernelBench,
    /// KernelBench v0.1's loop, used for DICE's paper: no L2 flush, no synchronisation before
    /// a call, nothing discarded.
    KernelBenchV01,
}

impl Timing {
    pub fn as_str(self) -> &'static str {
        match self {
            Timing::Dice => "dice",
            Timing::DiceQueued => "dice-queued",
            Timing::KernelBench => "kernelbench",
            Timing::KernelBenchV01 => "kernelbench-v0.1",
        }
    }

    /// Whether the candidate's and the baseline's rounds alternate; KernelBench's methods time
    /// all of the candidate's calls, then all of the baseline's.
    pub fn interleaves(self) -> bool {
        matches!(self, Timing::Dice | Timing::DiceQueued)
    }

    /// Whether dispersed calls are measured again; KernelBench's harness measures once.
    pub fn remeasures(self) -> bool {
        self.interleaves()
    }

    /// Whether timed calls start behind the baseline's hold: `DiceQueued` on a GPU. On the CPU
    /// there is no launch queue to hold, and `DiceQueued` times as `Dice` does.
    pub fn queues_launches(self, device: Device) -> bool {
        self == Timing::DiceQueued && device == Device::Cuda
    }

    /// Calls the candidate's timer makes before its first timed one: the warm-ups, and the
    /// trial KernelBench HEAD discards.
    pub fn untimed_first_calls(self) -> u32 {
        match self {
            Timing::Dice | Timing::DiceQueued | Timing::KernelBenchV01 => 3,
            Timing::KernelBench => 4,
        }
    }

    /// How many of a candidate's timed calls have their outputs judged after timing (fewer when
    /// it made fewer calls): a uniform sample of them (python/protocol.py `CheckedCalls`), or
    /// KernelBench's last.
    pub fn checked_timed_calls(self) -> u64 {
        match self {
            Timing::Dice | Timing::DiceQueued => 3,
            Timing::KernelBench | Timing::KernelBenchV01 => 1,
        }
    }
}

/// Floating-point tensors (inputs, parameters) are cast to this precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    Fp32,
    Fp16,
    Bf16,
}

impl Precision {
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
        }
    }

    /// KernelBench HEAD's tolerance for this precision (atol = rtol), KB spec §2.5.
    pub fn kernelbench_tolerance(self) -> f64 {
        match self {
            Precision::Fp32 => 1e-4,
            Precision::Fp16 | Precision::Bf16 => 1e-2,
        }
    }
}

/// One problem to evaluate against: its reference program as bytes.
#[derive(Clone, Debug)]
pub struct EvalProblem {
    pub level: u32,
    pub problem_id: u32,
    pub name: String,
    pub source: Vec<u8>,
    /// Why the problem cannot be used, when that is known before running it (e.g. no
    /// `get_inputs`); recorded as its reference error.
    pub defect: Option<String>,
}

impl From<Problem> for EvalProblem {
    fn from(p: Problem) -> EvalProblem {
        EvalProblem {
            level: p.level,
            problem_id: p.problem_id,
            name: p.name,
            source: p.source,
            defect: None,
        }
    }
}

impl EvalProblem {
    /// A rejected problem file that still names its level and id (`levelL/ID_name.py`): its
    /// candidates are skipped with the reason as the problem's reference error.
    pub fn defective(bad: &InvalidProblem) -> Option<EvalProblem> {
        let name = bad.path.file_name()?.to_str()?.to_string();
        let problem_id = name.split('_').next()?.parse().ok()?;
        let level = bad
            .path
            .parent()?
            .file_name()?
            .to_str()?
            .strip_prefix("level")?
            .parse()
            .ok()?;
        Some(EvalProblem {
            level,
            problem_id,
            name,
            source: Vec::new(),
            defect: Some(bad.reason.clone()),
        })
    }
}

/// One candidate: its program bytes, or None when no code could be extracted.
#[derive(Clone, Debug)]
pub struct EvalSample {
    pub level: u32,
    pub problem_id: u32,
    pub sample_id: u32,
    pub code: Option<Vec<u8>>,
    /// Where it came from, for messages and the store (file path, JSONL line).
    pub origin: String,
}

impl From<Candidate> for EvalSample {
    fn from(c: Candidate) -> EvalSample {
        EvalSample {
            level: c.level,
            problem_id: c.problem_id,
            sample_id: c.sample_id,
            code: c.code,
            origin: c.origin,
        }
    }
}

/// Reward-hack checks run on every finished sample before it is stored: the place where
/// dice-audit's rules set `flags` and `deceptive`, weighed against what the run showed
/// (`kernels`: the CUDA profile of forward, when there is one).
pub trait Audit: Send + Sync {
    fn audit(
        &self,
        problem: &EvalProblem,
        sample: &EvalSample,
        kernels: Option<&KernelProfile>,
        record: &mut SampleRecord,
    );
}

#[derive(Clone, Debug)]
pub struct EvalConfig {
    pub device: Device,
    /// Bounds each run of a candidate (import, construction and correctness trials; and each
    /// timing round), not counting extension builds.
    pub timeout: Duration,
    /// Bounds each extension build.
    pub compile_timeout: Duration,
    /// Parallel builds in the compile stage.
    pub jobs: usize,
    /// Candidates in flight per device: their untimed stages overlap, timing is exclusive.
    pub runs_per_device: usize,
    /// Each run slot starts its next candidate's process (and that problem's reference process)
    /// while the current candidate runs. Their start-up competes for the CPU with a timed
    /// process, so it suits machines that keep cores for timing.
    pub look_ahead: bool,
    pub correctness_trials: u32,
    pub perf_trials: u32,
    /// Timed trials are split into this many rounds, alternating candidate and baseline.
    pub timing_rounds: u32,
    /// Under dice's timing, the time one side's timed calls may take (as timed) in one
    /// measurement: when the correctness trials' calls, then the first round of each side, show
    /// calls so long that `perf_trials` of them would take longer, the rounds make fewer calls
    /// (`stage_timing.rs` `bound_plan`, `bound_rounds`; at least one a round). Timing holds the
    /// device alone, so a program of 0.5 s a call timed 100 times a side held every other sample
    /// in flight for minutes (bench/notes/eval-h200.md, session 25); calls that long are timed
    /// precisely in a few. None: always `perf_trials` calls.
    pub timing_budget: Option<Duration>,
    /// The share of wall time the compile stage's processes may be stopped for timing windows,
    /// over any 30 s (quiet.rs): 0 never stops them, 1 stops them for every window.
    pub quiet_timing_share: f64,
    /// A side whose calls' coefficient of variation is above this is measured again...
    pub remeasure_above_cv: f64,
    /// ... at most this many times, as is a candidate whose clock the evaluator's contradicts
    /// (that one past this limit until its contradiction rests on
    /// [`crate::runtime::CLOCK_EVIDENCE_ROUNDS`] rounds); the statistics pool every measurement's
    /// calls.
    pub max_remeasures: u32,
    /// Under dice's timing, a checked timed call whose outputs hold more bytes than this keeps,
    /// and has judged, each output's values at 2^20 positions drawn after the call returned
    /// (python/protocol.py `kept_sample`) instead of a whole copy: a stale or partly computed
    /// output is caught alike, and a program of multi-GB outputs no longer holds the device
    /// alone for a minute of host copies (TIMING.md, "Large outputs").
    pub timed_outputs_whole_up_to: u64,
    pub atol: f64,
    pub rtol: f64,
    pub precision: Precision,
    pub baseline: Baseline,
    pub timing: Timing,
    /// The candidate's module starts with the problem module's globals, as KernelBench's
    /// harness execs both into one namespace; by default it sees only its own.
    pub kernelbench_namespace: bool,
    pub build_cache: PathBuf,
    /// Builds of one host flag set the cache is asked for before a precompiled
    /// torch/extension.h is made for it (build_cache.rs): it costs about two host compiles and
    /// 750 MB of the cache, and cuts each later `load_inline` build's host compile 2–2.5×. The
    /// default, 8: a cache that sees a flag set a few times (a test, a small run) never pays for
    /// one, and a batch or an RL step, which build hundreds with one flag set, pay it once.
    pub pch_after_builds: u64,
    pub python: Option<PathBuf>,
    /// The SQLite store; with `postgres`, its folder holds only this host's files of the run
    /// (the device locks of its processes).
    pub db: PathBuf,
    /// The run in a PostgreSQL database instead: (URL, run name).
    pub postgres: Option<(String, String)>,
    /// Re-evaluate samples already stored.
    pub force: bool,
    /// Judge every sample, also one whose program an earlier sample brought for the same problem
    /// (by default that one gets a copy of the first's judgement: same_program.rs).
    pub judge_each_copy: bool,
    /// The run's seed of its correctness trials' and timed calls' inputs; None draws one when the
    /// run begins (or keeps the one it began with). A fixed seed reproduces a run, but it is
    /// public: a program can then carry its expected outputs instead of computing them.
    pub seed: Option<u64>,
    pub strict: bool,
    /// Where the problems came from (a KernelBench tree or a pairs file).
    pub source: String,
    pub progress: bool,
}

impl EvalConfig {
    /// Settings for the CPU; [`EvalConfig::set_device`] chooses another device.
    pub fn new(db: PathBuf, source: String) -> EvalConfig {
        EvalConfig {
            device: Device::Cpu,
            timeout: Duration::from_secs(120),
            compile_timeout: Duration::from_secs(900),
            jobs: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            runs_per_device: 1,
            look_ahead: false,
            correctness_trials: 5,
            perf_trials: 100,
            timing_rounds: 10,
            timing_budget: Some(Duration::from_secs(2)),
            quiet_timing_share: 0.25,
            remeasure_above_cv: 0.15,
            max_remeasures: 2,
            timed_outputs_whole_up_to: 1 << 30,
            atol: 1e-2,
            rtol: 1e-2,
            precision: Precision::Fp32,
            baseline: Baseline::Eager,
            timing: Timing::DiceQueued,
            kernelbench_namespace: false,
            build_cache: default_build_cache(),
            pch_after_builds: 8,
            python: None,
            db,
            postgres: None,
            force: false,
            judge_each_copy: false,
            seed: None,
            strict: false,
            source,
            progress: false,
        }
    }

    /// Sets the device and what suits it: on CUDA four candidates in flight, each run slot
    /// starting its next candidate while the current one runs; on the CPU, where that start-up
    /// would compete with the wall-clock timing, one candidate at a time and nothing ahead.
    pub fn set_device(&mut self, device: Device) {
        self.device = device;
        (self.runs_per_device, self.look_ahead) = match device {
            Device::Cuda => (4, true),
            Device::Cpu => (1, false),
        };
    }
}

/// `$DICE_CACHE`, else `~/.cache/dice/builds`.
pub fn default_build_cache() -> PathBuf {
    if let Some(dir) = std::env::var_os("DICE_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map_or_else(std::env::temp_dir, PathBuf::from);
    home.join(".cache/dice/builds")
}
