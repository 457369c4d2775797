//! The BiC-RL loop's steps (spec bicrl §1, §15), one process per host (the loop itself,
//! checkpoints, resuming and metrics are the run's, [`crate::run`]). One RL step:
//!
//! 1. draw the step's tasks ([`select_tasks`]); each rank takes a contiguous share of them, so a
//!    task's whole group is rolled out, rewarded and standardised on one rank;
//! 2. render their prompts and roll each out `samples_per_task` times with the trainer's current
//!    weights, in the engine kept for the whole run, every completion judged as it finishes
//!    ([`super::rollout`]); with `rollout.turns` > 1 a sample whose completion did not earn the
//!    reward gets further turns with the judge's feedback ([`super::turns`]), and its turns'
//!    discounted returns stand for the rewards below;
//! 3. z-score the rewards within each task's group, dropping zero-variance groups (a step whose
//!    groups are all dropped learns nothing, and says so: [`RlStepMetrics::learned`]);
//! 4. replay the traces ([`Replay`]), take the old log-probabilities from the weights the step
//!    started with, and update with the clipped loss and its KL penalty, `samples_per_update`
//!    replay samples per AdamW step (data-parallel over the ranks through the
//!    [`Collective`]), the moments reset at the start of the step as the reference's fresh
//!    optimizer has them;
//! 5. write the step's metrics line and a resumable checkpoint, in the background while the
//!    next step runs (f32 masters, no moments when they are reset every step; older ones kept
//!    every `save_steps` steps as models only; the newest is always there, so a killed run
//!    resumes after its last completed step).
//!
//! Rolling out step k+1 before step k's update would sample from weights the update's ratio
//! does not know about, so the loop does not: the judge's tail after the last completion and
//! the update are the only phases that do not overlap.

use super::advantage::group_advantages;
use super::config::RewardToken;
use super::config::RlConfig;
use super::metrics::{RankSeconds, RlEvalMetrics, RlStepMetrics, StepTotals, UpdateSeconds};
use super::recorded::RecordedCompletions;
use super::report::write_html;
use super::reward::{CensusToken, ContainsToken, JudgeReward, Reward};
use super::rollout::{
    decoder, eval_params, roll_out, roll_out_and_score, rollout_params, Candidates, PhaseTimes,
};
use super::task::{load_tasks, render_prompt, select_tasks, RlTask, Stage};
use super::turns::{
    discounted_returns, longest_turn_prompt, roll_out_trajectories, turn_seed, Refinement,
    TurnTotals,
};
use super::TraceRecord;
use super::{
    old_log_probs, pack_tokens, policy_loss_and_grad_sums, PolicyLossSettings, Replay,
    ReplaySettings,
};
use crate::dist::zero::StepSettings;
use crate::dist::{contiguous_share, Collective};
use crate::run::{DataFingerprint, Run, RunOptions, Steps, TrainSummary};
use anyhow::{ensure, Context, Result};
use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;
use dice_engine::{DecodeParams, Engine, EngineConfig, Request, SdarDecoder, TextCodec};
use dice_model::memory::PeakMemory;
use dice_model::{KvCache, SdarTokenizer};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// The end-of-text token: the rollout's only stop token (`<|im_end|>` is not one, spec bicrl
/// §5) and the pad of the replay.
const END_OF_TEXT: &str = "<|endoftext|>";

/// Evaluation tasks are judged under problem ids past the training tasks'.
const EVAL_PROBLEM_OFFSET: usize = 1 << 24;

/// A BiC-RL run, set up and ready to train.
pub struct RlTrainer {
    run: Run<RlConfig>,
    rl: RlSteps,
}

/// RL's part of the loop: the tasks, the text of prompts and completions, and the engine they
/// are decoded in.
struct RlSteps {
    tokenizer: SdarTokenizer,
    codec: TextCodec,
    end_of_text: u32,
    tasks: Vec<Arc<RlTask>>,
    eval_tasks: Vec<Arc<RlTask>>,
    engine: KeptEngine,
    /// `dice bench rl`'s completions, handed over in place of the decoded ones
    /// ([`RlTrainer::with_recorded_completions`]).
    recorded: Option<RecordedCompletions>,
}

/// The engine every rollout and evaluation of this rank decodes in: built at the first, over
/// the trainer's weights, and kept for the run with its KV cache and CUDA graphs
/// ([`super::rollout::roll_out`] refreshes the decoder's own copies of the weights). Rebuilding
/// it at every step cost 1.5 s of a 12 s rollout on the H200 (bench/notes/rl-h200.md).
struct KeptEngine {
    /// Room for every rollout's and evaluation's requests ([`engine_config`]).
    config: EngineConfig,
    engine: Option<Engine<SdarDecoder>>,
    /// Device memory the engine took when it was built (its KV cache, the decoder's stacked
    /// projections), as the driver counts it.
    engine_bytes: Option<u64>,
    /// The most device memory in use during an update run with the engine dropped (the whole
    /// device's: the trainer's weights and optimizer state, the update's activations, and
    /// whatever else runs there).
    update_peak: Option<u64>,
}

/// The share of the device's memory the kept engine's KV cache may hold through an update not
/// yet measured; above it the engine is dropped after each rollout (memory for the update) and
/// built again at the next, until an update's measured peak shows that the engine fits beside
/// it ([`KEPT_ENGINE_FREE_SHARE`]). Prompts of 1,287 tokens and answers of 4,096 fill 5,384
/// positions a slot: the presets' 20 slots hold 12 GB of cache for 1.7B (kept on an H200), the
/// 128 that rollouts at the engine's speed use 79 GB for 1.7B and 101 GB for 4B.
const KEPT_CACHE_SHARE: f64 = 0.25;

/// The share of the device's memory left free when an engine is kept beside an update whose
/// peak was measured (the next updates' data may be longer than the measured one's).
const KEPT_ENGINE_FREE_SHARE: f64 = 0.1;

impl KeptEngine {
    /// Before an update: drops the engine (CUDA only: on the CPU the cache is host memory the
    /// update does not compete for) unless its KV cache is within [`KEPT_CACHE_SHARE`] of the
    /// device's memory, or the engine fits beside the peak of an update measured without it;
    /// when it is not kept, returns the measurement of this update's peak for
    /// [`Self::measured_update`]. Rebuilding the engine costs its allocation and graph capture
    /// at every rollout: 1.5 s of a 12 s rollout at 256 sequences on the H200.
    fn make_room_for_update(&mut self, run: &Run<RlConfig>) -> Result<Option<PeakMemory>> {
        if let Some((_, total)) = dice_model::memory::free_and_total(&run.device)? {
            let total = total as f64;
            let cache = KvCache::bytes(
                run.model.config(),
                self.config.max_batch,
                self.config.max_seq_len,
                run.dtype,
            ) as f64;
            let fits_beside_update = match (self.update_peak, self.engine_bytes) {
                (Some(peak), Some(engine)) => {
                    (peak + engine) as f64 <= (1.0 - KEPT_ENGINE_FREE_SHARE) * total
                }
                _ => false,
            };
            if cache > KEPT_CACHE_SHARE * total
                && !fits_beside_update
                && self.engine.take().is_some()
            {
                tracing::debug!(
                    "the rollout engine's KV cache ({:.1} GB) is over {:.0} % of the device's \
                     memory and no update measured without it left room for it: dropped for \
                     the update, built again at the next rollout",
                    cache / 1e9,
                    KEPT_CACHE_SHARE * 100.0
                );
            }
        }
        match self.engine {
            Some(_) => Ok(None),
            None => Ok(Some(PeakMemory::start(&run.device)?)),
        }
    }

    /// The engine, built over `run`'s weights the first time.
    fn get(&mut self, run: &Run<RlConfig>) -> Result<&mut Engine<SdarDecoder>> {
        let engine = match self.engine.take() {
            Some(engine) => engine,
            None => {
                let free = || -> Result<Option<u64>> {
                    Ok(dice_model::memory::free_and_total(&run.device)?.map(|(free, _)| free))
                };
                let before = free()?;
                let block_length = run.config().rollout.block_length;
                let decoder = decoder(run.model.config(), trainer_weights(run), block_length)?;
                let engine = Engine::new(decoder, self.config)?;
                if let (Some(before), Some(after)) = (before, free()?) {
                    self.engine_bytes = Some(before.saturating_sub(after));
                }
                engine
            }
        };
        Ok(self.engine.insert(engine))
    }

    /// Records the peak of an update measured by [`Self::make_room_for_update`].
    fn measured_update(&mut self, measured: Option<PeakMemory>) {
        if let Some(bytes) = measured.and_then(PeakMemory::finish) {
            self.update_peak = Some(self.update_peak.map_or(bytes, |seen| seen.max(bytes)));
        }
    }
}

/// The trainer's weights, as the rollouts' decoder reads them.
fn trainer_weights(run: &Run<RlConfig>) -> VarBuilder<'static> {
    VarBuilder::from_varmap(&run.vars, run.dtype, &run.device)
}

/// RL's steps with the reward of one call of [`RlTrainer::train`].
struct Rewarded<'a> {
    rl: &'a mut RlSteps,
    reward: &'a mut dyn Reward,
}

impl RlTrainer {
    /// Resolves `config`, reads the tasks, loads the model (from the newest checkpoint in the
    /// output folder when there is one, else the start model) and prepares the output folder.
    pub fn new(config: RlConfig, options: RunOptions, ranks: Box<dyn Collective>) -> Result<Self> {
        let config = config.resolve()?;
        let stage = config.tasks.stage;
        let tasks: Vec<Arc<RlTask>> = load_tasks(config.task_file(), stage)?
            .into_iter()
            .map(Arc::new)
            .collect();
        let eval_tasks = match &config.eval.file {
            Some(file) => load_tasks(file, stage)?
                .into_iter()
                .map(|task| {
                    Arc::new(RlTask {
                        index: EVAL_PROBLEM_OFFSET + task.index,
                        ..task
                    })
                })
                .collect(),
            None => Vec::new(),
        };
        let data = DataFingerprint {
            sha256: file_fingerprint(config.task_file())?,
            covers: "its task file's bytes",
            keep: "the same --tasks",
        };
        let text = config.model.tokenizer_dir();
        let tokenizer = SdarTokenizer::from_dir(text)?;
        let codec = TextCodec::from_dir(text)?;
        let end_of_text = tokenizer
            .inner()
            .token_to_id(END_OF_TEXT)
            .with_context(|| format!("the tokenizer of {} has no {END_OF_TEXT}", text.display()))?;
        // The engine is sized once, for the longest request of the run.
        let longest = |tasks: &[Arc<RlTask>]| -> Result<usize> {
            tasks.iter().try_fold(0, |longest, task| {
                Ok(longest.max(prompt_ids(&tokenizer, task, stage)?.len()))
            })
        };
        let longest_first = longest(&tasks)?;
        let (turns, max_prompt_len) = (config.rollout.turns, config.training.max_prompt_len);
        let longest_prompts = [
            longest_turn_prompt(turns, longest_first, max_prompt_len),
            longest(&eval_tasks)?,
        ];
        let run = Run::open(config, data, options, ranks)?;
        let engine = KeptEngine {
            config: engine_config(&run, end_of_text, longest_prompts, eval_tasks.len()),
            engine: None,
            engine_bytes: None,
            update_peak: None,
        };
        let rl = RlSteps {
            tokenizer,
            codec,
            end_of_text,
            tasks,
            eval_tasks,
            engine,
            recorded: None,
        };
        Ok(Self { run, rl })
    }

    /// Steps that judge and learn from `recorded` programs instead of what the policy decodes
    /// (`dice bench rl`): the policy still decodes as many tokens, each decoded completion
    /// traded for its recorded one as it finishes.
    pub fn with_recorded_completions(mut self, recorded: RecordedCompletions) -> Self {
        self.rl.recorded = Some(recorded);
        self
    }

    /// The run: its settings, model and step.
    pub fn run(&self) -> &Run<RlConfig> {
        &self.run
    }

    /// Trains to the end of the run with `reward`, then writes the finished model to `final/`.
    pub fn train(&mut self, reward: &mut dyn Reward) -> Result<TrainSummary<RlStepMetrics>> {
        let rl = &mut self.rl;
        self.run.train(&mut Rewarded { rl, reward })
    }

    /// Trains with the reward the settings name: the toy [`ContainsToken`] reward, else the
    /// evaluator judging the candidates, each rank into a store of its own in the output
    /// folder (`judge.db`, `judge-rankR.db` for rank R > 0); the judge is shut down whether
    /// the run succeeds or not.
    pub fn train_with_configured_reward(&mut self) -> Result<TrainSummary<RlStepMetrics>> {
        let config = self.run.config();
        match config.reward.contains_token {
            Some(RewardToken::Id(token)) => return self.train(&mut ContainsToken(token)),
            Some(RewardToken::Census(_)) => {
                // Each rank would count only its own completions and could pick another token.
                ensure!(
                    self.run.collective.world_size() == 1,
                    "--reward-token census needs a single rank: run it once on one GPU and \
                     give the token it picks (OUT/reward_token.json) to the run of several"
                );
                let first_step = config.rollout.tasks_per_step * config.rollout.samples_per_task;
                let record = self.run.options.out.join("reward_token.json");
                return self.train(&mut CensusToken::new(first_step, record)?);
            }
            None => {}
        }
        let db = match self.run.collective.rank() {
            0 => self.run.options.out.join("judge.db"),
            r => self.run.options.out.join(format!("judge-rank{r}.db")),
        };
        let source = format!("rl-tasks:{}", config.task_file().display());
        let mut reward = JudgeReward::start(&config.reward, db, source)?;
        let summary = self.train(&mut reward);
        let judge_ended = reward.shutdown();
        let summary = summary?;
        judge_ended?;
        Ok(summary)
    }
}

impl Steps for Rewarded<'_> {
    type Config = RlConfig;
    type Line = RlStepMetrics;
    const STEP_NAME: &'static str = "RL step";
    const COMMAND: &'static str = "dice train rl";

    fn total_steps(&self, config: &RlConfig) -> u64 {
        config.training.total_steps
    }

    fn epoch(&self, config: &RlConfig, steps: u64) -> f64 {
        (steps as usize * config.rollout.tasks_per_step) as f64 / self.rl.tasks.len() as f64
    }

    fn step(&mut self, run: &mut Run<RlConfig>) -> Result<RlStepMetrics> {
        self.rl.step(run, self.reward)
    }

    fn eval_steps(&self, config: &RlConfig) -> Option<u64> {
        (!self.rl.eval_tasks.is_empty()).then_some(config.eval.eval_steps)
    }

    fn evaluate(&mut self, run: &mut Run<RlConfig>) -> Result<()> {
        self.rl.evaluate(run, self.reward)
    }

    fn checkpoint_every_step(&self) -> bool {
        true
    }

    fn draw_page(&self, metrics: &Path, html: &Path, title: &str) -> Result<()> {
        write_html(metrics, html, title)
    }
}

impl RlSteps {
    /// RL step `run.step() + 1`; returns its metrics line.
    fn step(&mut self, run: &mut Run<RlConfig>, reward: &mut dyn Reward) -> Result<RlStepMetrics> {
        let started = Instant::now();
        let step = run.step() + 1;
        let config = run.config();
        let (rollout, seed) = (&config.rollout, config.training.run.seed);
        let group = rollout.samples_per_task;
        let drawn = select_tasks(
            step,
            rollout.tasks_per_step,
            self.tasks.len(),
            config.tasks.order,
            seed,
        );
        let (rank, world) = (run.collective.rank(), run.collective.world_size());
        let share = contiguous_share(drawn.len(), rank, world);
        let first_slot = share.start * group;
        let mine: Vec<Arc<RlTask>> = drawn[share]
            .iter()
            .map(|&t| self.tasks[t].clone())
            .collect();
        let params = rollout_params(rollout, vec![self.end_of_text]);
        let samples_per_step = rollout.tasks_per_step * group;
        let mut first_prompts = Vec::with_capacity(mine.len() * group);
        for task in &mine {
            first_prompts.extend(std::iter::repeat_n(self.prompt_ids(config, task)?, group));
        }
        let refinement = match rollout.turns {
            1 => None,
            turns => Some(Refinement::new(
                &self.tokenizer,
                self.end_of_text,
                turns,
                config.training.max_prompt_len,
            )?),
        };
        let weights = trainer_weights(run);
        let engine = self.engine.get(run)?;
        let recorded = self.recorded.as_ref();
        let (trajectories, times) =
            roll_out_trajectories(first_prompts, refinement.as_ref(), |turn, prompts| {
                let requests = requests(prompts, &params, |slot| {
                    turn_seed(seed, step, first_slot + slot, turn)
                });
                // The judge's sample ids run on over the turns, each a step's worth of samples.
                let earlier = (step - 1) as usize * rollout.turns + turn;
                let candidates = Candidates {
                    tasks: &mine,
                    group,
                    stage: config.tasks.stage,
                    codec: &self.codec,
                    sample_id_base: earlier * samples_per_step + first_slot,
                };
                let slots: Vec<usize> = requests.iter().map(|&(slot, _)| slot).collect();
                let max_active = rollout.max_active;
                let engine = &mut *engine;
                roll_out_and_score(
                    |finished| match recorded {
                        None => roll_out(engine, &weights, requests, max_active, finished),
                        Some(recorded) => recorded.roll_out(
                            engine,
                            &weights,
                            requests,
                            max_active,
                            (&mine, group),
                            finished,
                        ),
                    },
                    &slots,
                    &candidates,
                    reward,
                )
            })?;

        // Returns, advantages and the records to replay (every turn's response), task group by
        // task group. A group's returns are z-scored over all its turns, not per turn: the later
        // turns are taken only by samples that failed before (a turn's own group can be one
        // sample, or all failures), and pooled they share the task's one baseline.
        let discount = config.reward.turn_discount;
        let mut records = Vec::new();
        let mut record_groups = Vec::new();
        let mut totals = StepTotals::default();
        let mut turn_totals = refinement.map(|_| TurnTotals::new(rollout.turns));
        for (t, (task, group_turns)) in mine.iter().zip(trajectories.chunks(group)).enumerate() {
            let every_turn = || group_turns.iter().flatten();
            totals.add_group(task.level as usize, every_turn().map(|turn| &turn.rolled));
            if let Some(turn_totals) = &mut turn_totals {
                turn_totals.add_group(group_turns);
            }
            let returns: Vec<f64> = group_turns
                .iter()
                .flat_map(|turns| {
                    let rewards: Vec<f64> = turns.iter().map(|t| t.rolled.score.reward).collect();
                    discounted_returns(&rewards, discount)
                })
                .collect();
            let Some(advantages) = group_advantages(&returns) else {
                continue;
            };
            totals.add_advantages(&advantages);
            for (turn, advantage) in every_turn().zip(advantages) {
                records.push(TraceRecord {
                    prompt: turn.prompt.clone(),
                    response: turn.rolled.completion.token_ids.clone(),
                    trace: turn.rolled.completion.trace.clone(),
                    advantage,
                });
                record_groups.push(t);
            }
        }
        let totals = totals.all_reduce(run.collective.as_ref())?;
        // The sums tell every rank alike whether any rank kept a group: all update, or none.
        let learned = totals.groups_kept > 0.0;
        let update_started = Instant::now();
        let update = if learned {
            let measured = self.engine.make_room_for_update(run)?;
            let update = self.update(run, &records, &record_groups)?;
            self.engine.measured_update(measured);
            update
        } else {
            UpdateTotals::default()
        };
        let seconds_update = update_started.elapsed().as_secs_f64();
        let seconds_per_rank = seconds_per_rank(run.collective.as_ref(), &times, seconds_update)?;
        let samples = totals.samples.max(1.0);
        let kept_samples = totals.advantages.max(1.0);
        let advantage_mean = totals.advantage_sum / kept_samples;
        Ok(RlStepMetrics {
            step,
            tasks: drawn.len(),
            samples: totals.samples as usize,
            reward_mean: totals.reward_sum / samples,
            pass_rate: totals.passed / samples,
            deceptive_rate: totals.deceptive / samples,
            pass_rate_by_level: totals.pass_rate_by_level(),
            groups_kept: totals.groups_kept as usize,
            learned,
            advantage_mean,
            advantage_std: (totals.advantage_sq_sum / kept_samples - advantage_mean.powi(2))
                .max(0.0)
                .sqrt(),
            advantage_abs_max: totals.advantage_abs_max,
            replay_samples: update.samples,
            loss_tokens: update.loss_tokens,
            loss: update.loss,
            kl: update.kl,
            clip_fraction: update.clip_fraction,
            entropy: update.entropy,
            grad_norm: update.grad_norm,
            updates: update.updates,
            tokens_generated: totals.tokens as u64,
            rollout_tokens_per_s: totals.tokens / times.rollout.max(1e-9),
            seconds_rollout: times.rollout,
            seconds_judge: times.judge,
            seconds_idle: times.idle,
            seconds_update,
            seconds_update_parts: update.seconds,
            seconds_step: started.elapsed().as_secs_f64(),
            seconds_per_rank,
            turns: turn_totals
                .map(|t| t.all_reduce(run.collective.as_ref()))
                .transpose()?,
        })
    }

    fn prompt_ids(&self, config: &RlConfig, task: &RlTask) -> Result<Vec<u32>> {
        prompt_ids(&self.tokenizer, task, config.tasks.stage)
    }

    /// The TraceRL update of one step over this rank's records, record `i` of the task group
    /// `record_groups[i]` (a group's records one after another).
    ///
    /// Every sum (gradients, loss, KL, token counts) is taken task group by task group and the
    /// groups' sums are added in task order, on each rank and then over the ranks: ranks that
    /// each hold one task group of an update sum exactly as one rank holding them all.
    fn update(
        &self,
        run: &mut Run<RlConfig>,
        records: &[TraceRecord],
        record_groups: &[usize],
    ) -> Result<UpdateTotals> {
        let training = run.config().training.clone();
        let settings = ReplaySettings {
            block_size: training.block_size,
            shrink: training.shrink,
            post_num: Some(training.post_num),
            max_prompt_len: training.max_prompt_len,
            max_response_len: training.max_response_len,
            mask_id: run.model.config().mask_token_id,
            pad_id: self.end_of_text,
            grid: training.grid.grid(),
        };
        let mut seconds = UpdateSeconds::default();
        let mut part = Instant::now();
        // Each part's seconds, ended where the device has finished its work.
        let lap = |part: &mut Instant, device: &Device| -> Result<f64> {
            device.synchronize()?;
            let seconds = part.elapsed().as_secs_f64();
            *part = Instant::now();
            Ok(seconds)
        };
        let mut replay = Replay::build(records, &settings)?;
        // L1 is the step's, over every rank: the largest of the ranks' own.
        replay.loss_normaliser = max_over_ranks(run.collective.as_ref(), replay.loss_normaliser)?;
        if training.reset_moments {
            run.optimizer.reset_moments()?;
        }
        seconds.replay = lap(&mut part, &run.device)?;
        let pack = pack_tokens(&run.model)?;
        let old = old_log_probs(&run.model, &replay, pack)?;
        seconds.old_log_probs = lap(&mut part, &run.device)?;
        let mut counts = [replay.samples.len() as f64];
        run.collective.all_reduce_sum_f64(&mut counts)?;
        let global_samples = counts[0] as usize;
        let updates = global_samples.div_ceil(training.samples_per_update);
        let loss_settings = PolicyLossSettings {
            clip_eps: training.clip_eps,
            kl_beta: training.kl_beta,
        };
        let local = replay.samples.len();
        let mut sums = UpdateSums::default();
        for groups in group_runs(&replay, 0..local, record_groups) {
            sums.entropy += old[groups]
                .iter()
                .flatten()
                .map(|&lp| -f64::from(lp))
                .sum::<f64>();
        }
        let mut grad_norm = 0.0;
        for u in 0..updates {
            let range = contiguous_share(local, u, updates);
            let mut update_grads: Option<HashMap<String, Tensor>> = None;
            for groups in group_runs(&replay, range.clone(), record_groups) {
                let loss = policy_loss_and_grad_sums(
                    &run.model,
                    &replay,
                    groups,
                    &old,
                    &loss_settings,
                    pack,
                )?;
                sums.loss += loss.samples.iter().map(|s| f64::from(s.loss)).sum::<f64>();
                sums.kl += loss.samples.iter().map(|s| s.kl).sum::<f64>();
                sums.tokens += loss.loss_tokens() as f64;
                sums.clipped += loss.clipped_tokens() as f64;
                update_grads = Some(match update_grads {
                    None => loss.grads,
                    Some(mut summed) => {
                        for (name, grad) in loss.grads {
                            let total = (&summed[&name] + grad)?;
                            summed.insert(name, total);
                        }
                        summed
                    }
                });
            }
            let grads = match update_grads {
                Some(grads) => grads,
                None => run.zero_grads()?,
            };
            seconds.loss_and_grads += lap(&mut part, &run.device)?;
            let mut in_update = [range.len() as f64];
            run.collective.all_reduce_sum_f64(&mut in_update)?;
            let step = StepSettings {
                grad_scale: training.grad_scale / in_update[0].max(1.0),
                max_grad_norm: training.run.max_grad_norm,
                lr: training.run.learning_rate,
            };
            grad_norm = f64::from(run.update(grads, &step)?);
            seconds.optimizer += lap(&mut part, &run.device)?;
        }
        let mut totals = [sums.loss, sums.kl, sums.tokens, sums.clipped, sums.entropy];
        run.collective.all_reduce_sum_f64(&mut totals)?;
        let [loss, kl, tokens, clipped, entropy] = totals;
        let n = (global_samples as f64).max(1.0);
        Ok(UpdateTotals {
            samples: global_samples,
            loss_tokens: tokens as usize,
            updates,
            loss: Some(loss / n),
            kl: Some(kl / n),
            clip_fraction: Some(clipped / tokens.max(1.0)),
            entropy: Some(entropy / tokens.max(1.0)),
            grad_norm: Some(grad_norm),
            seconds: Some(seconds),
        })
    }

    /// Pass rate of the held-out tasks: one greedy, static completion each (spec bicrl §11).
    fn evaluate(&mut self, run: &mut Run<RlConfig>, reward: &mut dyn Reward) -> Result<()> {
        let started = Instant::now();
        let share = contiguous_share(
            self.eval_tasks.len(),
            run.collective.rank(),
            run.collective.world_size(),
        );
        let config = run.config();
        let params = eval_params(&config.rollout, &config.eval, vec![self.end_of_text]);
        // One sample per task and evaluation, numbered by the step: ids never repeat.
        let base = run.step() as usize * self.eval_tasks.len() + share.start;
        let tasks = &self.eval_tasks[share];
        let prompts = tasks
            .iter()
            .enumerate()
            .map(|(t, task)| Ok((t, self.prompt_ids(config, task)?)))
            .collect::<Result<Vec<_>>>()?;
        let requests = requests(&prompts, &params, |_| 0);
        let candidates = Candidates {
            tasks,
            group: 1,
            stage: config.tasks.stage,
            codec: &self.codec,
            sample_id_base: base,
        };
        let weights = trainer_weights(run);
        let engine = self.engine.get(run)?;
        let slots: Vec<usize> = requests.iter().map(|&(slot, _)| slot).collect();
        let (rolled, _) = roll_out_and_score(
            |finished| roll_out(engine, &weights, requests, config.eval.max_active, finished),
            &slots,
            &candidates,
            reward,
        )?;
        let mut totals = [
            rolled
                .iter()
                .filter(|r| r.score.passed && !r.score.deceptive)
                .count() as f32,
            rolled.iter().filter(|r| r.score.deceptive).count() as f32,
        ];
        run.collective.all_reduce_sum_f32(&mut totals)?;
        let n = self.eval_tasks.len() as f64;
        let line = RlEvalMetrics {
            step: run.step(),
            eval_tasks: self.eval_tasks.len(),
            eval_pass_rate: f64::from(totals[0]) / n,
            eval_deceptive_rate: f64::from(totals[1]) / n,
            eval_seconds: started.elapsed().as_secs_f64(),
        };
        tracing::info!(step = line.step, pass_rate = line.eval_pass_rate, "rl eval");
        run.log(&line)
    }
}

/// What one step's update summed.
#[derive(Default)]
struct UpdateSums {
    loss: f64,
    kl: f64,
    tokens: f64,
    clipped: f64,
    entropy: f64,
}

/// What one step's update did: nothing when the step learned nothing.
#[derive(Default)]
struct UpdateTotals {
    samples: usize,
    loss_tokens: usize,
    updates: usize,
    loss: Option<f64>,
    kl: Option<f64>,
    clip_fraction: Option<f64>,
    entropy: Option<f64>,
    grad_norm: Option<f64>,
    seconds: Option<UpdateSeconds>,
}

/// The requests of `prompts` (each with its slot), completion `slot` seeded with `seed(slot)`.
fn requests(
    prompts: &[(usize, Vec<u32>)],
    params: &DecodeParams,
    seed: impl Fn(usize) -> u64,
) -> Vec<(usize, Request)> {
    prompts
        .iter()
        .map(|(slot, prompt)| {
            let params = DecodeParams {
                seed: seed(*slot),
                ..params.clone()
            };
            let prompt = prompt.clone();
            (*slot, Request { prompt, params })
        })
        .collect()
}

/// Every rank's phase times, gathered on every rank.
fn seconds_per_rank(
    collective: &dyn Collective,
    times: &PhaseTimes,
    update: f64,
) -> Result<Vec<RankSeconds>> {
    let mine = [times.rollout, times.judge, times.idle, update].map(|s| s as f32);
    let world = collective.world_size();
    let all = collective.all_gather_f32(&mine, &vec![mine.len(); world])?;
    Ok(all
        .chunks(mine.len())
        .map(|s| RankSeconds {
            rollout: f64::from(s[0]),
            judge: f64::from(s[1]),
            idle: f64::from(s[2]),
            update: f64::from(s[3]),
        })
        .collect())
}

/// The largest of the ranks' `value`s (through a sum of one-hot rows).
fn max_over_ranks(collective: &dyn Collective, value: usize) -> Result<usize> {
    let world = collective.world_size();
    if world == 1 {
        return Ok(value);
    }
    let mut row = vec![0f32; world];
    row[collective.rank()] = value as f32;
    collective.all_reduce_sum_f32(&mut row)?;
    Ok(row.into_iter().fold(0.0f32, f32::max) as usize)
}

/// `range` of the replay's samples cut where the task group of their record changes (record
/// `i` is of group `record_groups[i]`, a group's records one after another).
fn group_runs(replay: &Replay, range: Range<usize>, record_groups: &[usize]) -> Vec<Range<usize>> {
    let group_of = |n: usize| record_groups[replay.records[replay.samples[n].record].source];
    let mut runs: Vec<Range<usize>> = Vec::new();
    for n in range {
        match runs.last_mut() {
            Some(run) if group_of(run.start) == group_of(n) => run.end = n + 1,
            _ => runs.push(n..n + 1),
        }
    }
    runs
}

/// The token ids of `task`'s prompt for `stage`.
fn prompt_ids(tokenizer: &SdarTokenizer, task: &RlTask, stage: Stage) -> Result<Vec<u32>> {
    tokenizer.encode(&render_prompt(task, stage)?)
}

/// The size of `run`'s engine on this rank: as many slots as a rollout or an evaluation
/// decodes at once here (its `max_active`, or fewer when this rank's share of the requests is
/// smaller), each as long as the longest request of either (`longest_prompts` of the training
/// and the `eval_tasks` evaluation tasks, and the tokens each asks for, in whole blocks).
fn engine_config(
    run: &Run<RlConfig>,
    end_of_text: u32,
    longest_prompts: [usize; 2],
    eval_tasks: usize,
) -> EngineConfig {
    let config = run.config();
    let (rank, world) = (run.collective.rank(), run.collective.world_size());
    let rollout = &config.rollout;
    let params = rollout_params(rollout, vec![end_of_text]);
    let samples =
        contiguous_share(rollout.tasks_per_step, rank, world).len() * rollout.samples_per_task;
    let mut max_batch = rollout.max_active.min(samples);
    let mut max_seq_len = params.positions(longest_prompts[0]);
    if eval_tasks > 0 {
        let params = eval_params(rollout, &config.eval, vec![end_of_text]);
        let samples = contiguous_share(eval_tasks, rank, world).len();
        max_batch = max_batch.max(config.eval.max_active.min(samples));
        max_seq_len = max_seq_len.max(params.positions(longest_prompts[1]));
    }
    EngineConfig {
        max_batch: max_batch.max(1),
        max_seq_len,
        ..EngineConfig::default()
    }
}

/// SHA-256 of the task file's bytes.
fn file_fingerprint(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
