//! Compile stage: imports each candidate with CUDA hidden, only so that its extensions get built
//! into the cache. The candidate builds nothing itself: each extension it loads is asked of the
//! evaluator, which builds and publishes it (build_cache.rs). A failed or timed-out build is a
//! verdict here; anything else is left for the run stage to judge.

use crate::build_cache::{self, Provision};
use crate::child::{Child, Deadline, Event};
use crate::config::EvalSample;
use crate::job::{Compiled, JobContext, Outcome, COMPILE_STAGE_NICENESS};
use crate::zygote::Zygote;
use anyhow::{bail, Result};
use dice_store::Verdict;
use serde_json::json;

/// What the compile stage decided about one candidate.
pub(crate) enum Built {
    /// Go on to the run stage (its builds, if any, are cached).
    Ready(Compiled),
    /// The build failed or ran out of time.
    Failed(Box<Outcome>),
}

/// Whether a program could build an extension at all; others skip the compile stage.
pub(crate) fn may_build(code: &[u8]) -> bool {
    let has = |needle: &[u8]| code.windows(needle.len()).any(|w| w == needle);
    has(b"cpp_extension") || has(b"load_inline")
}

/// Err only when the evaluator itself failed (the sandbox could not be set up).
pub(crate) fn build(
    ctx: &JobContext,
    zygote: &Zygote,
    sample: &EvalSample,
    code: &[u8],
) -> Result<Built> {
    let started = std::time::Instant::now();
    let request = json!({
        "cache_dir": ctx.cfg.build_cache,
        "candidate_path": "candidate.py",
        "limits": ctx.limits,
        "cores": ctx.cores,
        "nice": COMPILE_STAGE_NICENESS,
        "env": ctx.env,
        "sandbox": ctx.users.candidate(),
    });
    let mut child = match Child::start(
        zygote,
        &ctx.jobs_dir,
        "build",
        &[("candidate.py", code)],
        request,
    ) {
        Ok(child) => child,
        Err(e) => {
            tracing::warn!("compile stage could not start for {}: {e:#}", sample.origin);
            return Ok(Built::Ready(Compiled {
                builds: Vec::new(),
                wall_s: started.elapsed().as_secs_f64(),
            }));
        }
    };
    // Stopped while candidates are timed (quiet.rs), which its time limits do not count. Its
    // builds happen outside it, between its messages: its own time is the run timeout.
    let group = ctx.build_groups.register(child.pid);
    let mut deadline = Deadline::new(ctx.cfg.timeout, ctx.cfg.timeout).excluding(group.pauses());
    let mut builds = Vec::new();
    let mut failure = None;
    loop {
        match child.next_within(&mut deadline) {
            None | Some(Event::Exited(_)) => break,
            Some(Event::Msg(msg)) => match msg["event"].as_str() {
                Some("build_request") => {
                    let provided = build_cache::provide(ctx, zygote, &msg["extension"])?;
                    let record = provided.record;
                    let reply = match provided.outcome {
                        Provision::Ready => json!({"op": "built", "ok": true, "key": record.key}),
                        Provision::Failed => json!({"op": "built", "ok": false, "log": record.log}),
                        Provision::TimedOut(message) => {
                            failure = Some((Verdict::CompileTimeout, message));
                            builds.push(record);
                            break;
                        }
                    };
                    builds.push(record);
                    child.send(&reply);
                }
                Some("failed") if msg["verdict"] == "compile_error" => {
                    let message = msg["message"]
                        .as_str()
                        .unwrap_or("the extension failed to build");
                    failure = Some((Verdict::CompileError, message.to_string()));
                }
                Some("done") => break,
                Some("sandbox_error") => bail!(
                    "cannot sandbox the compile stage of {}: {}",
                    sample.origin,
                    msg["message"].as_str().unwrap_or("unknown error")
                ),
                _ => {}
            },
        }
    }
    drop(group);
    let (_, log) = child.finish();
    let wall_s = started.elapsed().as_secs_f64();
    Ok(match failure {
        None => Built::Ready(Compiled { builds, wall_s }),
        Some((verdict, message)) => Built::Failed(Box::new(Outcome::failed(
            verdict, message, log, builds, wall_s,
        ))),
    })
}
