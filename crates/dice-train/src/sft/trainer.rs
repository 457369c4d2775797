//! The SFT training loop: data, model, optimizer, schedule, checkpoints, metrics and the
//! collective put together. One optimizer step: take the step's packed rows
//! ([`DataPlan::step_rows`]), noise each with the generator of (seed, step, row), run the
//! checkpointed loss and gradients one micro-batch of rows at a time and sum the gradients,
//! sum them over the ranks, clip their global norm, and let AdamW apply the schedule's
//! learning rate.
//!
//! Data parallelism: the step's rows are shared out among the ranks in contiguous runs, and
//! the gradient of a step is the sum over all its micro-batches whichever rank ran them, as
//! the single-rank accumulation defines it. A run of W ranks with A micro-batches each thus
//! takes the update of one rank with W·A micro-batches: bit for bit when each rank runs one
//! micro-batch (the ranks' sums are added in rank order, as one rank accumulates), otherwise
//! up to the rounding of a regrouped f32 sum. (DeepSpeed divides by the world size instead;
//! with the reference's clipping at 1.0 both give the same clipped gradient whenever the
//! norm exceeds 1.) With `zero_stage` 1 or 2 each rank keeps the optimizer state of one shard
//! of the parameters only ([`crate::dist::zero`]), for the same update.

use super::config::SftConfig;
use super::plan::{DataPlan, RunLength};
use crate::checkpoint::{
    checkpoint_name, checkpoints, Checkpointer, TrainerState, FINAL, OPTIMIZER_STATE,
};
use crate::data::{model_block_length, select_datasets, CleanRow, PackedDataset, Qwen3Encoder};
use crate::dist::zero::{DataParallelAdamW, ZeroStage};
use crate::dist::{contiguous_share, Collective};
use crate::metrics::{
    process_peak_rss, sft_step_flops, write_html, EvalMetrics, MetricsLog, StepMetrics,
};
use crate::noise::Noiser;
use crate::optim::GradientAccumulator;
use crate::schedule::LrSchedule;
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use dice_model::memory::PeakMemory;
use dice_model::{PackedRow, Sdar, SdarTokenizer, TwoStreamBatch};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The step the held-out rows are noised as: the same draw at every evaluation, and never a
/// training step's.
const EVAL_NOISE_STEP: u64 = u64::MAX;

/// Where a run starts from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// The newest complete checkpoint in the output folder, or the base model when there is
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
    /// Draw a progress bar on stderr (hidden when stderr is not a terminal).
    pub progress: bool,
}

/// What [`SftTrainer::train`] did.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// Steps taken by this call (0 when the run was already complete).
    pub steps_run: u64,
    /// Steps of the whole run.
    pub total_steps: u64,
    /// The loss of the last step taken by this call.
    pub last_loss: Option<f64>,
    /// The finished model.
    pub final_dir: PathBuf,
}

/// An SFT run, set up and ready to train.
pub struct SftTrainer {
    config: SftConfig,
    options: RunOptions,
    collective: Box<dyn Collective>,
    device: Device,
    model: Sdar,
    optimizer: DataParallelAdamW,
    schedule: LrSchedule,
    data: PackedDataset,
    plan: DataPlan,
    held_out: Vec<CleanRow>,
    noiser: Noiser,
    checkpointer: Checkpointer,
    /// Rank 0's log; other ranks write none.
    metrics: Option<MetricsLog>,
    data_fingerprint: String,
    step: u64,
}

impl SftTrainer {
    /// Resolves `config`, packs the data, loads the model (from the checkpoint it resumes
    /// from, else the base model) and the optimizer state, and prepares the output folder.
    pub fn new(
        config: SftConfig,
        options: RunOptions,
        collective: Box<dyn Collective>,
    ) -> Result<Self> {
        let config = config.resolve()?;
        let training = &config.training;
        let device = crate::dist::rank_device(training.device)?;
        let dtype = training.compute_dtype().dtype();
        let collective = crate::dist::for_device(collective, &device)?;

        let tokenizer = SdarTokenizer::from_dir(config.tokenizer_dir())?;
        let encoder = Qwen3Encoder::new(&tokenizer)?;
        let pack = config.pack_options(model_block_length(config.model_dir())?);
        let datasets = select_datasets(
            &config.data.files,
            config.data.dataset_info.as_deref(),
            &config.data.datasets,
        )?;
        let data = PackedDataset::build(&datasets, &encoder, &pack)?;
        tracing::info!("training data:\n{}", data.stats());
        let world = collective.world_size();
        let rows_per_step =
            training.per_device_train_batch_size * training.gradient_accumulation_steps * world;
        let length = match training.max_steps {
            Some(steps) => RunLength::Steps(steps),
            None => RunLength::Epochs(training.epochs),
        };
        let plan = DataPlan::new(
            data.len(),
            config.data.val_ratio,
            training.seed,
            rows_per_step,
            length,
        )?;
        let held_out = if config.data.val_files.is_empty() {
            plan.held_out_rows().iter().map(|&r| data.row(r)).collect()
        } else {
            let files = select_datasets(&config.data.val_files, None, &[])?;
            let val = PackedDataset::build(&files, &encoder, &pack)?;
            tracing::info!("validation data:\n{}", val.stats());
            (0..val.len()).map(|r| val.row(r)).collect()
        };
        let data_fingerprint = fingerprint(&data, plan.train_rows());

        let resume_from = match &options.resume {
            Resume::From(dir) => Some(dir.clone()),
            Resume::Auto => checkpoints(&options.out)?.pop().map(|(_, dir)| dir),
        };
        let mut step = 0;
        if let Some(dir) = &resume_from {
            let state = TrainerState::read(dir)?;
            check_resumable(dir, &state, &run_key(&config, world), &data_fingerprint)?;
            step = state.step;
        }
        let weights = resume_from.as_deref().unwrap_or(config.model_dir());
        let (model, varmap) = Sdar::load_trainable(weights, dtype, &device)?;
        let vars: Vec<(String, Var)> = varmap
            .data()
            .lock()
            .expect("the model's VarMap is not poisoned")
            .iter()
            .map(|(name, var)| (name.clone(), var.clone()))
            .collect();
        if world > 1 {
            let mut names: Vec<&(String, Var)> = vars.iter().collect();
            names.sort_by(|a, b| a.0.cmp(&b.0));
            for (_, var) in names {
                var.set(&collective.broadcast(var.as_tensor(), 0)?)?;
            }
        }
        let stage = ZeroStage::from_number(training.zero_stage)?;
        let mut optimizer = DataParallelAdamW::new(vars, config.optimizer, stage, &*collective)?;
        if let Some(dir) = &resume_from {
            optimizer.load_state(&dir.join(OPTIMIZER_STATE))?;
            ensure!(
                optimizer.steps() == step,
                "{}: the optimizer state has {} steps, the trainer state {step}",
                dir.display(),
                optimizer.steps()
            );
            tracing::info!("resuming from {} at step {step}", dir.display());
        }
        let schedule = LrSchedule::with_warmup_ratio(
            training.lr_scheduler,
            training.learning_rate,
            training.warmup_ratio,
            plan.total_steps(),
        );
        let noiser = Noiser::new(training.seed, model.config().mask_token_id);
        let checkpointer = Checkpointer {
            out: options.out.clone(),
            base_model: config.model_dir().to_path_buf(),
            tokenizer: config.tokenizer_dir().to_path_buf(),
            model_config: model.config().clone(),
            save_dtype: config.checkpoint.save_dtype,
            max_shard_bytes: config.checkpoint.max_shard_bytes,
            save_total_limit: config.checkpoint.save_total_limit,
        };

        let metrics = checkpointer.open_run_folder(&*collective, &config.to_toml()?, step)?;
        Ok(Self {
            config,
            options,
            collective,
            device,
            model,
            optimizer,
            schedule,
            data,
            plan,
            held_out,
            noiser,
            checkpointer,
            metrics,
            data_fingerprint,
            step,
        })
    }

    /// The resolved settings (what `config.toml` holds).
    pub fn config(&self) -> &SftConfig {
        &self.config
    }

    /// The model as it trains.
    pub fn model(&self) -> &Sdar {
        &self.model
    }

    /// Optimizer steps done.
    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn plan(&self) -> &DataPlan {
        &self.plan
    }

    /// f32 moment values this rank's optimizer holds (1/W of them with a sharded state).
    pub fn moment_elements(&self) -> usize {
        self.optimizer.moment_elements()
    }

    /// Trains to the end of the run: a checkpoint every `save_steps` steps and at the end, an
    /// evaluation of the held-out rows every `eval_steps` steps and at the end, then the
    /// finished model in `final/`.
    pub fn train(&mut self) -> Result<TrainSummary> {
        let total = self.plan.total_steps();
        let final_dir = self.options.out.join(FINAL);
        let mut summary = TrainSummary {
            steps_run: 0,
            total_steps: total,
            last_loss: None,
            final_dir: final_dir.clone(),
        };
        if self.step >= total && final_dir.join("config.json").is_file() {
            tracing::info!(
                "the run in {} is complete ({total} steps)",
                self.options.out.display()
            );
            return Ok(summary);
        }
        let bar = self.progress_bar(total);
        while self.step < total {
            let line = self.train_step()?;
            summary.steps_run += 1;
            summary.last_loss = Some(line.loss);
            bar.set_position(self.step);
            bar.set_message(format!(
                "loss {:.4} · {:.0} tokens/s",
                line.loss, line.tokens_per_s
            ));
            tracing::info!(
                step = line.step,
                loss = line.loss,
                lr = line.lr,
                grad_norm = line.grad_norm,
                tokens_per_s = line.tokens_per_s,
                "train"
            );
            if let Some(log) = &mut self.metrics {
                log.write(&line)?;
            }
            let end = self.step == total;
            if !self.held_out.is_empty()
                && (end || self.step.is_multiple_of(self.config.eval.eval_steps))
            {
                self.evaluate()?;
            }
            if end || self.step.is_multiple_of(self.config.checkpoint.save_steps) {
                let name = checkpoint_name(self.step);
                bar.suspend(|| self.save(&name, true))?;
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
                "{elapsed_precise} [{bar:30}] step {pos}/{len} · {msg} · ETA {eta}",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        bar.set_position(self.step);
        bar
    }

    /// One optimizer step; returns its metrics line.
    fn train_step(&mut self) -> Result<StepMetrics> {
        let started = Instant::now();
        let peak = PeakMemory::start(&self.device)?;
        let step = self.step;
        let training = &self.config.training;
        let rows = self.plan.step_rows(step);
        let world = self.collective.world_size();
        let mine: Vec<usize> =
            contiguous_share(rows.len(), self.collective.rank(), world).collect();

        let mut accumulator = GradientAccumulator::default();
        let (mut loss_sum, mut tokens, mut flops) = (0f64, 0usize, 0f64);
        for micro in mine.chunks(training.per_device_train_batch_size) {
            let noised: Vec<PackedRow> = micro
                .iter()
                .map(|&k| self.noiser.noise(self.data.row(rows[k]), step, k as u64))
                .collect();
            let batch = TwoStreamBatch::new(&noised)?;
            let result = self
                .model
                .sft_loss_and_grads(&batch, training.chunk_rows)
                .with_context(|| format!("step {}: the loss and gradients failed", step + 1))?;
            loss_sum += f64::from(result.loss);
            tokens += noised.iter().map(|r| r.input_ids.len()).sum::<usize>();
            flops += sft_step_flops(
                self.model.config(),
                batch.sample_lens(),
                batch.selected().len(),
            );
            accumulator.add(result.grads)?;
        }
        let micro_batches = accumulator.micro_batches();
        let grads = if micro_batches == 0 {
            self.zero_grads()?
        } else {
            accumulator.take()
        };
        let mut totals = [loss_sum, micro_batches as f64, tokens as f64, flops];
        self.collective.all_reduce_sum_f64(&mut totals)?;
        let [loss_sum, micro_batches, tokens, flops] = totals;
        let lr = self.schedule.lr(step);
        let grad_norm =
            self.optimizer
                .step(grads, training.max_grad_norm, lr, &*self.collective)?;
        if !grad_norm.is_finite() {
            bail!(
                "step {}: the gradient norm is {grad_norm}; the weights were left as they were. \
                 Lower the learning rate, or resume from the last checkpoint in {}",
                step + 1,
                self.options.out.display()
            );
        }
        self.step += 1;
        self.device.synchronize()?;

        let seconds = started.elapsed().as_secs_f64();
        let peak_flops = self.config.metrics.peak_tflops.map(|t| t * 1e12);
        Ok(StepMetrics {
            step: self.step,
            epoch: self.plan.epoch(self.step),
            loss: loss_sum / micro_batches.max(1.0),
            lr,
            grad_norm: f64::from(grad_norm),
            tokens: tokens as u64,
            tokens_per_s: tokens / seconds,
            tflops: flops / seconds / 1e12,
            mfu: peak_flops.map(|peak| flops / (seconds * peak * world as f64)),
            memory: peak.finish().or_else(process_peak_rss),
            step_time_s: seconds,
        })
    }

    /// Zero gradients, for a rank without rows in the last step of an epoch.
    fn zero_grads(&self) -> Result<HashMap<String, Tensor>> {
        self.model
            .config()
            .tensor_shapes()
            .into_iter()
            .map(|(name, shape)| Ok((name, Tensor::zeros(shape, DType::F32, &self.device)?)))
            .collect()
    }

    /// The loss of the held-out rows, logged as an eval line.
    fn evaluate(&mut self) -> Result<()> {
        let training = &self.config.training;
        let mine = contiguous_share(
            self.held_out.len(),
            self.collective.rank(),
            self.collective.world_size(),
        );
        let mut totals = [0f32; 2];
        for micro in mine
            .collect::<Vec<_>>()
            .chunks(training.per_device_train_batch_size)
        {
            let noised: Vec<PackedRow> = micro
                .iter()
                .map(|&k| {
                    self.noiser
                        .noise(self.held_out[k].clone(), EVAL_NOISE_STEP, k as u64)
                })
                .collect();
            let batch = TwoStreamBatch::new(&noised)?;
            totals[0] += self.model.sft_loss_value(&batch, training.chunk_rows)?;
            totals[1] += 1.0;
        }
        self.collective.all_reduce_sum_f32(&mut totals)?;
        let line = EvalMetrics {
            step: self.step,
            epoch: self.plan.epoch(self.step),
            eval_loss: f64::from(totals[0]) / f64::from(totals[1]).max(1.0),
            eval_rows: self.held_out.len(),
        };
        tracing::info!(step = line.step, eval_loss = line.eval_loss, "eval");
        if let Some(log) = &mut self.metrics {
            log.write(&line)?;
        }
        Ok(())
    }

    /// Rank 0 writes the folder `name` (the optimizer state too when `resumable`), prunes old
    /// checkpoints and refreshes the HTML page; every rank takes part in gathering a sharded
    /// optimizer state and waits for rank 0.
    fn save(&self, name: &str, resumable: bool) -> Result<()> {
        self.optimizer
            .with_whole_state_on_rank0(&*self.collective, |optimizer| {
                let state = TrainerState {
                    step: self.step,
                    total_steps: self.plan.total_steps(),
                    epoch: self.plan.epoch(self.step),
                    data_fingerprint: self.data_fingerprint.clone(),
                    resume_key: run_key(&self.config, self.collective.world_size()),
                };
                let dir = self.checkpointer.save(name, optimizer, &state, resumable)?;
                tracing::info!("saved {}", dir.display());
                self.checkpointer.prune()?;
                if let Some(log) = &self.metrics {
                    let title = format!("dice train sft: {}", self.options.out.display());
                    write_html(log.path(), &self.options.out.join("metrics.html"), &title)?;
                }
                Ok(())
            })?;
        self.collective.barrier()
    }
}

/// SHA-256 of the training rows, so a resumed run can tell that its data is the same.
fn fingerprint(data: &PackedDataset, rows: &[usize]) -> String {
    let mut hash = Sha256::new();
    for &r in rows {
        let row = data.row(r);
        hash.update((row.input_ids.len() as u64).to_le_bytes());
        for ((&id, &label), &position) in
            row.input_ids.iter().zip(&row.labels).zip(&row.position_ids)
        {
            hash.update(id.to_le_bytes());
            hash.update(label.to_le_bytes());
            hash.update(position.to_le_bytes());
        }
    }
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The settings a checkpoint records and a resumed run must repeat: the config's, and the
/// number of ranks when there are several (it sets the rows of a step; a run of one rank
/// records none, as runs did before data parallelism).
fn run_key(config: &SftConfig, world_size: usize) -> serde_json::Value {
    let mut key = config.resume_key();
    if world_size > 1 {
        key["world_size"] = world_size.into();
    }
    key
}

/// Refuses a checkpoint whose run asked for other settings or other data.
fn check_resumable(
    dir: &Path,
    state: &TrainerState,
    run_key: &serde_json::Value,
    data_fingerprint: &str,
) -> Result<()> {
    if let Some((key, recorded, asked)) =
        super::config::resume_key_difference(&state.resume_key, run_key)
    {
        bail!(
            "{} was trained with {key} = {recorded}, this run asks for {asked}: resume with the \
             same settings (its run's config.toml), or write to another --out",
            dir.display()
        );
    }
    ensure!(
        state.data_fingerprint == data_fingerprint,
        "{} was trained on other data (its packed rows differ from these): resume with the same \
         data and packing settings, or write to another --out",
        dir.display()
    );
    Ok(())
}
