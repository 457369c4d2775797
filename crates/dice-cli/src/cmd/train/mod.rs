//! `dice train`: block-diffusion fine-tuning ([`sft`]) and BiC-RL ([`rl`]). The flags map onto
//! `dice_train`'s settings and trainers; the flags of every run are declared once
//! ([`RunArgs`]), and so is how a run starts its ranks and reports.

mod rl;
mod sft;

use anyhow::Result;
use clap::{Args, Subcommand};
use dice_train::dist::{join_or_launch, Collective};
use dice_train::run::settings::{
    CheckpointConfig, ComputeDType, ModelConfig, RunTraining, SaveDType, Settings,
};
use dice_train::run::{Resume, RunOptions, StepLine, TrainSummary};
use std::ffi::OsString;
use std::path::PathBuf;

#[derive(Subcommand)]
pub(crate) enum TrainCommand {
    /// Supervised block-diffusion fine-tuning (the DICE recipe) on chat data.
    #[command(after_help = sft::MANUAL)]
    Sft(sft::SftArgs),
    /// BiC-RL (TraceRL): kernel infilling (stage 1) or end-to-end kernels (stage 2), rewarded
    /// by the evaluator.
    #[command(after_help = rl::MANUAL)]
    Rl(rl::RlArgs),
}

pub(crate) fn run(command: TrainCommand) -> Result<()> {
    match command {
        TrainCommand::Sft(a) => sft::run(a),
        TrainCommand::Rl(a) => rl::run(a),
    }
}

/// The flags of every training run, `dice train sft`'s and `dice train rl`'s.
#[derive(Args, Debug)]
pub(crate) struct RunArgs {
    /// The model folder to start from (config.json, safetensors, tokenizer files, chat
    /// template): the base model for sft; for rl the SFT model (stage 1) or the stage-1 model
    /// (stage 2).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Folder with the tokenizer files and chat template, when not the model folder.
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Output folder: checkpoints (checkpoint-STEP/, final/), config.toml, metrics.jsonl,
    /// metrics.html (rl: judge.db too).
    #[arg(long, value_name = "DIR", required_unless_present = "dry_run")]
    pub out: Option<PathBuf>,
    /// TOML file with the settings; flags given on the command line override it.
    #[arg(long, value_name = "F")]
    pub config: Option<PathBuf>,
    /// Resume from this checkpoint folder [default: the newest complete checkpoint in --out].
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Steps of the run: sft's optimizer steps (instead of counting --epochs), rl's RL steps
    /// [default: sft counts epochs; rl 20 for stage 1, 100 for stage 2].
    #[arg(long, value_name = "N")]
    pub max_steps: Option<u64>,
    /// Learning rate, sft's peak [default: the DICE recipes': 1e-5 for sft, 1e-6 for rl].
    #[arg(long, value_name = "X")]
    pub lr: Option<f64>,
    /// Global gradient-norm clipping [default: 1.0].
    #[arg(long, value_name = "X")]
    pub max_grad_norm: Option<f64>,
    /// Where the model trains (and rl's decodes) [default: cpu]; cuda needs a binary built
    /// with `--features cuda`.
    #[arg(long, value_enum)]
    pub device: Option<dice_eval::Device>,
    /// Compute dtype [default: f32 on the CPU, bf16 on CUDA].
    #[arg(long, value_enum)]
    pub dtype: Option<ComputeDType>,
    /// Keep AdamW's f32 masters and moments in host memory (ZeRO-Offload's split): the GPU
    /// holds the weights, gradients and activations (for SDAR-8B in bf16 about 64 GB at
    /// 6,144 tokens instead of over 170 with the state beside them); every step reads the
    /// gradients back, updates on every core of the host and writes the weights back; the
    /// host needs 12 bytes a parameter.
    /// The same updates, bit for bit; not with ZeRO sharding (--zero-stage 1 or 2).
    #[arg(long)]
    pub optimizer_offload: bool,
    /// Seed of everything the run draws: sft's data order, noise and validation split, rl's
    /// samples and shuffled task order [default: 42 for sft, 10086 for rl].
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,
    /// Keep a checkpoint every N steps (rl writes one after every step, sft every N steps, both
    /// at the end). Only the newest checkpoint is resumable; the kept ones before it are models
    /// only (the optimizer state removed once a newer one is complete); others are removed.
    /// Checkpoints are written in the background while the next step runs. Bytes, P
    /// parameters, bf16 (--save-dtype f32: the model 4P, no separate masters): the newest
    /// 14P for sft (model 2P, f32 masters 4P, AdamW moments 8P), 6P for rl (its presets reset
    /// the moments every step: none stored); each older kept one and final/ 2P. SDAR-1.7B
    /// (P = 2.03e9): sft 28.4 GB, rl 12.2 GB, kept 4.1 GB; 4B: 61.8, 26.5, 8.8 GB; 8B: 114.7,
    /// 49.1, 16.4 GB. While one is written the one before it still exists; a checkpoint that
    /// will not fit the free space fails the run before anything is written [default: 500 for
    /// sft, 10 for rl].
    #[arg(long, value_name = "N")]
    pub save_steps: Option<u64>,
    /// Keep only the newest K checkpoints (the resumable newest one included) [default: all
    /// that --save-steps keeps].
    #[arg(long, value_name = "K")]
    pub save_total_limit: Option<usize>,
    /// Dtype of the checkpoint weights: bf16 (2 bytes per parameter, the f32 masters kept
    /// beside them in the newest checkpoint) or f32 (4 bytes, which are the masters)
    /// [default: bf16].
    #[arg(long, value_enum)]
    pub save_dtype: Option<SaveDType>,
    /// Evaluate the held-out data (sft's rows, rl's --eval-tasks) every N steps and at the end
    /// [default: 500 for sft, 10 for rl].
    #[arg(long, value_name = "N")]
    pub eval_steps: Option<u64>,
    /// Print what the run would train on and exit, without loading the weights (see below).
    #[arg(long)]
    pub dry_run: bool,
    /// Train with N ranks on this machine (one per GPU with --device cuda, talking through
    /// NCCL, even N = 1), as torchrun's --nproc-per-node starts them; each step's work is
    /// shared out among them. Launched by torchrun, Slurm or Kubernetes instead, the ranks read
    /// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT [default: 1].
    #[arg(long, value_name = "N")]
    pub nproc_per_node: Option<usize>,
}

/// `field` set to the flag's value when the flag was given.
fn set<T: Clone>(field: &mut T, flag: &Option<T>) {
    if let Some(value) = flag {
        *field = value.clone();
    }
}

impl RunArgs {
    /// The settings file (`--config`), else `default()`.
    fn settings_or<C: Settings>(&self, default: impl FnOnce() -> Result<C>) -> Result<C> {
        match &self.config {
            Some(path) => C::read(path),
            None => default(),
        }
    }

    /// The flags set on the settings every run has.
    fn apply<R>(
        &self,
        model: &mut ModelConfig,
        training: &mut RunTraining<R>,
        checkpoint: &mut CheckpointConfig,
        eval_steps: &mut u64,
    ) {
        if self.model.is_some() {
            model.path.clone_from(&self.model);
        }
        if self.tokenizer.is_some() {
            model.tokenizer.clone_from(&self.tokenizer);
        }
        set(&mut training.learning_rate, &self.lr);
        set(&mut training.max_grad_norm, &self.max_grad_norm);
        set(&mut training.seed, &self.seed);
        set(&mut training.device, &self.device);
        if self.dtype.is_some() {
            training.dtype = self.dtype;
        }
        training.optimizer_offload |= self.optimizer_offload;
        set(&mut checkpoint.save_steps, &self.save_steps);
        if self.save_total_limit.is_some() {
            checkpoint.save_total_limit = self.save_total_limit;
        }
        set(&mut checkpoint.save_dtype, &self.save_dtype);
        set(eval_steps, &self.eval_steps);
    }

    /// Prints `dry_run(settings)` with --dry-run. Else trains in this process's rank (after
    /// starting the --nproc-per-node ranks this process only waits for them): `new` makes the
    /// trainer of the settings, the run's options and the rank's collective, `train` trains,
    /// and rank 0 prints what the run did.
    fn start<C, T, L: StepLine>(
        &self,
        settings: C,
        dry_run: impl FnOnce(C) -> Result<String>,
        new: impl FnOnce(C, RunOptions, Box<dyn Collective>) -> Result<T>,
        train: impl FnOnce(&mut T) -> Result<TrainSummary<L>>,
    ) -> Result<()> {
        if self.dry_run {
            print!("{}", dry_run(settings)?);
            return Ok(());
        }
        let Some(collective) =
            join_or_launch(self.nproc_per_node, &std::env::current_exe()?, &rank_args())?
        else {
            return Ok(());
        };
        let rank = collective.rank();
        let options = RunOptions {
            out: self
                .out
                .clone()
                .expect("clap requires --out without --dry-run"),
            resume: self.resume.clone().map_or(Resume::Auto, Resume::From),
            progress: true,
            stop_after: None,
        };
        let summary = train(&mut new(settings, options, collective)?)?;
        if rank == 0 {
            eprintln!("{summary}");
        }
        Ok(())
    }
}

/// This command line without `--nproc-per-node`: what every launched rank runs.
fn rank_args() -> Vec<OsString> {
    let mut args = std::env::args_os().skip(1);
    let mut kept = Vec::new();
    while let Some(arg) = args.next() {
        if arg == "--nproc-per-node" {
            args.next();
        } else if !arg.to_string_lossy().starts_with("--nproc-per-node=") {
            kept.push(arg);
        }
    }
    kept
}
