//! What every training run has, SFT's and RL's alike, so that a change to starting, resuming,
//! saving or reporting a run is made once: the settings they share ([`settings`]), the model
//! and its optimizer on this rank's device among the ranks of the run, the resume checks
//! (a checkpoint's settings and data must be the run's), checkpoints ([`checkpoint`]), the
//! metrics log and the progress loop that runs a trainer's steps ([`Run::train`], the trainer
//! saying what a step, an evaluation and a metrics line are through [`Steps`]).
//!
//! A run's output folder: `checkpoint-STEP/` (the newest resumable, older kept ones models
//! only: [`checkpoint`]), `final/`, `config.toml` (the resolved settings), `metrics.jsonl` and
//! `metrics.html`. Rank 0 alone writes it; checkpoints are written in the background while the
//! next steps run.

pub mod checkpoint;
pub mod settings;

use crate::dist::zero::{DataParallelAdamW, StepSettings};
use crate::dist::{for_device, rank_device, Collective};
use crate::metrics::MetricsLog;
use anyhow::{bail, ensure, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use checkpoint::{
    checkpoint_name, is_resumable, newest_resumable, CheckpointSave, CheckpointWriter,
    Checkpointer, SkippedCheckpoint, TrainerState, FINAL, OPTIMIZER_STATE,
};
use dice_model::Sdar;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use settings::{resume_key_difference, Settings};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Where a run starts from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// The newest complete checkpoint in the output folder, or the start model when there is
    /// none.
    Auto,
    /// This checkpoint folder.
    From(PathBuf),
}

/// How a run is carried out (not what it computes).
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The output folder: checkpoints, `final/`, `config.toml`, `metrics.jsonl`,
    /// `metrics.html`.
    pub out: PathBuf,
    pub resume: Resume,
    /// Draw a progress bar on stderr; where stderr is not a terminal (a log file, a batch
    /// job), a plain line instead at the first step, then at most every 30 s, and at the
    /// last.
    pub progress: bool,
    /// Stop after this step as a run killed right after that step's checkpoint would: the
    /// checkpoint written (whatever `save_steps` says), no final model; running again resumes
    /// there (tests of resuming, or a job with a time limit). `None`: run to the end.
    pub stop_after: Option<u64>,
}

/// What a trainer's `train` did.
#[derive(Debug, Clone)]
pub struct TrainSummary<L> {
    /// Steps of the whole run.
    pub total_steps: u64,
    /// The metrics lines of the steps this call ran (none when the run was already complete).
    pub steps: Vec<L>,
    /// The finished model.
    pub final_dir: PathBuf,
}

impl<L> TrainSummary<L> {
    /// Steps this call ran.
    pub fn steps_run(&self) -> u64 {
        self.steps.len() as u64
    }
}

impl<L: StepLine> std::fmt::Display for TrainSummary<L> {
    /// What the run did, in a line for its user.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.steps.last() {
            None => write!(
                f,
                "the run is already complete ({} steps): the model is in {}",
                self.total_steps,
                self.final_dir.display()
            ),
            Some(last) => write!(
                f,
                "ran {} of {} steps (last: {}); the model is in {}",
                self.steps_run(),
                self.total_steps,
                last.describe(),
                self.final_dir.display()
            ),
        }
    }
}

/// A step's line in `metrics.jsonl`, as the run reports it elsewhere too.
pub trait StepLine: Serialize {
    /// A few words on the step for the progress bar, the log (`RUST_LOG=info`) and the
    /// summary ("loss 0.1234 · …").
    fn describe(&self) -> String;

    /// What the user must hear of this step even without `RUST_LOG` (a step that learned
    /// nothing), logged as a warning by rank 0.
    fn note(&self) -> Option<String> {
        None
    }
}

/// What a run's data is, so that a resumed run can tell it is the same: a SHA-256, and what
/// the user must keep the same when it differs.
pub struct DataFingerprint {
    pub sha256: String,
    /// What the hash covers ("its packed rows", "its task file").
    pub covers: &'static str,
    /// How to resume after all ("the same data and packing settings").
    pub keep: &'static str,
}

/// A trainer's part of the progress loop of [`Run::train`].
pub trait Steps {
    /// The trainer's settings.
    type Config: Settings;
    type Line: StepLine;

    /// What the progress bar calls a step ("step", "RL step").
    const STEP_NAME: &'static str;

    /// The command, which titles the metrics page ("dice train sft").
    const COMMAND: &'static str;

    /// Steps of the whole run of `config`.
    fn total_steps(&self, config: &Self::Config) -> u64;

    /// Epochs done after `steps` steps (passes over the training rows or tasks).
    fn epoch(&self, config: &Self::Config, steps: u64) -> f64;

    /// Runs step `run.step() + 1` on this rank; returns its metrics line (the same on every
    /// rank). [`Run::train`] counts the step.
    fn step(&mut self, run: &mut Run<Self::Config>) -> Result<Self::Line>;

    /// Every how many steps the held-out data is evaluated (and at the end); `None` when the
    /// run has none.
    fn eval_steps(&self, config: &Self::Config) -> Option<u64>;

    /// Evaluates the held-out data after step `run.step()` and logs its line.
    fn evaluate(&mut self, run: &mut Run<Self::Config>) -> Result<()>;

    /// Whether a resumable checkpoint follows every step (an RL step is minutes of rollout),
    /// rather than every `save_steps` steps only; either way the older ones are pruned as
    /// [`Checkpointer::prune`] says.
    fn checkpoint_every_step(&self) -> bool;

    /// Draws `metrics.html` from `metrics.jsonl`.
    fn draw_page(&self, metrics: &Path, html: &Path, title: &str) -> Result<()>;
}

/// A run of the settings `C` on this rank: the model it trains and its optimizer on this
/// rank's device, the ranks it trains with, its output folder and the step it stands at.
/// Trainers hold one and add their steps.
pub struct Run<C> {
    config: C,
    pub(crate) options: RunOptions,
    pub(crate) collective: Box<dyn Collective>,
    pub(crate) device: Device,
    pub(crate) dtype: DType,
    pub(crate) model: Sdar,
    /// The model's weights by checkpoint name (the optimizer updates them in place).
    pub(crate) vars: VarMap,
    pub(crate) optimizer: DataParallelAdamW,
    /// Writes the checkpoints in the background (rank 0's are the ones written).
    writer: CheckpointWriter,
    save_steps: u64,
    /// Rank 0's log; other ranks write none.
    metrics: Option<MetricsLog>,
    /// What every checkpoint records and a resumed run must repeat.
    resume_key: serde_json::Value,
    data: DataFingerprint,
    step: u64,
}

impl<C: Settings> Run<C> {
    /// Opens the run of `config` (resolved) on `data` in `options.out`: this rank's device
    /// and collective, the model and the optimizer state of the checkpoint it resumes from
    /// (refused when that checkpoint's settings or data are not these), else the start model
    /// (rank 0's weights on every rank); the output folder prepared.
    pub fn open(
        config: C,
        data: DataFingerprint,
        options: RunOptions,
        collective: Box<dyn Collective>,
    ) -> Result<Self> {
        let parts = config.run_parts();
        let device = rank_device(parts.device)?;
        let collective = for_device(collective, &device)?;
        let world = collective.world_size();
        // The number of ranks sets the rows of an SFT step and the samples of an RL update; a
        // run of one rank records none, as runs did before data parallelism.
        let mut resume_key = config.resume_key();
        if world > 1 {
            resume_key["world_size"] = world.into();
        }
        let resume_from = match &options.resume {
            Resume::From(dir) => Some(dir.clone()),
            Resume::Auto => newest_resumable(&options.out)?,
        };
        let mut step = 0;
        if let Some(dir) = &resume_from {
            ensure!(
                is_resumable(dir),
                "{} holds no resume state (only a run's newest checkpoint keeps it): resume from \
                 the newest checkpoint-STEP of its run, or start a new run from it with --model {}",
                dir.display(),
                dir.display()
            );
            let state = TrainerState::read(dir)?;
            check_resumable(dir, &state, &resume_key, &data)?;
            step = state.step;
        }
        let weights = resume_from.as_deref().unwrap_or(parts.model.dir());
        let dtype = parts.dtype.dtype();
        let (model, vars) = Sdar::load_trainable(weights, dtype, &device)?;
        let mut named: Vec<(String, Var)> = vars
            .data()
            .lock()
            .expect("the model's VarMap is not poisoned")
            .iter()
            .map(|(name, var)| (name.clone(), var.clone()))
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        if world > 1 {
            for (_, var) in &named {
                var.set(&collective.broadcast(var.as_tensor(), 0)?)?;
            }
        }
        let stage = config.zero_stage()?;
        let mut optimizer = DataParallelAdamW::new(
            named,
            parts.optimizer,
            stage,
            parts.optimizer_offload,
            &*collective,
        )?;
        if let Some(dir) = &resume_from {
            optimizer.load_state(&dir.join(OPTIMIZER_STATE))?;
            tracing::info!("resuming from {} after step {step}", dir.display());
        }
        let checkpointer =
            Checkpointer::new(&options.out, parts.model, model.config(), parts.checkpoint);
        let metrics = checkpointer.open_run_folder(&*collective, &config.to_toml()?, step)?;
        let save_steps = parts.checkpoint.save_steps;
        let writer = CheckpointWriter::new(checkpointer);
        Ok(Self {
            config,
            options,
            collective,
            device,
            dtype,
            model,
            vars,
            optimizer,
            writer,
            save_steps,
            metrics,
            resume_key,
            data,
            step,
        })
    }

    /// The resolved settings (what `config.toml` holds).
    pub fn config(&self) -> &C {
        &self.config
    }

    /// Steps done.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The model as it trains.
    pub fn model(&self) -> &Sdar {
        &self.model
    }

    /// f32 moment values this rank's optimizer holds (1/W of them with a sharded state).
    pub fn moment_elements(&self) -> usize {
        self.optimizer.moment_elements()
    }

    /// Runs `steps` to the end of the run: after each step its metrics line, an evaluation of
    /// the held-out data every `eval_steps` steps and at the end, then a checkpoint every
    /// `save_steps` steps and at the end (or after every step, [`Steps::checkpoint_every_step`]);
    /// at the end the finished model in `final/`, and the wait for the last write. A run
    /// already complete does nothing.
    pub fn train<S: Steps<Config = C>>(&mut self, steps: &mut S) -> Result<TrainSummary<S::Line>> {
        let total = steps.total_steps(&self.config);
        let mut summary = TrainSummary {
            total_steps: total,
            steps: Vec::new(),
            final_dir: self.options.out.join(FINAL),
        };
        if self.step >= total && summary.final_dir.join("config.json").is_file() {
            tracing::info!(
                "the run in {} is complete ({total} steps)",
                self.options.out.display()
            );
            return Ok(summary);
        }
        let stop = self.options.stop_after.map_or(total, |s| s.min(total));
        let bar = self.progress_bar(total, S::STEP_NAME);
        let mut plain = (self.options.progress && self.collective.rank() == 0 && bar.is_hidden())
            .then(|| PlainProgress::new(S::STEP_NAME, total));
        while self.step < stop {
            let line = steps.step(self)?;
            self.step += 1;
            bar.set_position(self.step);
            let description = line.describe();
            tracing::info!("{} {}: {description}", S::STEP_NAME, self.step);
            if let Some(plain) = &mut plain {
                plain.step(self.step, self.step == stop, &description);
            }
            bar.set_message(description);
            if let (Some(note), 0) = (line.note(), self.collective.rank()) {
                bar.suspend(|| tracing::warn!("{note}"));
            }
            self.log(&line)?;
            let end = self.step == total;
            if let Some(every) = steps.eval_steps(&self.config) {
                if end || self.step.is_multiple_of(every) {
                    bar.suspend(|| steps.evaluate(self))?;
                }
            }
            // The last step of this call (the run's end, or where it stops) always saves.
            let kept = self.step == stop || self.step.is_multiple_of(self.save_steps);
            if kept || (steps.checkpoint_every_step() && !self.skip_save_while_writing()?) {
                bar.suspend(|| self.save(&checkpoint_name(self.step), true, steps))?;
            }
            summary.steps.push(line);
        }
        bar.finish_and_clear();
        if self.step == total {
            self.save(FINAL, false, steps)?;
        }
        self.finish_writes(steps)?;
        Ok(summary)
    }

    fn progress_bar(&self, total: u64, step_name: &str) -> ProgressBar {
        if !self.options.progress || self.collective.rank() != 0 {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template(&format!(
                "{{elapsed_precise}} [{{bar:30}}] {step_name} {{pos}}/{{len}} · {{msg}} · ETA {{eta}}"
            ))
            .expect("a valid template")
            .progress_chars("=> "),
        );
        bar.set_position(self.step);
        bar
    }

    /// Appends `line` to `metrics.jsonl` (rank 0 only).
    pub(crate) fn log(&mut self, line: &impl Serialize) -> Result<()> {
        match &mut self.metrics {
            Some(log) => log.write(line),
            None => Ok(()),
        }
    }

    /// The optimizer step of this rank's gradients `grads` (see [`DataParallelAdamW::step`]);
    /// returns the gradient norm before clipping. Fails, the weights left as they were, when
    /// the norm is not finite.
    pub(crate) fn update(
        &mut self,
        grads: HashMap<String, Tensor>,
        step: &StepSettings,
    ) -> Result<f32> {
        let norm = self.optimizer.step(grads, step, &*self.collective)?;
        if !norm.is_finite() {
            bail!(
                "step {}: the gradient norm is {norm}; the weights were left as they were. \
                 Lower the learning rate, or resume from the last checkpoint in {}",
                self.step + 1,
                self.options.out.display()
            );
        }
        Ok(norm)
    }

    /// Zero gradients of every weight, for a rank with nothing to learn from in an update the
    /// others take.
    pub(crate) fn zero_grads(&self) -> Result<HashMap<String, Tensor>> {
        self.model
            .config()
            .tensor_shapes()
            .into_iter()
            .map(|(name, shape)| Ok((name, Tensor::zeros(shape, DType::F32, &self.device)?)))
            .collect()
    }

    /// Saves the folder `name` (with the optimizer state when `resumable`): rank 0 waits for
    /// the write before it, copies the state to host memory (every rank takes part in gathering
    /// a sharded state) and starts writing it in the background, then redraws `metrics.html`;
    /// every rank waits for rank 0.
    fn save<S: Steps<Config = C>>(&mut self, name: &str, resumable: bool, steps: &S) -> Result<()> {
        let started = Instant::now();
        if let Some(written) = self.writer.wait()? {
            self.log(&written)?;
        }
        let moments = resumable && !self.config.resets_moments();
        let snapshot = self
            .optimizer
            .snapshot_on_rank0(&*self.collective, moments)?;
        if let Some(snapshot) = snapshot {
            let state = TrainerState {
                step: self.step,
                total_steps: steps.total_steps(&self.config),
                epoch: steps.epoch(&self.config, self.step),
                data_fingerprint: self.data.sha256.clone(),
                resume_key: self.resume_key.clone(),
            };
            let save = CheckpointSave {
                name: name.to_string(),
                snapshot,
                state,
                resumable,
            };
            self.writer.start(save, started)?;
            self.draw_page(steps)?;
        }
        self.collective.barrier()
    }

    /// Whether this step's checkpoint, one between kept ones, is skipped because rank 0 is
    /// still writing the one before it (every rank learns rank 0's answer): it is gone as soon
    /// as the next one is complete, and waiting for the write would stall the run for each
    /// step that is shorter than a write (`metrics.jsonl` gets a line saying so). The newest
    /// complete checkpoint stays the resume point.
    fn skip_save_while_writing(&mut self) -> Result<bool> {
        let writing = self.writer.writing().map(str::to_string);
        let mut busy = [f64::from(u8::from(writing.is_some()))];
        self.collective.all_reduce_sum_f64(&mut busy)?;
        if let Some(in_flight) = writing {
            let line = SkippedCheckpoint {
                step: self.step,
                checkpoint: checkpoint_name(self.step),
                checkpoint_skipped: format!("{in_flight} was still being written"),
            };
            tracing::info!(
                "{}: not saved, {}",
                line.checkpoint,
                line.checkpoint_skipped
            );
            self.log(&line)?;
        }
        Ok(busy[0] > 0.0)
    }

    /// Waits for the last checkpoint's write and logs it (rank 0), then every rank waits for
    /// rank 0: a run ends with its folders complete.
    fn finish_writes<S: Steps<Config = C>>(&mut self, steps: &S) -> Result<()> {
        if let Some(written) = self.writer.wait()? {
            self.log(&written)?;
            self.draw_page(steps)?;
        }
        self.collective.barrier()
    }

    /// Redraws `metrics.html` from `metrics.jsonl` (rank 0).
    fn draw_page<S: Steps<Config = C>>(&self, steps: &S) -> Result<()> {
        if let Some(log) = &self.metrics {
            let out = &self.options.out;
            let title = format!("{} · {}", S::COMMAND, out.display());
            steps.draw_page(log.path(), &out.join("metrics.html"), &title)?;
        }
        Ok(())
    }
}

/// Refuses a checkpoint whose run asked for other settings or other data.
fn check_resumable(
    dir: &Path,
    state: &TrainerState,
    resume_key: &serde_json::Value,
    data: &DataFingerprint,
) -> Result<()> {
    if let Some((key, recorded, asked)) = resume_key_difference(&state.resume_key, resume_key) {
        bail!(
            "{} was trained with {key} = {recorded}, this run asks for {asked}: resume with the \
             same settings (its run's config.toml), or write to another --out",
            dir.display()
        );
    }
    ensure!(
        state.data_fingerprint == data.sha256,
        "{} was trained on other data ({} differ from this run's): resume with {}, or write to \
         another --out",
        dir.display(),
        data.covers,
        data.keep
    );
    Ok(())
}

/// At most this long between two plain progress lines.
const PLAIN_PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// The progress of [`Run::train`] as plain lines on stderr, where no bar can be drawn: what a
/// log of a long run needs to show it is alive and how far it is, without a line per step of
/// a fast run.
struct PlainProgress {
    step_name: &'static str,
    total: u64,
    started: std::time::Instant,
    last: Option<std::time::Instant>,
}

impl PlainProgress {
    fn new(step_name: &'static str, total: u64) -> Self {
        Self {
            step_name,
            total,
            started: std::time::Instant::now(),
            last: None,
        }
    }

    /// Prints step `step`'s line if it is the first, the last, or the last line is
    /// [`PLAIN_PROGRESS_EVERY`] old.
    fn step(&mut self, step: u64, last: bool, description: &str) {
        let due = self
            .last
            .is_none_or(|at| at.elapsed() >= PLAIN_PROGRESS_EVERY);
        if due || last {
            eprintln!(
                "{} {step}/{} · {description} · {:.0} s",
                self.step_name,
                self.total,
                self.started.elapsed().as_secs_f64()
            );
            self.last = Some(std::time::Instant::now());
        }
    }
}
