//! `dice bench generate`: decoding throughput of the engine on a random-weight model, beside
//! the reference implementations' figures and the targets set against them.

use super::bench::{gib, RandomModelArgs};
use super::bench_profile::{print_profile, profile_decoding, profile_prefill};
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device};
use clap::Args;
use dice_engine::{
    DecodeParams, DecodeSettings, Engine, EngineConfig, ForwardCounts, Request, SdarDecoder,
    Strategy,
};
use dice_model::device::{cuda_event_tracking, set_cuda_event_tracking};
use dice_model::memory::PeakMemory;
use dice_model::sdar::ForwardProfile;
use dice_model::SdarConfig;
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args)]
pub struct GenerateBenchArgs {
    #[command(flatten)]
    pub model: RandomModelArgs,
    /// Batch sizes to measure (sequences decoded at once), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,128")]
    pub batch: Vec<usize>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// New tokens per sequence (no stop ids: every sequence runs to this limit).
    #[arg(long, default_value_t = 512)]
    pub new_tokens: usize,
    /// Tokens per diffusion block.
    #[arg(long, default_value_t = 4)]
    pub block_length: usize,
    /// Denoising steps per block.
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
    /// Remasking strategy (the threshold ones with their default thresholds).
    #[arg(long, value_enum, default_value_t = Strategy::LowConfidenceStatic)]
    pub strategy: Strategy,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// After the throughput runs, profile one decoding forward per batch size (block_length
    /// tokens per row over prompt_tokens + new_tokens/2 cached): each stage (embedding, every
    /// layer's norms, projections, rotary, KV write, attention, MLP, final norm, lm_head) timed
    /// on its own between device synchronizations, with the tensors it creates and its byte
    /// floor (weights + KV cache at the H200's bandwidth), beside the forward run as usual;
    /// the same for one prefill forward of the largest batch (as many prompts as the engine
    /// prefills at once; none for prompts shorter than a block); and time every engine step of one more generation per batch size,
    /// synchronized after each (the first step prefills), to show what a step costs beyond its
    /// forward.
    #[arg(long)]
    pub profile: bool,
    /// Keep cudarc's CUDA event tracking on (dice turns it off: two events per buffer that a
    /// single stream never needs), for an A/B comparison.
    #[arg(long)]
    pub cuda_event_tracking: bool,
}

/// The tokenizer's first special id (`<|endoftext|>`); prompt ids stay below it.
const FIRST_SPECIAL_ID: u32 = 151_643;

/// The H200's memory bandwidth: reading every weight once per forward bounds batch-1 speed.
const H200_BYTES_PER_S: f64 = 4.3e12;

#[derive(Serialize)]
struct GenerateBench {
    config: String,
    /// "4B" or "8B" when the config has their shapes (the sizes with reference figures).
    model: Option<&'static str>,
    device: String,
    dtype: String,
    parameters: usize,
    weight_bytes: u64,
    weight_read_ms_h200: f64,
    build_s: f64,
    prompt_tokens: usize,
    new_tokens: usize,
    block_length: usize,
    steps: usize,
    strategy: &'static str,
    /// Whether the CUDA device tracked buffer uses with events (false off CUDA).
    cuda_event_tracking: bool,
    rows: Vec<GenerateRow>,
    #[serde(skip_serializing_if = "Option::is_none")]
    profile: Option<Vec<ForwardProfile>>,
}

#[derive(Serialize)]
struct GenerateRow {
    batch: usize,
    generated_tokens: usize,
    wall_s: f64,
    tokens_per_s: f64,
    forwards: ForwardCounts,
    total_forwards: u64,
    ms_per_forward: f64,
    peak_bytes: Option<u64>,
    reference: Option<Reference>,
    target_met: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    steps: Option<StepTimes>,
}

/// Wall time of each engine step of one generation, the device synchronized after each.
#[derive(Serialize)]
struct StepTimes {
    /// The first step: the prefill of every prompt, then the first decoding forward.
    first_ms: f64,
    /// Every later step, in order.
    later_ms: Vec<f64>,
}

/// A published figure for the same model, batch and decoding settings, and our target.
#[derive(Serialize)]
struct Reference {
    source: &'static str,
    tokens_per_s: f64,
    ms_per_forward: Option<f64>,
    target: Target,
}

#[derive(Clone, Copy, Serialize)]
#[serde(rename_all = "snake_case")]
enum Target {
    /// Twice the time of reading the weights once at the H200's bandwidth.
    MsPerForwardAtMost(f64),
    TokensPerSAtLeast(f64),
}

impl Target {
    fn met(self, row: &GenerateRow) -> bool {
        match self {
            Target::MsPerForwardAtMost(ms) => row.ms_per_forward <= ms,
            Target::TokensPerSAtLeast(rate) => row.tokens_per_s >= rate,
        }
    }

    fn describe(self) -> String {
        match self {
            Target::MsPerForwardAtMost(ms) => format!("<= {ms} ms/forward"),
            Target::TokensPerSAtLeast(rate) => format!(">= {rate:.0} tok/s"),
        }
    }
}

const PYTHON_REFERENCE: &str = "reference Python (HF transformers, SDPA), H200";

/// The figures were measured with random weights, bf16, block 4, 4 steps, static greedy,
/// 512-token prompts and 512 new tokens, without stop ids; 4B is 2560 wide with 36 layers, 8B
/// 4096 wide with 36 layers.
fn reference(model: &str, batch: usize) -> Option<Reference> {
    let (source, tokens_per_s, ms_per_forward, target) = match (model, batch) {
        ("4B", 1) => (
            PYTHON_REFERENCE,
            18.8,
            Some(42.4),
            Target::MsPerForwardAtMost(4.2),
        ),
        ("8B", 1) => (
            PYTHON_REFERENCE,
            14.9,
            Some(53.6),
            Target::MsPerForwardAtMost(7.6),
        ),
        ("4B", 128) => ("JetEngine", 3700.0, None, Target::TokensPerSAtLeast(7400.0)),
        _ => return None,
    };
    Some(Reference {
        source,
        tokens_per_s,
        ms_per_forward,
        target,
    })
}

fn model_size(config: &SdarConfig) -> Option<&'static str> {
    match (config.hidden_size, config.num_hidden_layers) {
        (2560, 36) => Some("4B"),
        (4096, 36) => Some("8B"),
        _ => None,
    }
}

fn at_reference_settings(args: &GenerateBenchArgs, params: &DecodeParams, dtype: DType) -> bool {
    dtype == DType::BF16
        && params.block_length == 4
        && params.steps == 4
        && params.strategy == Strategy::LowConfidenceStatic
        && args.prompt_tokens == 512
        && args.new_tokens == 512
}

pub fn run(args: GenerateBenchArgs) -> Result<()> {
    ensure!(
        !args.batch.is_empty() && args.batch.iter().all(|&b| b > 0),
        "--batch needs batch sizes of at least 1"
    );
    let (config, device, dtype) = args.model.resolve()?;
    if args.cuda_event_tracking {
        set_cuda_event_tracking(&device, true);
    }
    let params = decode_params(&args)?;
    let start = Instant::now();
    let mut model = SdarDecoder::random(&config, dtype, &device, args.block_length)?;
    device.synchronize()?;
    let build_s = start.elapsed().as_secs_f64();
    let parameters = model.model().num_parameters();
    let weight_bytes = (parameters * dtype.size_in_bytes()) as u64;
    let size = model_size(&config);
    let compared = size.filter(|_| at_reference_settings(&args, &params, dtype));
    let prompt_bound = FIRST_SPECIAL_ID
        .min(config.mask_token_id)
        .min(config.vocab_size as u32);
    let mut rows = Vec::new();
    for &batch in &args.batch {
        let prompts = prompts(batch, args.prompt_tokens, prompt_bound);
        let (mut row, back) = measure(model, &prompts, &params, args.profile)?;
        model = back;
        row.reference = compared.and_then(|size| reference(size, batch));
        row.target_met = row.reference.as_ref().map(|r| r.target.met(&row));
        rows.push(row);
    }
    let profile = args
        .profile
        .then(|| {
            let largest = args.batch.iter().copied().max().unwrap_or(1);
            let prefill = || profile_prefill(model.model(), largest, &args, H200_BYTES_PER_S);
            args.batch
                .iter()
                .map(|&batch| profile_decoding(model.model(), batch, &args, H200_BYTES_PER_S))
                .chain(std::iter::once_with(|| prefill().transpose()).flatten())
                .collect::<Result<Vec<_>>>()
        })
        .transpose()?;
    let result = GenerateBench {
        config: args.model.config_name(),
        model: size,
        device: format!("{:?}", device.location()),
        dtype: format!("{dtype:?}"),
        parameters,
        weight_bytes,
        weight_read_ms_h200: weight_bytes as f64 / H200_BYTES_PER_S * 1e3,
        build_s,
        prompt_tokens: args.prompt_tokens,
        new_tokens: args.new_tokens,
        block_length: params.block_length,
        steps: params.steps,
        strategy: params.strategy.name(),
        cuda_event_tracking: cuda_event_tracking(&device),
        rows,
        profile,
    };
    print_generate_bench(&result);
    if size.is_some() && compared.is_none() {
        println!(
            "(the reference figures were measured in bf16 with block 4, 4 steps, \
             low_confidence_static, 512-token prompts and 512 new tokens: not compared here)"
        );
    }
    for row in &result.rows {
        if let Some(steps) = &row.steps {
            print_step_times(row.batch, steps, result.steps);
        }
    }
    for profile in result.profile.iter().flatten() {
        print_profile(profile);
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// DICE's evaluation (greedy, no stop ids) with the benchmark's block, steps and strategy.
fn decode_params(args: &GenerateBenchArgs) -> Result<DecodeParams> {
    DecodeSettings {
        strategy: Some(args.strategy),
        block_length: Some(args.block_length),
        steps: Some(args.steps),
        ..DecodeSettings::default()
    }
    .over(&DecodeParams::dice_eval(args.new_tokens))
}

/// Deterministic pseudo-random prompts of ids below `bound`, a different stream per sequence.
fn prompts(batch: usize, len: usize, bound: u32) -> Vec<Vec<u32>> {
    (0..batch as u64)
        .map(|row| {
            (0..len as u64)
                .map(|i| (splitmix64(row << 32 | i) % u64::from(bound)) as u32)
                .collect()
        })
        .collect()
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Positions per KV-cache row of the benchmark's engine: the prompt and the new tokens, in whole
/// blocks (the profile runs in caches of this size too).
pub fn engine_capacity(prompt_tokens: usize, new_tokens: usize, block: usize) -> usize {
    (prompt_tokens + new_tokens).div_ceil(block) * block
}

/// Generates for every prompt at once in an engine of exactly that batch; gives the model back.
fn measure(
    model: SdarDecoder,
    prompts: &[Vec<u32>],
    params: &DecodeParams,
    time_steps: bool,
) -> Result<(GenerateRow, SdarDecoder)> {
    let device = model.model().device().clone();
    let block = params.block_length;
    let prompt_tokens = prompts.first().map_or(0, Vec::len);
    let requests = |params: &DecodeParams| -> Vec<Request> {
        prompts
            .iter()
            .map(|p| Request {
                prompt: p.clone(),
                params: params.clone(),
            })
            .collect()
    };
    // The allocator may still hold the previous batch's memory: measure from a settled state.
    device.synchronize()?;
    let peak = PeakMemory::start(&device)?;
    let mut engine = Engine::new(
        model,
        EngineConfig {
            max_batch: prompts.len(),
            max_seq_len: engine_capacity(prompt_tokens, params.max_new_tokens, block),
            ..EngineConfig::default()
        },
    )?;
    // One block per sequence allocates the KV cache and loads the prefill and decoding
    // kernels at these shapes before the timing starts.
    let warm_up = DecodeParams {
        max_new_tokens: block,
        ..params.clone()
    };
    engine.generate(requests(&warm_up))?;
    device.synchronize()?;
    let before = engine.forward_counts();
    let start = Instant::now();
    let completions = engine.generate(requests(params))?;
    device.synchronize()?;
    let wall_s = start.elapsed().as_secs_f64();
    let peak_bytes = peak.finish();
    let after = engine.forward_counts();
    let forwards = ForwardCounts {
        prefill: after.prefill - before.prefill,
        decode: after.decode - before.decode,
    };
    let generated_tokens = completions.iter().map(|c| c.token_ids.len()).sum();
    let steps = time_steps
        .then(|| step_times(&mut engine, requests(params), &device))
        .transpose()?;
    let row = GenerateRow {
        batch: prompts.len(),
        generated_tokens,
        wall_s,
        tokens_per_s: generated_tokens as f64 / wall_s,
        forwards,
        total_forwards: forwards.total(),
        ms_per_forward: wall_s * 1e3 / forwards.total() as f64,
        peak_bytes,
        reference: None,
        target_met: None,
        steps,
    };
    Ok((row, engine.into_model()))
}

fn step_times(
    engine: &mut Engine<SdarDecoder>,
    requests: Vec<Request>,
    device: &Device,
) -> Result<StepTimes> {
    for request in requests {
        engine.submit(request)?;
    }
    let mut times = Vec::new();
    while engine.has_work() {
        let start = Instant::now();
        engine.step()?;
        device.synchronize()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    let (first_ms, later_ms) = times.split_first().context("the generation took no step")?;
    Ok(StepTimes {
        first_ms: *first_ms,
        later_ms: later_ms.to_vec(),
    })
}

/// What the timed steps say, read as those of a batch in lock-step (as the benchmark's are
/// unless sequences fall behind): after the first step, every `steps`-th step is the first of a
/// block and also stores the block before (their median apart); the last step only commits.
fn print_step_times(batch: usize, t: &StepTimes, steps: usize) {
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let (mut storing, mut plain) = (Vec::new(), Vec::new());
    for (k, &ms) in t.later_ms.iter().enumerate() {
        if (k + 1) % steps.max(1) == 0 {
            storing.push(ms);
        } else {
            plain.push(ms);
        }
    }
    println!(
        "engine steps at batch {batch} (synchronized after each): the first (prefill of every \
         prompt + a forward) {:.1} ms; then {} steps in {:.1} ms: median {:.2} ms, {:.2} ms for \
         every {steps}th (in lock-step, those that also store the block before)",
        t.first_ms,
        t.later_ms.len(),
        t.later_ms.iter().sum::<f64>(),
        median(plain),
        median(storing),
    );
}

fn print_generate_bench(b: &GenerateBench) {
    println!(
        "generate with {} ({} parameters, {} weights, {}) on {}, built in {:.2} s; reading the \
         weights once takes {:.2} ms at the H200's 4.3 TB/s",
        b.config,
        b.parameters,
        gib(b.weight_bytes),
        b.dtype,
        b.device,
        b.build_s,
        b.weight_read_ms_h200
    );
    println!(
        "block {}, {} steps, {}, greedy, {}-token prompts, {} new tokens, no stop ids",
        b.block_length, b.steps, b.strategy, b.prompt_tokens, b.new_tokens
    );
    println!("| config | batch | tokens/s | forwards (prefill) | ms/forward | peak memory | reference | target |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |");
    let config = b.model.map_or_else(|| b.config.clone(), String::from);
    for r in &b.rows {
        let (reference, target) = match (&r.reference, r.target_met) {
            (Some(reference), Some(met)) => (
                format!(
                    "{}: {} tok/s{}",
                    reference.source,
                    reference.tokens_per_s,
                    reference
                        .ms_per_forward
                        .map_or(String::new(), |ms| format!(", {ms} ms/forward"))
                ),
                format!(
                    "{}: {}",
                    reference.target.describe(),
                    if met { "met" } else { "NOT met" }
                ),
            ),
            _ => ("-".to_string(), "-".to_string()),
        };
        println!(
            "| {config} | {} | {:.1} | {} ({}) | {:.2} | {} | {reference} | {target} |",
            r.batch,
            r.tokens_per_s,
            r.total_forwards,
            r.forwards.prefill,
            r.ms_per_forward,
            r.peak_bytes.map_or("-".to_string(), gib),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_distinct_deterministic_and_below_the_bound() {
        let a = prompts(64, 32, 1000);
        assert_eq!(a, prompts(64, 32, 1000));
        for (i, row) in a.iter().enumerate() {
            assert_eq!(row.len(), 32);
            assert!(row.iter().all(|&t| t < 1000));
            assert!(a[..i].iter().all(|other| other != row), "row {i} repeats");
        }
    }
}
