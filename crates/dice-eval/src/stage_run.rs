//! Run stage on one device: the reference process of a problem (trusted; also the judge) and one
//! candidate process at a time. Correctness trials are judged as they arrive; a correct candidate
//! is then timed in rounds that alternate with the reference, never both at once.

use crate::child::{Child, Deadline, Event};
use crate::config::{Device, EvalProblem};
use crate::gate::{Access, SharedPass};
use crate::job::{build_record, Compiled, JobContext, Outcome};
use crate::runtime::{self, Finding, KernelProfile};
use crate::stats::timing_stats;
use crate::verdict::Verdict;
use crate::zygote::{Exit, Zygote};
use anyhow::anyhow;
use dice_audit::Rule;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

/// The reference of a problem failed: a problem error, never blamed on the candidate.
#[derive(Clone, Debug)]
pub struct ReferenceFailed(pub String);

/// Why a candidate got no outcome.
#[derive(Debug)]
pub enum RunError {
    Reference(ReferenceFailed),
    /// The evaluator itself failed (e.g. its fork server died): nobody's verdict.
    Evaluator(anyhow::Error),
}

impl From<ReferenceFailed> for RunError {
    fn from(e: ReferenceFailed) -> Self {
        RunError::Reference(e)
    }
}

/// A problem's reference process, kept alive across the problem's candidates.
pub struct Reference {
    child: Child,
    footprint: Option<Footprint>,
}

/// What a reference process holds on its GPU once all its expected outputs are computed, and
/// the GPU's size, as it reported them.
#[derive(Clone, Copy, Debug)]
pub struct Footprint {
    pub bytes: u64,
    pub device_total: u64,
}

/// A reference process started for a problem, importing it; nothing on the device yet.
pub struct StartedReference {
    reference: Reference,
}

impl StartedReference {
    /// The model and the timing inputs on the device, under an untimed pass of `access`, once the
    /// process has imported the problem.
    pub fn construct(
        self,
        ctx: &JobContext,
        problem: &EvalProblem,
        access: &Access<'_>,
    ) -> Result<Reference, RunError> {
        let mut reference = self.reference;
        let ready = reference
            .wait_for(ctx, "loaded", "importing the problem")
            .and_then(|_| {
                let _step = access.untimed();
                reference.request(
                    ctx,
                    json!({"op": "construct"}),
                    "ready",
                    "running the reference",
                )
            });
        match ready {
            Ok(ready) => {
                reference.footprint = ready["device_bytes"]
                    .as_u64()
                    .zip(ready["device_total"].as_u64())
                    .map(|(bytes, device_total)| Footprint {
                        bytes,
                        device_total,
                    });
                Ok(reference)
            }
            Err(failed) => {
                let (_, log) = reference.child.finish();
                tracing::warn!(
                    "the reference of {} failed: {}\n{log}",
                    problem.name,
                    failed.0
                );
                Err(failed.into())
            }
        }
    }
}

impl Reference {
    /// Starts the reference process of `problem` (the process and its imports run outside any
    /// device pass); [`StartedReference::construct`] makes it ready.
    pub fn spawn(
        ctx: &JobContext,
        zygote: &Zygote,
        problem: &EvalProblem,
    ) -> Result<StartedReference, RunError> {
        let mut request = common_request(ctx);
        request["problem_path"] = json!("problem.py");
        request["baseline"] = json!(ctx.cfg.baseline.as_str());
        request["atol"] = json!(ctx.cfg.atol);
        request["rtol"] = json!(ctx.cfg.rtol);
        let files: [(&str, &[u8]); 1] = [("problem.py", &problem.source)];
        let child = Child::start(zygote, &ctx.jobs_dir, "reference", &files, request)
            .map_err(RunError::Evaluator)?;
        Ok(StartedReference {
            reference: Reference {
                child,
                footprint: None,
            },
        })
    }

    /// None on the CPU.
    pub fn footprint(&self) -> Option<Footprint> {
        self.footprint
    }

    fn wait_for(
        &mut self,
        ctx: &JobContext,
        event: &str,
        doing: &str,
    ) -> Result<Value, ReferenceFailed> {
        let mut deadline = Deadline::new(ctx.cfg.timeout, ctx.cfg.compile_timeout);
        loop {
            match self.child.next_within(&mut deadline) {
                None => {
                    return Err(ReferenceFailed(format!(
                        "{doing} took longer than {} s",
                        ctx.cfg.timeout.as_secs()
                    )))
                }
                Some(Event::Exited(exit)) => {
                    return Err(ReferenceFailed(format!(
                        "{doing}: the reference {}",
                        describe_exit(exit)
                    )))
                }
                Some(Event::Msg(msg)) if msg["event"] == event => return Ok(msg),
                Some(Event::Msg(msg)) if msg["event"] == "failed" => {
                    let why = msg["message"].as_str().unwrap_or("unknown error");
                    return Err(ReferenceFailed(format!("{doing}: {why}")));
                }
                Some(Event::Msg(_)) => {}
            }
        }
    }

    fn request(
        &mut self,
        ctx: &JobContext,
        op: Value,
        reply: &str,
        doing: &str,
    ) -> Result<Value, ReferenceFailed> {
        if !self.child.send(&op) {
            return Err(ReferenceFailed(format!(
                "{doing}: the reference process is gone"
            )));
        }
        self.wait_for(ctx, reply, doing)
    }

    /// Judges the output the candidate published at `path` against expected output `trial`,
    /// then deletes it: published outputs can be GBs of RAM (job folders live in /dev/shm).
    /// An untimed step of its own (the candidate's step that made the output is over), so a
    /// timer waits for one of the two, never for both.
    fn judge(
        &mut self,
        ctx: &JobContext,
        access: &Access<'_>,
        clock: &mut StageClock,
        trial: u32,
        path: &Path,
    ) -> Result<Value, ReferenceFailed> {
        let _step = clock.untimed(access);
        let judged = self.request(
            ctx,
            json!({"op": "judge", "trial": trial, "path": path.to_string_lossy()}),
            "judged",
            "judging an output",
        );
        let _ = std::fs::remove_file(path);
        judged
    }

    /// Timings of `n` calls in ms, and the evaluator-side wall time of the batch.
    fn time(&mut self, ctx: &JobContext, n: u32) -> Result<(Vec<f64>, f64), ReferenceFailed> {
        let started = Instant::now();
        let reply = self.request(
            ctx,
            json!({"op": "time", "n": n}),
            "times",
            "timing the baseline",
        )?;
        Ok((times_of(&reply), started.elapsed().as_secs_f64() * 1e3))
    }

    pub fn close(self) {
        self.child.send(&json!({"op": "quit"}));
        self.child.finish();
    }
}

fn common_request(ctx: &JobContext) -> Value {
    json!({
        "device": ctx.cfg.device.as_str(),
        "precision": ctx.cfg.precision.as_str(),
        "trials": ctx.cfg.correctness_trials,
        "limits": ctx.limits,
        "cores": ctx.cores,
        "env": ctx.env,
    })
}

fn times_of(reply: &Value) -> Vec<f64> {
    reply["ms"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

pub fn describe_exit(exit: Exit) -> String {
    match exit {
        Exit::Signal(sig) => format!("was killed by signal {sig} ({})", signal_name(sig)),
        Exit::Code(code) => format!("exited with status {code}"),
        Exit::Lost => "was lost with its worker".to_string(),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGABRT => "SIGABRT",
        libc::SIGFPE => "SIGFPE",
        libc::SIGILL => "SIGILL",
        libc::SIGKILL => "SIGKILL",
        libc::SIGXCPU => "SIGXCPU, CPU time limit",
        libc::SIGXFSZ => "SIGXFSZ, file size limit",
        libc::SIGTERM => "SIGTERM",
        _ => "signal",
    }
}

/// Judging state of the correctness trials.
#[derive(Default)]
struct Trials {
    judged: u32,
    passed: u32,
    max_abs: Option<f64>,
    max_rel: Option<f64>,
    failure: Option<(Verdict, String)>,
}

impl Trials {
    /// Takes one judgement; true when the candidate is already decided (a shape mismatch).
    fn take(&mut self, judged: &Value) -> bool {
        self.judged += 1;
        let fold = |old: Option<f64>, new: Option<f64>| match (old, new) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        self.max_abs = fold(self.max_abs, judged["max_abs"].as_f64());
        self.max_rel = fold(self.max_rel, judged["max_rel"].as_f64());
        let Some((verdict, message)) = judged_failure(judged) else {
            self.passed += 1;
            return false;
        };
        self.failure.get_or_insert((verdict, message));
        verdict == Verdict::ShapeMismatch
    }
}

/// The verdict and message of a judgement that failed; None when the output was right.
fn judged_failure(judged: &Value) -> Option<(Verdict, String)> {
    let verdict = match judged["verdict"].as_str() {
        Some("ok") => return None,
        Some("shape_mismatch") => Verdict::ShapeMismatch,
        Some("nan_or_inf") => Verdict::NanOrInf,
        Some("output_mismatch") => Verdict::OutputMismatch,
        _ => Verdict::RuntimeError,
    };
    let message = judged["message"].as_str().unwrap_or("wrong output");
    Some((verdict, message.to_string()))
}

/// What the run stage learnt about a candidate besides its verdict.
#[derive(Default)]
struct Evidence {
    findings: Vec<Finding>,
    kernels: Option<KernelProfile>,
}

/// A candidate process started for a problem, before its reference is ready.
pub struct CandidateRun {
    child: Child,
    custom_names: Vec<String>,
    clock: StageClock,
}

impl CandidateRun {
    /// The candidate's stages are counted from now: it was started ahead, while the run slot
    /// was busy with the previous candidate, and only the wait left is its own.
    pub fn restart_clock(&mut self) {
        self.clock = StageClock::start();
    }
}

/// Starts the candidate process, as the next sandbox user, after its compile stage.
pub fn spawn_candidate(
    ctx: &JobContext,
    zygote: &Zygote,
    problem: &EvalProblem,
    code: &[u8],
) -> Result<CandidateRun, RunError> {
    let clock = StageClock::start();
    let custom_names =
        std::str::from_utf8(code).map_or_else(|_| Vec::new(), dice_audit::custom_kernel_names);
    let mut request = common_request(ctx);
    request["cache_dir"] = json!(ctx.cfg.build_cache);
    request["problem_path"] = json!("problem.py");
    request["candidate_path"] = json!("candidate.py");
    request["sandbox"] = ctx.users.run();
    let files: [(&str, &[u8]); 2] = [("problem.py", &problem.source), ("candidate.py", code)];
    let child = Child::start(zygote, &ctx.jobs_dir, "candidate", &files, request)
        .map_err(RunError::Evaluator)?;
    Ok(CandidateRun {
        child,
        custom_names,
        clock,
    })
}

/// Runs a started candidate against `reference`: construction, each correctness trial and each
/// judgement under an untimed pass of `access` apiece; when correct, timing's inputs made under
/// one more, the timed calls with the device to itself, then on CUDA the profiled rerun of trial 1.
pub fn run_candidate(
    ctx: &JobContext,
    access: &Access<'_>,
    reference: &mut Reference,
    candidate: CandidateRun,
    compiled: Compiled,
) -> Result<Unsettled, RunError> {
    let Compiled {
        mut builds,
        wall_s: build_wall_s,
    } = compiled;
    let CandidateRun {
        mut child,
        custom_names,
        mut clock,
    } = candidate;
    let mut step = None;
    let mut deadline = Deadline::new(ctx.cfg.timeout, ctx.cfg.compile_timeout);
    let mut trials = Trials::default();
    let mut evidence = Evidence::default();
    let mut phase = "importing the program".to_string();
    let mut verdict: Option<(Verdict, String)> = None;
    let mut timing = None;
    while verdict.is_none() {
        match child.next_within(&mut deadline) {
            None => verdict = Some(timed_out(ctx, &deadline, &phase)),
            Some(Event::Exited(exit)) => {
                verdict = Some((
                    Verdict::Crashed,
                    format!("{} while {phase}", describe_exit(exit)),
                ))
            }
            Some(Event::Msg(msg)) => match msg["event"].as_str().unwrap_or_default() {
                "sandbox_error" => {
                    let why = msg["message"].as_str().unwrap_or("unknown error");
                    return Err(RunError::Evaluator(anyhow!(
                        "cannot sandbox the candidate: {why} (run the evaluator as root, or see \
                         crates/dice-eval/SANDBOX.md)"
                    )));
                }
                "build" => builds.push(build_record(&msg)),
                "failed" => verdict = Some(failure_of(&msg)),
                "loaded" => {
                    clock.lap("import");
                    step = clock.untimed(access);
                    child.send(&json!({"op": "construct"}));
                    phase = "constructing ModelNew".into();
                }
                "constructed" => {
                    // Given back before the next one: a second shared pass taken while a writer
                    // waits would deadlock.
                    drop(step.take());
                    clock.lap("construct");
                    step = clock.untimed(access);
                    child.send(&json!({"op": "trial"}));
                    phase = "running correctness trial 1".into();
                }
                // The candidate could stay silent about itself, but never makes itself better.
                "finding" if msg["rule"] == "input_mutation" => {
                    let message = msg["message"].as_str().unwrap_or("input changed in place");
                    evidence
                        .findings
                        .push(Finding::error(Rule::InputMutation, message.to_string()));
                }
                "output" => {
                    // The candidate's word is not trusted: trials come in order, and the judge
                    // reads the one file the candidate may publish for that trial.
                    let trial = trials.judged;
                    if msg["trial"].as_u64() != Some(u64::from(trial))
                        || trial >= ctx.cfg.correctness_trials
                    {
                        verdict = Some((
                            Verdict::RuntimeError,
                            "the program broke the evaluation protocol".into(),
                        ));
                        continue;
                    }
                    drop(step.take());
                    let path = child.dir().join(format!("output_{trial}.bin"));
                    let judged = reference.judge(ctx, access, &mut clock, trial, &path)?;
                    if trials.take(&judged) {
                        verdict = trials.failure.clone();
                    } else if trial + 1 < ctx.cfg.correctness_trials {
                        step = clock.untimed(access);
                        child.send(&json!({"op": "trial"}));
                        phase = format!("running correctness trial {}", trial + 2);
                    } else if trials.failure.is_some() {
                        verdict = trials.failure.clone();
                    } else {
                        // Timing's inputs go on the device under this pass, not in the window.
                        step = clock.untimed(access);
                        child.send(&json!({"op": "prepare_timing"}));
                        phase = "preparing the timing inputs".into();
                    }
                }
                // Asked for only after every trial passed; sent before that by the program itself,
                // it decides against the program.
                "timing_ready" => match trials.failure.clone() {
                    Some(failure) => verdict = Some(failure),
                    None if trials.passed < ctx.cfg.correctness_trials => {
                        verdict = Some((
                            Verdict::RuntimeError,
                            "fewer outputs than correctness trials".into(),
                        ))
                    }
                    None => {
                        // Given back first: the exclusive pass waits for every shared one.
                        drop(step.take());
                        clock.lap("trials");
                        let mut result = time_side_by_side(
                            ctx,
                            access,
                            &mut child,
                            reference,
                            &mut evidence,
                            &mut clock,
                        )?;
                        if result.is_ok() {
                            let mut check = KernelCheck {
                                custom_names: &custom_names,
                                evidence: &mut evidence,
                                clock: &mut clock,
                            };
                            if let Err(failure) =
                                profile_candidate(ctx, access, &mut child, reference, &mut check)?
                            {
                                result = Err(failure);
                            }
                        }
                        verdict = Some(match result {
                            Ok(t) => {
                                timing = Some(t);
                                (Verdict::Correct, String::new())
                            }
                            Err(failure) => failure,
                        });
                    }
                },
                _ => {}
            },
        }
    }
    drop(step);
    child.send(&json!({"op": "quit"}));
    let (verdict, message) = verdict.expect("loop ends with a verdict");
    let wall_s = build_wall_s + clock.total_s();
    let mut outcome = Outcome::failed(verdict, message, String::new(), builds, wall_s);
    outcome.stages = clock.into_stages();
    if verdict == Verdict::Correct {
        outcome.message = None;
    }
    outcome.trials_passed = trials.passed;
    outcome.max_abs_error = trials.max_abs;
    outcome.max_rel_error = trials.max_rel;
    outcome.findings = evidence.findings;
    outcome.kernels = evidence.kernels;
    if let Some(t) = timing.filter(|t| !t.candidate_ms.is_empty()) {
        outcome.candidate_timing = timing_stats(&t.candidate_ms);
        outcome.baseline_timing = timing_stats(&t.baseline_ms);
        outcome.candidate_wall_ms = Some(t.candidate_wall_ms);
        outcome.baseline_wall_ms = Some(t.baseline_wall_ms);
    }
    Ok(Unsettled { outcome, child })
}

/// A candidate's outcome while its process exits: a process with a CUDA context takes about
/// half a second to die, which its run slot need not wait for.
pub struct Unsettled {
    /// Complete but for the process's output excerpt (`log`).
    pub outcome: Outcome,
    child: Child,
}

impl Unsettled {
    /// The whole outcome, once the process has exited.
    pub fn settle(self) -> Outcome {
        let (_, log) = self.child.finish();
        Outcome {
            log,
            ..self.outcome
        }
    }
}

fn timed_out(ctx: &JobContext, deadline: &Deadline, phase: &str) -> (Verdict, String) {
    if deadline.building() {
        let secs = ctx.cfg.compile_timeout.as_secs();
        (
            Verdict::CompileTimeout,
            format!("an extension build ran past {secs} s"),
        )
    } else {
        (
            Verdict::Timeout,
            format!(
                "no result within {} s while {phase}",
                ctx.cfg.timeout.as_secs()
            ),
        )
    }
}

/// A failure the candidate process reported about itself; it can only ever make itself worse.
fn failure_of(msg: &Value) -> (Verdict, String) {
    let verdict = match msg["verdict"].as_str().and_then(|v| v.parse().ok()) {
        Some(v @ (Verdict::LoadError | Verdict::CompileError | Verdict::Crashed)) => v,
        _ => Verdict::RuntimeError,
    };
    let message = msg["message"].as_str().unwrap_or("failed").to_string();
    (verdict, message)
}

struct Timings {
    candidate_ms: Vec<f64>,
    baseline_ms: Vec<f64>,
    candidate_wall_ms: f64,
    baseline_wall_ms: f64,
}

/// Alternates rounds of candidate and baseline calls (the order flips each round), each round
/// with its own time limit; then judges the candidate's last output on each timing input set and
/// checks its clock against the evaluator's wall time.
fn time_side_by_side(
    ctx: &JobContext,
    access: &Access<'_>,
    child: &mut Child,
    reference: &mut Reference,
    evidence: &mut Evidence,
    clock: &mut StageClock,
) -> Result<Result<Timings, (Verdict, String)>, ReferenceFailed> {
    let mut t = Timings {
        candidate_ms: Vec::new(),
        baseline_ms: Vec::new(),
        candidate_wall_ms: 0.0,
        baseline_wall_ms: 0.0,
    };
    let total = ctx.cfg.perf_trials;
    if total == 0 {
        return Ok(Ok(t));
    }
    let rounds = ctx.cfg.timing_rounds.clamp(1, total);
    let mut reused = None;
    let alone = access.timed();
    clock.lap("timing wait");
    for round in 0..rounds {
        let n = total / rounds + u32::from(round < total % rounds);
        for side in [round % 2, 1 - round % 2] {
            if side == 0 {
                let started = Instant::now();
                match time_candidate(ctx, child, n) {
                    Ok((ms, why)) => {
                        t.candidate_ms.extend(ms);
                        reused = reused.or(why);
                    }
                    Err(failure) => return Ok(Err(failure)),
                }
                t.candidate_wall_ms += started.elapsed().as_secs_f64() * 1e3;
            } else {
                let (ms, wall) = reference.time(ctx, n)?;
                t.baseline_ms.extend(ms);
                t.baseline_wall_ms += wall;
            }
        }
    }
    drop(alone);
    clock.lap("timing");
    if let Some(why) = reused {
        evidence
            .findings
            .push(Finding::error(Rule::OutputReused, why));
    }
    evidence.findings.extend(runtime::check_timer(
        &t.candidate_ms,
        t.candidate_wall_ms,
        &t.baseline_ms,
        t.baseline_wall_ms,
        rounds,
    ));
    let judged = judge_timing_outputs(ctx, access, clock, child, reference)?;
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

/// Has the candidate publish its last timed output of each input set, and judges them like
/// correctness trials (the reference knows the expected outputs after its correctness trials).
fn judge_timing_outputs(
    ctx: &JobContext,
    access: &Access<'_>,
    clock: &mut StageClock,
    child: &mut Child,
    reference: &mut Reference,
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
    let sets = reply["sets"].as_u64().unwrap_or(0).min(TIMING_SETS);
    if sets != TIMING_SETS {
        return Ok(Err((
            Verdict::RuntimeError,
            "the program broke the evaluation protocol".into(),
        )));
    }
    for k in 0..sets as u32 {
        let path = child.dir().join(format!("timing_{k}.bin"));
        let index = ctx.cfg.correctness_trials + k;
        let judged = reference.judge(ctx, access, clock, index, &path)?;
        if let Some((verdict, message)) = judged_failure(&judged) {
            let message = format!(
                "the last timed call on input set {} was wrong: {message}",
                k + 1
            );
            return Ok(Err((verdict, message)));
        }
    }
    Ok(Ok(()))
}

/// Input sets the timing loop rotates through (python/protocol.py TIMING_SEEDS).
const TIMING_SETS: u64 = 2;

/// Timings of `n` calls, and why the candidate's outputs look cached, if they do.
fn time_candidate(
    ctx: &JobContext,
    child: &mut Child,
    n: u32,
) -> Result<(Vec<f64>, Option<String>), (Verdict, String)> {
    let msg = request_candidate(ctx, child, json!({"op": "time", "n": n}), "times")?;
    let ms = times_of(&msg);
    if ms.len() != n as usize || ms.iter().any(|x| !x.is_finite() || *x < 0.0) {
        return Err((
            Verdict::RuntimeError,
            "the timing loop returned invalid timings".into(),
        ));
    }
    Ok((ms, msg["reused"].as_str().map(str::to_string)))
}

/// Sends `op` to the candidate and waits (within one run timeout) for the `reply` event.
fn request_candidate(
    ctx: &JobContext,
    child: &mut Child,
    op: Value,
    reply: &str,
) -> Result<Value, (Verdict, String)> {
    request_candidate_with(ctx, child, op, reply, |_| {})
}

/// [`request_candidate`], handing every other event to `other`.
fn request_candidate_with(
    ctx: &JobContext,
    child: &mut Child,
    op: Value,
    reply: &str,
    mut other: impl FnMut(&Value),
) -> Result<Value, (Verdict, String)> {
    if !child.send(&op) {
        return Err((
            Verdict::Crashed,
            "the candidate stopped listening before timing".into(),
        ));
    }
    let mut deadline = Deadline::new(ctx.cfg.timeout, Duration::ZERO);
    loop {
        match child.next_within(&mut deadline) {
            None => return Err(timed_out(ctx, &deadline, "timing")),
            Some(Event::Exited(exit)) => {
                return Err((
                    Verdict::Crashed,
                    format!("{} while timing", describe_exit(exit)),
                ))
            }
            Some(Event::Msg(msg)) if msg["event"] == reply => return Ok(msg),
            Some(Event::Msg(msg)) if msg["event"] == "failed" => return Err(failure_of(&msg)),
            Some(Event::Msg(msg)) => other(&msg),
        }
    }
}

/// Where the profiled run's findings go.
struct KernelCheck<'a> {
    custom_names: &'a [String],
    evidence: &'a mut Evidence,
    clock: &'a mut StageClock,
}

/// On CUDA, the first correctness trial once more under the profiler, after timing (roles.py
/// `Profiled` says why): which kernels ran, on which streams; its output is judged like any
/// trial's, so behaving differently under the profiler is wrong output.
fn profile_candidate(
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
    let mut on_event = |msg: &Value| match msg["event"].as_str() {
        Some("kernels") => kernels = Some(msg.clone()),
        Some("profile_unavailable") => tracing::warn!(
            "no kernel profile: {}",
            msg["message"].as_str().unwrap_or("unknown error")
        ),
        _ => {}
    };
    let start = json!({"op": "start_profiler"});
    if let Err(failure) = request_candidate_with(ctx, child, start, "profiler_ready", &mut on_event)
    {
        return Ok(Err(failure));
    }
    check.clock.lap("profiler start");
    let step = check.clock.untimed(access);
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
            Ok(reference.judge(ctx, access, check.clock, 0, &path)?)
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

/// Wall time of a candidate's stages, as the evaluator saw them, in seconds; time spent waiting
/// for an untimed pass is also summed apart (`pass wait`).
struct StageClock {
    started: Instant,
    last: Instant,
    stages: Vec<(String, f64)>,
    pass_wait_s: f64,
}

impl StageClock {
    fn start() -> Self {
        let now = Instant::now();
        StageClock {
            started: now,
            last: now,
            stages: Vec::new(),
            pass_wait_s: 0.0,
        }
    }

    /// A pass of `access` for one untimed step; the wait for it counts as `pass wait`.
    fn untimed<'a>(&mut self, access: &Access<'a>) -> Option<SharedPass<'a>> {
        let asked = Instant::now();
        let pass = access.untimed();
        self.pass_wait_s += asked.elapsed().as_secs_f64();
        pass
    }

    fn into_stages(mut self) -> Vec<(String, f64)> {
        self.stages
            .push(("pass wait".to_string(), self.pass_wait_s));
        self.stages
    }

    /// Ends the stage `name`, which began when the previous one ended.
    fn lap(&mut self, name: &str) {
        let now = Instant::now();
        self.stages
            .push((name.to_string(), (now - self.last).as_secs_f64()));
        self.last = now;
    }

    fn total_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }
}
