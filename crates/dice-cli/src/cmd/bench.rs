//! `dice bench`: speed and memory of the model on its real sizes, with random weights.

use super::generate::{DTypeArg, DeviceKind};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::{Args, Subcommand};
use dice_model::memory::PeakMemory;
use dice_model::{KvCache, Sdar, SdarConfig};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Load, prefill and cached block-decoding speed and peak memory of a random-weight model.
    #[command(after_help = "\
Builds a model of CONFIG's real shapes with random weights directly on the device, then for each
batch size: a block-causal prefill of CONTEXT tokens per row, and one read-only 4-token block
forward over that cache (the step a block-diffusion decoder repeats). Prints a table, and checks
the memory bound: at batch 1, peak <= weights + KV cache + 2 GiB.

Peak memory is the highest device memory in use that the CUDA driver reports while each piece
runs (sampled every millisecond; it includes the CUDA context).

Example (H200):
  dice bench model --config sdar-8b.json --device cuda --dtype bf16 --batch 1,32 --context 2048")]
    Model(ModelBenchArgs),
    /// Recompute the reference's golden outputs on a device and dtype, and compare.
    Golden(super::golden::GoldenArgs),
    /// One checkpointed two-stream SFT step (loss and all gradients) of a random-weight model.
    #[command(after_help = "\
Builds a model of CONFIG's real shapes with random weights, packs one synthetic sample of TOKENS
tokens (a quarter prompt, the response masked with p = 0.5), and runs STEPS checkpointed
training steps (forward and backward of the two-stream loss over 2 x TOKENS positions). Prints
the last step's wall time and the peak device memory, beside the bound (--bound-gib).

Example (H200): dice bench train --config sdar-1.7b.json --device cuda --tokens 4096")]
    Train(TrainBenchArgs),
    /// Decoding throughput and peak memory of the engine on a random-weight model.
    #[command(after_help = concat!("\
Builds a model of CONFIG's real shapes with random weights, then for each batch size: an engine
of that many slots generates NEW_TOKENS greedy tokens (no stop ids) after PROMPT_TOKENS
pseudo-random prompt tokens for every sequence at once, after one untimed one-block warm-up.
Prints tokens/s (generated tokens / wall time), the forwards the engine ran (prefill included),
ms per forward and peak memory; for the 4B (2560 wide, 36 layers) and 8B (4096 wide, 36 layers)
shapes at the reference settings (the defaults, bf16), also the reference implementations'
figures and whether the targets are met: batch 1 at most twice the weight-read time per forward
(4B <= 4.2 ms, 8B <= 7.6 ms), 4B batch 128 >= 7400 tokens/s (twice JetEngine's).

Example (H200):
  dice bench generate --config sdar-4b.json --device cuda --batch 1,128

", super::cuda_decoding_env!()))]
    Generate(super::bench_generate::GenerateBenchArgs),
    /// Identity candidates (each reference with `Model` renamed `ModelNew`) for timing precision.
    #[command(after_help = "\
For each level, in problem-id order, takes the first N problems whose inputs fit the budget: the
tensors returned by get_inputs(), measured once for all problems by the project's Python on
torch's meta device (nothing is allocated). A problem over the budget, or whose inputs cannot be
measured, is skipped and the next one is taken instead. Writes JSONL lines
{level, problem_id, sample_id: 0, code}, the candidates `dice eval` reads; prints to stderr the
problems taken per level and every problem skipped, with its input size or the error.

Example (the evaluator's timing-precision benchmark):
  dice bench identity --kernelbench KernelBench/ --out identity.jsonl")]
    Identity(super::bench_identity::IdentityArgs),
}

/// The model every benchmark builds: a real config's shapes with random weights.
#[derive(Args)]
pub struct RandomModelArgs {
    /// A model config.json (e.g. tests/data/sdar/configs/sdar-4b.json); weights are random.
    #[arg(long)]
    pub config: PathBuf,
    /// Where to run (cuda needs a binary built with `--features cuda`).
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceKind,
    /// Weight and activation dtype.
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: DTypeArg,
}

impl RandomModelArgs {
    pub fn resolve(&self) -> Result<(SdarConfig, Device, DType)> {
        Ok((
            SdarConfig::from_path(&self.config)?,
            self.device.device()?,
            self.dtype.dtype(),
        ))
    }

    pub fn config_name(&self) -> String {
        self.config.display().to_string()
    }
}

#[derive(Args)]
pub struct TrainBenchArgs {
    #[command(flatten)]
    pub model: RandomModelArgs,
    /// Tokens of the packed row (the step sees twice as many positions).
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
    /// Steps to run; all but the last are warm-up.
    #[arg(long, default_value_t = 2)]
    pub steps: usize,
    /// The peak-memory bound to check against, in GiB.
    #[arg(long, default_value_t = 60.0)]
    pub bound_gib: f64,
    /// Also write the result as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args)]
pub struct ModelBenchArgs {
    #[command(flatten)]
    pub model: RandomModelArgs,
    /// Batch sizes to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    pub batch: Vec<usize>,
    /// Prompt tokens per row (prefilled), and the context of the cached block forward.
    #[arg(long, default_value_t = 2048)]
    pub context: usize,
    /// Timed repetitions of the block forward (after 3 warm-ups); the median is reported.
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn run(command: BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Model(args) => model(args),
        BenchCommand::Golden(args) => super::golden::run(args),
        BenchCommand::Train(args) => train(args),
        BenchCommand::Generate(args) => super::bench_generate::run(args),
        BenchCommand::Identity(args) => super::bench_identity::run(args),
    }
}

#[derive(Serialize)]
struct ModelBench {
    config: String,
    device: String,
    dtype: String,
    parameters: usize,
    weight_bytes: u64,
    build_s: f64,
    rows: Vec<BatchBench>,
}

#[derive(Serialize)]
struct BatchBench {
    batch: usize,
    context: usize,
    prefill_ms: f64,
    prefill_tokens_per_s: f64,
    block_forward_ms: f64,
    kv_cache_bytes: u64,
    peak_bytes: Option<u64>,
}

fn model(args: ModelBenchArgs) -> Result<()> {
    let (config, device, dtype) = args.model.resolve()?;
    let start = Instant::now();
    let model = Sdar::random(&config, dtype, &device)?;
    device.synchronize()?;
    let build_s = start.elapsed().as_secs_f64();
    let weight_bytes = (model.num_parameters() * dtype.size_in_bytes()) as u64;
    let mut rows = Vec::new();
    for &batch in &args.batch {
        rows.push(measure_batch(&model, batch, args.context, args.iters)?);
    }
    let result = ModelBench {
        config: args.model.config_name(),
        device: format!("{:?}", device.location()),
        dtype: format!("{dtype:?}"),
        parameters: model.num_parameters(),
        weight_bytes,
        build_s,
        rows,
    };
    print_model_bench(&result);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

fn measure_batch(model: &Sdar, batch: usize, context: usize, iters: usize) -> Result<BatchBench> {
    let config = model.config();
    let device = model.device();
    let bs = config.block_size;
    let context = context / bs * bs;
    // The allocator may still hold the previous batch's memory: measure from a settled state.
    device.synchronize()?;
    let peak = PeakMemory::start(device)?;
    let mut cache = KvCache::new(config, batch, context + bs, model.dtype(), device)?;
    let ids: Vec<u32> = (0..batch * context)
        .map(|i| (i * 7919 % 150_000) as u32)
        .collect();
    let prompt = Tensor::from_vec(ids, (batch, context), device)?;
    // One untimed prefill loads the kernels; the timed one starts from an empty cache again.
    model.forward_hidden(&prompt, &mut cache, &vec![context; batch])?;
    for row in 0..batch {
        cache.truncate_row(row, 0)?;
    }
    device.synchronize()?;
    let start = Instant::now();
    model.forward_hidden(&prompt, &mut cache, &vec![context; batch])?;
    device.synchronize()?;
    let prefill_ms = start.elapsed().as_secs_f64() * 1e3;
    let block = Tensor::full(config.mask_token_id, (batch, bs), device)?;
    let read_only = vec![false; batch];
    for _ in 0..3 {
        model.block_forward(&block, &mut cache, &read_only)?;
    }
    device.synchronize()?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        let start = Instant::now();
        model.block_forward(&block, &mut cache, &read_only)?;
        device.synchronize()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let kv_cache_bytes = cache.size_in_bytes() as u64;
    drop(cache);
    Ok(BatchBench {
        batch,
        context,
        prefill_ms,
        prefill_tokens_per_s: (batch * context) as f64 / (prefill_ms / 1e3),
        block_forward_ms: times[times.len() / 2],
        kv_cache_bytes,
        peak_bytes: peak.finish(),
    })
}

fn print_model_bench(b: &ModelBench) {
    println!(
        "model {} ({} parameters, {} weights, {}) on {}, built in {:.2} s",
        b.config,
        b.parameters,
        gib(b.weight_bytes),
        b.dtype,
        b.device,
        b.build_s
    );
    println!("| batch | context | prefill ms | prefill tok/s | 4-token block ms | KV cache | peak memory | bound (weights + KV + 2 GiB) |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |");
    for r in &b.rows {
        let bound = b.weight_bytes + r.kv_cache_bytes + (2u64 << 30);
        let check = match r.peak_bytes {
            Some(p) if r.batch == 1 => {
                format!(
                    "{} ({})",
                    gib(bound),
                    if p <= bound { "met" } else { "NOT met" }
                )
            }
            _ => "-".to_string(),
        };
        println!(
            "| {} | {} | {:.1} | {:.0} | {:.2} | {} | {} | {} |",
            r.batch,
            r.context,
            r.prefill_ms,
            r.prefill_tokens_per_s,
            r.block_forward_ms,
            gib(r.kv_cache_bytes),
            r.peak_bytes.map_or("-".to_string(), gib),
            check
        );
    }
}

#[derive(Serialize)]
struct TrainBench {
    config: String,
    dtype: String,
    tokens: usize,
    positions: usize,
    masked: usize,
    loss: f32,
    step_s: f64,
    peak_bytes: Option<u64>,
    bound_bytes: u64,
}

fn train(args: TrainBenchArgs) -> Result<()> {
    let (config, device, dtype) = args.model.resolve()?;
    let peak = PeakMemory::start(&device)?;
    let step = dice_model::bench::time_sft_step(&config, dtype, &device, args.tokens, args.steps)?;
    let result = TrainBench {
        config: args.model.config_name(),
        dtype: format!("{dtype:?}"),
        tokens: args.tokens,
        positions: step.positions,
        masked: step.masked,
        loss: step.loss,
        step_s: step.seconds,
        peak_bytes: peak.finish(),
        bound_bytes: (args.bound_gib * (1u64 << 30) as f64) as u64,
    };
    let check = match result.peak_bytes {
        Some(p) if p <= result.bound_bytes => "met",
        Some(_) => "NOT met",
        None => "not measured on the CPU",
    };
    println!(
        "sft step of {} ({}): {} tokens, {} positions, {} masked; loss {:.4}; {:.2} s; peak {} (bound {}: {check})",
        result.config,
        result.dtype,
        result.tokens,
        result.positions,
        result.masked,
        result.loss,
        result.step_s,
        result.peak_bytes.map_or("-".to_string(), gib),
        gib(result.bound_bytes),
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

pub(super) fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}
