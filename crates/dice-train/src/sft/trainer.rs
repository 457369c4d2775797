//! The SFT training loop's steps (the loop itself, checkpoints, resuming and metrics are the
//! run's, [`crate::run`]). One optimizer step: take the step's packed rows
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
use super::packing::{pack, training_datasets};
use super::plan::{DataPlan, RunLength};
use crate::data::{select_datasets, CleanRow, PackedDataset};
use crate::dist::zero::StepSettings;
use crate::dist::{contiguous_share, Collective};
use crate::metrics::{process_peak_rss, sft_step_flops, write_html, EvalMetrics, StepMetrics};
use crate::noise::Noiser;
use crate::optim::GradientAccumulator;
use crate::run::{DataFingerprint, Run, RunOptions, StepLine, Steps, TrainSummary};
use crate::schedule::LrSchedule;
use anyhow::{ensure, Context, Result};
use dice_model::memory::PeakMemory;
use dice_model::{PackedRow, TwoStreamBatch};
use sha2::{Digest, Sha256};
use std::path::Path;
use std::time::Instant;

/// The step the held-out rows are noised as: the same draw at every evaluation, and never a
/// training step's.
const EVAL_NOISE_STEP: u64 = u64::MAX;

/// An SFT run, set up and ready to train.
pub struct SftTrainer {
    run: Run<SftConfig>,
    sft: SftSteps,
}

/// SFT's part of the loop: the packed rows, which of them each step takes, their noise and
/// the learning-rate schedule.
struct SftSteps {
    data: PackedDataset,
    plan: DataPlan,
    held_out: Vec<CleanRow>,
    noiser: Noiser,
    schedule: LrSchedule,
}

impl SftTrainer {
    /// Resolves `config`, packs the data, loads the model (from the checkpoint it resumes
    /// from, else the base model) and the optimizer state, and prepares the output folder.
    pub fn new(config: SftConfig, options: RunOptions, ranks: Box<dyn Collective>) -> Result<Self> {
        let config = config.resolve()?;
        let training = &config.training;
        let data = pack(&config, &training_datasets(&config)?)?;
        tracing::info!("training data:\n{}", data.stats());
        let rows_per_step = training.per_device_train_batch_size
            * training.gradient_accumulation_steps
            * ranks.world_size();
        let length = match training.max_steps {
            Some(steps) => RunLength::Steps(steps),
            None => RunLength::Epochs(training.epochs),
        };
        let (seed, warmup_ratio) = (training.run.seed, training.warmup_ratio);
        let plan = DataPlan::new(
            data.len(),
            config.data.val_ratio,
            seed,
            rows_per_step,
            length,
        )?;
        let held_out = if config.data.val_files.is_empty() {
            plan.held_out_rows().iter().map(|&r| data.row(r)).collect()
        } else {
            let val = pack(
                &config,
                &select_datasets(&config.data.val_files, None, &[])?,
            )?;
            tracing::info!("validation data:\n{}", val.stats());
            (0..val.len()).map(|r| val.row(r)).collect()
        };
        let schedule = LrSchedule::with_warmup_ratio(
            training.lr_scheduler,
            training.run.learning_rate,
            warmup_ratio,
            plan.total_steps(),
        );
        let data_fingerprint = DataFingerprint {
            sha256: fingerprint(&data, plan.train_rows()),
            covers: "its packed rows",
            keep: "the same data and packing settings",
        };
        let run = Run::open(config, data_fingerprint, options, ranks)?;
        ensure!(
            run.optimizer.steps() == run.step(),
            "the checkpoint's optimizer state has {} steps, its trainer state {}: resume from a \
             checkpoint of dice train sft",
            run.optimizer.steps(),
            run.step()
        );
        let noiser = Noiser::new(seed, run.model.config().mask_token_id);
        let sft = SftSteps {
            data,
            plan,
            held_out,
            noiser,
            schedule,
        };
        Ok(Self { run, sft })
    }

    /// The run: its settings, model and step.
    pub fn run(&self) -> &Run<SftConfig> {
        &self.run
    }

    /// Trains to the end of the run: a checkpoint every `save_steps` steps and at the end, an
    /// evaluation of the held-out rows every `eval_steps` steps and at the end, then the
    /// finished model in `final/`.
    pub fn train(&mut self) -> Result<TrainSummary<StepMetrics>> {
        self.run.train(&mut self.sft)
    }
}

impl Steps for SftSteps {
    type Config = SftConfig;
    type Line = StepMetrics;
    const STEP_NAME: &'static str = "step";
    const COMMAND: &'static str = "dice train sft";

    fn total_steps(&self, _: &SftConfig) -> u64 {
        self.plan.total_steps()
    }

    fn epoch(&self, _: &SftConfig, steps: u64) -> f64 {
        self.plan.epoch(steps)
    }

    fn step(&mut self, run: &mut Run<SftConfig>) -> Result<StepMetrics> {
        let started = Instant::now();
        let peak = PeakMemory::start(&run.device)?;
        let step = run.step();
        let training = &run.config().training;
        let rows = self.plan.step_rows(step);
        let world = run.collective.world_size();
        let mine: Vec<usize> = contiguous_share(rows.len(), run.collective.rank(), world).collect();

        let mut accumulator = GradientAccumulator::default();
        let (mut loss_sum, mut tokens, mut flops) = (0f64, 0usize, 0f64);
        for micro in mine.chunks(training.per_device_train_batch_size) {
            let noised: Vec<PackedRow> = micro
                .iter()
                .map(|&k| self.noiser.noise(self.data.row(rows[k]), step, k as u64))
                .collect();
            let batch = TwoStreamBatch::new(&noised)?;
            let result = run
                .model
                .sft_loss_and_grads(&batch, training.chunk_rows)
                .with_context(|| format!("step {}: the loss and gradients failed", step + 1))?;
            loss_sum += f64::from(result.loss);
            tokens += noised.iter().map(|r| r.input_ids.len()).sum::<usize>();
            flops += sft_step_flops(
                run.model.config(),
                batch.sample_lens(),
                batch.selected().len(),
            );
            accumulator.add(result.grads)?;
        }
        run.device.synchronize()?;
        let forward_backward_s = started.elapsed().as_secs_f64();
        let micro_batches = accumulator.micro_batches();
        let grads = if micro_batches == 0 {
            // A rank without rows in the last step of an epoch.
            run.zero_grads()?
        } else {
            accumulator.take()
        };
        let mut totals = [loss_sum, micro_batches as f64, tokens as f64, flops];
        run.collective.all_reduce_sum_f64(&mut totals)?;
        let [loss_sum, micro_batches, tokens, flops] = totals;
        let update = StepSettings {
            grad_scale: 1.0,
            max_grad_norm: training.run.max_grad_norm,
            lr: self.schedule.lr(step),
        };
        let peak_tflops = run.config().metrics.peak_tflops;
        let grad_norm = run.update(grads, &update)?;
        run.device.synchronize()?;

        let seconds = started.elapsed().as_secs_f64();
        let peak_flops = peak_tflops.map(|t| t * 1e12);
        Ok(StepMetrics {
            step: step + 1,
            epoch: self.plan.epoch(step + 1),
            loss: loss_sum / micro_batches.max(1.0),
            lr: update.lr,
            grad_norm: f64::from(grad_norm),
            tokens: tokens as u64,
            tokens_per_s: tokens / seconds,
            tflops: flops / seconds / 1e12,
            mfu: peak_flops.map(|peak| flops / (seconds * peak * world as f64)),
            memory: peak.finish().or_else(process_peak_rss),
            step_time_s: seconds,
            forward_backward_s,
            update_s: seconds - forward_backward_s,
        })
    }

    fn eval_steps(&self, config: &SftConfig) -> Option<u64> {
        (!self.held_out.is_empty()).then_some(config.eval.eval_steps)
    }

    /// The loss of the held-out rows, logged as an eval line.
    fn evaluate(&mut self, run: &mut Run<SftConfig>) -> Result<()> {
        let training = &run.config().training;
        let mine = contiguous_share(
            self.held_out.len(),
            run.collective.rank(),
            run.collective.world_size(),
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
            totals[0] += run.model.sft_loss_value(&batch, training.chunk_rows)?;
            totals[1] += 1.0;
        }
        run.collective.all_reduce_sum_f32(&mut totals)?;
        let line = EvalMetrics {
            step: run.step(),
            epoch: self.plan.epoch(run.step()),
            eval_loss: f64::from(totals[0]) / f64::from(totals[1]).max(1.0),
            eval_rows: self.held_out.len(),
        };
        tracing::info!(step = line.step, eval_loss = line.eval_loss, "eval");
        run.log(&line)
    }

    fn checkpoint_every_step(&self) -> bool {
        false
    }

    fn draw_page(&self, metrics: &Path, html: &Path, title: &str) -> Result<()> {
        write_html(metrics, html, title)
    }
}

impl StepLine for StepMetrics {
    fn describe(&self) -> String {
        format!(
            "loss {:.4} · lr {:.2e} · grad norm {:.3} · {:.0} tokens/s",
            self.loss, self.lr, self.grad_norm, self.tokens_per_s
        )
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
