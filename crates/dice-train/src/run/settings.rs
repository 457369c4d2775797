//! The settings every run has, SFT's and RL's alike, as their TOML files name them: the
//! `[model]` it starts from, the part of `[training]` every trainer reads ([`RunTraining`]:
//! learning rate, clipping, seed, device, dtype), the `[checkpoint]` section; how a settings
//! file is read and written ([`Settings`]), and how two runs' resume keys are compared.

use crate::dist::zero::ZeroStage;
use crate::optim::AdamWConfig;
use anyhow::{bail, ensure, Context, Result};
use candle_core::DType;
use dice_eval::Device;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

/// The model a run starts from.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// The model folder (config.json, safetensors, tokenizer files, chat template).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// The tokenizer folder (tokenizer files and chat template), when not the model folder.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
}

impl ModelConfig {
    /// Makes both folders absolute (so the written settings work from any folder); fails when
    /// no model is named or a folder does not exist.
    pub fn resolve(&mut self) -> Result<()> {
        let Some(model) = &self.path else {
            bail!("no model: pass --model DIR (or set [model] path in the settings file)");
        };
        self.path = Some(existing(model, "model folder")?);
        if let Some(tokenizer) = &self.tokenizer {
            self.tokenizer = Some(existing(tokenizer, "tokenizer folder")?);
        }
        Ok(())
    }

    /// The model folder (resolved settings have one).
    pub fn dir(&self) -> &Path {
        self.path
            .as_deref()
            .expect("resolved settings name a model")
    }

    /// The folder of the tokenizer files: the tokenizer folder, else the model's.
    pub fn tokenizer_dir(&self) -> &Path {
        self.tokenizer.as_deref().unwrap_or(self.dir())
    }
}

/// A trainer's defaults for the settings of [`RunTraining`] that differ between trainers.
pub trait Recipe {
    const LEARNING_RATE: f64;
    const SEED: u64;
}

/// The `[training]` settings every run has, beside the trainer's own keys of that section;
/// keys left out take the defaults of the trainer's recipe `R`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, bound(deserialize = "R: Recipe", serialize = ""))]
pub struct RunTraining<R> {
    /// The learning rate (SFT's peak, which its schedule warms up to).
    pub learning_rate: f64,
    /// Global gradient-norm clipping.
    pub max_grad_norm: f64,
    /// Seed of everything the run draws.
    pub seed: u64,
    /// Where the model trains: each rank on the CPU, or on its machine's GPU `LOCAL_RANK`.
    pub device: Device,
    /// [default: f32 on the CPU, bf16 on CUDA]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dtype: Option<ComputeDType>,
    /// AdamW's masters and moments in host memory instead of beside the weights
    /// (ZeRO-Offload's split, [`crate::optim::AdamW::offloaded`]): the device keeps weights,
    /// gradients and activations; every step reads the gradients back and writes the weights.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub optimizer_offload: bool,
    #[serde(skip)]
    recipe: PhantomData<R>,
}

impl<R: Recipe> Default for RunTraining<R> {
    fn default() -> Self {
        Self {
            learning_rate: R::LEARNING_RATE,
            max_grad_norm: 1.0,
            seed: R::SEED,
            device: Device::Cpu,
            dtype: None,
            optimizer_offload: false,
            recipe: PhantomData,
        }
    }
}

impl<R> RunTraining<R> {
    /// The compute dtype, its default resolved.
    pub fn compute_dtype(&self) -> ComputeDType {
        self.dtype.unwrap_or(match self.device {
            Device::Cpu => ComputeDType::F32,
            Device::Cuda => ComputeDType::Bf16,
        })
    }

    /// Checks every value and resolves the dtype.
    pub fn resolve(&mut self) -> Result<()> {
        ensure!(
            self.learning_rate.is_finite() && self.learning_rate >= 0.0,
            "the learning rate must be finite and not negative, not {}",
            self.learning_rate
        );
        ensure!(
            self.max_grad_norm > 0.0,
            "max_grad_norm must be positive, not {}",
            self.max_grad_norm
        );
        self.dtype = Some(self.compute_dtype());
        Ok(())
    }
}

/// The dtype of the weights the model computes with (masters and moments are f32 always).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum ComputeDType {
    /// float32 weights and compute (the CPU default).
    F32,
    /// bfloat16 compute with float32 master weights and optimizer moments (the reference's).
    Bf16,
}

impl ComputeDType {
    pub fn dtype(self) -> DType {
        match self {
            ComputeDType::F32 => DType::F32,
            ComputeDType::Bf16 => DType::BF16,
        }
    }
}

/// The dtype checkpoint weights are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum SaveDType {
    /// The SDAR checkpoints' dtype: the f32 masters rounded to nearest even.
    #[default]
    Bf16,
    /// The f32 masters as they are.
    F32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// A checkpoint kept every this many steps (and always at the end).
    pub save_steps: u64,
    /// Checkpoints kept, the newest ones; all when unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub save_total_limit: Option<usize>,
    pub save_dtype: SaveDType,
    /// Weight bytes per safetensors shard.
    pub max_shard_bytes: u64,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            save_steps: 500,
            save_total_limit: None,
            save_dtype: SaveDType::Bf16,
            max_shard_bytes: dice_model::init::DEFAULT_MAX_SHARD_BYTES,
        }
    }
}

impl CheckpointConfig {
    /// Checks every value, with `eval_steps` (the trainer's evaluation cadence, which must be
    /// a whole number of steps too).
    pub fn check(&self, eval_steps: u64) -> Result<()> {
        ensure!(
            self.save_steps > 0 && eval_steps > 0,
            "save_steps and eval_steps must be at least 1"
        );
        ensure!(
            self.save_total_limit != Some(0),
            "save_total_limit must be at least 1 (leave it out to keep every checkpoint)"
        );
        ensure!(self.max_shard_bytes > 0, "max_shard_bytes must be positive");
        Ok(())
    }
}

/// The settings of a trainer that the run under every trainer reads.
#[derive(Debug, Clone, Copy)]
pub struct RunParts<'a> {
    pub model: &'a ModelConfig,
    pub device: Device,
    pub dtype: ComputeDType,
    pub optimizer: AdamWConfig,
    /// AdamW's state in host memory ([`RunTraining::optimizer_offload`]).
    pub optimizer_offload: bool,
    pub checkpoint: &'a CheckpointConfig,
}

impl<'a> RunParts<'a> {
    pub fn new<R>(
        model: &'a ModelConfig,
        training: &RunTraining<R>,
        optimizer: AdamWConfig,
        checkpoint: &'a CheckpointConfig,
    ) -> Self {
        Self {
            model,
            device: training.device,
            dtype: training.compute_dtype(),
            optimizer,
            optimizer_offload: training.optimizer_offload,
            checkpoint,
        }
    }
}

/// A trainer's settings: a TOML file (keys it leaves out keep their defaults) that every run
/// writes back resolved as `OUT/config.toml`, and the parts the run under every trainer reads.
pub trait Settings: Serialize + DeserializeOwned + Sized {
    /// The model, the compute and the checkpoint settings.
    fn run_parts(&self) -> RunParts<'_>;

    /// The settings the weights of a run depend on, as JSON: a checkpoint records them and a
    /// resumed run must ask for the same ([`resume_key_difference`]).
    fn resume_key(&self) -> serde_json::Value;

    /// Whether the optimizer's moments are reset before every step's update (BiC-RL's fresh
    /// AdamW per step), so that a checkpoint need not keep them.
    fn resets_moments(&self) -> bool {
        false
    }

    /// How the optimizer state is spread over the ranks: replicated unless the trainer
    /// shards it.
    fn zero_stage(&self) -> Result<ZeroStage> {
        Ok(ZeroStage::Replicated)
    }

    /// Reads a TOML settings file.
    fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the settings file {}", path.display()))?;
        Self::from_toml(&text).with_context(|| format!("{} is not valid settings", path.display()))
    }

    /// Settings from TOML text, the parser's message on one line.
    fn from_toml(text: &str) -> Result<Self> {
        toml::from_str(text).map_err(|e| anyhow::anyhow!("{}", e.to_string().trim_end()))
    }

    fn to_toml(&self) -> Result<String> {
        Ok(toml::to_string(self)?)
    }
}

/// `section` as a JSON object without `keys`: the part of a settings section a resume key
/// holds (the device, the chunking and the like change no weight).
pub fn without(section: &impl Serialize, keys: &[&str]) -> serde_json::Value {
    let mut value = serde_json::to_value(section).expect("settings serialize");
    if let Some(fields) = value.as_object_mut() {
        for key in keys {
            fields.remove(*key);
        }
    }
    value
}

/// The first setting where two resume keys differ, as `(key, recorded, asked)`.
pub fn resume_key_difference(
    recorded: &serde_json::Value,
    asked: &serde_json::Value,
) -> Option<(String, String, String)> {
    fn walk(
        path: &str,
        a: &serde_json::Value,
        b: &serde_json::Value,
    ) -> Option<(String, String, String)> {
        match (a.as_object(), b.as_object()) {
            (Some(a), Some(b)) => {
                let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
                keys.sort();
                keys.dedup();
                keys.into_iter().find_map(|k| {
                    let null = serde_json::Value::Null;
                    let key = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    walk(&key, a.get(k).unwrap_or(&null), b.get(k).unwrap_or(&null))
                })
            }
            _ if a == b => None,
            _ => Some((path.to_string(), a.to_string(), b.to_string())),
        }
    }
    walk("", recorded, asked)
}

/// `path` made absolute (as given otherwise, so messages name it as the user wrote it), when it
/// exists.
pub fn existing(path: &Path, what: &str) -> Result<PathBuf> {
    ensure!(path.exists(), "cannot find the {what} {}", path.display());
    std::path::absolute(path)
        .with_context(|| format!("cannot resolve the {what} {}", path.display()))
}
