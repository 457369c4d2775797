//! `dice bench model`: prefill and cached block-forward speed and peak memory of a random-weight
//! model ([`dice_model::forward_timing`]), beside the memory bound of `bench/targets.toml`.

use super::format::gib;
use crate::cmd::args::RandomModelArgs;
use anyhow::{Context, Result};
use clap::Args;
use dice_model::forward_timing::{time_random_model, ModelTiming};
use dice_report::targets::{describe_settings, Benchmark, Targets};
use serde::Serialize;
use std::path::PathBuf;

/// The metric of the benchmarks this command measures: peak memory over weights + KV cache.
const METRIC: &str = "peak_over_weights_and_kv_cache";

#[derive(Args)]
pub(crate) struct ModelBenchArgs {
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

pub(super) fn after_help() -> String {
    let bounds: String = memory_bounds()
        .map(|b| {
            format!(
                "\n  {}: where {}, peak <= weights + KV cache + {} {}",
                b.name,
                describe_settings(&b.settings, &[]),
                b.target,
                b.unit
            )
        })
        .collect();
    format!(
        "\
Builds a model of CONFIG's real shapes with random weights directly on the device, then for each
batch size: a block-causal prefill of CONTEXT tokens per row, and one read-only 4-token block
forward over that cache (the step a block-diffusion decoder repeats). Prints a table, and checks
the memory bounds of bench/targets.toml:{bounds}

Peak memory is the highest device memory in use that the CUDA driver reports while each piece
runs (sampled every millisecond; it includes the CUDA context).

Example (H200):
  dice bench model --config sdar-8b.json --device cuda --dtype bf16 --batch 1,32 --context 2048"
    )
}

fn memory_bounds() -> impl Iterator<Item = &'static Benchmark> {
    Targets::get()
        .measured_by("bench model")
        .filter(|b| b.metric == METRIC)
}

#[derive(Serialize)]
struct ModelBench {
    config: String,
    device: String,
    dtype: String,
    #[serde(flatten)]
    timing: ModelTiming,
}

pub(super) fn run(args: ModelBenchArgs) -> Result<()> {
    let (config, device, dtype) = args.model.resolve()?;
    let timing = time_random_model(
        &config,
        dtype,
        &device,
        &args.batch,
        args.context,
        args.iters,
    )?;
    let result = ModelBench {
        config: args.model.config_name(),
        device: format!("{:?}", device.location()),
        dtype: format!("{dtype:?}"),
        timing,
    };
    print_model_bench(&result);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

fn print_model_bench(b: &ModelBench) {
    let t = &b.timing;
    println!(
        "model {} ({} parameters, {} weights, {}) on {}, built in {:.2} s",
        b.config,
        t.parameters,
        gib(t.weight_bytes),
        b.dtype,
        b.device,
        t.build_s
    );
    let bound = memory_bounds().next();
    let bound_header = bound.map_or("bound".to_string(), |b| {
        format!("bound (weights + KV + {} {})", b.target, b.unit)
    });
    println!("| batch | context | prefill ms | prefill tok/s | 4-token block ms | KV cache | peak memory | {bound_header} |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |");
    for r in &t.rows {
        let settings = toml::Table::from_iter([("batch".to_string(), (r.batch as i64).into())]);
        let applies = bound.filter(|b| b.differing(&settings).next().is_none());
        let check = match (applies, r.peak_bytes) {
            (Some(b), Some(peak)) => {
                let slack = (b.target * (1u64 << 30) as f64) as u64;
                let limit = t.weight_bytes + r.kv_cache_bytes + slack;
                let over = peak.saturating_sub(t.weight_bytes + r.kv_cache_bytes);
                let met = b.met(over as f64 / (1u64 << 30) as f64);
                format!("{} ({})", gib(limit), if met { "met" } else { "NOT met" })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_targets_hold_one_memory_bound_in_gib() {
        let bounds: Vec<_> = Targets::get().measured_by("bench model").collect();
        assert_eq!(bounds.len(), 1);
        assert_eq!(bounds[0].metric, METRIC);
        assert_eq!(bounds[0].unit, "GiB");
    }
}
