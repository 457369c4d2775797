//! What a run stores: the contract between the evaluator (which writes it) and reports (which read it).

use crate::verdict::Verdict;
use serde::{Deserialize, Serialize};

/// Summary statistics of repeated timings, in milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimingStats {
    pub mean_ms: f64,
    pub median_ms: f64,
    pub std_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    pub trials: u32,
}

/// A 95 % confidence interval of a speedup: a bootstrap over the timed rounds (dice-eval's
/// `stats.rs` says how).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpeedupInterval {
    pub low: f64,
    pub high: f64,
}

/// Settings a run was started with; stored once per run and shown in reports.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    /// `cpu` or `cuda`.
    pub device: String,
    /// Hardware name as the worker reports it (GPU name or CPU model).
    pub hardware: String,
    pub torch_version: String,
    pub python_version: String,
    pub dice_version: String,
    pub correctness_trials: u32,
    pub perf_trials: u32,
    pub atol: f64,
    pub rtol: f64,
    /// `eager` or `torch_compile`.
    pub baseline: String,
    /// How timed calls were made: `dice`, `kernelbench` or `kernelbench-v0.1` (runs stored
    /// before the choice existed used dice's).
    #[serde(default = "dice_timing")]
    pub timing: String,
    /// Deceptive samples count as incorrect.
    pub strict: bool,
    /// Where the problems came from: a KernelBench tree or a pairs file.
    pub source: String,
}

fn dice_timing() -> String {
    "dice".to_string()
}

/// Where one batch of the evaluator (all of a `dice eval`) spent its wall time as a whole (each
/// sample stores its own steps): its start-up, and on each device the exclusive windows of timing
/// and their queue.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunTimeline {
    /// Samples given to the run stage in this batch.
    pub samples: usize,
    /// From the start of the evaluation to its end, seconds.
    pub wall_s: f64,
    /// When the first run slot began its first sample (start-up: interpreter check, fork
    /// servers, the first builds), seconds from the start.
    pub first_sample_s: Option<f64>,
    /// When the last outcome was stored, seconds from the start.
    pub last_outcome_s: Option<f64>,
    /// Exclusive windows (timed candidates, evaluations alone), summed over devices.
    pub exclusive_windows: u32,
    /// Seconds inside them.
    pub exclusive_s: f64,
    /// Seconds evaluations waited for them, summed over the waiting evaluations.
    pub exclusive_wait_s: f64,
    /// Wall seconds during which an exclusive pass was held or asked for, per device summed: no
    /// new untimed step could start on the device then.
    pub gate_closed_s: f64,
    /// Untimed steps (shared passes: constructions, trials, judgements, ...), the seconds they
    /// held their pass and waited for it, and the longest (what a timer may wait for).
    pub untimed_steps: u32,
    pub untimed_step_s: f64,
    pub untimed_wait_s: f64,
    pub longest_untimed_step_s: f64,
}

/// One problem of the run, with the outcome of running its reference.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProblemRecord {
    pub level: u32,
    pub problem_id: u32,
    pub name: String,
    /// `None` when the reference ran; otherwise why it failed (never blamed on candidates).
    pub reference_error: Option<String>,
}

/// One evaluated candidate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SampleRecord {
    pub level: u32,
    pub problem_id: u32,
    pub sample_id: u32,
    /// SHA-256 of the candidate program bytes (None for `no_code`).
    pub code_hash: Option<String>,
    pub verdict: Verdict,
    /// One line saying why, for every verdict other than `correct`.
    pub message: Option<String>,
    /// Largest absolute / relative error seen in correctness trials (mismatches and passes).
    pub max_abs_error: Option<f64>,
    pub max_rel_error: Option<f64>,
    /// Correctness trials passed, out of `RunInfo::correctness_trials`.
    pub trials_passed: u32,
    pub candidate_timing: Option<TimingStats>,
    pub baseline_timing: Option<TimingStats>,
    /// Baseline over candidate, only for correct samples: by the medians of the calls under
    /// `--timing dice-queued` on a GPU, by their means otherwise; when the candidate's clock
    /// contradicts the evaluator's (`timer_inconsistent`), baseline mean over the evaluator's
    /// bound of the candidate's mean.
    pub speedup: Option<f64>,
    /// Where the speedup lies with 95 % confidence, from the reported times (None without a
    /// speedup, or when the candidate's clock was not trusted).
    #[serde(default)]
    pub speedup_interval: Option<SpeedupInterval>,
    /// How often the timing was measured again because its dispersion was too high; the stored
    /// timings pool every measurement's calls.
    #[serde(default)]
    pub timing_remeasures: u32,
    /// Rule ids of reward-hack findings (static and run-time).
    pub flags: Vec<String>,
    pub deceptive: bool,
    /// Bounded excerpt of the candidate's stdout/stderr and build log.
    pub log_excerpt: String,
    /// Wall seconds spent on this sample (build + run).
    pub wall_s: f64,
    /// Seconds per run-stage step (reference start, import, trials, timing, ...): where the
    /// evaluator's time went. Empty when the sample never ran (or was stored before stages were).
    pub stages: Vec<(String, f64)>,
}

impl SampleRecord {
    /// The record of a verdict and nothing else measured: no message, errors, timings, flags,
    /// log or stages (tests and reports fill in what they need with struct update syntax).
    pub fn new(level: u32, problem_id: u32, sample_id: u32, verdict: Verdict) -> Self {
        Self {
            level,
            problem_id,
            sample_id,
            code_hash: None,
            verdict,
            message: None,
            max_abs_error: None,
            max_rel_error: None,
            trials_passed: 0,
            candidate_timing: None,
            baseline_timing: None,
            speedup: None,
            speedup_interval: None,
            timing_remeasures: 0,
            flags: Vec::new(),
            deceptive: false,
            log_excerpt: String::new(),
            wall_s: 0.0,
            stages: Vec::new(),
        }
    }
}

/// One extension build (or cache hit) seen while evaluating a sample.
#[derive(Clone, Debug, PartialEq)]
pub struct BuildRecord {
    pub key: String,
    pub name: String,
    pub ok: bool,
    pub cached: bool,
    pub wall_s: f64,
    pub log: String,
}

/// Measurements stored next to a sample that are not part of [`SampleRecord`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SampleExtras {
    /// Where the candidate came from (file, JSONL line).
    pub origin: String,
    /// Evaluator-side wall time of all timed batches, candidate and baseline (a check on the
    /// timers a candidate could tamper with).
    pub candidate_wall_ms: Option<f64>,
    pub baseline_wall_ms: Option<f64>,
    pub builds: Vec<BuildRecord>,
    /// CUDA: the kernels of the profiled correctness trial, with the share of kernel time in the
    /// candidate's own kernels (also a column of its own, `custom_kernel_share`).
    pub kernels: Option<KernelProfile>,
}

/// One kernel name on one stream during the profiled correctness trial.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LaunchedKernel {
    pub name: String,
    pub stream: Option<i64>,
    pub us: f64,
    pub calls: u64,
}

/// What the profiled correctness trial launched (CUDA only), as stored with the sample.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelProfile {
    /// The profiler's id of the default stream, learnt from an ATen op in the same process.
    pub default_stream: Option<i64>,
    /// Share of kernel time spent in the candidate's own kernels (None: it has none).
    pub custom_share: Option<f64>,
    pub kernels: Vec<LaunchedKernel>,
}

impl SampleRecord {
    /// Whether the sample counts as correct (e.g. for a reward): under `strict`, a deceptive
    /// sample does not.
    pub fn counts_as_correct(&self, strict: bool) -> bool {
        self.verdict.is_correct() && !(strict && self.deceptive)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_scoring_drops_deceptive_samples() {
        let mut s = SampleRecord {
            trials_passed: 5,
            flags: vec!["no_custom_kernel".into()],
            deceptive: true,
            ..SampleRecord::new(1, 1, 0, Verdict::Correct)
        };
        assert!(s.counts_as_correct(false));
        assert!(!s.counts_as_correct(true));
        s.deceptive = false;
        assert!(s.counts_as_correct(true));
        s.verdict = Verdict::Timeout;
        assert!(!s.counts_as_correct(false));
    }
}
