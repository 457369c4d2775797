//! Timing stage of a candidate that passed its correctness trials: rounds that alternate it with
//! the reference's baseline, the device to itself; its timed outputs judged and its clock checked
//! after; on CUDA, correctness trial 1 once more under the profiler.

use crate::call_keys::{CallKeys, RoundAsks};
use crate::candidate::{request_candidate, request_candidate_with, Evidence};
use crate::child::Child;
use crate::clock::StageClock;
use crate::config::{Device, Timing};
use crate::gate::Access;
use crate::job::{log_long_calls, persisting_l2_of, times_of, JobContext, Outcome};
use crate::quiet::Beside;
use crate::runtime::{self, Finding, TimedRound};
use crate::stage_reference::{judged_failure, ExpectedOutput, Reference, ReferenceFailed};
use crate::stats::{dispersion, reported_stats, speedup_interval, timing_stats, Statistic};
use dice_audit::Rule;
use dice_store::Verdict;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// A timed candidate's rounds and its baseline's, every measurement's, as they reported them and
/// as the evaluator's clock saw them.
pub(crate) struct Timings {
    pub candidate: Vec<TimedRound>,
    pub baseline: Vec<TimedRound>,
    /// Measurements made again because either side's calls were too dispersed.
    pub remeasures: u32,
    /// The candidate's per-call time by the evaluator's clock, when its own contradicted it
    /// (runtime.rs `check_clock`): the speedup uses it instead of the reported mean.
    pub trusted_candidate_ms: Option<f64>,
    /// What the compile stage did meanwhile.
    pub builds: Beside,
    /// Whether the timed process had cores of its own (python/protocol.py `Timer.run`).
    pub pinned: bool,
}

impl Timings {
    /// Sets the outcome's timings: statistics of the calls as `timing` reports them, the
    /// evaluator's wall time, the speedup (by the statistic of `timing` on `device`) and its
    /// interval, and how it was measured.
    pub(crate) fn record(self, timing: Timing, device: Device, outcome: &mut Outcome) {
        let wall = |rounds: &[TimedRound]| rounds.iter().map(|r| r.wall_ms).sum::<f64>();
        let per_round = |rounds: &[TimedRound]| -> Vec<Vec<f64>> {
            rounds.iter().map(|r| r.reported_ms.clone()).collect()
        };
        outcome.candidate_timing = reported_stats(timing, &calls_ms(&self.candidate));
        outcome.baseline_timing = reported_stats(timing, &calls_ms(&self.baseline));
        outcome.candidate_wall_ms = Some(wall(&self.candidate));
        outcome.baseline_wall_ms = Some(wall(&self.baseline));
        // A candidate whose clock contradicted the evaluator's is timed by the evaluator's: the
        // mean of its calls by wall time, against the baseline's mean.
        let statistic = Statistic::of_timing(timing, device);
        outcome.speedup = match (
            self.trusted_candidate_ms,
            &outcome.candidate_timing,
            &outcome.baseline_timing,
        ) {
            (Some(trusted), _, Some(b)) => Some(b.mean_ms / trusted),
            (None, Some(c), Some(b)) => Some(statistic.of_stats(b) / statistic.of_stats(c)),
            _ => None,
        }
        .filter(|s| s.is_finite());
        if self.trusted_candidate_ms.is_none() {
            outcome.speedup_interval = speedup_interval(
                statistic,
                &per_round(&self.candidate),
                &per_round(&self.baseline),
            );
        }
        outcome.timing_remeasures = self.remeasures;
        // How the sample was timed, beside its stages: for reports, and for curation that keeps
        // only samples timed on a quiet host.
        let running = if self.pinned {
            "timing: builds running, cores apart"
        } else {
            "timing: builds running"
        };
        outcome.stages.extend([
            (
                "timing: builds stopped".to_string(),
                self.builds.stopped.as_secs_f64(),
            ),
            (running.to_string(), self.builds.running.as_secs_f64()),
        ]);
    }
}

/// Which side makes the calls of a timing round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Candidate,
    Baseline,
}

/// The rounds of `total` calls per side, in order. dice's timing alternates the sides (the
/// order flips each round), so a change of the machine's speed weighs on both alike, the
/// candidate first, or the baseline where its first round sets the hold of the queued timing
/// (on `device`); KernelBench's times all of the candidate's calls, then all of the baseline's.
fn schedule(timing: Timing, device: Device, total: u32, rounds: u32) -> Vec<(Side, u32)> {
    let calls = |round: u32| total / rounds + u32::from(round < total % rounds);
    if !timing.interleaves() {
        let side = |side| (0..rounds).map(move |round| (side, calls(round)));
        return side(Side::Candidate).chain(side(Side::Baseline)).collect();
    }
    let mut order = Vec::new();
    for round in 0..rounds {
        let (first, second) = if (round % 2 == 0) != timing.queues_launches(device) {
            (Side::Candidate, Side::Baseline)
        } else {
            (Side::Baseline, Side::Candidate)
        };
        order.push((first, calls(round)));
        order.push((second, calls(round)));
    }
    order
}

/// Times the candidate and its baseline in rounds (`schedule`), each round with its own time
/// limit, every call on inputs of its own (the baseline's call of the same number on the same
/// ones); then judges a sample of the candidate's timed outputs and checks its clock against the
/// evaluator's wall time. `trial_call_ms`: how long a call took in the correctness trials (the
/// slower side's), which sizes a slow program's rounds within the timing budget from the first.
pub(crate) fn time_side_by_side(
    ctx: &JobContext,
    access: &Access<'_>,
    child: &mut Child,
    reference: &mut Reference,
    evidence: &mut Evidence,
    clock: &mut StageClock,
    trial_call_ms: Option<f64>,
) -> Result<Result<Timings, (Verdict, String)>, ReferenceFailed> {
    let mut t = Timings {
        candidate: Vec::new(),
        baseline: Vec::new(),
        remeasures: 0,
        trusted_candidate_ms: None,
        builds: Beside::default(),
        pinned: !ctx.cores.is_null(),
    };
    let total = ctx.cfg.perf_trials;
    if total == 0 {
        return Ok(Ok(t));
    }
    let rounds = ctx.cfg.timing_rounds.clamp(1, total);
    // Every measurement's plan: sized by the trials' call time once, then each measurement's
    // first rounds may cut its own copy further.
    let mut plan = schedule(ctx.cfg.timing, ctx.cfg.device, total, rounds);
    if let (Some(budget), Some(call_ms)) = (timing_budget(ctx), trial_call_ms) {
        bound_plan(&mut plan, call_ms, budget);
    }
    let mut found = Found::default();
    let alone = access.timed();
    // Dropped on every way out, unwinding included: the builds never stay stopped.
    let quiet = ctx.build_groups.quiet();
    clock.lap("timing wait");
    // Every measurement's rounds, for the statistics and the clock check: a measurement made
    // again adds its calls to the earlier ones' (the same estimate from three times the calls),
    // and the more rounds, the likelier one of them is quiet enough to clear an honest
    // candidate's clock.
    let mut keys = CallKeys::default();
    let mismatch = loop {
        let calls_made = calls_ms(&t.candidate).len() as u64;
        let (candidate, baseline) = match measure(
            ctx,
            child,
            reference,
            plan.clone(),
            calls_made,
            &mut keys,
            &mut found,
        )? {
            Ok(measured) => measured,
            Err(failure) => return Ok(Err(failure)),
        };
        t.candidate.extend(candidate.iter().cloned());
        t.baseline.extend(baseline.iter().cloned());
        let overhead_tolerance = match ctx.cfg.device {
            Device::Cpu => runtime::CPU_OVERHEAD_TOLERANCE,
            Device::Cuda => 0.0,
        };
        let mismatch = runtime::check_clock(&t.candidate, &t.baseline, overhead_tolerance);
        // A clock contradicted by a few rounds may be a burst of load that hit all of them:
        // more rounds are unlikely to be hit all alike, while a forged clock contradicts every
        // one; so a contradiction is measured again past the remeasures' limit until it rests on
        // enough rounds.
        let clock_unsettled =
            mismatch.is_some() && t.candidate.len() < runtime::CLOCK_EVIDENCE_ROUNDS;
        let settled = !ctx.cfg.timing.remeasures()
            || (t.remeasures >= ctx.cfg.max_remeasures && !clock_unsettled);
        if settled || !(too_dispersed(ctx, &candidate, &baseline) || mismatch.is_some()) {
            break mismatch;
        }
        t.remeasures += 1;
    };
    t.builds = quiet.beside();
    drop(quiet);
    drop(alone);
    clock.lap("timing");
    // On the H200 every honest program of the 99 pairs was found with persisting L2 state
    // (bench/runs/2026-12-01-328bf66-h200): what the baseline's trusted process finds too, the
    // environment set, and the reset before every flush is all that is needed. A kind of state
    // only the candidate's process had (a reservation, a window on the timed stream) is its own.
    if let Some(why) = own_persisting_l2(&found.persisting_l2, &reference.environment_l2) {
        evidence
            .findings
            .push(Finding::error(Rule::L2PersistingWindow, why.clone()));
    } else if !found.persisting_l2.is_empty() {
        tracing::debug!(
            "persisting L2 state also in the baseline's process: {:?}",
            reference.environment_l2
        );
    }
    if let Some(mismatch) = mismatch {
        evidence.findings.push(mismatch.finding);
        t.trusted_candidate_ms = Some(mismatch.trusted_mean_ms);
    }
    let calls_made = calls_ms(&t.candidate).len() as u64;
    let judged = judge_timing_outputs(ctx, access, clock, child, reference, calls_made, &mut keys)?;
    clock.lap("judge timing outputs");
    if let Err(failure) = judged {
        evidence.findings.push(Finding::error(
            Rule::TimingOutputMismatch,
            failure.1.clone(),
        ));
        return Ok(Err(failure));
    }
    Ok(Ok(t))
}

/// The description of the first kind of persisting L2 state the candidate's process had and the
/// baseline's (`environment`) never did: what the candidate itself set.
fn own_persisting_l2<'a>(
    found: &'a BTreeMap<String, String>,
    environment: &BTreeSet<String>,
) -> Option<&'a String> {
    found
        .iter()
        .find(|(kind, _)| !environment.contains(*kind))
        .map(|(_, why)| why)
}

/// What the candidate's timed calls showed, over all measurements.
#[derive(Default)]
struct Found {
    /// The persisting L2 state found before a flush, by kind (see [`persisting_l2_of`]).
    persisting_l2: BTreeMap<String, String>,
}

/// The rounds of one measurement: the candidate's and the baseline's.
type Measurement = (Vec<TimedRound>, Vec<TimedRound>);

/// The budget of one side's timed calls in a measurement; none under KernelBench's timing, which
/// makes its fixed count of calls.
fn timing_budget(ctx: &JobContext) -> Option<Duration> {
    ctx.cfg
        .timing_budget
        .filter(|_| ctx.cfg.timing.interleaves())
}

/// One measurement: every round of `plan` (the schedule, sized by the trials), from call
/// `calls_made` of each side (the calls of earlier measurements).
fn measure(
    ctx: &JobContext,
    child: &mut Child,
    reference: &mut Reference,
    mut plan: Vec<(Side, u32)>,
    calls_made: u64,
    keys: &mut CallKeys,
    found: &mut Found,
) -> Result<Result<Measurement, (Verdict, String)>, ReferenceFailed> {
    let (mut candidate, mut baseline) = (Vec::new(), Vec::new());
    let (mut candidate_call, mut baseline_call) = (calls_made, calls_made);
    let mut budget = timing_budget(ctx);
    // A GPU's timer makes each call's inputs right before the call, so it asks for one key at a
    // time (call_keys.rs).
    let one_call_at_a_time = ctx.cfg.device == Device::Cuda;
    for step in 0..plan.len() {
        // Once both sides' first rounds are done (interleaved: the later rounds pair up).
        if let (Some(b), [first_candidate, ..], [first_baseline, ..]) =
            (budget, candidate.as_slice(), baseline.as_slice())
        {
            bound_rounds(&mut plan[step..], first_candidate, first_baseline, b);
            budget = None;
        }
        let (side, n) = plan[step];
        if side == Side::Candidate {
            let asks = RoundAsks::new(candidate_call, n, one_call_at_a_time);
            let started = Instant::now();
            // The queued timing's hold, which the baseline's first round has set.
            let hold_ms = ctx
                .cfg
                .timing
                .queues_launches(ctx.cfg.device)
                .then(|| reference.hold_ms.unwrap_or(0.0));
            let timed = match time_candidate(ctx, child, n, candidate_call, hold_ms, asks, keys) {
                Ok(timed) => timed,
                Err(failure) => return Ok(Err(failure)),
            };
            candidate_call += u64::from(n);
            for (kind, why) in timed.persisting_l2 {
                found.persisting_l2.entry(kind).or_insert(why);
            }
            let warmup_calls = if calls_made == 0 && candidate.is_empty() {
                ctx.cfg.timing.untimed_first_calls()
            } else {
                0
            };
            candidate.push(TimedRound {
                reported_ms: timed.ms,
                wall_ms: started.elapsed().as_secs_f64() * 1e3,
                warmup_calls,
            });
        } else {
            let asks = RoundAsks::new(baseline_call, n, one_call_at_a_time);
            baseline.push(reference.time(ctx, n, baseline_call, asks, keys)?);
            baseline_call += u64::from(n);
        }
    }
    Ok(Ok((candidate, baseline)))
}

/// Fewer calls in the rounds `rest` when the first round of each side (`first_candidate`,
/// `first_baseline`) shows that the planned calls would take one side longer than `budget`: a
/// call's time is the slower side's mean timed call in its first round (the warm-ups' one-time
/// costs, such as compiling a `torch.compile` baseline, left out; a candidate that reports its
/// calls shorter only keeps more of them, and its clock is checked), and the rounds left share
/// what the budget leaves after the first round, at least one call each. Both sides' rounds of
/// one number keep one count.
fn bound_rounds(
    rest: &mut [(Side, u32)],
    first_candidate: &TimedRound,
    first_baseline: &TimedRound,
    budget: Duration,
) {
    let spent_ms = |r: &TimedRound| r.reported_ms.iter().sum::<f64>();
    let per_call_ms = |r: &TimedRound| spent_ms(r) / (r.reported_ms.len().max(1) as f64);
    let call_ms = per_call_ms(first_candidate).max(per_call_ms(first_baseline));
    let first_ms = spent_ms(first_candidate).max(spent_ms(first_baseline));
    let left_ms = (budget.as_secs_f64() * 1e3 - first_ms).max(0.0);
    share_calls(rest, left_ms / call_ms);
}

/// Fewer calls in every round of `plan` (the first included) when calls of `call_ms`, as the
/// correctness trials took them, would take one side longer than `budget`: the rounds share
/// what the budget affords. A program of 0.25 s a call no longer spends its whole first round (a
/// tenth of its calls) before the budget applies; bound_rounds still corrects the count by the
/// first rounds' timed calls.
fn bound_plan(plan: &mut [(Side, u32)], call_ms: f64, budget: Duration) {
    share_calls(plan, budget.as_secs_f64() * 1e3 / call_ms);
}

/// The interleaved rounds `rest` (pairs of one count) cut to `affordable` calls a side where
/// they plan more: round r gets affordable / rounds, one more while r is below the remainder, at
/// least one, never more than it planned. Nothing changes for an affordable count that is not a
/// number (no call time known) or not below the plan.
fn share_calls(rest: &mut [(Side, u32)], affordable: f64) {
    let rounds = (rest.len() / 2) as u32;
    let planned: u32 = rest
        .iter()
        .filter(|(side, _)| *side == Side::Candidate)
        .map(|(_, n)| n)
        .sum();
    if rounds == 0 || affordable.is_nan() || affordable >= f64::from(planned) {
        return;
    }
    let affordable = (affordable as u32).max(rounds);
    for (round, pair) in (0u32..).zip(rest.chunks_mut(2)) {
        let share = affordable / rounds + u32::from(round < affordable % rounds);
        for entry in pair {
            entry.1 = entry.1.min(share);
        }
    }
}

/// Whether either side's calls in one measurement vary more than the settings accept.
fn too_dispersed(ctx: &JobContext, candidate: &[TimedRound], baseline: &[TimedRound]) -> bool {
    [candidate, baseline].into_iter().any(|rounds| {
        timing_stats(&calls_ms(rounds)).is_some_and(|s| dispersion(&s) > ctx.cfg.remeasure_above_cv)
    })
}

/// The reported times of every call of `rounds`.
fn calls_ms(rounds: &[TimedRound]) -> Vec<f64> {
    rounds
        .iter()
        .flat_map(|r| r.reported_ms.iter().copied())
        .collect()
}

/// Has the candidate publish the outputs of its checked timed calls (python/protocol.py
/// `CheckedCalls`), and judges each against the reference's output on the inputs of that call.
/// It made `calls_made` timed calls; it names the calls, and they must be as many as the
/// evaluator asked for, distinct, and among those it made.
fn judge_timing_outputs(
    ctx: &JobContext,
    access: &Access<'_>,
    clock: &mut StageClock,
    child: &mut Child,
    reference: &mut Reference,
    calls_made: u64,
    keys: &mut CallKeys,
) -> Result<Result<(), (Verdict, String)>, ReferenceFailed> {
    let published = {
        let _step = clock.untimed(access);
        request_candidate(
            ctx,
            child,
            json!({"op": "publish_timing"}),
            "timing_outputs",
        )
    };
    let reply = match published {
        Ok(reply) => reply,
        Err(failure) => return Ok(Err(failure)),
    };
    let expected_count = ctx.cfg.timing.checked_timed_calls().min(calls_made);
    let Some(calls) = checked_calls(&reply, expected_count, calls_made) else {
        return Ok(Err((
            Verdict::RuntimeError,
            "the program broke the evaluation protocol".into(),
        )));
    };
    for (k, call) in calls.into_iter().enumerate() {
        let path = child.dir().join(format!("timing_{k}.bin"));
        // A call whose key was never asked for gets one now, which its output cannot match.
        let key = keys.of_call(call);
        let expected = ExpectedOutput::TimedCall { call, key };
        let judged = reference.judge(ctx, access, clock, expected, &path, None)?;
        if let Some((verdict, message)) = judged_failure(&judged) {
            let message = format!(
                "timed call {} of {calls_made} was wrong: {message}",
                call + 1
            );
            return Ok(Err((verdict, message)));
        }
    }
    Ok(Ok(()))
}

/// The timed calls a `timing_outputs` reply names, when they are `count` distinct calls below
/// `calls_made`.
fn checked_calls(reply: &Value, count: u64, calls_made: u64) -> Option<Vec<u64>> {
    let calls: Vec<u64> = reply["calls"]
        .as_array()?
        .iter()
        .map(Value::as_u64)
        .collect::<Option<_>>()?;
    let distinct: std::collections::BTreeSet<u64> = calls.iter().copied().collect();
    let valid = calls.len() as u64 == count
        && distinct.len() == calls.len()
        && calls.iter().all(|&call| call < calls_made);
    valid.then_some(calls)
}

/// What one round of the candidate's timed calls reported.
struct Timed {
    ms: Vec<f64>,
    /// The persisting L2 state found before a flush, by kind.
    persisting_l2: BTreeMap<String, String>,
}

/// Timings of `n` calls of the candidate, from call `first_call` of its timing, behind the
/// baseline's hold `hold_ms` under the queued timing; the calls' keys handed out as its timer
/// asks (`asks`).
fn time_candidate(
    ctx: &JobContext,
    child: &mut Child,
    n: u32,
    first_call: u64,
    hold_ms: Option<f64>,
    mut asks: RoundAsks,
    keys: &mut CallKeys,
) -> Result<Timed, (Verdict, String)> {
    let mut op = json!({"op": "time", "n": n, "first_call": first_call});
    if let Some(hold_ms) = hold_ms {
        op["hold_ms"] = json!(hold_ms);
    }
    let msg = request_candidate_with(ctx, child, op, "times", |child, msg| {
        if msg["event"] != "keys" {
            return Ok(());
        }
        match asks.answer(msg, keys) {
            Some(reply) if child.send(&reply) => Ok(()),
            Some(_) => Err((
                Verdict::Crashed,
                "the candidate stopped listening while timed".into(),
            )),
            None => Err((
                Verdict::RuntimeError,
                "the program broke the evaluation protocol (asked for timed calls' inputs out of turn)"
                    .into(),
            )),
        }
    })?;
    log_long_calls(child.dir(), "candidate", &msg);
    let ms = times_of(&msg);
    if ms.len() != n as usize || ms.iter().any(|x| !x.is_finite() || *x < 0.0) {
        return Err((
            Verdict::RuntimeError,
            "the timing loop returned invalid timings".into(),
        ));
    }
    Ok(Timed {
        ms,
        persisting_l2: persisting_l2_of(&msg),
    })
}

/// Where the profiled run's findings go.
pub(crate) struct KernelCheck<'a> {
    pub custom_names: &'a [String],
    pub evidence: &'a mut Evidence,
    pub clock: &'a mut StageClock,
}

/// On CUDA, the first correctness trial once more under the profiler, after timing (roles.py
/// `Profiled` says why): which kernels ran, on which streams; its output is judged like any
/// trial's, so behaving differently under the profiler is wrong output.
pub(crate) fn profile_candidate(
    ctx: &JobContext,
    access: &Access<'_>,
    child: &mut Child,
    reference: &mut Reference,
    check: &mut KernelCheck<'_>,
) -> Result<Result<(), (Verdict, String)>, ReferenceFailed> {
    if ctx.cfg.device != Device::Cuda {
        return Ok(Ok(()));
    }
    let mut kernels = None;
    let mut on_event = |_: &Child, msg: &Value| {
        match msg["event"].as_str() {
            Some("kernels") => kernels = Some(msg.clone()),
            Some("profile_unavailable") => tracing::warn!(
                "no kernel profile: {}",
                msg["message"].as_str().unwrap_or("unknown error")
            ),
            _ => {}
        }
        Ok(())
    };
    // Under the pass from here: starting CUPTI and freeing timing's memory go to the driver and
    // the device, where another evaluation's timed calls would wait for them (timing_noise.py's
    // profiled contexts slowed a timed call 10-44x; bench/notes/eval-h200.md, session 23).
    let step = check.clock.untimed(access);
    let start = json!({"op": "start_profiler"});
    if let Err(failure) = request_candidate_with(ctx, child, start, "profiler_ready", &mut on_event)
    {
        return Ok(Err(failure));
    }
    check.clock.lap("profiler start");
    let profiled = request_candidate_with(
        ctx,
        child,
        json!({"op": "profile"}),
        "profiled",
        &mut on_event,
    );
    drop(step);
    let judged = match profiled {
        Ok(_) => {
            let path = child.dir().join("output_profiled.bin");
            let first_trial = ExpectedOutput::Trial(0);
            Ok(reference.judge(
                ctx,
                access,
                check.clock,
                first_trial,
                &path,
                Some(child.pid),
            )?)
        }
        Err(failure) => Err(failure),
    };
    check.clock.lap("profiled trial");
    if let Some(msg) = kernels {
        let (profile, findings) = runtime::check_kernels(&msg, check.custom_names, ctx.cfg.strict);
        check.evidence.kernels = Some(profile);
        check.evidence.findings.extend(findings);
    }
    let judged = match judged {
        Ok(judged) => judged,
        Err(failure) => return Ok(Err(failure)),
    };
    Ok(match judged_failure(&judged) {
        Some((verdict, message)) => Err((
            verdict,
            format!("correctness trial 1, run again under the profiler, was wrong: {message}"),
        )),
        None => Ok(()),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn persisting_l2_of_the_environment_is_not_the_candidates() {
        use super::{own_persisting_l2, persisting_l2_of};
        let reply =
            serde_json::json!({"persisting_l2": {"limit": "reserved", "window": "a window"}});
        let found = persisting_l2_of(&reply);
        let environment = |kinds: &[&str]| kinds.iter().map(ToString::to_string).collect();
        // The machine reserves persisting L2 for every process: the window is the candidate's.
        assert_eq!(
            own_persisting_l2(&found, &environment(&["limit"])),
            Some(&"a window".to_string())
        );
        assert_eq!(
            own_persisting_l2(&found, &environment(&["limit", "window"])),
            None
        );
        let honest = persisting_l2_of(&serde_json::json!({"persisting_l2": {"limit": "reserved"}}));
        assert_eq!(own_persisting_l2(&honest, &environment(&["limit"])), None);
        assert_eq!(
            own_persisting_l2(&honest, &environment(&[])),
            Some(&"reserved".to_string())
        );
        // A timer off CUDA reports nothing (an empty object, or none at all).
        assert!(persisting_l2_of(&serde_json::json!({"persisting_l2": {}})).is_empty());
        assert!(persisting_l2_of(&serde_json::json!({"ms": [1.0]})).is_empty());
    }

    use super::*;

    #[test]
    fn dice_alternates_the_sides_and_kernelbench_times_the_candidate_first() {
        let sides = |timing| {
            let order = schedule(timing, Device::Cuda, 10, 3);
            let calls: u32 = order.iter().map(|(_, n)| n).sum();
            let names: String = order
                .iter()
                .map(|(side, _)| if *side == Side::Candidate { 'c' } else { 'b' })
                .collect();
            (names, calls)
        };
        assert_eq!(sides(Timing::Dice), ("cbbccb".to_string(), 20));
        assert_eq!(sides(Timing::DiceQueued), ("bccbbc".to_string(), 20));
        assert_eq!(sides(Timing::KernelBench), ("cccbbb".to_string(), 20));
        assert_eq!(sides(Timing::KernelBenchV01), ("cccbbb".to_string(), 20));
        // No hold to set on the CPU: the queued method's rounds are dice's.
        let on_cpu = schedule(Timing::DiceQueued, Device::Cpu, 10, 3);
        assert_eq!(on_cpu, schedule(Timing::Dice, Device::Cpu, 10, 3));
    }

    /// Calls of 0.25 s (a first round of 10 each side, 2.5 s) leave nothing of a 2 s budget:
    /// one call a round after the first; calls of 20 ms leave 1.8 s, 90 calls for 9 rounds;
    /// short calls keep the plan; the two sides of a round always make as many.
    #[test]
    fn the_rounds_after_the_first_share_what_the_budget_leaves() {
        let first = |ms_per_call: f64| TimedRound {
            reported_ms: vec![ms_per_call; 10],
            wall_ms: 10.0 * ms_per_call,
            warmup_calls: 0,
        };
        let bounded = |candidate_ms: f64, baseline_ms: f64| {
            let mut plan = schedule(Timing::Dice, Device::Cuda, 100, 10);
            bound_rounds(
                &mut plan[2..],
                &first(candidate_ms),
                &first(baseline_ms),
                Duration::from_secs(2),
            );
            for pair in plan.chunks(2) {
                assert_eq!(pair[0].1, pair[1].1, "{plan:?}");
            }
            plan[2..]
                .iter()
                .step_by(2)
                .map(|(_, n)| *n)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            bounded(250.0, 1.0),
            vec![1; 9],
            "the slower side sets the pace"
        );
        assert_eq!(bounded(1.0, 250.0), vec![1; 9]);
        assert_eq!(bounded(20.0, 20.0), vec![10; 9], "90 calls fit 1.8 s");
        assert_eq!(
            bounded(25.0, 5.0),
            vec![8, 8, 8, 8, 8, 8, 8, 7, 7],
            "70 calls in 1.75 s"
        );
        assert_eq!(bounded(0.1, 0.1), vec![10; 9]);
        // Warm-ups that took seconds once (a torch.compile baseline compiling) bound nothing.
        let compiled = TimedRound {
            reported_ms: vec![1.0; 10],
            wall_ms: 30_000.0,
            warmup_calls: 5,
        };
        let mut plan = schedule(Timing::Dice, Device::Cuda, 100, 10);
        bound_rounds(
            &mut plan[2..],
            &first(1.0),
            &compiled,
            Duration::from_secs(2),
        );
        let later: u32 = plan[2..].iter().step_by(2).map(|(_, n)| n).sum();
        assert_eq!(later, 90);
    }

    /// From the correctness trials' call time, before any round: calls of 0.25 s afford 8 in the
    /// 2 s budget but every round makes one, calls of 40 ms get 50 over the 10 rounds, short
    /// calls and an unknown time keep the plan.
    #[test]
    fn the_trials_call_time_bounds_every_round_from_the_first() {
        let planned = |call_ms: f64| {
            let mut plan = schedule(Timing::Dice, Device::Cuda, 100, 10);
            bound_plan(&mut plan, call_ms, Duration::from_secs(2));
            for pair in plan.chunks(2) {
                assert_eq!(pair[0].1, pair[1].1, "{plan:?}");
            }
            plan.iter().step_by(2).map(|(_, n)| *n).collect::<Vec<_>>()
        };
        assert_eq!(planned(250.0), vec![1; 10], "at least one call a round");
        assert_eq!(planned(40.0), vec![5; 10]);
        assert_eq!(
            planned(30.0),
            vec![7, 7, 7, 7, 7, 7, 6, 6, 6, 6],
            "66 calls in 2 s"
        );
        assert_eq!(planned(1.0), vec![10; 10]);
        assert_eq!(planned(0.0), vec![10; 10]);
        assert_eq!(planned(f64::NAN), vec![10; 10]);
    }

    #[test]
    fn the_checked_calls_are_as_many_as_asked_distinct_and_among_those_made() {
        let named = |calls: Value| checked_calls(&json!({ "calls": calls }), 3, 10);
        assert_eq!(named(json!([7, 0, 9])), Some(vec![7, 0, 9]));
        assert_eq!(named(json!([7, 0])), None, "too few");
        assert_eq!(named(json!([7, 7, 9])), None, "one call twice");
        assert_eq!(named(json!([7, 0, 10])), None, "a call never made");
        assert_eq!(named(json!([7, 0, -1])), None, "not a call number");
        assert_eq!(checked_calls(&json!({}), 3, 10), None);
    }
}
