//! Checkpoints of a training run, in the layout of the SDAR checkpoints on Hugging Face so
//! that `dice generate`, `dice serve` and transformers load them unchanged: sharded
//! `model-0000N-of-0000M.safetensors` with `model.safetensors.index.json` (the checkpoint key
//! names), the base model's `config.json` (its `torch_dtype` set to the stored dtype), its
//! tokenizer files, chat template, generation settings and remote-code `*.py` files. A
//! checkpoint a run can resume from (`checkpoint-STEP/`) also holds the optimizer state (f32
//! masters and moments, [`OPTIMIZER_STATE`]) and [`TRAINER_STATE`].
//!
//! A checkpoint folder is written whole under a temporary name in the output folder and then
//! renamed: a folder named `checkpoint-STEP` or `final` is always complete, whenever the
//! process was killed.

use super::settings::{CheckpointConfig, ModelConfig, SaveDType};
use crate::dist::Collective;
use crate::metrics::MetricsLog;
use crate::optim::AdamW;
use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use dice_model::shards::{
    is_atomic_temporary, write_atomically, write_weights, IndexFile, StoredDType, StoredTensor,
};
use dice_model::SdarConfig;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The trainer's state in a checkpoint.
pub const TRAINER_STATE: &str = "trainer_state.json";
/// The optimizer's state in a checkpoint ([`AdamW::save_state`]).
pub const OPTIMIZER_STATE: &str = "optimizer.safetensors";
/// The folder of the finished run's model.
pub const FINAL: &str = "final";
const PREFIX: &str = "checkpoint-";
const PARTIAL: &str = ".partial-";

/// Elements converted and copied to the host at a time while weights are written.
const CHUNK_ELEMENTS: usize = 1 << 24;

/// Where a run stands, as a checkpoint records it. The data order and the noise are
/// functions of the seed and the step, so the step is their whole state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps done.
    pub step: u64,
    pub total_steps: u64,
    pub epoch: f64,
    /// SHA-256 of the run's data: SFT's training rows (tokens, labels, positions) in dataset
    /// order, RL's task file.
    pub data_fingerprint: String,
    /// The settings the weights depend on ([`super::settings::Settings::resume_key`], with the
    /// number of ranks when there are several).
    pub resume_key: serde_json::Value,
}

impl TrainerState {
    pub fn read(checkpoint: &Path) -> Result<Self> {
        let path = checkpoint.join(TRAINER_STATE);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} is not valid", path.display()))
    }
}

/// The name of the checkpoint after `step` steps.
pub fn checkpoint_name(step: u64) -> String {
    format!("{PREFIX}{step}")
}

/// The complete checkpoints of an output folder with their steps, oldest first.
pub fn checkpoints(out: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let entries = match std::fs::read_dir(out) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", out.display())),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot read {}", out.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(step) = name
            .strip_prefix(PREFIX)
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        let dir = entry.path();
        if dir.join(TRAINER_STATE).is_file() && dir.join(OPTIMIZER_STATE).is_file() {
            found.push((step, dir));
        }
    }
    found.sort();
    Ok(found)
}

/// Writes the checkpoints of one run.
pub struct Checkpointer {
    out: PathBuf,
    /// The base model folder, whose config.json and `*.py` files every checkpoint carries.
    base_model: PathBuf,
    /// The folder whose tokenizer files every checkpoint carries.
    tokenizer: PathBuf,
    model_config: SdarConfig,
    save_dtype: SaveDType,
    max_shard_bytes: u64,
    /// Checkpoints kept, the newest; all when `None`.
    save_total_limit: Option<usize>,
}

impl Checkpointer {
    /// The checkpoints of a run in `out` of the model `model` (whose config is
    /// `model_config`), as `settings` ask.
    pub fn new(
        out: &Path,
        model: &ModelConfig,
        model_config: &SdarConfig,
        settings: &CheckpointConfig,
    ) -> Self {
        Self {
            out: out.to_path_buf(),
            base_model: model.dir().to_path_buf(),
            tokenizer: model.tokenizer_dir().to_path_buf(),
            model_config: model_config.clone(),
            save_dtype: settings.save_dtype,
            max_shard_bytes: settings.max_shard_bytes,
            save_total_limit: settings.save_total_limit,
        }
    }

    /// Prepares the output folder on rank 0 (partial saves removed, the run's settings written
    /// as `config.toml`) and opens its `metrics.jsonl` from `step`; other ranks get no log. Every
    /// rank waits for rank 0, so none starts before the folder exists.
    pub fn open_run_folder(
        &self,
        collective: &dyn Collective,
        config_toml: &str,
        step: u64,
    ) -> Result<Option<MetricsLog>> {
        let metrics = if collective.rank() == 0 {
            std::fs::create_dir_all(&self.out)
                .with_context(|| format!("cannot create {}", self.out.display()))?;
            self.remove_partial_saves()?;
            write_atomically(&self.out.join("config.toml"), |w| {
                Ok(w.write_all(config_toml.as_bytes())?)
            })?;
            Some(MetricsLog::open(&self.out.join("metrics.jsonl"), step)?)
        } else {
            None
        };
        collective.barrier()?;
        Ok(metrics)
    }

    /// Removes the temporary folders of saves, and the temporary files of atomic writes
    /// (metrics pages, settings), that an earlier process did not finish.
    pub fn remove_partial_saves(&self) -> Result<()> {
        let Ok(entries) = std::fs::read_dir(&self.out) else {
            return Ok(());
        };
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let removed = if name.starts_with(PARTIAL) {
                std::fs::remove_dir_all(entry.path())
            } else if is_atomic_temporary(&name) && entry.file_type()?.is_file() {
                std::fs::remove_file(entry.path())
            } else {
                continue;
            };
            removed.with_context(|| {
                format!("cannot remove the partial save {}", entry.path().display())
            })?;
        }
        Ok(())
    }

    /// Writes the folder `name` of the output folder: the model from the optimizer's f32
    /// masters, the files beside it, `state`, and with `resumable` the optimizer state.
    /// Replaces a folder of that name.
    pub fn save(
        &self,
        name: &str,
        optimizer: &AdamW,
        state: &TrainerState,
        resumable: bool,
    ) -> Result<PathBuf> {
        let target = self.out.join(name);
        let partial = self
            .out
            .join(format!("{PARTIAL}{name}-{}", std::process::id()));
        if partial.exists() {
            std::fs::remove_dir_all(&partial)?;
        }
        std::fs::create_dir_all(&partial)
            .with_context(|| format!("cannot create {}", partial.display()))?;
        self.write_model(&partial, optimizer)?;
        if resumable {
            optimizer.save_state(&partial.join(OPTIMIZER_STATE))?;
        }
        write_atomically(&partial.join(TRAINER_STATE), |w| {
            serde_json::to_writer_pretty(&mut *w, state)?;
            writeln!(w)?;
            Ok(())
        })?;
        if target.exists() {
            let replaced = self
                .out
                .join(format!("{PARTIAL}replaced-{name}-{}", std::process::id()));
            std::fs::rename(&target, &replaced)
                .with_context(|| format!("cannot move the old {} aside", target.display()))?;
            std::fs::remove_dir_all(&replaced)
                .with_context(|| format!("cannot remove {}", replaced.display()))?;
        }
        std::fs::rename(&partial, &target)
            .with_context(|| format!("cannot move the checkpoint into {}", target.display()))?;
        std::fs::File::open(&self.out)
            .and_then(|dir| dir.sync_all())
            .with_context(|| format!("cannot sync {}", self.out.display()))?;
        Ok(target)
    }

    /// After the checkpoint of `step`: deletes the one before it unless its step is a
    /// multiple of `save_steps` (a run that writes one after every step keeps only the newest
    /// of those between), then the oldest beyond the limit.
    pub fn prune(&self, step: u64, save_steps: u64) -> Result<()> {
        let previous = step.saturating_sub(1);
        let unkept = self.out.join(checkpoint_name(previous));
        if previous > 0 && !previous.is_multiple_of(save_steps) && unkept.exists() {
            std::fs::remove_dir_all(&unkept)
                .with_context(|| format!("cannot remove {}", unkept.display()))?;
        }
        let Some(limit) = self.save_total_limit else {
            return Ok(());
        };
        let all = checkpoints(&self.out)?;
        for (_, dir) in &all[..all.len().saturating_sub(limit)] {
            std::fs::remove_dir_all(dir)
                .with_context(|| format!("cannot remove the old checkpoint {}", dir.display()))?;
        }
        Ok(())
    }

    /// The model files of a checkpoint: weights, config.json, tokenizer and remote code.
    fn write_model(&self, dir: &Path, optimizer: &AdamW) -> Result<()> {
        let dtype = match self.save_dtype {
            SaveDType::Bf16 => StoredDType::BF16,
            SaveDType::F32 => StoredDType::F32,
        };
        let masters: HashMap<&str, Tensor> = optimizer.master_weights().collect();
        let tensors: Vec<StoredTensor> = self
            .model_config
            .tensor_shapes()
            .into_iter()
            .map(|(name, shape)| StoredTensor { name, shape, dtype })
            .collect();
        write_weights(
            dir,
            &tensors,
            self.max_shard_bytes,
            IndexFile::Always,
            |tensor, w| {
                let master = masters
                    .get(tensor.name.as_str())
                    .with_context(|| format!("the optimizer holds no weight {}", tensor.name))?;
                write_tensor(master, dtype, w)
            },
        )?;

        let source = self.base_model.join("config.json");
        let text = std::fs::read_to_string(&source)
            .with_context(|| format!("cannot read {}", source.display()))?;
        let mut config: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", source.display()))?;
        config["torch_dtype"] = dtype.torch_name().into();
        write_atomically(&dir.join("config.json"), |w| {
            serde_json::to_writer_pretty(&mut *w, &config)?;
            writeln!(w)?;
            Ok(())
        })?;
        dice_model::init::copy_tokenizer_files(&self.tokenizer, dir)?;
        for entry in std::fs::read_dir(&self.base_model)
            .with_context(|| format!("cannot read {}", self.base_model.display()))?
        {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "py") && path.is_file() {
                let bytes = std::fs::read(&path)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                let name = path.file_name().expect("a file has a name");
                write_atomically(&dir.join(name), |w| Ok(w.write_all(&bytes)?))?;
            }
        }
        Ok(())
    }
}

/// The little-endian bytes of `tensor` in `dtype` (f32 rounded to nearest even for bf16).
fn write_tensor(tensor: &Tensor, dtype: StoredDType, w: &mut dyn Write) -> Result<()> {
    let flat = tensor.flatten_all()?;
    let len = flat.elem_count();
    let mut bytes = Vec::new();
    for start in (0..len).step_by(CHUNK_ELEMENTS) {
        let part = flat.narrow(0, start, CHUNK_ELEMENTS.min(len - start))?;
        bytes.clear();
        match dtype {
            StoredDType::BF16 => bytes.extend(
                part.to_dtype(DType::BF16)?
                    .to_vec1::<half::bf16>()?
                    .iter()
                    .flat_map(|v| v.to_le_bytes()),
            ),
            StoredDType::F32 => bytes.extend(
                part.to_dtype(DType::F32)?
                    .to_vec1::<f32>()?
                    .iter()
                    .flat_map(|v| v.to_le_bytes()),
            ),
        }
        w.write_all(&bytes)?;
    }
    Ok(())
}
