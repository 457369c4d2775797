//! The settings of an SFT run, as a TOML file (`dice train sft --config F`) with command-line
//! flags on top; every run writes what it resolved to `OUT/config.toml`, which reads back as
//! the same settings. Keys left out take the defaults: the DICE recipe (spec §6.5) and the HF
//! Trainer's defaults it runs with.

use crate::data::PackOptions;
use crate::dist::zero::ZeroStage;
use crate::optim::AdamWConfig;
use crate::run::settings::{
    existing, without, CheckpointConfig, ModelConfig, Recipe, RunParts, RunTraining, Settings,
};
use crate::schedule::ScheduleKind;
use anyhow::{ensure, Result};
use dice_eval::Device;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

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

/// DICE's SFT recipe: the defaults of the settings every run has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SftRecipe {}

impl Recipe for SftRecipe {
    const LEARNING_RATE: f64 = 1e-5;
    const SEED: u64 = 42;
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainingConfig {
    /// Passes over the training rows (fractions allowed); `max_steps` wins when set.
    pub epochs: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_steps: Option<u64>,
    /// The learning rate (the peak), clipping, seed (of the data order, the noise and the
    /// validation split), device and dtype.
    #[serde(flatten)]
    pub run: RunTraining<SftRecipe>,
    pub lr_scheduler: ScheduleKind,
    /// Share of the steps spent warming up (rounded up).
    pub warmup_ratio: f64,
    /// Packed rows per micro-batch (one forward and backward).
    pub per_device_train_batch_size: usize,
    /// Micro-batches whose gradients are summed into one optimizer step.
    pub gradient_accumulation_steps: usize,
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
            run: RunTraining::default(),
            lr_scheduler: ScheduleKind::ConstantWithWarmup,
            warmup_ratio: 0.03,
            per_device_train_batch_size: 1,
            gradient_accumulation_steps: 1,
            chunk_rows: dice_model::sdar::QUERY_CHUNK,
            zero_stage: 0,
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

impl Settings for SftConfig {
    fn run_parts(&self) -> RunParts<'_> {
        let (model, checkpoint) = (&self.model, &self.checkpoint);
        RunParts::new(model, &self.training.run, self.optimizer, checkpoint)
    }

    /// Training (but the device and the chunking, which change rounding at most, and the ZeRO
    /// stage and the optimizer's offload, which change neither the update, see
    /// [`crate::dist::zero`] and [`crate::optim::AdamW::offloaded`], nor the checkpoint) and
    /// the optimizer.
    fn resume_key(&self) -> serde_json::Value {
        serde_json::json!({
            "training": without(
                &self.training,
                &["device", "chunk_rows", "zero_stage", "optimizer_offload"],
            ),
            "optimizer": self.optimizer,
        })
    }

    fn zero_stage(&self) -> Result<ZeroStage> {
        ZeroStage::from_number(self.training.zero_stage)
    }
}

impl SftConfig {
    /// The settings a run uses: defaults that depend on other settings filled in (dtype,
    /// cutoff, peak TFLOP/s), paths made absolute (so the written settings work from any
    /// folder), and every value checked.
    pub fn resolve(mut self) -> Result<Self> {
        self.model.resolve()?;
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
        t.run.resolve()?;
        ensure!(
            (0.0..=1.0).contains(&t.warmup_ratio),
            "warmup_ratio must be in [0, 1], not {}",
            t.warmup_ratio
        );
        ensure!(
            t.per_device_train_batch_size > 0 && t.gradient_accumulation_steps > 0,
            "per_device_train_batch_size and gradient_accumulation_steps must be at least 1"
        );
        ensure!(t.chunk_rows > 0, "chunk_rows must be at least 1");
        ZeroStage::from_number(t.zero_stage)?;
        self.checkpoint.check(self.eval.eval_steps)?;
        if self.metrics.peak_tflops.is_none() && self.training.run.device == Device::Cuda {
            self.metrics.peak_tflops = Some(crate::metrics::HOPPER_BF16_PEAK_TFLOPS);
        }
        if let Some(peak) = self.metrics.peak_tflops {
            ensure!(
                peak.is_finite() && peak > 0.0,
                "peak_tflops must be positive, not {peak}"
            );
        }
        Ok(self)
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
}

fn absolute_all(paths: &[PathBuf], what: &str) -> Result<Vec<PathBuf>> {
    paths.iter().map(|p| existing(p, what)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::settings::{resume_key_difference, SaveDType};

    #[test]
    fn the_defaults_are_the_dice_recipe() {
        let config = SftConfig::default();
        assert_eq!(config.training.run.learning_rate, 1e-5);
        assert_eq!(config.training.epochs, 3.0);
        assert_eq!(
            config.training.lr_scheduler,
            ScheduleKind::ConstantWithWarmup
        );
        assert_eq!(config.training.warmup_ratio, 0.03);
        assert_eq!(config.training.run.max_grad_norm, 1.0);
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
        b.training.run.learning_rate = 2e-5;
        b.training.run.device = Device::Cuda;
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
