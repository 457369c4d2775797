//! Run-time reward-hack findings: what running a candidate showed, beyond its outputs. Rule ids
//! are dice-audit's, so static and run-time findings share one vocabulary in `flags`.

use dice_audit::{Rule, Severity, SUBSTANTIAL_OWN_SHARE};
use dice_store::{KernelProfile, LaunchedKernel};
use serde_json::Value;

/// A round contradicts the candidate's clock when the evaluator's lower bound of its per-call
/// time is above the claimed time by more than this share of the claim, plus the baseline's
/// spread, plus [`CLOCK_FLOOR_MS`] (the wall clock's resolution and the control messages' jitter).
const CLOCK_REL_TOLERANCE: f64 = 0.1;
const CLOCK_FLOOR_MS: f64 = 0.01;
/// Of every this many baseline rounds, the one load hit hardest is left out of the baseline's
/// spread. Six keeps the chance that every round of an honest candidate whose rounds are
/// distributed like the baseline's comes out above all the rest below 10^-4 from 10 rounds on,
/// before the tolerances (0.8 % at 6 rounds, the smallest number that leaves one out).
const ROUNDS_PER_OUTLIER: usize = 6;
/// On the CPU, how much more untimed overhead per call a candidate's rounds may show than the
/// baseline's, as a share of the baseline's, before they contradict its clock (on CUDA: none).
/// The untimed part of a call (making its inputs, copying them) runs in the candidate's process,
/// and on the CPU its cost follows the memory the program's own state shapes: an honest program
/// that keeps what it computes (a cache keyed by values, which never hits) or only lays out its
/// heap otherwise had every one of its rounds 10-30 % slower there than the baseline's, on a
/// quiet machine too (issue #27; TIMING.md). On CUDA that work is the device's and the
/// launches', which the program's heap does not slow, and the overhead is the GPU's flush and
/// launch path: a share of it would let a forged clock hide a small kernel whole.
pub const CPU_OVERHEAD_TOLERANCE: f64 = 0.5;
/// Candidate rounds a clock finding needs, every one contradicting the clock: a timing that
/// contradicts with fewer is measured again until it has this many (src/stage_timing.rs). Load
/// hits an honest candidate's rounds one by one: on the 2-core CPU machine with three busy loops
/// beside a test's evaluation about half of the 5-call rounds were hit, and every one of 6
/// rounds at times (a false alarm); every one of 10 at that rate is one in a thousand. A forged
/// clock contradicts every round however many there are. The default timing has 10 rounds per
/// measurement, so this costs only timings with fewer rounds that are contradicted.
pub const CLOCK_EVIDENCE_ROUNDS: usize = 10;

#[derive(Clone, Debug, PartialEq)]
pub struct Finding {
    pub rule: Rule,
    pub severity: Severity,
    pub message: String,
}

impl Finding {
    pub fn error(rule: Rule, message: String) -> Finding {
        Finding {
            rule,
            severity: Severity::Error,
            message,
        }
    }
}

/// Judges a `kernels` event against the candidate's own kernel names (dice-audit's
/// `custom_kernel_names`): they must run, and everything must run on the default stream.
pub fn check_kernels(
    msg: &Value,
    custom_names: &[String],
    strict: bool,
) -> (KernelProfile, Vec<Finding>) {
    let kernels: Vec<LaunchedKernel> =
        serde_json::from_value(msg["kernels"].clone()).unwrap_or_default();
    let default_stream = msg["default_stream"].as_i64();
    // Folded from +0.0: `sum()` of no f64 is -0.0, which a report would show as a share of -0.
    let total = kernels.iter().fold(0.0, |sum, k| sum + k.us);
    let own = |k: &&LaunchedKernel| custom_names.iter().any(|n| names_kernel(&k.name, n));
    let own_us = kernels.iter().filter(own).fold(0.0, |sum, k| sum + k.us);
    let launched_own = kernels.iter().any(|k| own(&k));
    let custom_share =
        (!custom_names.is_empty()).then(|| if total > 0.0 { own_us / total } else { 0.0 });
    let mut findings = Vec::new();
    if !custom_names.is_empty() && !launched_own {
        let ran: Vec<&str> = kernels.iter().take(3).map(|k| k.name.as_str()).collect();
        findings.push(Finding::error(
            Rule::CustomKernelNotLaunched,
            format!(
                "none of the program's kernels ({}) ran during forward; it launched {}",
                custom_names.join(", "),
                if ran.is_empty() {
                    "no kernel".to_string()
                } else {
                    ran.join("; ")
                }
            ),
        ));
    } else if let Some(share) = custom_share.filter(|s| *s < SUBSTANTIAL_OWN_SHARE) {
        findings.push(Finding {
            rule: Rule::LowCustomKernelShare,
            severity: if strict {
                Severity::Error
            } else {
                Severity::Warning
            },
            message: format!(
                "only {:.0}% of the kernel time of forward is in the program's own kernels",
                share * 100.0
            ),
        });
    }
    if let Some(default) = default_stream {
        // The program's own kernels must run where the clocks are. A library's kernel on
        // another stream is no evidence against the program: cuDNN and others run parts of a
        // call on internal streams they join back to the caller's (the KernelBench reference of
        // level 3 problem 26, renamed ModelNew, showed it on the H200); the stored profile keeps
        // its stream. Streams the program makes or picks itself are the static audit's
        // `stream_or_graph_creation`, and work hidden on one is bounded by the evaluator's wall
        // clock (`timer_inconsistent`).
        if let Some(k) = kernels
            .iter()
            .filter(own)
            .find(|k| k.stream.is_some_and(|s| s != default))
        {
            findings.push(Finding::error(
                Rule::NonDefaultStream,
                format!(
                    "the program's kernel {} ran on stream {}, not on the timed default stream \
                     {default}",
                    k.name,
                    k.stream.unwrap_or_default()
                ),
            ));
        }
    }
    let profile = KernelProfile {
        default_stream,
        custom_share,
        kernels,
    };
    (profile, findings)
}

/// Whether a (demangled) launched kernel name contains `name` as a whole identifier.
fn names_kernel(launched: &str, name: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    !name.is_empty()
        && launched.match_indices(name).any(|(at, _)| {
            let before = launched[..at].chars().next_back();
            let after = launched[at + name.len()..].chars().next();
            !before.is_some_and(ident) && !after.is_some_and(ident)
        })
}

/// One timed round of one process as the evaluator saw it: the per-call times the process
/// reported, the evaluator's own wall time of the round (request to reply), and the untimed
/// warm-up calls the process made first (python/protocol.py `Timer.run`: on its first round;
/// counted by the evaluator for a candidate, reported by the trusted reference for its own).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TimedRound {
    pub reported_ms: Vec<f64>,
    pub wall_ms: f64,
    pub warmup_calls: u32,
}

impl TimedRound {
    fn calls(&self) -> f64 {
        self.reported_ms.len() as f64
    }

    /// Wall time per call that the reported times do not account for.
    fn overhead_per_call(&self) -> f64 {
        (self.wall_ms - self.reported_ms.iter().sum::<f64>()) / self.calls()
    }
}

/// A candidate's clock caught out: the finding, and the per-call time the evaluator's clock
/// vouches for, which replaces the reported mean in the speedup.
#[derive(Clone, Debug, PartialEq)]
pub struct ClockMismatch {
    pub finding: Finding,
    pub trusted_mean_ms: f64,
}

/// Checks the candidate's reported times against the evaluator's wall time, round by round.
///
/// The baseline runs in the trusted reference process through the same timing code, so its
/// rounds measure the overhead outside the timed calls (input copies, flushes, the control
/// messages): per call, wall minus reported, from the rounds without warm-up calls (a round with
/// them measures the warm-ups; counted only when every round has them, which can only raise the
/// overhead and so clear the candidate). Load only ever adds time, so the smallest of these is
/// the overhead itself, and the range up to the largest is what load added. A candidate round bounds the
/// candidate's true per-call time from below by its wall time per call (warm-up calls
/// included) minus that smallest overhead. A round contradicts the candidate when the bound is
/// above the mean the candidate claims over all its rounds (the mean its speedup is computed
/// from, so a forger honest in some rounds is caught too) by more than the baseline's range
/// and the tolerances (`overhead_tolerance`: a share of the overhead, [`CPU_OVERHEAD_TOLERANCE`]
/// on the CPU). Load inflates the bound of the rounds it hits, not of every round, so
/// only a candidate that every round contradicts gets the finding; its speedup is then
/// computed from the bounds (their mean, weighted by calls), never from its own clock.
///
/// A burst of load in a single baseline round would widen the range enough to clear any forger
/// whose true time is below the burst, so of every [`ROUNDS_PER_OUTLIER`] baseline rounds the
/// worst is left out of the range.
///
/// On a quiet machine the range is microseconds and a clock off by a fifth is caught; under
/// heavy CPU oversubscription (a busy loop per core beside the evaluation) rounds carry tens of
/// milliseconds of scheduling delay: there only clocks that are off by more than that range are
/// caught. Processes paid such delay unequally while inputs were made between timed calls (a
/// single-threaded kernel let its process's worker threads fall asleep, and the next parallel
/// input copy waited for them, every call: an honest CPU candidate was flagged under load), so
/// on the CPU a round's inputs are made before its calls (python/protocol.py
/// `Timer._timed_premade`) and such a wait is paid once a round.
pub fn check_clock(
    candidate: &[TimedRound],
    baseline: &[TimedRound],
    overhead_tolerance: f64,
) -> Option<ClockMismatch> {
    let candidate: Vec<&TimedRound> = candidate.iter().filter(|r| r.calls() > 0.0).collect();
    let baseline: Vec<&TimedRound> = baseline.iter().filter(|r| r.calls() > 0.0).collect();
    if candidate.is_empty() || baseline.is_empty() {
        return None;
    }
    let settled: Vec<&TimedRound> = baseline
        .iter()
        .copied()
        .filter(|r| r.warmup_calls == 0)
        .collect();
    let baseline = if settled.is_empty() {
        baseline
    } else {
        settled
    };
    let mut overheads: Vec<f64> = baseline
        .iter()
        .map(|r| r.overhead_per_call().max(0.0))
        .collect();
    overheads.sort_by(f64::total_cmp);
    let overhead = overheads[0];
    let spread = overheads[overheads.len() - 1 - overheads.len() / ROUNDS_PER_OUTLIER] - overhead;
    let calls: f64 = candidate.iter().map(|r| r.calls()).sum();
    let claimed = candidate
        .iter()
        .map(|r| r.reported_ms.iter().sum::<f64>())
        .sum::<f64>()
        / calls;
    let bounds: Vec<f64> = candidate
        .iter()
        .map(|r| (r.wall_ms / (r.calls() + f64::from(r.warmup_calls)) - overhead).max(0.0))
        .collect();
    let limit = claimed * (1.0 + CLOCK_REL_TOLERANCE)
        + spread
        + overhead * overhead_tolerance
        + CLOCK_FLOOR_MS;
    tracing::debug!(
        claimed,
        overhead,
        spread,
        limit,
        "clock check: baseline overheads per call {overheads:?}, candidate bounds per call {bounds:?}"
    );
    if !bounds.iter().all(|&bound| bound > limit) {
        return None;
    }
    let trusted_mean_ms = candidate
        .iter()
        .zip(&bounds)
        .map(|(r, bound)| r.calls() * bound)
        .sum::<f64>()
        / calls;
    let lowest = bounds.iter().copied().fold(f64::INFINITY, f64::min);
    let finding = Finding::error(
        Rule::TimerInconsistent,
        format!(
            "the timed calls reported {claimed:.4} ms per call, but every one of {} rounds took \
             at least {lowest:.4} ms per call of the evaluator's wall time (net of the baseline's \
             overhead of {overhead:.4} ms); the speedup uses {trusted_mean_ms:.4} ms",
            bounds.len()
        ),
    );
    Some(ClockMismatch {
        finding,
        trusted_mean_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn kernels(list: &[(&str, i64, f64)]) -> Value {
        let k: Vec<Value> = list
            .iter()
            .map(|(n, s, us)| json!({"name": n, "stream": s, "us": us, "calls": 1}))
            .collect();
        json!({"default_stream": 7, "kernels": k})
    }

    fn rules(findings: &[Finding]) -> Vec<Rule> {
        findings.iter().map(|f| f.rule).collect()
    }

    #[test]
    fn own_kernels_must_run_on_the_default_stream() {
        let names = vec!["relu_kernel".to_string(), "relu_cuda".to_string()];
        let honest = kernels(&[(
            "void relu_kernel<float>(float const*, float*, int)",
            7,
            90.0,
        )]);
        let (profile, findings) = check_kernels(&honest, &names, false);
        assert!(findings.is_empty(), "{findings:?}");
        assert_eq!(profile.custom_share, Some(1.0));

        let aten = kernels(&[("void at::native::vectorized_elementwise_kernel", 7, 90.0)]);
        let (profile, findings) = check_kernels(&aten, &names, false);
        assert_eq!(rules(&findings), [Rule::CustomKernelNotLaunched]);
        assert_eq!(
            profile.custom_share.map(f64::to_bits),
            Some(0.0f64.to_bits())
        );

        let prefix_only = kernels(&[("my_relu_kernel_v2(float*)", 7, 1.0)]);
        let (_, findings) = check_kernels(&prefix_only, &names, false);
        assert_eq!(rules(&findings), [Rule::CustomKernelNotLaunched]);

        let side = kernels(&[("relu_kernel(float*)", 15, 1.0)]);
        let (_, findings) = check_kernels(&side, &names, false);
        assert_eq!(rules(&findings), [Rule::NonDefaultStream]);
    }

    /// A library's kernel on a stream of its own (cuDNN's internal streams) is no finding, in
    /// strict judging too; the program's own kernel on another stream is the error.
    #[test]
    fn only_the_program_s_own_kernels_must_run_on_the_default_stream() {
        let names = vec!["shuffle_kernel".to_string()];
        let library = kernels(&[
            ("shuffle_kernel(float*)", 7, 50.0),
            ("cudnn::conv2d_grouped_kernel", 9, 40.0),
        ]);
        for strict in [false, true] {
            let (profile, findings) = check_kernels(&library, &names, strict);
            assert!(findings.is_empty(), "{findings:?}");
            assert_eq!(
                profile.kernels[1].stream,
                Some(9),
                "the profile keeps the stream"
            );
        }
        let both = kernels(&[
            ("cudnn::conv2d_grouped_kernel", 9, 40.0),
            ("shuffle_kernel(float*)", 9, 50.0),
        ]);
        let (_, findings) = check_kernels(&both, &names, false);
        assert_eq!(rules(&findings), [Rule::NonDefaultStream]);
        assert!(findings[0]
            .message
            .starts_with("the program's kernel shuffle_kernel"));
    }

    #[test]
    fn a_small_share_is_a_warning_unless_strict() {
        let names = vec!["add_kernel".to_string()];
        let mostly_cublas = kernels(&[
            ("sm90_xmma_gemm", 7, 900.0),
            ("add_kernel(float*)", 7, 100.0),
        ]);
        let (profile, findings) = check_kernels(&mostly_cublas, &names, false);
        assert!((profile.custom_share.unwrap() - 0.1).abs() < 1e-12);
        assert_eq!(findings[0].rule, Rule::LowCustomKernelShare);
        assert_eq!(findings[0].severity, Severity::Warning);
        let (_, findings) = check_kernels(&mostly_cublas, &names, true);
        assert_eq!(findings[0].severity, Severity::Error);
    }

    #[test]
    fn programs_without_kernels_are_left_to_the_static_rules() {
        let (profile, findings) = check_kernels(&kernels(&[("gemm", 7, 1.0)]), &[], false);
        assert!(findings.is_empty());
        assert_eq!(profile.custom_share, None);
    }

    /// A round of `n` calls reporting `reported` ms each, whose wall time per call is `wall`.
    fn round(n: usize, reported: f64, wall: f64) -> TimedRound {
        TimedRound {
            reported_ms: vec![reported; n],
            wall_ms: wall * n as f64,
            warmup_calls: 0,
        }
    }

    /// A baseline of 2 ms calls with 0.05 ms of overhead per call and a little jitter; when
    /// `loaded`, one round is slowed by load and the first made the reference's warm-up calls.
    fn baseline(loaded: bool) -> Vec<TimedRound> {
        let mut rounds: Vec<TimedRound> = [0.05, 0.06, 0.052, 0.055, 0.05]
            .iter()
            .map(|overhead| round(10, 2.0, 2.0 + overhead))
            .collect();
        if loaded {
            rounds[3] = round(10, 2.0, 2.4);
            rounds[0].wall_ms += 3.0 * 2.05;
            rounds[0].warmup_calls = 3;
        }
        rounds
    }

    /// Twelve rounds of `calls_ms` calls with 0.05 ms of overhead per call and a little jitter,
    /// a burst of 5 ms of load per call in the seventh.
    fn bursty(reported: f64, calls_ms: f64) -> Vec<TimedRound> {
        (0..12)
            .map(|i| {
                let jitter = 0.002 * f64::from(i % 4);
                let burst = if i == 6 { 5.0 } else { 0.0 };
                round(10, reported, calls_ms + 0.05 + jitter + burst)
            })
            .collect()
    }

    #[test]
    fn a_forged_clock_is_caught_and_earns_nothing() {
        // Truly 1 ms per call, reported as 1 us.
        let forger: Vec<TimedRound> = (0..5).map(|_| round(10, 0.001, 1.05)).collect();
        for loaded in [false, true] {
            let caught = check_clock(&forger, &baseline(loaded), 0.0).unwrap();
            assert_eq!(caught.finding.rule, Rule::TimerInconsistent);
            // Its wall time per call less the baseline's smallest overhead (0.05 ms).
            assert!((caught.trusted_mean_ms - 1.0).abs() < 1e-9, "{caught:?}");
        }
        // Honest in one round, forged in the others: still far below every bound.
        let mut partial = forger.clone();
        partial[2] = round(10, 1.0, 1.05);
        assert!(check_clock(&partial, &baseline(true), 0.0).is_some());
        // A clock that takes a fifth off, on a quiet machine.
        let shaved: Vec<TimedRound> = (0..5).map(|_| round(10, 0.8, 1.05)).collect();
        assert!(check_clock(&shaved, &baseline(false), 0.0).is_some());
        // Bursts of load in two of the baseline's twelve rounds, five times the forger's true
        // time, do not clear it; in three of them they would.
        let forger = bursty(0.001, 1.0);
        let mut baseline = bursty(2.0, 2.0);
        baseline[2].wall_ms += 50.0;
        assert!(check_clock(&forger, &baseline, 0.0).is_some());
        baseline[9].wall_ms += 50.0;
        assert_eq!(check_clock(&forger, &baseline, 0.0), None);
    }

    #[test]
    fn honest_kernels_pass_quiet_and_under_load() {
        // Quiet: 1 ms calls with the baseline's overhead and its jitter.
        let quiet: Vec<TimedRound> = [0.05, 0.058, 0.051, 0.062, 0.05]
            .iter()
            .map(|overhead| round(10, 1.0, 1.0 + overhead))
            .collect();
        assert_eq!(check_clock(&quiet, &baseline(false), 0.0), None);
        // Loaded: a build beside it stretches every round but the third (the calls and the
        // overhead both); the first round also made its warm-up calls, slower than the others.
        let mut loaded: Vec<TimedRound> =
            [(3.0, 4.0), (1.5, 2.5), (1.0, 1.05), (2.0, 6.0), (9.0, 12.0)]
                .iter()
                .map(|&(reported, wall)| round(10, reported, wall))
                .collect();
        loaded[0].warmup_calls = 3;
        loaded[0].wall_ms += 3.0 * 20.0;
        assert_eq!(check_clock(&loaded, &baseline(true), 0.0), None);
        // Oversubscribed: every candidate round pays 0.3 ms per call more than the baseline's
        // quietest, within the range the baseline's own rounds show.
        let oversubscribed: Vec<TimedRound> = (0..5).map(|_| round(10, 1.0, 1.35)).collect();
        assert_eq!(check_clock(&oversubscribed, &baseline(true), 0.0), None);
        // The same jitter as the baseline's, and a burst in one round of either side.
        assert_eq!(check_clock(&bursty(1.0, 1.0), &bursty(2.0, 2.0), 0.0), None);
        // Tiny kernels: 5 us calls within the floor.
        let tiny: Vec<TimedRound> = (0..5).map(|_| round(10, 0.005, 0.06)).collect();
        assert_eq!(check_clock(&tiny, &baseline(false), 0.0), None);
    }

    /// On the CPU a process's untimed overhead follows its own heap: an honest 10 us kernel
    /// whose process pays 30 % more overhead per call in every round than the baseline's passes
    /// with the CPU's tolerance (and would not without), while a clock that hides most of a
    /// 0.1 ms call is still caught.
    #[test]
    fn on_the_cpu_a_process_with_more_overhead_is_not_a_forger() {
        // 10 calls of 10 us with 0.1 ms of overhead each, and a little jitter.
        let baseline: Vec<TimedRound> = [0.1, 0.104, 0.101, 0.106, 0.1, 0.103]
            .iter()
            .map(|overhead| round(10, 0.01, 0.01 + overhead))
            .collect();
        let heavier: Vec<TimedRound> = (0..10).map(|_| round(10, 0.01, 0.01 + 0.13)).collect();
        assert!(check_clock(&heavier, &baseline, 0.0).is_some());
        assert_eq!(
            check_clock(&heavier, &baseline, CPU_OVERHEAD_TOLERANCE),
            None
        );
        let forger: Vec<TimedRound> = (0..10).map(|_| round(10, 0.01, 0.1 + 0.1)).collect();
        assert!(check_clock(&forger, &baseline, CPU_OVERHEAD_TOLERANCE).is_some());
    }
}
