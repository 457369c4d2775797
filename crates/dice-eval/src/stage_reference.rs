//! Reference stage: a problem's reference process (trusted; also the judge), kept alive across
//! the problem's candidates. It computes the expected outputs, judges the outputs candidates
//! publish (as plain tensors, never running candidate code) and times the baseline.

use crate::call_keys::{CallKeys, RoundAsks};
use crate::child::{describe_exit, Child, Deadline, Event};
use crate::clock::StageClock;
use crate::config::EvalProblem;
use crate::gate::Access;
use crate::job::{common_request, log_long_calls, persisting_l2_of, times_of, JobContext};
use crate::runtime::TimedRound;
use crate::zygote::Zygote;
use dice_store::Verdict;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::Path;
use std::time::Instant;

/// An output the reference computes to judge a candidate's against.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ExpectedOutput {
    /// Correctness trial `0..`.
    Trial(u32),
    /// Call `0..` of a candidate's timing, on the inputs that call got from its `key`
    /// (python/protocol.py `Seeds.timed_call`).
    TimedCall { call: u64, key: u64 },
}

/// The reference of a problem failed: a problem error, never blamed on the candidate.
#[derive(Clone, Debug)]
pub(crate) struct ReferenceFailed(pub String);

/// Why a candidate got no outcome.
#[derive(Debug)]
pub(crate) enum RunError {
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
pub(crate) struct Reference {
    child: Child,
    footprint: Option<Footprint>,
    /// Why the process died or hung on a candidate's output, which it was reading: that
    /// candidate's failure, and the problem's next candidate gets a fresh reference.
    lost: Option<String>,
    /// The kinds of persisting-L2 state its own timer found before a flush: set by the
    /// environment (the trusted process ran no candidate code), so the same kind found in a
    /// candidate's process is not its doing.
    pub(crate) environment_l2: BTreeSet<String>,
    /// The spin before each timed call of the queued timing, as the baseline's warm-ups set it
    /// (python/protocol.py `Timer`), once its first round has run on the device.
    pub(crate) hold_ms: Option<f64>,
}

/// What a reference process holds on its GPU once all its expected outputs are computed, and
/// the GPU's size, as it reported them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Footprint {
    pub bytes: u64,
    pub device_total: u64,
}

/// A reference process started for a problem, importing it; nothing on the device yet.
pub(crate) struct StartedReference {
    reference: Reference,
}

impl StartedReference {
    /// The model and the timing inputs on the device, under an untimed pass of `access`, once the
    /// process has imported the problem.
    pub(crate) fn construct(
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
    pub(crate) fn spawn(
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
                lost: None,
                environment_l2: BTreeSet::new(),
                hold_ms: None,
            },
        })
    }

    /// True once the process died or hung judging a candidate's output: it judges nothing more.
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_some()
    }

    /// None on the CPU.
    pub(crate) fn footprint(&self) -> Option<Footprint> {
        self.footprint
    }

    fn wait_for(
        &mut self,
        ctx: &JobContext,
        event: &str,
        doing: &str,
    ) -> Result<Value, ReferenceFailed> {
        self.wait_for_any(ctx, &[event], doing)
    }

    /// The next of the process's messages whose event is one of `events`.
    fn wait_for_any(
        &mut self,
        ctx: &JobContext,
        events: &[&str],
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
                Some(Event::Msg(msg)) if events.iter().any(|e| msg["event"] == *e) => {
                    return Ok(msg)
                }
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
        self.send(&op, doing)?;
        self.wait_for(ctx, reply, doing)
    }

    fn send(&self, op: &Value, doing: &str) -> Result<(), ReferenceFailed> {
        if self.child.send(op) {
            Ok(())
        } else {
            Err(ReferenceFailed(format!(
                "{doing}: the reference process is gone"
            )))
        }
    }

    /// Judges the output the candidate published at `path` against `expected`,
    /// then deletes it: published outputs can be GBs of RAM (job folders live in /dev/shm).
    /// `owner`: the candidate's process, whose processes may hand the judge large outputs as
    /// shared device memory (python/shared_output.py); None where the output is never shared.
    /// An untimed step of its own (the candidate's step that made the output is over), so a
    /// timer waits for one of the two, never for both.
    ///
    /// The reference failing to compute the expected output is the problem's failure; once it
    /// has (`judging`), only the candidate's file is left to read, so a judge that dies or hangs
    /// from then on is the candidate's failure, never its problem's.
    pub(crate) fn judge(
        &mut self,
        ctx: &JobContext,
        access: &Access<'_>,
        clock: &mut StageClock,
        expected: ExpectedOutput,
        path: &Path,
        owner: Option<i32>,
    ) -> Result<Value, ReferenceFailed> {
        let _step = clock.untimed(access);
        let judged = self.judge_files(ctx, expected, path, None, owner);
        let _ = std::fs::remove_file(path);
        judged
    }

    /// [`Reference::judge`] for correctness trial `trial` of `candidate`, which published its
    /// output in its folder, and its inputs as its forward left them: the judge compares those
    /// with the trial's inputs as it makes them, and says in `input_mutation` (null when
    /// unchanged) which one changed.
    pub(crate) fn judge_trial(
        &mut self,
        ctx: &JobContext,
        access: &Access<'_>,
        clock: &mut StageClock,
        trial: u32,
        candidate: &Child,
    ) -> Result<Value, ReferenceFailed> {
        let path = candidate.dir().join(format!("output_{trial}.bin"));
        let inputs = candidate.dir().join(format!("inputs_{trial}.bin"));
        let _step = clock.untimed(access);
        let judged = self.judge_files(
            ctx,
            ExpectedOutput::Trial(trial),
            &path,
            Some(&inputs),
            Some(candidate.pid),
        );
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(&inputs);
        judged
    }

    fn judge_files(
        &mut self,
        ctx: &JobContext,
        expected: ExpectedOutput,
        path: &Path,
        inputs: Option<&Path>,
        owner: Option<i32>,
    ) -> Result<Value, ReferenceFailed> {
        if self.lost.is_none() {
            let mut op = json!({
                "op": "judge",
                "path": path.to_string_lossy(),
                "inputs": inputs.map(Path::to_string_lossy),
                "owner": owner,
            });
            match expected {
                ExpectedOutput::Trial(trial) => op["trial"] = json!(trial),
                ExpectedOutput::TimedCall { call, key } => {
                    op["timed_call"] = json!(call);
                    op["key"] = json!(key);
                }
            }
            self.request(ctx, op, "judging", "computing an expected output")?;
            match self.wait_for(ctx, "judged", "judging an output") {
                Ok(judged) => return Ok(judged),
                Err(ReferenceFailed(why)) => self.lost = Some(why),
            }
        }
        let why = self.lost.as_deref().unwrap_or_default();
        Ok(json!({
            "verdict": "runtime_error",
            "message": format!("the judge failed on the program's published output ({why})"),
        }))
    }

    /// A round of `n` timed calls from call `first_call` of a candidate's timing, on the inputs
    /// those calls of the candidate get (their keys handed out as the timer asks, `asks`): their
    /// times in ms as the reference reported them, the evaluator-side wall time of the round, and
    /// the untimed warm-up calls it made first.
    pub(crate) fn time(
        &mut self,
        ctx: &JobContext,
        n: u32,
        first_call: u64,
        mut asks: RoundAsks,
        keys: &mut CallKeys,
    ) -> Result<TimedRound, ReferenceFailed> {
        let started = Instant::now();
        let doing = "timing the baseline";
        self.send(
            &json!({"op": "time", "n": n, "first_call": first_call}),
            doing,
        )?;
        let reply = loop {
            let msg = self.wait_for_any(ctx, &["times", "keys"], doing)?;
            if msg["event"] == "times" {
                break msg;
            }
            let Some(answer) = asks.answer(&msg, keys) else {
                return Err(ReferenceFailed(format!(
                    "{doing}: the reference's timer asked for the keys of calls out of turn"
                )));
            };
            self.send(&answer, doing)?;
        };
        log_long_calls(self.child.dir(), "baseline", &reply);
        self.environment_l2
            .extend(persisting_l2_of(&reply).into_keys());
        self.hold_ms = reply["hold_ms"]
            .as_f64()
            .filter(|ms| ms.is_finite() && *ms >= 0.0);
        Ok(TimedRound {
            reported_ms: times_of(&reply),
            wall_ms: started.elapsed().as_secs_f64() * 1e3,
            warmup_calls: reply["untimed"]
                .as_u64()
                .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
        })
    }

    pub(crate) fn close(self) {
        self.child.send(&json!({"op": "quit"}));
        self.child.finish();
    }
}

/// The verdict and message of a judgement that failed; None when the output was right.
pub(crate) fn judged_failure(judged: &Value) -> Option<(Verdict, String)> {
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
