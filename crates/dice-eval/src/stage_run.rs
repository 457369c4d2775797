//! Run stage of one candidate: its process imports the program, constructs `ModelNew` and runs
//! the correctness trials, each judged by the problem's reference as it arrives; a candidate that
//! passes them all is then timed (stage_timing.rs).

use crate::candidate::{failure_of, timed_out, CandidateRun, Evidence};
use crate::child::{describe_exit, Child, Deadline, Event};
use crate::gate::Access;
use crate::job::{build_record, Compiled, JobContext, Outcome};
use crate::runtime::Finding;
use crate::stage_reference::{judged_failure, Reference, RunError};
use crate::stage_timing::{profile_candidate, time_side_by_side, KernelCheck};
use anyhow::anyhow;
use dice_audit::Rule;
use dice_store::Verdict;
use serde_json::{json, Value};
use std::time::Instant;

/// Judging state of the correctness trials.
#[derive(Default)]
struct Trials {
    judged: u32,
    passed: u32,
    max_abs: Option<f64>,
    max_rel: Option<f64>,
    failure: Option<(Verdict, String)>,
    /// Each trial's call: the candidate's as this process saw it (from the request to its output
    /// published), the reference's forward as its process timed it.
    candidate_ms: Vec<f64>,
    reference_ms: Vec<f64>,
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
        self.reference_ms.extend(judged["reference_ms"].as_f64());
        let Some((verdict, message)) = judged_failure(judged) else {
            self.passed += 1;
            return false;
        };
        self.failure.get_or_insert((verdict, message));
        verdict == Verdict::ShapeMismatch
    }

    /// How long one call takes, as the trials show it: the slower side's fastest trial after the
    /// first (whose call pays one-time costs) where there are several. It only sizes the timing
    /// plan (stage_timing.rs): a candidate slower in its trials is timed in fewer calls of the
    /// same kind, which gains it nothing.
    fn call_ms(&self) -> Option<f64> {
        let fastest = |ms: &[f64]| {
            let later = if ms.len() > 1 { &ms[1..] } else { ms };
            later.iter().copied().reduce(f64::min)
        };
        let (candidate, reference) = (fastest(&self.candidate_ms), fastest(&self.reference_ms));
        match (candidate, reference) {
            (Some(c), Some(r)) => Some(c.max(r)),
            (c, r) => c.or(r),
        }
    }
}

/// Runs a started candidate against `reference`: construction, each correctness trial and each
/// judgement under an untimed pass of `access` apiece; when correct, timing's inputs made under
/// one more, the timed calls with the device to itself, then on CUDA the profiled rerun of trial 1.
pub(crate) fn run_candidate(
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
    // When the trial in progress was asked for.
    let mut trial_asked = Instant::now();
    let mut evidence = Evidence::default();
    let mut mutation_judged = false;
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
                ));
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
                    trial_asked = Instant::now();
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
                    trials
                        .candidate_ms
                        .push(trial_asked.elapsed().as_secs_f64() * 1e3);
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
                    let judged = reference.judge_trial(ctx, access, &mut clock, trial, &child)?;
                    // The judge's own comparison, which the program cannot patch (the
                    // candidate's report above is extra evidence); its first finding is kept.
                    if let Some(message) = judged["input_mutation"].as_str() {
                        if !std::mem::replace(&mut mutation_judged, true) {
                            evidence
                                .findings
                                .push(Finding::error(Rule::InputMutation, message.to_string()));
                        }
                    }
                    if trials.take(&judged) || reference.is_lost() {
                        verdict = trials.failure.clone();
                    } else if trial + 1 < ctx.cfg.correctness_trials {
                        step = clock.untimed(access);
                        child.send(&json!({"op": "trial"}));
                        trial_asked = Instant::now();
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
                        ));
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
                            trials.call_ms(),
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
    if let Some(t) = timing.filter(|t| !t.candidate.is_empty()) {
        t.record(ctx.cfg.timing, ctx.cfg.device, &mut outcome);
    }
    Ok(Unsettled { outcome, child })
}

/// A candidate's outcome while its process exits: a process with a CUDA context takes about
/// half a second to die, which its run slot need not wait for.
pub(crate) struct Unsettled {
    /// Complete but for the process's output excerpt (`log`).
    pub outcome: Outcome,
    child: Child,
}

impl Unsettled {
    /// The whole outcome, once the process has exited.
    pub(crate) fn settle(self) -> Outcome {
        let (_, log) = self.child.finish();
        Outcome {
            log,
            ..self.outcome
        }
    }
}
