//! Checkpoints of a training run, in the layout of the SDAR checkpoints on Hugging Face so
//! that `dice generate`, `dice serve` and transformers load them unchanged: sharded
//! `model-0000N-of-0000M.safetensors` with `model.safetensors.index.json` (the checkpoint key
//! names), the base model's `config.json` (its `torch_dtype` set to the stored dtype), its
//! tokenizer files, chat template, generation settings and remote-code `*.py` files.
//!
//! # What a checkpoint holds
//!
//! Every checkpoint holds the model, the f32 masters rounded to `save_dtype` (what users load),
//! and [`TRAINER_STATE`] (the step; the data order and the noise are functions of the seed and
//! the step). The run's newest checkpoint is also resumable: [`OPTIMIZER_STATE`] holds what an
//! exact resume needs and nothing more:
//! - the f32 masters, unless the model is saved in f32 (then the model's weights are the
//!   masters, read from there on resume, and not written twice);
//! - AdamW's two moments, unless the run resets them before every update (the BiC-RL presets'
//!   fresh AdamW per step, [`super::settings::Settings::resets_moments`]): a resume then starts
//!   from a fresh AdamW, as the next step would anyway.
//!
//! Bytes per checkpoint for P parameters (small files aside; P = 2.03e9 for SDAR-1.7B, 4.41e9
//! for 4B, 8.19e9 for 8B):
//!
//! | checkpoint                      | bf16 (default)   | f32        | 1.7B / 4B / 8B (bf16) |
//! |---------------------------------|------------------|------------|------------------------|
//! | newest, SFT (moments kept)      | 2P + 4P + 8P = 14P | 4P + 8P = 12P | 28.4 / 61.8 / 114.7 GB |
//! | newest, RL presets (no moments) | 2P + 4P = 6P     | 4P         | 12.2 / 26.5 / 49.1 GB  |
//! | older kept, and `final/`        | 2P               | 4P         | 4.1 / 8.8 / 16.4 GB    |
//!
//! Kept: the newest checkpoint (resumable) and every `save_steps`-th one before it, as a model
//! only (its optimizer state removed once a newer checkpoint is complete), the newest
//! `save_total_limit` of them ([`Checkpointer::prune`]). While a checkpoint is written the one
//! before it still exists, so a run needs room for two newest checkpoints besides the kept
//! ones; before writing, the free space is checked against the checkpoint's size, and a
//! checkpoint that will not fit fails the run with what to do, before anything is written or
//! removed.
//!
//! # Writing in the background
//!
//! A save copies the state ([`crate::optim::OptimizerSnapshot`], the only time the training
//! waits): on a CUDA device with room for it, into device memory (milliseconds), else to host
//! memory (through a page-locked staging buffer, `crate::readback`). A background thread reads
//! a device copy back (the same way: the device's copy engine is busy for well under a second,
//! not for the seconds of a pageable read the next step's own reads would queue behind) and
//! writes it while the next step runs ([`CheckpointWriter`]): at most one write is in flight
//! (the next save waits for it; in a run that saves after every step, a save between kept
//! ones is skipped instead, [`SkippedCheckpoint`]), the run's end waits for the last one, and
//! a failed write fails the run at its next save or at its end. A checkpoint folder is written
//! whole under a temporary name in the output folder and then renamed: a folder named
//! `checkpoint-STEP` or `final` is always complete, whenever the process was killed, and a
//! crash mid-write leaves the previous checkpoint as it was.

use super::settings::{CheckpointConfig, ModelConfig, SaveDType};
use crate::dist::Collective;
use crate::metrics::MetricsLog;
use crate::optim::{OptimizerSnapshot, SnapshotPlace};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Tensor};
use dice_model::shards::{
    is_atomic_temporary, write_atomically, write_weights, IndexFile, StoredDType, StoredTensor,
};
use dice_model::SdarConfig;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// The trainer's state in a checkpoint.
pub const TRAINER_STATE: &str = "trainer_state.json";
/// The optimizer's state in a resumable checkpoint ([`OptimizerSnapshot::save_state`]).
pub const OPTIMIZER_STATE: &str = "optimizer.safetensors";
/// The folder of the finished run's model.
pub const FINAL: &str = "final";
const PREFIX: &str = "checkpoint-";
const PARTIAL: &str = ".partial-";

/// Elements converted and copied to the host at a time while weights are written.
const CHUNK_ELEMENTS: usize = 1 << 24;

/// Room a checkpoint needs beside its tensors: safetensors headers, config, tokenizer files
/// (Qwen's tokenizer.json is 11 MB), remote code.
const FILES_BESIDE_TENSORS: u64 = 64 << 20;

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

/// Whether the checkpoint folder `dir` holds what a run resumes from (the run's newest
/// checkpoint does; older kept ones are models only).
pub fn is_resumable(dir: &Path) -> bool {
    dir.join(TRAINER_STATE).is_file() && dir.join(OPTIMIZER_STATE).is_file()
}

/// The complete checkpoints of an output folder with their steps, oldest first, resumable or
/// not.
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
        if dir.join(TRAINER_STATE).is_file() {
            found.push((step, dir));
        }
    }
    found.sort();
    Ok(found)
}

/// The newest checkpoint of an output folder a run can resume from.
pub fn newest_resumable(out: &Path) -> Result<Option<PathBuf>> {
    Ok(checkpoints(out)?
        .into_iter()
        .rev()
        .map(|(_, dir)| dir)
        .find(|dir| is_resumable(dir)))
}

/// One folder to write: the state copied at the save, with what it records.
pub struct CheckpointSave {
    /// The folder's name in the output folder (`checkpoint-STEP`, `final`).
    pub name: String,
    pub snapshot: OptimizerSnapshot,
    pub state: TrainerState,
    /// Whether the folder gets the optimizer state (and older checkpoints are pruned after it).
    pub resumable: bool,
}

/// The free bytes of the file system holding a path, for an unprivileged writer.
pub type FreeBytes = fn(&Path) -> std::io::Result<u64>;

/// The free bytes of the file system of `path` (`statvfs`: blocks available to unprivileged
/// users times the fragment size).
#[allow(unsafe_code)] // statvfs fills a plain struct
#[allow(clippy::useless_conversion)] // the fields' widths differ between platforms
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `path` is a valid C string and `stats` a properly sized, writable statvfs.
    let mut stats: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(path.as_ptr(), &mut stats) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(u64::from(stats.f_bavail) * u64::from(stats.f_frsize))
}

/// Writes the checkpoints of one run.
#[derive(Clone)]
pub struct Checkpointer {
    out: PathBuf,
    /// The base model folder, whose config.json and `*.py` files every checkpoint carries.
    base_model: PathBuf,
    /// The folder whose tokenizer files every checkpoint carries.
    tokenizer: PathBuf,
    model_config: SdarConfig,
    save_dtype: SaveDType,
    max_shard_bytes: u64,
    /// Every this many steps a checkpoint is kept (as a model only once a newer one exists).
    save_steps: u64,
    /// Checkpoints kept, the newest; all when `None`.
    save_total_limit: Option<usize>,
    /// What the disk guard reads the free space with (a seam for tests).
    free_bytes: FreeBytes,
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
            save_steps: settings.save_steps,
            save_total_limit: settings.save_total_limit,
            free_bytes,
        }
    }

    /// The same checkpointer reading the free space with `free` instead of `statvfs`.
    pub fn with_free_bytes(self, free: FreeBytes) -> Self {
        Self {
            free_bytes: free,
            ..self
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

    /// The bytes `save` will take on disk: the model in `save_dtype`, the optimizer state of a
    /// resumable folder ([`OptimizerSnapshot::state_bytes`]), and room for the small files.
    pub fn expected_bytes(&self, save: &CheckpointSave) -> u64 {
        let model = save.snapshot.parameters() * self.stored_dtype().size_in_bytes();
        let state = if save.resumable {
            save.snapshot.state_bytes(self.writes_masters())
        } else {
            0
        };
        model + state + FILES_BESIDE_TENSORS
    }

    /// Fails, before anything is written or removed, when the output folder's file system has
    /// less room than `save` needs.
    pub fn check_free_space(&self, save: &CheckpointSave) -> Result<()> {
        let needed = self.expected_bytes(save);
        let free = (self.free_bytes)(&self.out)
            .with_context(|| format!("cannot read the free space of {}", self.out.display()))?;
        if free < needed {
            bail!(
                "no room for {name}: it needs {needed} bytes ({:.1} GB) and the file system of {out} \
                 has {free} bytes ({:.1} GB) free; free some space, keep fewer checkpoints \
                 (--save-total-limit, a larger --save-steps), or write to another --out \
                 (the run resumes from its newest checkpoint there)",
                needed as f64 / 1e9,
                free as f64 / 1e9,
                name = save.name,
                out = self.out.display(),
            );
        }
        Ok(())
    }

    /// Whether the optimizer state holds the masters: not when the model is saved in f32,
    /// whose weights are then the masters.
    fn writes_masters(&self) -> bool {
        self.save_dtype != SaveDType::F32
    }

    fn stored_dtype(&self) -> StoredDType {
        match self.save_dtype {
            SaveDType::Bf16 => StoredDType::BF16,
            SaveDType::F32 => StoredDType::F32,
        }
    }

    /// Writes `save` as the folder of its name in the output folder (replacing a folder of
    /// that name) and, when it is resumable, prunes the older checkpoints; returns the folder's
    /// bytes.
    pub fn write(&self, save: &CheckpointSave) -> Result<u64> {
        let name = &save.name;
        let target = self.out.join(name);
        let partial = self
            .out
            .join(format!("{PARTIAL}{name}-{}", std::process::id()));
        if partial.exists() {
            std::fs::remove_dir_all(&partial)?;
        }
        let written = self.write_files(&partial, save);
        if written.is_err() {
            // What was written of it would only fill the disk (a full disk is the likely cause).
            let _ = std::fs::remove_dir_all(&partial);
        }
        let bytes = written?;
        if target.exists() {
            self.discard(&target)?;
        }
        std::fs::rename(&partial, &target)
            .with_context(|| format!("cannot move the checkpoint into {}", target.display()))?;
        std::fs::File::open(&self.out)
            .and_then(|dir| dir.sync_all())
            .with_context(|| format!("cannot sync {}", self.out.display()))?;
        tracing::info!("saved {}", target.display());
        if save.resumable {
            self.prune(save.state.step)?;
        }
        Ok(bytes)
    }

    /// The files of `save` in the new folder `dir`; returns their bytes.
    fn write_files(&self, dir: &Path, save: &CheckpointSave) -> Result<u64> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        self.write_model(dir, &save.snapshot)?;
        if save.resumable {
            save.snapshot
                .save_state(&dir.join(OPTIMIZER_STATE), self.writes_masters())?;
        }
        write_atomically(&dir.join(TRAINER_STATE), |w| {
            serde_json::to_writer_pretty(&mut *w, &save.state)?;
            writeln!(w)?;
            Ok(())
        })?;
        folder_bytes(dir)
    }

    /// After the resumable checkpoint of `step` is complete: each older checkpoint is kept as
    /// a model only (its optimizer state removed) when its step is a multiple of `save_steps`,
    /// else removed; then the oldest beyond `save_total_limit` are removed. The newest one, the
    /// run's to resume from, is always kept.
    pub fn prune(&self, step: u64) -> Result<()> {
        let all = checkpoints(&self.out)?;
        let mut kept = Vec::new();
        for (older, dir) in all {
            if older == step {
                continue;
            }
            if older > step {
                // From a later run this one was resumed before; the limit alone rules them.
                kept.push(dir);
            } else if older.is_multiple_of(self.save_steps) {
                let state = dir.join(OPTIMIZER_STATE);
                if state.exists() {
                    std::fs::remove_file(&state)
                        .with_context(|| format!("cannot remove {}", state.display()))?;
                }
                kept.push(dir);
            } else {
                self.discard(&dir)?;
            }
        }
        let Some(limit) = self.save_total_limit else {
            return Ok(());
        };
        // The limit counts the newest checkpoint too.
        let beyond = (kept.len() + 1).saturating_sub(limit);
        for dir in &kept[..beyond.min(kept.len())] {
            self.discard(dir)?;
        }
        Ok(())
    }

    /// Removes a complete folder, renamed first, so that a kill meanwhile leaves no folder
    /// under a checkpoint's name that is not complete.
    fn discard(&self, dir: &Path) -> Result<()> {
        let name = dir
            .file_name()
            .map_or_else(Default::default, |n| n.to_string_lossy());
        let aside = self
            .out
            .join(format!("{PARTIAL}removed-{name}-{}", std::process::id()));
        std::fs::rename(dir, &aside)
            .with_context(|| format!("cannot move {} aside", dir.display()))?;
        std::fs::remove_dir_all(&aside)
            .with_context(|| format!("cannot remove {}", aside.display()))
    }

    /// The model files of a checkpoint: weights, config.json, tokenizer and remote code.
    fn write_model(&self, dir: &Path, snapshot: &OptimizerSnapshot) -> Result<()> {
        let dtype = self.stored_dtype();
        let masters: HashMap<&str, &Tensor> = snapshot.masters().collect();
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

/// Bytes of the files in `dir`.
fn folder_bytes(dir: &Path) -> Result<u64> {
    let mut bytes = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))? {
        bytes += entry?.metadata()?.len();
    }
    Ok(bytes)
}

/// A checkpoint's line in `metrics.jsonl`, written once its folder is complete.
#[derive(Debug, Clone, Serialize)]
pub struct CheckpointMetrics {
    /// The step whose state it holds.
    pub step: u64,
    /// The folder (`checkpoint-STEP`, `final`).
    pub checkpoint: String,
    /// Bytes of its files.
    pub checkpoint_bytes: u64,
    /// Seconds the training waited for the save: for the write before it to finish, and to
    /// copy the state.
    pub seconds_checkpoint: f64,
    /// Seconds the background write took (with reading a device copy back), while the
    /// training went on.
    pub seconds_checkpoint_write: f64,
    /// Where the state was copied: `device` (read back by the writer) or `host`.
    pub checkpoint_snapshot: SnapshotPlace,
}

/// A resumable checkpoint not written because the one before it was still being written
/// ([`super::Run`] skips such saves between kept checkpoints): its line in `metrics.jsonl`.
#[derive(Debug, Clone, Serialize)]
pub struct SkippedCheckpoint {
    /// The step whose state was not saved.
    pub step: u64,
    /// The folder that was not written (`checkpoint-STEP`).
    pub checkpoint: String,
    /// Why: the folder whose write was still in flight.
    pub checkpoint_skipped: String,
}

/// Writes a run's checkpoints in a background thread, one at a time.
pub struct CheckpointWriter {
    checkpointer: Arc<Checkpointer>,
    in_flight: Option<InFlight>,
}

/// The write in progress.
struct InFlight {
    name: String,
    step: u64,
    seconds_blocked: f64,
    snapshot: SnapshotPlace,
    /// The folder's bytes and the write's seconds.
    handle: JoinHandle<Result<(u64, f64)>>,
}

impl CheckpointWriter {
    pub fn new(checkpointer: Checkpointer) -> Self {
        Self {
            checkpointer: Arc::new(checkpointer),
            in_flight: None,
        }
    }

    /// The folder whose write is still in progress, if any.
    pub fn writing(&self) -> Option<&str> {
        self.in_flight
            .as_ref()
            .filter(|write| !write.handle.is_finished())
            .map(|write| write.name.as_str())
    }

    /// Waits for the write in flight, if any: its line, or its error.
    pub fn wait(&mut self) -> Result<Option<CheckpointMetrics>> {
        let Some(write) = self.in_flight.take() else {
            return Ok(None);
        };
        let joined = write.handle.join().map_err(|_| {
            anyhow!(
                "writing {} failed (its writer panicked); the run resumes from the checkpoint \
                 before it",
                write.name
            )
        })?;
        let (bytes, seconds) = joined.with_context(|| format!("cannot write {}", write.name))?;
        Ok(Some(CheckpointMetrics {
            step: write.step,
            checkpoint: write.name,
            checkpoint_bytes: bytes,
            seconds_checkpoint: write.seconds_blocked,
            seconds_checkpoint_write: seconds,
            checkpoint_snapshot: write.snapshot,
        }))
    }

    /// Starts writing `save` in the background, once the disk guard lets it; the save began at
    /// `started` (the time until now is what the training waited for it). The caller has
    /// waited for the write before it.
    pub fn start(&mut self, save: CheckpointSave, started: Instant) -> Result<()> {
        assert!(
            self.in_flight.is_none(),
            "a checkpoint is written while another is in flight"
        );
        self.checkpointer.check_free_space(&save)?;
        let checkpointer = Arc::clone(&self.checkpointer);
        let (name, step) = (save.name.clone(), save.state.step);
        let snapshot = save.snapshot.place();
        let handle = std::thread::Builder::new()
            .name("checkpoint-writer".into())
            .spawn(move || {
                let writing = Instant::now();
                // Read back first, so that a device copy holds device memory no longer.
                let save = CheckpointSave {
                    snapshot: save.snapshot.into_host()?,
                    ..save
                };
                let bytes = checkpointer.write(&save)?;
                Ok((bytes, writing.elapsed().as_secs_f64()))
            })
            .context("cannot start the checkpoint writer thread")?;
        self.in_flight = Some(InFlight {
            name,
            step,
            seconds_blocked: started.elapsed().as_secs_f64(),
            snapshot,
            handle,
        });
        Ok(())
    }
}

impl Drop for CheckpointWriter {
    /// A run that ends by an error still completes the checkpoint it was writing.
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            tracing::error!("{e:#}");
        }
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
