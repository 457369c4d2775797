//! The BiC-RL loop (spec bicrl §1, §15) in one process per host. One RL step:
//!
//! 1. draw the step's tasks ([`select_tasks`]); each rank takes a contiguous share of them, so a
//!    task's whole group is rolled out, rewarded and standardised on one rank;
//! 2. render their prompts and roll each out `samples_per_task` times with the trainer's current
//!    weights ([`super::rollout`]); every completion goes to the judging thread the moment it
//!    finishes, which hands it to the reward beside those still being judged, so judging
//!    overlaps the rest of the rollout;
//! 3. z-score the rewards within each task's group, dropping zero-variance groups;
//! 4. replay the traces ([`Replay`]), take the old log-probabilities from the weights the step
//!    started with, and update with the clipped loss and its KL penalty, `samples_per_update`
//!    replay samples per AdamW step (data-parallel over the ranks through the [`Collective`]),
//!    the moments reset at the start of the step as the reference's fresh optimizer has them;
//! 5. write the step's metrics line and a resumable checkpoint (kept every `save_steps` steps;
//!    the newest is always there, so a killed run resumes after its last completed step).
//!
//! Rolling out step k+1 before step k's update would sample from weights the update's ratio
//! does not know about, so the loop does not: the judge's tail after the last completion and
//! the update are the only phases that do not overlap.

use super::advantage::group_advantages;
use super::config::RlConfig;
use super::reward::{Candidate, Reward, Score};
use super::rollout::{decoder, eval_params, roll_out, rollout_params, sample_seed};
use super::task::{candidate_program, load_tasks, render_prompt, select_tasks, RlTask};
use super::TraceRecord;
use super::{old_log_probs, policy_loss_and_grad_sums, PolicyLossSettings, Replay, ReplaySettings};
use crate::checkpoint::{checkpoint_name, checkpoints, Checkpointer, TrainerState, FINAL};
use crate::dist::{contiguous_share, Collective};
use crate::metrics::MetricsLog;
use crate::optim::{clip_grad_norm, AdamW};
use crate::sft::{Resume, RunOptions};
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use dice_engine::{Completion, DecodeParams, Request, TextCodec};
use dice_model::{Sdar, SdarTokenizer};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::Path;
use std::sync::mpsc::{channel, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The end-of-text token: the rollout's only stop token (`<|im_end|>` is not one, spec bicrl
/// §5) and the pad of the replay.
const END_OF_TEXT: &str = "<|endoftext|>";

/// Evaluation tasks are judged under problem ids past the training tasks'.
const EVAL_PROBLEM_OFFSET: usize = 1 << 24;

/// Levels the per-level pass rates are summed over (0–7).
const LEVELS: usize = 8;

/// One RL step's line in `metrics.jsonl`.
#[derive(Debug, Clone, Serialize)]
pub struct RlStepMetrics {
    pub step: u64,
    pub tasks: usize,
    /// Completions rolled out.
    pub samples: usize,
    pub reward_mean: f64,
    /// Share of completions that compiled and were correct.
    pub pass_rate: f64,
    /// Share of completions the audit flagged as reward hacks.
    pub deceptive_rate: f64,
    /// Pass rate per task level, for the levels the step drew.
    pub pass_rate_by_level: BTreeMap<u32, f64>,
    /// Task groups with a learning signal (not all equally rewarded).
    pub groups_kept: usize,
    pub advantage_mean: f64,
    pub advantage_std: f64,
    pub advantage_abs_max: f64,
    pub replay_samples: usize,
    pub loss_tokens: usize,
    /// Mean loss over the step's updates.
    pub loss: f64,
    /// Mean k3 KL term over the replay samples.
    pub kl: f64,
    pub clip_fraction: f64,
    /// Mean −log π_old of the decoded tokens: the policy's entropy on what it decoded.
    pub entropy: f64,
    /// Gradient norm (before clipping) of the step's last update.
    pub grad_norm: f64,
    pub updates: usize,
    pub tokens_generated: u64,
    pub rollout_tokens_per_s: f64,
    pub seconds_rollout: f64,
    /// Time the judge spent judging (overlapping the rollout).
    pub seconds_judge: f64,
    /// Time from the last completion to the last verdict: the devices idle, waiting for it.
    pub seconds_idle: f64,
    pub seconds_update: f64,
    pub seconds_step: f64,
    /// Each rank's rollout, judge, idle and update seconds, in rank order (a rank is a GPU
    /// with --device cuda).
    pub seconds_per_rank: Vec<RankSeconds>,
}

/// One rank's share of a step's time.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RankSeconds {
    pub rollout: f64,
    pub judge: f64,
    pub idle: f64,
    pub update: f64,
}

/// An evaluation's line in `metrics.jsonl`.
#[derive(Debug, Clone, Serialize)]
pub struct RlEvalMetrics {
    pub step: u64,
    pub eval_tasks: usize,
    pub eval_pass_rate: f64,
    pub eval_deceptive_rate: f64,
    pub eval_seconds: f64,
}

/// What [`RlTrainer::train`] did.
#[derive(Debug, Clone)]
pub struct RlSummary {
    pub steps_run: u64,
    pub total_steps: u64,
    /// The metrics of the steps this call ran.
    pub steps: Vec<RlStepMetrics>,
}

/// A rolled-out completion with its score.
struct Rolled {
    completion: Completion,
    score: Score,
}

/// What the judging thread hands back: each completion's score by slot, the time it spent
/// scoring, and when it finished.
struct Judged {
    scores: Vec<(usize, Score)>,
    busy: f64,
    done: Instant,
}

/// What rolling out and judging a set of prompts took.
#[derive(Default)]
struct PhaseTimes {
    rollout: f64,
    judge: f64,
    idle: f64,
}

/// How long the judging thread waits for scores before it looks for new completions to hand
/// over: a completion waits at most this long to join those being judged.
const NEW_COMPLETIONS_POLL: Duration = Duration::from_millis(50);

/// A BiC-RL run, set up and ready to train.
pub struct RlTrainer {
    config: RlConfig,
    options: RunOptions,
    collective: Box<dyn Collective>,
    device: Device,
    dtype: DType,
    model: Sdar,
    vars: VarMap,
    optimizer: AdamW,
    tokenizer: SdarTokenizer,
    codec: TextCodec,
    end_of_text: u32,
    tasks: Vec<Arc<RlTask>>,
    eval_tasks: Vec<Arc<RlTask>>,
    checkpointer: Checkpointer,
    metrics: Option<MetricsLog>,
    task_fingerprint: String,
    step: u64,
}

impl RlTrainer {
    /// Resolves `config`, reads the tasks, loads the model (from the newest checkpoint in the
    /// output folder when there is one, else the start model) and prepares the output folder.
    pub fn new(
        config: RlConfig,
        options: RunOptions,
        collective: Box<dyn Collective>,
    ) -> Result<Self> {
        let config = config.resolve()?;
        let training = &config.training;
        let device = crate::dist::rank_device(training.device)?;
        let collective = crate::dist::for_device(collective, &device)?;
        let dtype = training.compute_dtype().dtype();
        let tasks: Vec<Arc<RlTask>> = load_tasks(config.task_file(), config.tasks.stage)?
            .into_iter()
            .map(Arc::new)
            .collect();
        let eval_tasks = match &config.eval.file {
            Some(file) => load_tasks(file, config.tasks.stage)?
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
        let task_fingerprint = file_fingerprint(config.task_file())?;

        let resume_from = match &options.resume {
            Resume::From(dir) => Some(dir.clone()),
            Resume::Auto => checkpoints(&options.out)?.pop().map(|(_, dir)| dir),
        };
        let mut step = 0;
        if let Some(dir) = &resume_from {
            let state = TrainerState::read(dir)?;
            let key = run_key(&config, collective.world_size());
            check_resumable(dir, &state, &key, &task_fingerprint)?;
            step = state.step;
        }
        let weights = resume_from.as_deref().unwrap_or(config.model_dir());
        let (model, vars) = Sdar::load_trainable(weights, dtype, &device)?;
        let named = named_vars(&vars);
        if collective.world_size() > 1 {
            for (_, var) in &named {
                var.set(&collective.broadcast(var.as_tensor(), 0)?)?;
            }
        }
        let mut optimizer = AdamW::new(named, config.optimizer)?;
        if let Some(dir) = &resume_from {
            optimizer.load_state(&dir.join(crate::checkpoint::OPTIMIZER_STATE))?;
            tracing::info!("resuming from {} after step {step}", dir.display());
        }
        let tokenizer = SdarTokenizer::from_dir(config.model_dir())?;
        let codec = TextCodec::from_dir(config.model_dir())?;
        let end_of_text = tokenizer
            .inner()
            .token_to_id(END_OF_TEXT)
            .with_context(|| {
                format!(
                    "the tokenizer of {} has no {END_OF_TEXT} token",
                    config.model_dir().display()
                )
            })?;
        let checkpointer = Checkpointer {
            out: options.out.clone(),
            base_model: config.model_dir().to_path_buf(),
            tokenizer: config.model_dir().to_path_buf(),
            model_config: model.config().clone(),
            save_dtype: config.checkpoint.save_dtype,
            max_shard_bytes: config.checkpoint.max_shard_bytes,
            save_total_limit: None,
        };
        let metrics = checkpointer.open_run_folder(&*collective, &config.to_toml()?, step)?;
        Ok(Self {
            config,
            options,
            collective,
            device,
            dtype,
            model,
            vars,
            optimizer,
            tokenizer,
            codec,
            end_of_text,
            tasks,
            eval_tasks,
            checkpointer,
            metrics,
            task_fingerprint,
            step,
        })
    }

    /// The resolved settings (what `config.toml` holds).
    pub fn config(&self) -> &RlConfig {
        &self.config
    }

    /// RL steps done.
    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn tasks(&self) -> &[Arc<RlTask>] {
        &self.tasks
    }

    /// The model as it trains.
    pub fn model(&self) -> &Sdar {
        &self.model
    }

    /// Trains to the end of the run with `reward`, then writes the finished model to `final/`.
    pub fn train(&mut self, reward: &mut dyn Reward) -> Result<RlSummary> {
        let total = self.config.training.total_steps;
        let mut summary = RlSummary {
            steps_run: 0,
            total_steps: total,
            steps: Vec::new(),
        };
        let final_dir = self.options.out.join(FINAL);
        if self.step >= total && final_dir.join("config.json").is_file() {
            tracing::info!(
                "the run in {} is complete ({total} steps)",
                self.options.out.display()
            );
            return Ok(summary);
        }
        let bar = self.progress_bar(total);
        while self.step < total {
            let line = self.train_step(reward)?;
            self.step += 1;
            bar.set_position(self.step);
            bar.set_message(format!(
                "reward {:.3} · pass {:.3} · kl {:.2e}",
                line.reward_mean, line.pass_rate, line.kl
            ));
            tracing::info!(
                step = line.step,
                reward_mean = line.reward_mean,
                pass_rate = line.pass_rate,
                kl = line.kl,
                seconds_step = line.seconds_step,
                "rl step"
            );
            self.log(&line)?;
            summary.steps_run += 1;
            summary.steps.push(line);
            bar.suspend(|| self.save_step())?;
            let end = self.step == total;
            if !self.eval_tasks.is_empty()
                && (end || self.step.is_multiple_of(self.config.eval.eval_steps))
            {
                bar.suspend(|| self.evaluate(reward))?;
            }
        }
        bar.finish_and_clear();
        self.save(FINAL, false)?;
        Ok(summary)
    }

    fn progress_bar(&self, total: u64) -> ProgressBar {
        if !self.options.progress || self.collective.rank() != 0 {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template(
                "{elapsed_precise} [{bar:30}] RL step {pos}/{len} · {msg} · ETA {eta}",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        bar.set_position(self.step);
        bar
    }

    /// RL step `self.step + 1`; returns its metrics line.
    fn train_step(&mut self, reward: &mut dyn Reward) -> Result<RlStepMetrics> {
        let started = Instant::now();
        let step = self.step + 1;
        let (rollout, training) = (&self.config.rollout, &self.config.training);
        let group = rollout.samples_per_task;
        let drawn = select_tasks(
            step,
            rollout.tasks_per_step,
            self.tasks.len(),
            self.config.tasks.order,
            training.seed,
        );
        let (rank, world) = (self.collective.rank(), self.collective.world_size());
        let share = contiguous_share(drawn.len(), rank, world);
        let first_slot = share.start * group;
        let mine: Vec<Arc<RlTask>> = drawn[share]
            .iter()
            .map(|&t| self.tasks[t].clone())
            .collect();
        let params = rollout_params(rollout, vec![self.end_of_text]);
        let step_base = (step - 1) as usize * rollout.tasks_per_step * group;
        let (rolled, times) = self.roll_out_and_score(
            &mine,
            group,
            &params,
            |slot| sample_seed(training.seed, step, first_slot + slot),
            step_base + first_slot,
            rollout.max_active,
            reward,
        )?;

        // Rewards, advantages and the records to replay, task group by task group.
        let mut records = Vec::new();
        let mut totals = StepTotals::default();
        for (task, rolled) in mine.iter().zip(rolled.chunks(group)) {
            let rewards: Vec<f64> = rolled.iter().map(|r| r.score.reward).collect();
            totals.add_group(task.level as usize, rolled);
            let Some(advantages) = group_advantages(&rewards) else {
                continue;
            };
            totals.add_advantages(&advantages);
            let prompt = self.prompt_ids(task)?;
            for (r, advantage) in rolled.iter().zip(advantages) {
                records.push(TraceRecord {
                    prompt: prompt.clone(),
                    response: r.completion.token_ids.clone(),
                    trace: r.completion.trace.clone(),
                    advantage,
                });
            }
        }
        let update_started = Instant::now();
        let update = self.update(&records, group)?;
        let seconds_update = update_started.elapsed().as_secs_f64();
        let totals = totals.all_reduce(self.collective.as_ref())?;
        let seconds_per_rank = self.seconds_per_rank(&times, seconds_update)?;
        let samples = totals.samples.max(1.0);
        let kept_samples = (totals.groups_kept * group as f64).max(1.0);
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
            seconds_step: started.elapsed().as_secs_f64(),
            seconds_per_rank,
        })
    }

    /// Every rank's phase times, gathered on every rank.
    fn seconds_per_rank(&self, times: &PhaseTimes, update: f64) -> Result<Vec<RankSeconds>> {
        let mine = [times.rollout, times.judge, times.idle, update].map(|s| s as f32);
        let world = self.collective.world_size();
        let all = self
            .collective
            .all_gather_f32(&mine, &vec![mine.len(); world])?;
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

    fn prompt_ids(&self, task: &RlTask) -> Result<Vec<u32>> {
        self.tokenizer
            .encode(&render_prompt(task, self.config.tasks.stage)?)
    }

    /// Rolls out `group` completions of each task with the current weights, scoring each in
    /// the judging thread as it finishes; returns them task-major with the phase times.
    #[allow(clippy::too_many_arguments)] // the pieces of one rollout, named at both call sites
    fn roll_out_and_score(
        &self,
        tasks: &[Arc<RlTask>],
        group: usize,
        params: &DecodeParams,
        seed: impl Fn(usize) -> u64,
        sample_id_base: usize,
        max_active: usize,
        reward: &mut dyn Reward,
    ) -> Result<(Vec<Rolled>, PhaseTimes)> {
        let stage = self.config.tasks.stage;
        let mut requests = Vec::with_capacity(tasks.len() * group);
        for (t, task) in tasks.iter().enumerate() {
            let prompt = self.prompt_ids(task)?;
            for j in 0..group {
                let slot = t * group + j;
                let params = DecodeParams {
                    seed: seed(slot),
                    ..params.clone()
                };
                requests.push((
                    slot,
                    Request {
                        prompt: prompt.clone(),
                        params,
                    },
                ));
            }
        }
        let decoder = decoder(
            self.model.config(),
            &self.vars,
            self.dtype,
            &self.device,
            params.block_length,
        )?;
        let mut completions: Vec<Option<Completion>> = vec![None; requests.len()];
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
            let rolled_out = roll_out(decoder, requests, max_active, |slot, completion| {
                let task = &tasks[slot / group];
                let text = self.codec.completion_text(&completion.token_ids)?;
                let candidate = Candidate {
                    slot,
                    task: task.clone(),
                    sample_id: u32::try_from(sample_id_base + slot)
                        .context("more samples than the judge's sample ids can number")?,
                    token_ids: completion.token_ids.clone(),
                    program: candidate_program(task, stage, &text),
                };
                completions[slot] = Some(completion);
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
            .enumerate()
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

    /// The TraceRL update of one step over this rank's records, `group` records per task.
    ///
    /// Every sum (gradients, loss, KL, token counts) is taken task group by task group and the
    /// groups' sums are added in task order, on each rank and then over the ranks: ranks that
    /// each hold one task group of an update sum exactly as one rank holding them all.
    fn update(&mut self, records: &[TraceRecord], group: usize) -> Result<UpdateTotals> {
        let training = &self.config.training;
        let settings = ReplaySettings {
            block_size: training.block_size,
            shrink: training.shrink,
            post_num: Some(training.post_num),
            max_prompt_len: training.max_prompt_len,
            max_response_len: training.max_response_len,
            mask_id: self.model.config().mask_token_id,
            pad_id: self.end_of_text,
            grid: training.grid.grid(),
        };
        let mut replay = Replay::build(records, &settings)?;
        // L1 is the step's, over every rank: the largest of the ranks' own.
        replay.loss_normaliser = self.max_over_ranks(replay.loss_normaliser)?;
        if training.reset_moments {
            self.optimizer.reset_moments()?;
        }
        let old = old_log_probs(&self.model, &replay)?;
        let mut counts = [replay.samples.len() as f64];
        self.collective.all_reduce_sum_f64(&mut counts)?;
        let global_samples = counts[0] as usize;
        let updates = global_samples.div_ceil(training.samples_per_update);
        let loss_settings = PolicyLossSettings {
            clip_eps: training.clip_eps,
            kl_beta: training.kl_beta,
        };
        let local = replay.samples.len();
        let mut sums = UpdateSums::default();
        for run in group_runs(&replay, 0..local, group) {
            sums.entropy += old[run]
                .iter()
                .flatten()
                .map(|&lp| -f64::from(lp))
                .sum::<f64>();
        }
        let mut grad_norm = 0.0;
        for u in 0..updates {
            let range = contiguous_share(local, u, updates);
            let mut update_grads: Option<HashMap<String, Tensor>> = None;
            for run in group_runs(&replay, range.clone(), group) {
                let loss =
                    policy_loss_and_grad_sums(&self.model, &replay, run, &old, &loss_settings)?;
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
            let mut grads = match update_grads {
                Some(grads) => grads,
                None => self.zero_grads()?,
            };
            let mut in_update = [range.len() as f64];
            self.collective.all_reduce_sum_f64(&mut in_update)?;
            let scale = training.grad_scale / in_update[0].max(1.0);
            let mut names: Vec<String> = grads.keys().cloned().collect();
            names.sort();
            for name in names {
                let summed = (self.collective.all_reduce_sum(&grads[&name])? * scale)?;
                grads.insert(name, summed);
            }
            let norm = clip_grad_norm(&mut grads, training.max_grad_norm)?;
            if !norm.is_finite() {
                bail!(
                    "RL step {}: the gradient norm is {norm}; the weights were left as they were. \
                     Lower the learning rate, or resume from the last checkpoint in {}",
                    self.step + 1,
                    self.options.out.display()
                );
            }
            grad_norm = f64::from(norm);
            self.optimizer.step(&grads, training.learning_rate)?;
        }
        self.device.synchronize()?;
        let mut totals = [sums.loss, sums.kl, sums.tokens, sums.clipped, sums.entropy];
        self.collective.all_reduce_sum_f64(&mut totals)?;
        let [loss, kl, tokens, clipped, entropy] = totals;
        let n = (global_samples as f64).max(1.0);
        Ok(UpdateTotals {
            samples: global_samples,
            loss_tokens: tokens as usize,
            updates,
            loss: loss / n,
            kl: kl / n,
            clip_fraction: clipped / tokens.max(1.0),
            entropy: entropy / tokens.max(1.0),
            grad_norm,
        })
    }

    /// The largest of the ranks' `value`s (through a sum of one-hot rows).
    fn max_over_ranks(&self, value: usize) -> Result<usize> {
        let world = self.collective.world_size();
        if world == 1 {
            return Ok(value);
        }
        let mut row = vec![0f32; world];
        row[self.collective.rank()] = value as f32;
        self.collective.all_reduce_sum_f32(&mut row)?;
        Ok(row.into_iter().fold(0.0f32, f32::max) as usize)
    }

    fn zero_grads(&self) -> Result<HashMap<String, Tensor>> {
        self.model
            .config()
            .tensor_shapes()
            .into_iter()
            .map(|(name, shape)| Ok((name, Tensor::zeros(shape, DType::F32, &self.device)?)))
            .collect()
    }

    /// Pass rate of the held-out tasks: one greedy, static completion each (spec bicrl §11).
    fn evaluate(&mut self, reward: &mut dyn Reward) -> Result<()> {
        let started = Instant::now();
        let share = contiguous_share(
            self.eval_tasks.len(),
            self.collective.rank(),
            self.collective.world_size(),
        );
        let params = eval_params(
            &self.config.rollout,
            &self.config.eval,
            vec![self.end_of_text],
        );
        let tasks = &self.eval_tasks[share.clone()];
        // One sample per task and evaluation, numbered by the step: ids never repeat.
        let base = self.step as usize * self.eval_tasks.len() + share.start;
        let (rolled, _) = self.roll_out_and_score(
            tasks,
            1,
            &params,
            |_| 0,
            base,
            self.config.eval.max_active,
            reward,
        )?;
        let mut totals = [
            rolled
                .iter()
                .filter(|r| r.score.passed && !r.score.deceptive)
                .count() as f32,
            rolled.iter().filter(|r| r.score.deceptive).count() as f32,
        ];
        self.collective.all_reduce_sum_f32(&mut totals)?;
        let n = self.eval_tasks.len() as f64;
        let line = RlEvalMetrics {
            step: self.step,
            eval_tasks: self.eval_tasks.len(),
            eval_pass_rate: f64::from(totals[0]) / n,
            eval_deceptive_rate: f64::from(totals[1]) / n,
            eval_seconds: started.elapsed().as_secs_f64(),
        };
        tracing::info!(step = line.step, pass_rate = line.eval_pass_rate, "rl eval");
        self.log(&line)
    }

    /// Appends `line` to `metrics.jsonl` and redraws `metrics.html` (rank 0 only).
    fn log(&mut self, line: &impl Serialize) -> Result<()> {
        let Some(log) = &mut self.metrics else {
            return Ok(());
        };
        log.write(line)?;
        let title = format!("dice train rl · {}", self.options.out.display());
        super::report::write_html(log.path(), &self.options.out.join("metrics.html"), &title)
    }

    /// The checkpoint after this step: resumable, and kept when the step is a multiple of
    /// `save_steps` (the previous one is removed otherwise).
    fn save_step(&self) -> Result<()> {
        self.save(&checkpoint_name(self.step), true)?;
        if self.collective.rank() == 0 {
            let previous = self.step - 1;
            if previous > 0 && !previous.is_multiple_of(self.config.checkpoint.save_steps) {
                let dir = self.options.out.join(checkpoint_name(previous));
                if dir.exists() {
                    std::fs::remove_dir_all(&dir)
                        .with_context(|| format!("cannot remove {}", dir.display()))?;
                }
            }
        }
        self.collective.barrier()
    }

    fn save(&self, name: &str, resumable: bool) -> Result<()> {
        if self.collective.rank() == 0 {
            let state = TrainerState {
                step: self.step,
                total_steps: self.config.training.total_steps,
                epoch: (self.step as usize * self.config.rollout.tasks_per_step) as f64
                    / self.tasks.len() as f64,
                data_fingerprint: self.task_fingerprint.clone(),
                resume_key: run_key(&self.config, self.collective.world_size()),
            };
            let dir = self
                .checkpointer
                .save(name, &self.optimizer, &state, resumable)?;
            tracing::info!("saved {}", dir.display());
        }
        self.collective.barrier()
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

struct UpdateTotals {
    samples: usize,
    loss_tokens: usize,
    updates: usize,
    loss: f64,
    kl: f64,
    clip_fraction: f64,
    entropy: f64,
    grad_norm: f64,
}

/// A step's rollout statistics, summed over the rank's groups, then over the ranks.
#[derive(Default)]
struct StepTotals {
    samples: f64,
    reward_sum: f64,
    passed: f64,
    deceptive: f64,
    tokens: f64,
    groups_kept: f64,
    advantage_sum: f64,
    advantage_sq_sum: f64,
    advantage_abs_max: f64,
    /// (samples, passed) per level.
    levels: [[f64; 2]; LEVELS],
}

/// A task group's sums are taken on their own, then added to the step's: the ranks' totals
/// add up to one rank's exactly when each holds one group (see [`RlTrainer::update`]).
impl StepTotals {
    fn add_group(&mut self, level: usize, rolled: &[Rolled]) {
        let passed: f64 = rolled
            .iter()
            .map(|r| f64::from(u8::from(r.score.passed && !r.score.deceptive)))
            .sum();
        self.samples += rolled.len() as f64;
        self.reward_sum += rolled.iter().map(|r| r.score.reward).sum::<f64>();
        self.passed += passed;
        self.deceptive += rolled
            .iter()
            .map(|r| f64::from(u8::from(r.score.deceptive)))
            .sum::<f64>();
        self.tokens += rolled
            .iter()
            .map(|r| r.completion.token_ids.len() as f64)
            .sum::<f64>();
        let bucket = &mut self.levels[level.min(LEVELS - 1)];
        bucket[0] += rolled.len() as f64;
        bucket[1] += passed;
    }

    fn add_advantages(&mut self, advantages: &[f64]) {
        self.groups_kept += 1.0;
        self.advantage_sum += advantages.iter().sum::<f64>();
        self.advantage_sq_sum += advantages.iter().map(|a| a * a).sum::<f64>();
        self.advantage_abs_max = advantages
            .iter()
            .fold(self.advantage_abs_max, |max, a| max.max(a.abs()));
    }

    fn all_reduce(mut self, collective: &dyn Collective) -> Result<Self> {
        let mut values: Vec<f64> = [
            self.samples,
            self.reward_sum,
            self.passed,
            self.deceptive,
            self.tokens,
            self.groups_kept,
            self.advantage_sum,
            self.advantage_sq_sum,
        ]
        .into_iter()
        .chain(self.levels.iter().flatten().copied())
        .collect();
        collective.all_reduce_sum_f64(&mut values)?;
        let mut values = values.into_iter();
        let mut next = || values.next().expect("as many values as were summed");
        self.samples = next();
        self.reward_sum = next();
        self.passed = next();
        self.deceptive = next();
        self.tokens = next();
        self.groups_kept = next();
        self.advantage_sum = next();
        self.advantage_sq_sum = next();
        for bucket in &mut self.levels {
            *bucket = [next(), next()];
        }
        let world = collective.world_size();
        let mut max = vec![0.0; world];
        max[collective.rank()] = self.advantage_abs_max;
        collective.all_reduce_sum_f64(&mut max)?;
        self.advantage_abs_max = max.into_iter().fold(0.0, f64::max);
        Ok(self)
    }

    fn pass_rate_by_level(&self) -> BTreeMap<u32, f64> {
        self.levels
            .iter()
            .enumerate()
            .filter(|(_, [n, _])| *n > 0.0)
            .map(|(level, [n, passed])| (level as u32, passed / n))
            .collect()
    }
}

fn named_vars(vars: &VarMap) -> Vec<(String, Var)> {
    let mut named: Vec<(String, Var)> = vars
        .data()
        .lock()
        .expect("the model's VarMap is not poisoned")
        .iter()
        .map(|(name, var)| (name.clone(), var.clone()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// `range` of the replay's samples cut where the task group of their record changes (a kept
/// group's `group` records come one after another).
fn group_runs(replay: &Replay, range: Range<usize>, group: usize) -> Vec<Range<usize>> {
    let group_of = |n: usize| replay.records[replay.samples[n].record].source / group;
    let mut runs: Vec<Range<usize>> = Vec::new();
    for n in range {
        match runs.last_mut() {
            Some(run) if group_of(run.start) == group_of(n) => run.end = n + 1,
            _ => runs.push(n..n + 1),
        }
    }
    runs
}

/// The settings a checkpoint records and a resumed run must repeat: the config's, and the
/// number of ranks when there are several (an update takes its share of every rank's replay
/// samples, so the ranks decide which samples make an update).
fn run_key(config: &RlConfig, world_size: usize) -> serde_json::Value {
    let mut key = config.resume_key();
    if world_size > 1 {
        key["world_size"] = world_size.into();
    }
    key
}

/// SHA-256 of the task file's bytes.
fn file_fingerprint(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn check_resumable(
    dir: &Path,
    state: &TrainerState,
    resume_key: &serde_json::Value,
    task_fingerprint: &str,
) -> Result<()> {
    if let Some((key, recorded, asked)) =
        crate::sft::config::resume_key_difference(&state.resume_key, resume_key)
    {
        bail!(
            "{} was trained with {key} = {recorded}, this run asks for {asked}: resume with the \
             same settings (its run's config.toml), or write to another --out",
            dir.display()
        );
    }
    ensure!(
        state.data_fingerprint == task_fingerprint,
        "{} was trained on another task file: resume with the same --tasks, or write to another --out",
        dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::SingleProcess;

    #[test]
    fn step_totals_count_passes_per_level() {
        let rolled = |passed: bool| Rolled {
            completion: Completion {
                id: 0,
                token_ids: vec![1, 2],
                trace: vec![1, 1],
                finish_reason: dice_engine::FinishReason::Length,
                prompt_len: 3,
            },
            score: Score {
                reward: f64::from(u8::from(passed)),
                passed,
                deceptive: false,
            },
        };
        let mut totals = StepTotals::default();
        totals.add_group(1, &[rolled(true), rolled(false)]);
        totals.add_group(2, &[rolled(false), rolled(false)]);
        let totals = totals.all_reduce(&SingleProcess).unwrap();
        assert_eq!(
            (totals.samples, totals.passed, totals.tokens),
            (4.0, 1.0, 8.0)
        );
        assert_eq!(
            totals.pass_rate_by_level(),
            BTreeMap::from([(1, 0.5), (2, 0.0)])
        );
    }
}
