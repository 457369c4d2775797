//! A candidate process of the run stage: its start, the requests made to it, how its failures
//! read, and what running it showed besides its verdict.

use crate::child::{describe_exit, Child, Deadline, Event};
use crate::clock::StageClock;
use crate::config::EvalProblem;
use crate::job::{common_request, JobContext};
use crate::runtime::Finding;
use crate::stage_reference::RunError;
use crate::zygote::Zygote;
use dice_store::{KernelProfile, Verdict};
use serde_json::{json, Value};
use std::time::Duration;

/// What the run stage learnt about a candidate besides its verdict.
#[derive(Default)]
pub(crate) struct Evidence {
    pub findings: Vec<Finding>,
    pub kernels: Option<KernelProfile>,
}

/// A candidate process started for a problem, before its reference is ready.
pub(crate) struct CandidateRun {
    pub child: Child,
    pub custom_names: Vec<String>,
    pub clock: StageClock,
}

impl CandidateRun {
    /// The candidate's stages are counted from now: it was started ahead, while the run slot
    /// was busy with the previous candidate, and only the wait left is its own.
    pub(crate) fn restart_clock(&mut self) {
        self.clock.restart();
    }
}

/// Starts the candidate process, as the next sandbox user, after its compile stage.
pub(crate) fn spawn_candidate(
    ctx: &JobContext,
    zygote: &Zygote,
    problem: &EvalProblem,
    code: &[u8],
) -> Result<CandidateRun, RunError> {
    let mut clock = StageClock::start();
    let custom_names =
        std::str::from_utf8(code).map_or_else(|_| Vec::new(), dice_audit::custom_kernel_names);
    let mut request = common_request(ctx);
    request["cache_dir"] = json!(ctx.cfg.build_cache);
    request["problem_path"] = json!("problem.py");
    request["candidate_path"] = json!("candidate.py");
    request["kernelbench_namespace"] = json!(ctx.cfg.kernelbench_namespace);
    request["sandbox"] = ctx.users.candidate();
    let files: [(&str, &[u8]); 2] = [("problem.py", &problem.source), ("candidate.py", code)];
    let child = Child::start(zygote, &ctx.jobs_dir, "candidate", &files, request)
        .map_err(RunError::Evaluator)?;
    clock.set_label(child.dir().display().to_string());
    Ok(CandidateRun {
        child,
        custom_names,
        clock,
    })
}

/// Sends `op` to the candidate and waits (within one run timeout) for the `reply` event.
pub(crate) fn request_candidate(
    ctx: &JobContext,
    child: &mut Child,
    op: Value,
    reply: &str,
) -> Result<Value, (Verdict, String)> {
    request_candidate_with(ctx, child, op, reply, |_, _| Ok(()))
}

/// [`request_candidate`], handing every other event to `other` (with the process, to answer
/// it), which may decide against the candidate.
pub(crate) fn request_candidate_with(
    ctx: &JobContext,
    child: &mut Child,
    op: Value,
    reply: &str,
    mut other: impl FnMut(&Child, &Value) -> Result<(), (Verdict, String)>,
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
            Some(Event::Msg(msg)) => other(child, &msg)?,
        }
    }
}

pub(crate) fn timed_out(ctx: &JobContext, deadline: &Deadline, phase: &str) -> (Verdict, String) {
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
pub(crate) fn failure_of(msg: &Value) -> (Verdict, String) {
    let verdict = match msg["verdict"].as_str().and_then(|v| v.parse().ok()) {
        Some(v @ (Verdict::LoadError | Verdict::CompileError | Verdict::Crashed)) => v,
        _ => Verdict::RuntimeError,
    };
    let message = msg["message"].as_str().unwrap_or("failed").to_string();
    (verdict, message)
}
