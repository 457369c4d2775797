//! Rollouts (spec bicrl §5): the trainer's weights decode the step's prompts in the engine, in
//! memory (the decoder's model is built over the trainer's own `Var`s, so an update is seen by
//! the next rollout without a copy through the disk; the few weights the decoder holds as
//! copies of its own are refreshed in place before each rollout, so one engine, its KV cache
//! and its CUDA graphs serve the whole run), and each completion is handed on as it finishes,
//! with its trace: to the judging thread ([`roll_out_and_score`]), which hands it to the reward
//! beside those still being judged, so judging overlaps the rest of the rollout.

use super::config::{EvalConfig, RolloutConfig};
use super::reward::{Candidate, Reward, Score};
use super::task::{candidate_program, RlTask, Stage};
use anyhow::{ensure, Context, Result};
use candle_nn::VarBuilder;
use dice_engine::{
    Completion, DecodeParams, Engine, Event, Overflow, Request, SamplingParams, SdarDecoder,
    Strategy, TextCodec,
};
use dice_model::{Sdar, SdarConfig};
use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc::{channel, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the judging thread waits for scores before it looks for new completions to hand
/// over: a completion waits at most this long to join those being judged.
const NEW_COMPLETIONS_POLL: Duration = Duration::from_millis(50);

/// The decoding of training rollouts: dynamic threshold, temperature sampling, stopping at
/// `stop_ids` or exactly `max_tokens` tokens.
pub fn rollout_params(rollout: &RolloutConfig, stop_ids: Vec<u32>) -> DecodeParams {
    DecodeParams {
        block_length: rollout.block_length,
        steps: rollout.denoising_steps,
        strategy: Strategy::LowConfidenceDynamic {
            threshold: rollout.dynamic_threshold,
        },
        sampling: SamplingParams {
            temperature: rollout.temperature,
            top_k: rollout.top_k,
            top_p: rollout.top_p,
        },
        max_new_tokens: rollout.max_tokens,
        exact_max: true,
        stop_ids,
        seed: 0,
        overflow: Overflow::Clamp,
    }
}

/// The decoding of evaluations (spec bicrl §11): top-k 1 with the static strategy, one token
/// per pass.
pub fn eval_params(rollout: &RolloutConfig, eval: &EvalConfig, stop_ids: Vec<u32>) -> DecodeParams {
    DecodeParams {
        strategy: Strategy::LowConfidenceStatic,
        sampling: SamplingParams::GREEDY,
        max_new_tokens: eval.max_tokens,
        ..rollout_params(rollout, stop_ids)
    }
}

/// The seed of one completion: a function of the run's seed, the step, and the completion's
/// place in it, so that a resumed step draws the same samples.
pub fn sample_seed(seed: u64, step: u64, slot: usize) -> u64 {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ step.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ (slot as u64).wrapping_mul(0x1656_67B1_9E37_79F9)
}

/// A decoder over `weights` (the trainer's `VarMap`: its weights shared, not copied; on CUDA
/// the decoder stacks its q/k/v and gate/up projections into buffers of its own, which
/// [`roll_out`] refreshes).
pub fn decoder(
    config: &SdarConfig,
    weights: VarBuilder,
    block_length: usize,
) -> Result<SdarDecoder> {
    let config = SdarConfig {
        block_size: block_length,
        ..config.clone()
    };
    let model = Sdar::new(&config, weights)
        .context("cannot build the rollout model from the trainer's weights")?;
    SdarDecoder::new(model)
}

/// Decodes `requests` (each with the caller's slot number) in `engine`, up to `max_active` at
/// once, handing each completion to `finished` as soon as it is done. The engine is a run's,
/// kept from one rollout to the next with its KV cache and CUDA graphs: its decoder's own
/// copies of the weights are first given `weights`' current values, in place. The engine is
/// left without work, whether the rollout succeeds or not.
pub fn roll_out(
    engine: &mut Engine<SdarDecoder>,
    weights: &VarBuilder,
    requests: Vec<(usize, Request)>,
    max_active: usize,
    mut finished: impl FnMut(usize, Completion) -> Result<()>,
) -> Result<()> {
    ensure!(
        !engine.has_work(),
        "internal error: a rollout started in an engine with work left"
    );
    let decode = || -> Result<()> {
        engine
            .model()
            .model()
            .refresh_weights(weights)
            .context("cannot refresh the rollout model's weights")?;
        let mut queued = requests.into_iter();
        let mut slots = BTreeMap::new();
        loop {
            // A finished request's place goes to the next before the step that admits it.
            while slots.len() < max_active.max(1) {
                let Some((slot, request)) = queued.next() else {
                    break;
                };
                slots.insert(engine.submit(request)?, slot);
            }
            if !engine.has_work() {
                return Ok(());
            }
            for event in engine.step()? {
                if let Event::Finished(completion) = event {
                    let slot = slots
                        .remove(&completion.id)
                        .context("the engine finished a request it was not given")?;
                    finished(slot, completion)?;
                }
            }
        }
    };
    let decoded = decode();
    if decoded.is_err() {
        engine.abort_all();
    }
    decoded
}

/// A rolled-out completion with its score.
pub(crate) struct Rolled {
    pub(crate) completion: Completion,
    pub(crate) score: Score,
}

/// What rolling out and judging a set of prompts took.
#[derive(Default)]
pub(crate) struct PhaseTimes {
    pub(crate) rollout: f64,
    /// Time the judge spent judging (overlapping the rollout).
    pub(crate) judge: f64,
    /// Time from the last completion to the last verdict.
    pub(crate) idle: f64,
}

/// What the judging thread hands back: each completion's score by slot, the time it spent
/// scoring, and when it finished.
struct Judged {
    scores: Vec<(usize, Score)>,
    busy: f64,
    done: Instant,
}

/// How the completions of a rollout become candidates for the judge.
pub(crate) struct Candidates<'a> {
    /// The tasks rolled out, `group` requests each (slot `s` is task `s / group`'s).
    pub(crate) tasks: &'a [Arc<RlTask>],
    pub(crate) group: usize,
    pub(crate) stage: Stage,
    pub(crate) codec: &'a TextCodec,
    /// The judge's sample id of slot 0 (slot `s` is judged as `sample_id_base + s`).
    pub(crate) sample_id_base: usize,
}

/// Where a step's completions come from: `produce` hands the completion of each slot to its
/// callback as it finishes — the engine decoding them
/// ([`roll_out`]), or a benchmark's recorded programs ([`super::bench`]).
pub(crate) type Finished<'f> = &'f mut dyn FnMut(usize, Completion) -> Result<()>;

/// Runs `produce` ([`Finished`]), which completes each of `slots` once, and scores each
/// completion with `reward` in a judging thread the moment it is handed over; returns them in
/// slot order with the phase times.
pub(crate) fn roll_out_and_score(
    produce: impl FnOnce(Finished) -> Result<()>,
    slots: &[usize],
    candidates: &Candidates,
    reward: &mut dyn Reward,
) -> Result<(Vec<Rolled>, PhaseTimes)> {
    let mut completions: BTreeMap<usize, Option<Completion>> =
        slots.iter().map(|&slot| (slot, None)).collect();
    let (to_judge, judging) = channel::<Candidate>();
    let started = Instant::now();
    let (rolled_out, judged) = std::thread::scope(|scope| {
        let judge = scope.spawn(move || -> Result<Judged> {
            let mut scores = Vec::new();
            let mut busy = 0.0;
            // Completions handed to the reward and not scored yet.
            let mut unscored = 0usize;
            let mut rolling_out = true;
            while rolling_out || unscored > 0 {
                // Waits for a completion only while nothing is being judged.
                let mut finished = Vec::new();
                if rolling_out && unscored == 0 {
                    match judging.recv() {
                        Ok(candidate) => finished.push(candidate),
                        Err(_) => rolling_out = false,
                    }
                }
                while rolling_out {
                    match judging.try_recv() {
                        Ok(candidate) => finished.push(candidate),
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => rolling_out = false,
                    }
                }
                let t = Instant::now();
                unscored += finished.len();
                let mut ready = Vec::new();
                if !finished.is_empty() {
                    ready = reward.submit(finished)?;
                }
                if ready.is_empty() && unscored > 0 {
                    ready = reward.scored(NEW_COMPLETIONS_POLL)?;
                }
                busy += t.elapsed().as_secs_f64();
                unscored = unscored
                    .checked_sub(ready.len())
                    .context("the reward scored more completions than it was given")?;
                scores.extend(ready);
            }
            Ok(Judged {
                scores,
                busy,
                done: Instant::now(),
            })
        });
        let rolled_out = produce(&mut |slot, completion: Completion| {
            let task = &candidates.tasks[slot / candidates.group];
            let text = candidates.codec.completion_text(&completion.token_ids)?;
            let candidate = Candidate {
                slot,
                task: task.clone(),
                sample_id: u32::try_from(candidates.sample_id_base + slot)
                    .context("more samples than the judge's sample ids can number")?,
                token_ids: completion.token_ids.clone(),
                program: candidate_program(task, candidates.stage, &text),
            };
            *completions
                .get_mut(&slot)
                .context("the engine finished a request of no slot")? = Some(completion);
            to_judge
                .send(candidate)
                .map_err(|_| anyhow::anyhow!("the judge stopped"))
        })
        .map(|()| Instant::now());
        drop(to_judge);
        let judged = judge
            .join()
            .map_err(|_| anyhow::anyhow!("the judging thread panicked"));
        (rolled_out, judged)
    });
    let Judged {
        scores,
        busy,
        done: judged_at,
    } = judged??;
    let rolled_out_at = rolled_out?;
    let mut scores: HashMap<usize, Score> = scores.into_iter().collect();
    let rolled = completions
        .into_iter()
        .map(|(slot, completion)| {
            Ok(Rolled {
                completion: completion.context("a request finished without a completion")?,
                score: scores
                    .remove(&slot)
                    .context("a completion was not scored")?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let times = PhaseTimes {
        rollout: (rolled_out_at - started).as_secs_f64(),
        judge: busy,
        idle: judged_at
            .saturating_duration_since(rolled_out_at)
            .as_secs_f64(),
    };
    Ok((rolled, times))
}
