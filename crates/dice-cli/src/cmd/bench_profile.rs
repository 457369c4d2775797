//! `dice bench generate --profile`: where the time of one decoding forward goes, stage by
//! stage, at the benchmark's shapes.

use super::bench_generate::{engine_capacity, GenerateBenchArgs};
use anyhow::{Context, Result};
use dice_engine::EngineConfig;
use dice_model::sdar::{BlockForwardShape, ForwardProfile, ProfileSettings};
use dice_model::Sdar;

const WARM_UP: usize = 3;
const REPETITIONS: usize = 10;

/// Profiles the decoding forward of `batch` rows halfway through the benchmark's generation:
/// caches filled to the prompt plus half the new tokens (rounded down to whole blocks), in a
/// cache as large as the engine's, floors at `bytes_per_s`.
pub fn profile_decoding(
    model: &Sdar,
    batch: usize,
    args: &GenerateBenchArgs,
    bytes_per_s: f64,
) -> Result<ForwardProfile> {
    let block = model.config().block_size;
    let cached_tokens = (args.prompt_tokens + args.new_tokens / 2) / block * block;
    let shape = BlockForwardShape {
        batch,
        cached_tokens,
        capacity: engine_capacity(args.prompt_tokens, args.new_tokens, block)
            .max(cached_tokens + block),
        tokens: block,
    };
    let settings = ProfileSettings {
        warm_up: WARM_UP,
        repetitions: REPETITIONS,
        bytes_per_s,
    };
    profile(model, shape, settings, "decoding")
}

/// Profiles one prefill forward as the engine runs them for `batch` prompts of the benchmark:
/// as many whole prompts per forward as its prefill chunk takes, over empty caches. `None` for
/// prompts shorter than a block, which the engine does not prefill (they sit in the first
/// block).
pub fn profile_prefill(
    model: &Sdar,
    batch: usize,
    args: &GenerateBenchArgs,
    bytes_per_s: f64,
) -> Result<Option<ForwardProfile>> {
    let block = model.config().block_size;
    let tokens = args.prompt_tokens / block * block;
    if tokens == 0 {
        return Ok(None);
    }
    let rows = (EngineConfig::default().max_prefill_tokens / tokens).clamp(1, batch);
    let shape = BlockForwardShape {
        batch: rows,
        cached_tokens: 0,
        capacity: engine_capacity(args.prompt_tokens, args.new_tokens, block),
        tokens,
    };
    // A prefill forward is long: fewer repetitions give the same precision.
    let settings = ProfileSettings {
        warm_up: 1,
        repetitions: 2,
        bytes_per_s,
    };
    profile(model, shape, settings, "prefill").map(Some)
}

fn profile(
    model: &Sdar,
    shape: BlockForwardShape,
    settings: ProfileSettings,
    kind: &str,
) -> Result<ForwardProfile> {
    model
        .profile_block_forward(shape, settings)
        .with_context(|| format!("cannot profile the {kind} forward at batch {}", shape.batch))
}

pub fn print_profile(p: &ForwardProfile) {
    let sum = p.components_ms();
    println!();
    println!(
        "profile of one {} forward at batch {}: {} new tokens per row over {} cached \
         (cache of {} positions), mean of {} after {} warm-ups",
        if p.shape.cached_tokens == 0 {
            "prefill (with logits of every position, which the engine's prefill does not compute)"
        } else {
            "decoding"
        },
        p.shape.batch,
        p.shape.tokens,
        p.shape.cached_tokens,
        p.shape.capacity,
        p.repetitions,
        p.warm_up
    );
    println!(
        "the forward as inference runs it (one synchronize, at the end): {:.3} ms, {} tensors; \
         the stages timed one by one (synchronized before and after each) sum to {sum:.3} ms; \
         floors: weights + KV cache bytes at {:.1} TB/s",
        p.forward_ms,
        count(p.forward_tensors),
        p.bytes_per_s / 1e12
    );
    let runs: u64 = p.components.iter().map(|c| c.runs).sum();
    println!(
        "{runs} stage runs per forward; an empty stage takes {:.4} ms ({:.3} ms over all runs)",
        p.empty_stage_ms,
        runs as f64 * p.empty_stage_ms
    );
    println!(
        "| stage | runs | ms | share | floor ms | x floor | tensors | per layer ms (min - max) |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |");
    for c in &p.components {
        let over_floor = if c.floor_ms > 0.0 {
            format!("{:.1}", c.ms / c.floor_ms)
        } else {
            "-".to_string()
        };
        let per_layer = match (
            c.per_layer_ms.iter().copied().reduce(f64::min),
            c.per_layer_ms.iter().copied().reduce(f64::max),
        ) {
            (Some(min), Some(max)) => format!("{min:.4} - {max:.4}"),
            _ => "-".to_string(),
        };
        println!(
            "| {} | {} | {:.3} | {:.1}% | {:.4} | {over_floor} | {} | {per_layer} |",
            c.name,
            c.runs,
            c.ms,
            100.0 * c.ms / sum,
            c.floor_ms,
            count(c.tensors),
        );
    }
}

fn count(n: Option<u64>) -> String {
    n.map_or("-".to_string(), |n| n.to_string())
}
