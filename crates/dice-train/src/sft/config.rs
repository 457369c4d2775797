//! The settings of an SFT run, as a TOML file (`dice train sft --config F`) with command-line
//! flags on top; every run writes what it resolved to `OUT/config.toml`, which reads back as
//! the same settings. Keys left out take the defaults: the DICE recipe (spec §6.5) and the HF
//! Trainer's defaults it runs with.

use crate::data::PackOptions;
use crate::dist::zero::ZeroStage;
use crate::optim::AdamWConfig;
use crate::schedule::ScheduleKind;
use anyhow::{bail, ensure, Context, Result};
use candle_core::DType;
use dice_eval::Device;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Everything an SFT run is configured with.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftConfig {
    pub model: ModelConfig,
    pub data: DataConfig,
    pub training: TrainingConfig,
    /// AdamW's β, ε and weight decay.
    pub optimizer: AdamWConfig,
    pub checkpoint: CheckpointConfig,
    pub eval: EvalConfig,
    pub metrics: MetricsConfig,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// The base model folder (config.json, safetensors, tokenizer files, chat template).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// The tokenizer folder, when not the model folder.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// Plain data files (their layout told by their first record).
    pub files: Vec<PathBuf>,
    /// LlamaFactory's dataset_info.json, or the folder holding it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dataset_info: Option<PathBuf>,
    /// Datasets of `dataset_info` to train on, in order.
    pub datasets: Vec<String>,
    /// Tokens per packed row.
    pub row_tokens: usize,
    /// Longest sample kept, after block padding [default: row_tokens - 1].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cutoff_len: Option<usize>,
    /// Records per preprocessing batch (the packing combines samples of one batch only).
    pub preprocessing_batch_size: usize,
    /// Contiguous shards the records are split into before batching.
    pub preprocessing_num_workers: usize,
    /// Share of the packed rows held out for evaluation (chosen by the seed).
    pub val_ratio: f64,
    /// Files packed as the evaluation rows instead of a share of the training rows.
    pub val_files: Vec<PathBuf>,
}

impl Default for DataConfig {
    fn default() -> Self {
        let pack = PackOptions::default();
        Self {
            files: Vec::new(),
            dataset_info: None,
            datasets: Vec::new(),
            row_tokens: pack.row_tokens,
            cutoff_len: None,
            preprocessing_batch_size: pack.preprocessing_batch_size,
            preprocessing_num_workers: pack.preprocessing_num_workers,
            val_ratio: 0.0,
            val_files: Vec::new(),
        }
    }
}

/// Settings of type `T` read from the TOML file `path`; keys it leaves out keep their defaults.
pub(crate) fn read_settings<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the settings file {}", path.display()))?;
    settings_from_toml(&text).with_context(|| format!("{} is not valid settings", path.display()))
}

/// Settings of type `T` from TOML text, the parser's message on one line.
pub(crate) fn settings_from_toml<T: serde::de::DeserializeOwned>(text: &str) -> Result<T> {
    toml::from_str(text).map_err(|e| anyhow::anyhow!("{}", e.to_string().trim_end()))
}

/// The dtype of the weights the model computes with (masters and moments are f32 always).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDType {
    F32,
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainingConfig {
    /// Passes over the training rows (fractions allowed); `max_steps` wins when set.
    pub epochs: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_steps: Option<u64>,
    /// Peak learning rate.
    pub learning_rate: f64,
    pub lr_scheduler: ScheduleKind,
    /// Share of the steps spent warming up (rounded up).
    pub warmup_ratio: f64,
    /// Packed rows per micro-batch (one forward and backward).
    pub per_device_train_batch_size: usize,
    /// Micro-batches whose gradients are summed into one optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Global gradient-norm clipping.
    pub max_grad_norm: f64,
    /// Seed of the data order, the noise and the validation split.
    pub seed: u64,
    /// Where the model trains: each rank on the CPU, or on its machine's GPU `LOCAL_RANK`.
    pub device: Device,
    /// [default: f32 on the CPU, bf16 on CUDA]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dtype: Option<ComputeDType>,
    /// Query and head rows per chunk of the checkpointed forward and backward (memory, not
    /// results).
    pub chunk_rows: usize,
    /// How the optimizer state is spread over the ranks: 0 replicated, 1 sharded (ZeRO-1),
    /// 2 sharded with reduce-scattered gradients (ZeRO-2). The same weights either way.
    pub zero_stage: u8,
}

impl Default for TrainingConfig {
    fn default() -> Self {
        Self {
            epochs: 3.0,
            max_steps: None,
            learning_rate: 1e-5,
            lr_scheduler: ScheduleKind::ConstantWithWarmup,
            warmup_ratio: 0.03,
            per_device_train_batch_size: 1,
            gradient_accumulation_steps: 1,
            max_grad_norm: 1.0,
            seed: 42,
            device: Device::Cpu,
            dtype: None,
            chunk_rows: dice_model::sdar::QUERY_CHUNK,
            zero_stage: 0,
        }
    }
}

impl TrainingConfig {
    /// The compute dtype, its default resolved.
    pub fn compute_dtype(&self) -> ComputeDType {
        self.dtype.unwrap_or(match self.device {
            Device::Cpu => ComputeDType::F32,
            Device::Cuda => ComputeDType::Bf16,
        })
    }
}

/// The dtype checkpoint weights are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
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
    /// A checkpoint every this many optimizer steps (and always at the end).
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalConfig {
    /// The held-out rows are evaluated every this many steps (and at the end).
    pub eval_steps: u64,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self { eval_steps: 500 }
    }
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Peak dense TFLOP/s of one device in the compute dtype, the MFU's denominator
    /// [default: 989 (H100/H200 SXM, bf16) on CUDA; none on the CPU, where no MFU is given].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_tflops: Option<f64>,
}

/// H100 / H200 SXM dense bf16 tensor-core peak, TFLOP/s.
const HOPPER_BF16_PEAK_TFLOPS: f64 = 989.0;

impl SftConfig {
    /// Reads a TOML settings file; keys it leaves out keep their defaults.
    pub fn read(path: &Path) -> Result<Self> {
        read_settings(path)
    }

    pub fn from_toml(text: &str) -> Result<Self> {
        settings_from_toml(text)
    }

    pub fn to_toml(&self) -> Result<String> {
        Ok(toml::to_string(self)?)
    }

    /// The settings a run uses: defaults that depend on other settings filled in (dtype,
    /// cutoff, peak TFLOP/s), paths made absolute (so the written settings work from any
    /// folder), and every value checked.
    pub fn resolve(mut self) -> Result<Self> {
        let Some(model) = &self.model.path else {
            bail!("no model: pass --model DIR (or set [model] path in the settings file)");
        };
        self.model.path = Some(existing(model, "model folder")?);
        if let Some(tokenizer) = &self.model.tokenizer {
            self.model.tokenizer = Some(existing(tokenizer, "tokenizer folder")?);
        }
        ensure!(
            !self.data.files.is_empty() || !self.data.datasets.is_empty(),
            "no training data: pass --data FILE or --dataset-info F --dataset NAME"
        );
        ensure!(
            self.data.datasets.is_empty() == self.data.dataset_info.is_none(),
            "datasets need a dataset_info and a dataset_info needs datasets: pass both --dataset-info and --dataset"
        );
        self.data.files = absolute_all(&self.data.files, "data file")?;
        self.data.val_files = absolute_all(&self.data.val_files, "validation file")?;
        if let Some(info) = &self.data.dataset_info {
            self.data.dataset_info = Some(existing(info, "dataset_info")?);
        }
        ensure!(
            (0.0..1.0).contains(&self.data.val_ratio),
            "val_ratio must be in [0, 1), not {}",
            self.data.val_ratio
        );
        ensure!(
            self.data.val_ratio == 0.0 || self.data.val_files.is_empty(),
            "give a validation share (--val-ratio) or validation files (--val-data), not both"
        );
        self.data.cutoff_len = Some(self.pack_options(1).cutoff_len);

        let t = &mut self.training;
        match t.max_steps {
            Some(steps) => ensure!(steps > 0, "max_steps must be at least 1"),
            None => ensure!(
                t.epochs.is_finite() && t.epochs > 0.0,
                "epochs must be positive, not {}",
                t.epochs
            ),
        }
        ensure!(
            t.learning_rate.is_finite() && t.learning_rate >= 0.0,
            "the learning rate must be finite and not negative, not {}",
            t.learning_rate
        );
        ensure!(
            (0.0..=1.0).contains(&t.warmup_ratio),
            "warmup_ratio must be in [0, 1], not {}",
            t.warmup_ratio
        );
        ensure!(
            t.per_device_train_batch_size > 0 && t.gradient_accumulation_steps > 0,
            "per_device_train_batch_size and gradient_accumulation_steps must be at least 1"
        );
        ensure!(
            t.max_grad_norm > 0.0,
            "max_grad_norm must be positive, not {}",
            t.max_grad_norm
        );
        ensure!(t.chunk_rows > 0, "chunk_rows must be at least 1");
        ZeroStage::from_number(t.zero_stage)?;
        t.dtype = Some(t.compute_dtype());
        ensure!(
            self.checkpoint.save_steps > 0 && self.eval.eval_steps > 0,
            "save_steps and eval_steps must be at least 1"
        );
        ensure!(
            self.checkpoint.save_total_limit != Some(0),
            "save_total_limit must be at least 1 (leave it out to keep every checkpoint)"
        );
        ensure!(
            self.checkpoint.max_shard_bytes > 0,
            "max_shard_bytes must be positive"
        );
        if self.metrics.peak_tflops.is_none() && self.training.device == Device::Cuda {
            self.metrics.peak_tflops = Some(HOPPER_BF16_PEAK_TFLOPS);
        }
        if let Some(peak) = self.metrics.peak_tflops {
            ensure!(
                peak.is_finite() && peak > 0.0,
                "peak_tflops must be positive, not {peak}"
            );
        }
        Ok(self)
    }

    /// The model folder (resolved settings have one).
    pub fn model_dir(&self) -> &Path {
        self.model
            .path
            .as_deref()
            .expect("resolved settings name a model")
    }

    /// The folder of the tokenizer files: the tokenizer folder, else the model's.
    pub fn tokenizer_dir(&self) -> &Path {
        self.model.tokenizer.as_deref().unwrap_or(self.model_dir())
    }

    /// How the samples are packed, for a model of `block_length`.
    pub fn pack_options(&self, block_length: usize) -> PackOptions {
        PackOptions {
            row_tokens: self.data.row_tokens,
            cutoff_len: self
                .data
                .cutoff_len
                .unwrap_or(self.data.row_tokens.saturating_sub(1)),
            block_length,
            preprocessing_batch_size: self.data.preprocessing_batch_size,
            preprocessing_num_workers: self.data.preprocessing_num_workers,
        }
    }

    /// The settings the weights of a run depend on, as JSON: training (but the device and the
    /// chunking, which change rounding at most, and the ZeRO stage, which changes neither the
    /// update, see [`crate::dist::zero`], nor the checkpoint) and the optimizer. A checkpoint records them; a
    /// resumed run must ask for the same.
    pub fn resume_key(&self) -> serde_json::Value {
        let mut training = serde_json::to_value(&self.training).expect("settings serialize");
        if let Some(fields) = training.as_object_mut() {
            fields.remove("device");
            fields.remove("chunk_rows");
            fields.remove("zero_stage");
        }
        serde_json::json!({
            "training": training,
            "optimizer": serde_json::to_value(self.optimizer).expect("settings serialize"),
        })
    }
}

/// The first setting where two [`SftConfig::resume_key`]s differ, as `(key, recorded, asked)`.
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
fn existing(path: &Path, what: &str) -> Result<PathBuf> {
    ensure!(path.exists(), "cannot find the {what} {}", path.display());
    std::path::absolute(path)
        .with_context(|| format!("cannot resolve the {what} {}", path.display()))
}

fn absolute_all(paths: &[PathBuf], what: &str) -> Result<Vec<PathBuf>> {
    paths.iter().map(|p| existing(p, what)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_dice_recipe() {
        let config = SftConfig::default();
        assert_eq!(config.training.learning_rate, 1e-5);
        assert_eq!(config.training.epochs, 3.0);
        assert_eq!(
            config.training.lr_scheduler,
            ScheduleKind::ConstantWithWarmup
        );
        assert_eq!(config.training.warmup_ratio, 0.03);
        assert_eq!(config.training.max_grad_norm, 1.0);
        assert_eq!(config.optimizer, AdamWConfig::default());
        assert_eq!(config.data.row_tokens, 6144);
        assert_eq!(config.checkpoint.save_dtype, SaveDType::Bf16);
    }

    #[test]
    fn an_empty_file_is_the_defaults_and_unknown_keys_are_refused() {
        assert_eq!(SftConfig::from_toml("").unwrap(), SftConfig::default());
        let error = SftConfig::from_toml("[training]\nlearning_rat = 1e-4\n")
            .unwrap_err()
            .to_string();
        assert!(error.contains("learning_rat"), "{error}");
    }

    #[test]
    fn the_first_difference_of_two_resume_keys_is_named() {
        let a = SftConfig::default();
        let mut b = a.clone();
        b.training.learning_rate = 2e-5;
        b.training.device = Device::Cuda;
        b.optimizer.weight_decay = 0.1;
        assert_eq!(
            resume_key_difference(&a.resume_key(), &a.resume_key()),
            None
        );
        let (key, recorded, asked) =
            resume_key_difference(&a.resume_key(), &b.resume_key()).unwrap();
        assert_eq!(
            (key.as_str(), recorded.as_str(), asked.as_str()),
            ("optimizer.weight_decay", "0.0", "0.1")
        );
    }
}
