//! `dice bench rl` (issue #26): one stage-2 RL step at a preset's full size with random
//! weights, measured without a policy that writes programs. The step is the trainer's own
//! ([`RlTrainer`]): the policy decodes the step's requests in the kept engine, the real judge
//! scores programs as they finish, and the real TraceRL update learns from them; only what is
//! judged and learned from is swapped: each decoded completion is traded, the moment it
//! finishes, for a recorded program of known outcome of the same task ([`Variant`]), so that
//! rewards are real and mixed and every group is kept. The policy decodes exactly as many
//! tokens as the recorded completion holds, so the rollout's time is that of decoding it.
//!
//! The step runs twice, on the same tasks and weights: pipelined (each completion judged as it
//! finishes, as training runs) and back to back (every completion handed to the judge once the
//! whole rollout is done: rollout, then judging, then the update), the baseline. Each run has
//! a judge and (unless one shared cache is asked for) a build cache of its own, and every
//! sample's source differs, so both build every program as a real rollout's distinct programs
//! are built.

use super::config::RlConfig;
use super::metrics::{RlStepMetrics, UpdateSeconds};
use super::recorded::{Pacing, RecordedCompletions, Variant};
use super::reward::{Candidate, JudgeReward, Reward, Score};
use super::task::Stage;
use super::trainer::RlTrainer;
use crate::dist::SingleProcess;
use crate::run::{Resume, RunOptions};
use anyhow::{ensure, Context, Result};
use dice_model::init::{InitWeights, ModelInit};
use dice_model::{SdarConfig, SdarTokenizer};
use serde::Serialize;
use std::path::Path;
use std::time::Duration;

/// The seconds of one step's phases, as its metrics line has them.
#[derive(Debug, Clone, Serialize)]
pub struct StepPhases {
    /// Decoding the step's tokens with the policy (the judge overlapping it when pipelined).
    pub rollout: f64,
    /// The judging thread's busy time.
    pub judge: f64,
    /// From the rollout's end to the last verdict: the judging the rollout did not hide.
    pub idle: f64,
    pub update: f64,
    /// The update's parts (absent when the step learned nothing).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub update_parts: Option<UpdateSeconds>,
    /// The whole step.
    pub step: f64,
}

impl StepPhases {
    /// One line: every phase's seconds.
    pub fn summary(&self) -> String {
        let parts = self
            .update_parts
            .map(|parts| format!(" ({})", parts.summary()))
            .unwrap_or_default();
        format!(
            "rollout {:.2} s, judge {:.2} s, idle {:.2} s, update {:.2} s{parts}, step {:.2} s",
            self.rollout, self.judge, self.idle, self.update, self.step
        )
    }
}

impl From<&RlStepMetrics> for StepPhases {
    fn from(m: &RlStepMetrics) -> Self {
        Self {
            rollout: m.seconds_rollout,
            judge: m.seconds_judge,
            idle: m.seconds_idle,
            update: m.seconds_update,
            update_parts: m.seconds_update_parts,
            step: m.seconds_step,
        }
    }
}

/// How the judge scored one variant's samples.
#[derive(Debug, Clone, Serialize)]
pub struct VariantOutcome {
    pub variant: Variant,
    pub samples: usize,
    /// Compiled and correct.
    pub passed: usize,
    pub deceptive: usize,
    pub reward_sum: f64,
}

/// The judge, its scores counted by the variant of their sample (slot `s` is sample
/// `s % group` of its task).
struct Tallied<'a> {
    judge: &'a mut JudgeReward,
    group: usize,
    outcomes: Vec<VariantOutcome>,
}

impl<'a> Tallied<'a> {
    fn new(judge: &'a mut JudgeReward, group: usize) -> Self {
        let outcomes = Variant::MIX
            .iter()
            .map(|&variant| VariantOutcome {
                variant,
                samples: 0,
                passed: 0,
                deceptive: 0,
                reward_sum: 0.0,
            })
            .collect();
        Self {
            judge,
            group,
            outcomes,
        }
    }

    fn count(&mut self, scores: &[(usize, Score)]) {
        for (slot, score) in scores {
            let outcome = &mut self.outcomes[slot % self.group % Variant::MIX.len()];
            outcome.samples += 1;
            outcome.passed += usize::from(score.passed);
            outcome.deceptive += usize::from(score.deceptive);
            outcome.reward_sum += score.reward;
        }
    }
}

impl Reward for Tallied<'_> {
    fn score(&mut self, candidates: &[Candidate]) -> Result<Vec<Score>> {
        let scores = self.judge.score(candidates)?;
        let by_slot: Vec<(usize, Score)> = candidates
            .iter()
            .map(|c| c.slot)
            .zip(scores.iter().cloned())
            .collect();
        self.count(&by_slot);
        Ok(scores)
    }

    fn submit(&mut self, candidates: Vec<Candidate>) -> Result<Vec<(usize, Score)>> {
        let ready = self.judge.submit(candidates)?;
        self.count(&ready);
        Ok(ready)
    }

    fn scored(&mut self, wait: Duration) -> Result<Vec<(usize, Score)>> {
        let ready = self.judge.scored(wait)?;
        self.count(&ready);
        Ok(ready)
    }
}

/// What `dice bench rl` measured.
#[derive(Debug, Clone, Serialize)]
pub struct RlBench {
    pub tasks: usize,
    pub samples: usize,
    /// Tokens decoded (and learned from) in each run of the step.
    pub tokens: u64,
    pub reward_mean: f64,
    pub pass_rate: f64,
    pub deceptive_rate: f64,
    pub groups_kept: usize,
    pub learned: bool,
    pub replay_samples: usize,
    /// How the judge scored each variant (in the pipelined run).
    pub outcomes: Vec<VariantOutcome>,
    /// Each completion judged as it finished.
    pub pipelined: StepPhases,
    /// Rollout, then judging every completion, then the update.
    pub back_to_back: StepPhases,
    /// The back-to-back step's seconds over the pipelined step's.
    pub speedup: f64,
    /// The share of the pipelined step in which the trainer's device waits for the judge
    /// (`idle / step`): decoding and the update keep it busy the rest of the time (what the
    /// judge itself runs on the device, with `--judge-device cuda`, is not counted).
    pub gpu_idle_share: f64,
}

/// Runs the step of `config` (stage 2; its task file's tasks with their `cuda_code`) on a
/// model of `model` with random weights (written under `work`, the runs' output folders
/// beside it): pipelined, then back to back. Each run judges with a build cache of its own
/// under `work`, or both with `shared_build_cache` (a warm or shared cache spares the builds, so
/// judging is shorter than a real step's: for measuring the other phases, or testing).
/// `finished(name, phases)` is told each run's phases as it ends ("pipelined", then
/// "back-to-back"), so that a benchmark cut short still shows what it measured.
pub fn bench_rl(
    mut config: RlConfig,
    model: &SdarConfig,
    work: &Path,
    shared_build_cache: Option<&Path>,
    mut finished: impl FnMut(&str, &StepPhases),
) -> Result<RlBench> {
    ensure!(
        config.tasks.stage == Stage::E2e,
        "dice bench rl judges whole programs: it runs stage 2 (e2e)"
    );
    let model_dir = work.join("model");
    ModelInit::new(model, InitWeights::Random { seed: 0 })
        .write(&model_dir)
        .context("cannot write the random-weight model")?;
    config.model.path = Some(model_dir);
    config.training.total_steps = 1;
    config.eval.file = None;
    config.reward.contains_token = None;
    let resolved = config.clone().resolve()?;
    let tokenizer = SdarTokenizer::from_dir(resolved.model.tokenizer_dir())?;
    let mut step = |pacing: Pacing, name: &str| -> Result<(RlStepMetrics, Vec<VariantOutcome>)> {
        let group = resolved.rollout.samples_per_task;
        let recorded = RecordedCompletions::load(resolved.task_file(), group, &tokenizer, pacing)?;
        let out = work.join(name);
        // A build cache of its own unless told otherwise: the other run's builds of the same
        // programs would spare this one the judge's compiling.
        let mut config = config.clone();
        config.reward.build_cache =
            Some(shared_build_cache.map_or_else(|| out.join("builds"), Path::to_path_buf));
        let options = RunOptions {
            out: out.clone(),
            resume: Resume::Auto,
            progress: false,
            // The step's checkpoint and no final model: a full-size model's write is no phase.
            stop_after: Some(1),
        };
        let mut trainer = RlTrainer::new(config, options, Box::new(SingleProcess))?
            .with_recorded_completions(recorded);
        let settings = &trainer.run().config().reward;
        let mut judge =
            JudgeReward::start(settings, out.join("judge.db"), format!("bench-rl:{name}"))?;
        let mut tallied = Tallied::new(&mut judge, group);
        let summary = trainer.train(&mut tallied);
        let outcomes = tallied.outcomes;
        let judge_ended = judge.shutdown();
        let line = summary?
            .steps
            .into_iter()
            .next()
            .context("the benchmark's run ran no step")?;
        judge_ended?;
        finished(name, &StepPhases::from(&line));
        Ok((line, outcomes))
    };
    let (pipelined, outcomes) = step(Pacing::AsDecoded, "pipelined")?;
    let (back_to_back, _) = step(Pacing::AfterRollout, "back-to-back")?;
    Ok(RlBench {
        outcomes,
        tasks: pipelined.tasks,
        samples: pipelined.samples,
        tokens: pipelined.tokens_generated,
        reward_mean: pipelined.reward_mean,
        pass_rate: pipelined.pass_rate,
        deceptive_rate: pipelined.deceptive_rate,
        groups_kept: pipelined.groups_kept,
        learned: pipelined.learned,
        replay_samples: pipelined.replay_samples,
        speedup: back_to_back.seconds_step / pipelined.seconds_step.max(1e-9),
        gpu_idle_share: pipelined.seconds_idle / pipelined.seconds_step.max(1e-9),
        pipelined: StepPhases::from(&pipelined),
        back_to_back: StepPhases::from(&back_to_back),
    })
}
