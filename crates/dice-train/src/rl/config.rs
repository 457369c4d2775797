//! The settings of a BiC-RL run, as a TOML file (`dice train rl --config F`) or a preset with
//! command-line flags on top; every run writes what it resolved to `OUT/config.toml`, which
//! reads back as the same settings. The defaults are DICE's 8B stage-1 configuration
//! (spec bicrl §2); [`RlConfig::preset`] gives the others (§13: the sizes differ only in how
//! many sequences a rollout engine decodes at once).

use super::task::{Stage, TaskOrder};
use super::BlockGrid;
use crate::optim::AdamWConfig;
use crate::run::settings::{
    existing, without, CheckpointConfig, ModelConfig, Recipe, RunParts, RunTraining, Settings,
};
use anyhow::{bail, ensure, Result};
use dice_eval::Device;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The presets [`RlConfig::preset`] knows.
pub const PRESETS: [&str; 6] = [
    "dice-8b-stage1",
    "dice-8b-stage2",
    "dice-4b-stage1",
    "dice-4b-stage2",
    "dice-1.7b-stage1",
    "dice-1.7b-stage2",
];

/// Everything a BiC-RL run is configured with.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RlConfig {
    pub model: ModelConfig,
    pub tasks: TasksConfig,
    pub rollout: RolloutConfig,
    pub reward: RewardConfig,
    pub training: TrainingConfig,
    /// AdamW's β, ε and weight decay.
    pub optimizer: AdamWConfig,
    pub checkpoint: CheckpointConfig,
    pub eval: EvalConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TasksConfig {
    /// The task file ([`super::task`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    pub stage: Stage,
    pub order: TaskOrder,
}

impl Default for TasksConfig {
    fn default() -> Self {
        Self {
            file: None,
            stage: Stage::Infill,
            order: TaskOrder::Sequential,
        }
    }
}

/// How completions are sampled (spec bicrl §2 `rollout.*`, §5).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutConfig {
    pub tasks_per_step: usize,
    /// The group each task's advantages are standardised in.
    pub samples_per_task: usize,
    pub max_tokens: usize,
    pub block_length: usize,
    /// Denoising passes per block at most.
    pub denoising_steps: usize,
    /// `low_confidence_dynamic`'s confidence threshold.
    pub dynamic_threshold: f32,
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    pub top_p: f32,
    /// Sequences an engine decodes at once (throughput only).
    pub max_active: usize,
    /// Turns of each sample's trajectory (refinement, [`super::turns`]): after the first, a
    /// sample that did not earn the full reward is decoded again with the judge's feedback.
    /// Left out of the settings at 1, so one-turn runs write and resume as before it existed.
    #[serde(skip_serializing_if = "is_one_turn")]
    pub turns: usize,
}

fn is_one_turn(turns: &usize) -> bool {
    *turns == 1
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            tasks_per_step: 64,
            samples_per_task: 16,
            max_tokens: 4096,
            block_length: 4,
            denoising_steps: 4,
            dynamic_threshold: 0.9,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            max_active: 32,
            turns: 1,
        }
    }
}

/// How candidates are rewarded (spec bicrl §6).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardConfig {
    /// Where candidates are judged: `cpu` (C++ candidates; tests, machines without a GPU) or
    /// `cuda` [default: the training device].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub judge_device: Option<Device>,
    /// Correctness trials per candidate (the reference runs 1).
    pub correctness_trials: u32,
    /// atol = rtol of the correctness check.
    pub tolerance: f64,
    /// Seconds a candidate may run (the reference's subprocess timeout is 300).
    pub timeout_s: u64,
    /// Reward correct programs `min(speedup, cap)` instead of 1 (times them; off in DICE).
    pub speedup_shaping: bool,
    pub speedup_cap: f64,
    /// γ of a trajectory's returns: a turn's program earns its reward plus γ times the next
    /// turn's return (Kevin's 0.4); used when `rollout.turns` > 1.
    pub turn_discount: f64,
    /// The Python with torch and ninja the judge's workers run [default: `DICE_PYTHON`, else
    /// the project's .dice/venv, else python3].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub python: Option<PathBuf>,
    /// The judge's build cache [default: `DICE_CACHE`, else ~/.cache/dice/builds].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub build_cache: Option<PathBuf>,
    /// Reward 1 for a completion holding this token, else 0, instead of judging programs: the
    /// verifiable toy reward ([`super::ContainsToken`]) that checks the loop, its ranks and a
    /// deployment without the evaluator.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub contains_token: Option<RewardToken>,
}

/// The token of the toy reward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RewardToken {
    /// This token id.
    Id(u32),
    /// The token held by the share of the first step's completions closest to half, found by a
    /// census of them ([`super::CensusToken`]): a reward that some but not all completions of
    /// an untrained model earn, whatever its weights, so its groups carry a learning signal.
    Census(Census),
}

/// `census`, as the settings spell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Census {
    Census,
}

impl std::str::FromStr for RewardToken {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "census" {
            return Ok(RewardToken::Census(Census::Census));
        }
        s.parse()
            .map(RewardToken::Id)
            .map_err(|_| format!("`{s}` is neither a token id nor `census`"))
    }
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self {
            judge_device: None,
            correctness_trials: 1,
            tolerance: 1e-2,
            timeout_s: 300,
            speedup_shaping: false,
            speedup_cap: 4.0,
            turn_discount: 0.4,
            python: None,
            build_cache: None,
            contains_token: None,
        }
    }
}

/// The update (spec bicrl §2 `training.*`, §8, §9).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainingConfig {
    /// RL steps of the run.
    pub total_steps: u64,
    /// Replay samples per optimizer update (8 ranks × 32 accumulated micro-batches in the
    /// reference); the last update of a step takes what is left.
    pub samples_per_update: usize,
    /// The learning rate, clipping, seed (of the samples and of a shuffled task order), device
    /// and dtype.
    #[serde(flatten)]
    pub run: RunTraining<RlRecipe>,
    pub clip_eps: f32,
    pub kl_beta: f32,
    /// Gradients are multiplied by this before clipping: 1/32 reproduces the reference's
    /// double division by its accumulation steps under DeepSpeed (spec bicrl §9.4).
    pub grad_scale: f64,
    /// A fresh AdamW (zero moments) every RL step, as the reference's trainer process is.
    pub reset_moments: bool,
    pub block_size: usize,
    pub shrink: usize,
    /// Pad (= EOS) tokens of a sample that keep their loss; 0 as DICE runs.
    pub post_num: usize,
    pub max_prompt_len: usize,
    pub max_response_len: usize,
    /// The block grid traces are replayed on: `rollout` (the grid they were sampled on) or
    /// `reference` (the reference trainer's, spec bicrl §16.3).
    pub grid: GridName,
}

impl Default for TrainingConfig {
    fn default() -> Self {
        Self {
            total_steps: 20,
            samples_per_update: 256,
            run: RunTraining::default(),
            clip_eps: 0.2,
            kl_beta: 0.01,
            grad_scale: 1.0 / 32.0,
            reset_moments: true,
            block_size: 4,
            shrink: 1,
            post_num: 0,
            max_prompt_len: 2000,
            max_response_len: 4096,
            grid: GridName::Rollout,
        }
    }
}

/// DICE's BiC-RL recipe: the defaults of the settings every run has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RlRecipe {}

impl Recipe for RlRecipe {
    const LEARNING_RATE: f64 = 1e-6;
    const SEED: u64 = 10086;
}

/// [`BlockGrid`] as the settings name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum GridName {
    /// The block grid each trace was sampled on.
    #[default]
    Rollout,
    /// The reference trainer's grid (response blocks from the response start).
    Reference,
}

impl GridName {
    pub fn grid(self) -> BlockGrid {
        match self {
            GridName::Rollout => BlockGrid::Rollout,
            GridName::Reference => BlockGrid::Reference,
        }
    }
}

/// Evaluation on held-out tasks (spec bicrl §11): greedy, static, one sample per task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalConfig {
    /// The held-out task file (the stage's format); no evaluation without one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    /// Every this many RL steps (and at the end).
    pub eval_steps: u64,
    pub max_tokens: usize,
    pub max_active: usize,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            file: None,
            eval_steps: 10,
            max_tokens: 4096,
            max_active: 32,
        }
    }
}

impl RlConfig {
    /// A named preset (see [`PRESETS`]).
    pub fn preset(name: &str) -> Result<Self> {
        let Some((size, stage)) = name
            .strip_prefix("dice-")
            .and_then(|rest| rest.split_once('-'))
        else {
            bail!(
                "unknown preset `{name}`: choose one of {}",
                PRESETS.join(", ")
            );
        };
        let mut config = Self::default();
        config.checkpoint.save_steps = 10;
        let (rollout_active, eval_active) = match (size, stage) {
            ("8b" | "4b", "stage1") => (32, 32),
            ("1.7b", "stage1") => (32, 16),
            ("8b", "stage2") => (48, 4),
            ("4b" | "1.7b", "stage2") => (20, 4),
            _ => bail!(
                "unknown preset `{name}`: choose one of {}",
                PRESETS.join(", ")
            ),
        };
        config.rollout.max_active = rollout_active;
        config.eval.max_active = eval_active;
        if stage == "stage2" {
            config.tasks.stage = Stage::E2e;
            config.training.total_steps = 100;
            config.training.max_prompt_len = 1500;
        }
        Ok(config)
    }

    /// The settings a run uses: paths made absolute, the dtype resolved, every value checked.
    pub fn resolve(mut self) -> Result<Self> {
        self.model.resolve()?;
        let Some(file) = &self.tasks.file else {
            bail!("no tasks: pass --tasks FILE (or set [tasks] file in the settings file)");
        };
        self.tasks.file = Some(existing(file, "task file")?);
        if let Some(file) = &self.eval.file {
            self.eval.file = Some(existing(file, "evaluation task file")?);
        }
        let r = &self.rollout;
        ensure!(
            r.tasks_per_step > 0 && r.samples_per_task > 0 && r.max_active > 0,
            "tasks_per_step, samples_per_task and max_active must be at least 1"
        );
        ensure!(
            r.max_tokens > 0 && r.block_length > 0 && r.denoising_steps > 0,
            "max_tokens, block_length and denoising_steps must be at least 1"
        );
        ensure!(r.turns > 0, "turns must be at least 1");
        ensure!(
            r.turns == 1 || self.tasks.stage == Stage::E2e,
            "--turns is a stage-2 option: the judge's feedback asks for the whole program, which \
             only --stage e2e writes"
        );
        ensure!(
            (0.0..=1.0).contains(&self.reward.turn_discount),
            "turn_discount must be within 0..=1"
        );
        let t = &mut self.training;
        ensure!(t.total_steps > 0, "total_steps must be at least 1");
        ensure!(
            t.samples_per_update > 0,
            "samples_per_update must be at least 1"
        );
        t.run.resolve()?;
        ensure!(t.grad_scale > 0.0, "grad_scale must be positive");
        ensure!(
            t.block_size == self.rollout.block_length,
            "the training block size ({}) must be the rollout's block length ({}): traces are replayed block by block",
            t.block_size,
            self.rollout.block_length
        );
        ensure!(t.shrink > 0, "shrink must be at least 1");
        self.reward.judge_device.get_or_insert(t.run.device);
        self.checkpoint.check(self.eval.eval_steps)?;
        Ok(self)
    }

    /// The task file (resolved settings have one).
    pub fn task_file(&self) -> &Path {
        self.tasks
            .file
            .as_deref()
            .expect("resolved settings name a task file")
    }
}

impl Settings for RlConfig {
    /// The tasks' stage and order, the rollout, the reward, the training and the optimizer:
    /// not the device, the engines' batch size, the evaluation or the run's length (a
    /// finished run can be extended).
    fn resume_key(&self) -> serde_json::Value {
        let mut key = serde_json::json!({
            "tasks": {"stage": self.tasks.stage, "order": self.tasks.order},
            "rollout": without(&self.rollout, &["max_active"]),
            "reward": {
                "speedup_shaping": self.reward.speedup_shaping,
                "correctness_trials": self.reward.correctness_trials,
                "tolerance": self.reward.tolerance,
                "contains_token": self.reward.contains_token,
            },
            "training": without(&self.training, &["device", "total_steps", "optimizer_offload"]),
            "optimizer": self.optimizer,
        });
        // Only trajectories of several turns are discounted: one-turn runs keep the key they
        // had before refinement existed, and resume.
        if self.rollout.turns > 1 {
            key["reward"]["turn_discount"] = self.reward.turn_discount.into();
        }
        key
    }

    fn resets_moments(&self) -> bool {
        self.training.reset_moments
    }

    fn run_parts(&self) -> RunParts<'_> {
        let (model, checkpoint) = (&self.model, &self.checkpoint);
        RunParts::new(model, &self.training.run, self.optimizer, checkpoint)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_reward_token_is_an_id_or_census_in_flags_and_settings() {
        use super::{Census, RewardToken};
        assert_eq!("16".parse(), Ok(RewardToken::Id(16)));
        assert_eq!("census".parse(), Ok(RewardToken::Census(Census::Census)));
        assert!("half".parse::<RewardToken>().is_err());
        for token in [RewardToken::Id(16), RewardToken::Census(Census::Census)] {
            let text = toml::to_string(&super::RewardConfig {
                contains_token: Some(token),
                ..Default::default()
            })
            .unwrap();
            let back: super::RewardConfig = toml::from_str(&text).unwrap();
            assert_eq!(back.contains_token, Some(token), "{text}");
        }
    }

    use super::*;

    #[test]
    fn the_defaults_are_dice_8b_stage1() {
        let config = RlConfig::default();
        assert_eq!(config.rollout.tasks_per_step, 64);
        assert_eq!(config.rollout.samples_per_task, 16);
        assert_eq!(config.rollout.dynamic_threshold, 0.9);
        assert_eq!(config.training.run.learning_rate, 1e-6);
        assert_eq!(
            (config.training.clip_eps, config.training.kl_beta),
            (0.2, 0.01)
        );
        assert_eq!(config.training.total_steps, 20);
        assert!(config.training.reset_moments);
        assert_eq!(
            RlConfig::preset("dice-8b-stage1").unwrap().rollout,
            config.rollout
        );
    }

    #[test]
    fn one_turn_settings_read_and_resume_as_before_refinement() {
        let one = RlConfig::preset("dice-8b-stage2").unwrap();
        assert_eq!(one.rollout.turns, 1);
        let text = one.to_toml().unwrap();
        assert!(!text.contains("turns ="), "{text}");
        assert!(one.resume_key()["rollout"].get("turns").is_none());
        assert!(one.resume_key()["reward"].get("turn_discount").is_none());
        let mut two = one.clone();
        two.rollout.turns = 2;
        assert_eq!(RlConfig::from_toml(&two.to_toml().unwrap()).unwrap(), two);
        assert_eq!(two.resume_key()["rollout"]["turns"], 2);
        assert_eq!(two.resume_key()["reward"]["turn_discount"], 0.4);
        let mut discounted = two.clone();
        discounted.reward.turn_discount = 0.5;
        assert_ne!(discounted.resume_key(), two.resume_key());
    }

    #[test]
    fn presets_differ_as_the_reference_configs_do() {
        let stage2 = RlConfig::preset("dice-8b-stage2").unwrap();
        assert_eq!(stage2.tasks.stage, Stage::E2e);
        assert_eq!(stage2.training.total_steps, 100);
        assert_eq!(stage2.training.max_prompt_len, 1500);
        assert_eq!((stage2.rollout.max_active, stage2.eval.max_active), (48, 4));
        let small = RlConfig::preset("dice-1.7b-stage1").unwrap();
        assert_eq!((small.rollout.max_active, small.eval.max_active), (32, 16));
        let small2 = RlConfig::preset("dice-1.7b-stage2").unwrap();
        assert_eq!(small2.rollout.max_active, 20);
        for name in PRESETS {
            let preset = RlConfig::preset(name).unwrap();
            assert_eq!(
                RlConfig::from_toml(&preset.to_toml().unwrap()).unwrap(),
                preset,
                "{name}"
            );
        }
        assert!(RlConfig::preset("dice-9b-stage1").is_err());
    }
}
