//! `dice bench generate`: decoding throughput of the engine on a random-weight model
//! ([`dice_engine::throughput`]), beside the anchors and targets of `bench/targets.toml`.

use super::format::gib;
use super::profile::print_profile;
use crate::cmd::args::{RandomModelArgs, SamplingArgs};
use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use dice_engine::throughput::{PromptLengths, ThroughputBench, ThroughputRow, ThroughputRun};
use dice_engine::{SamplingParams, Strategy};
use dice_model::device::set_cuda_event_tracking;
use dice_model::sdar::ForwardProfile;
use dice_report::targets::{describe_settings, Benchmark, Machine, Targets};
use serde::Serialize;
use std::collections::BTreeSet;
use std::path::PathBuf;

#[derive(Args)]
pub(crate) struct GenerateBenchArgs {
    #[command(flatten)]
    pub model: RandomModelArgs,
    /// Batch sizes to measure (sequences decoded at once), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,128")]
    pub batch: Vec<usize>,
    /// Prompt tokens per sequence: N, or MIN-MAX for prompts of lengths spread evenly over the
    /// batch (as a rollout's task prompts differ: their block boundaries fall out of step).
    #[arg(long, default_value = "512")]
    pub prompt_tokens: PromptLengths,
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
    /// How each token is drawn: greedy by default (DICE's evaluation); `--top-k 0` samples the
    /// whole distribution, as training rollouts do.
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// After the throughput runs, profile one decoding forward per batch size (block_length
    /// tokens per row over prompt_tokens + new_tokens/2 cached): each stage (embedding, every
    /// layer's norms, projections, rotary, KV write, attention, MLP, final norm, lm_head) timed
    /// on its own between device synchronizations, with the tensors it creates and its byte
    /// floor (weights + KV cache at the memory bandwidth of bench/targets.toml's machine),
    /// beside the forward run as usual; the same for one prefill forward of the largest batch
    /// (as many prompts as the engine prefills at once; none for prompts shorter than a block);
    /// and time every engine step of one more generation per batch size, synchronized after
    /// each (the first step prefills), to show what a step costs beyond its forward.
    #[arg(long)]
    pub profile: bool,
    /// Keep cudarc's CUDA event tracking on (dice turns it off: two events per buffer that a
    /// single stream never needs), for an A/B comparison.
    #[arg(long)]
    pub cuda_event_tracking: bool,
}

/// The metrics of the benchmarks this command measures.
const METRICS: [&str; 2] = ["ms_per_forward", "tokens_per_s"];

pub(super) fn after_help() -> String {
    let benchmarks: Vec<&Benchmark> = Targets::get().measured_by("bench generate").collect();
    let mut compared = String::new();
    for b in &benchmarks {
        let model = b.model.as_ref().map_or("", |m| m.name.as_str());
        let batch = b
            .settings
            .get("batch")
            .map_or(String::new(), |batch| format!(" at batch {batch}"));
        compared.push_str(&format!(
            "\n  {}: {model}{batch}, {} {}; anchor {}",
            b.name,
            b.metric,
            b.describe_target(),
            b.describe_anchor()
        ));
    }
    let settings: BTreeSet<String> = benchmarks
        .iter()
        .map(|b| describe_settings(&b.settings, &["batch"]))
        .collect();
    let settings: String = settings.iter().map(|s| format!("\n  {s}")).collect();
    format!(
        "\
Builds a model of CONFIG's real shapes with random weights, then for each batch size: an engine
of that many slots generates NEW_TOKENS tokens (no stop ids; greedy unless --top-k says
otherwise) after PROMPT_TOKENS pseudo-random prompt tokens for every sequence at once, after one
untimed one-block warm-up. PROMPT_TOKENS MIN-MAX spreads the prompts' lengths evenly over the
batch, as a rollout's task prompts differ: compare a rollout's tokens/s with a bench of its
prompt lengths (their block boundaries out of step cost forwards that equal prompts do not).
On CUDA, greedy tokens are picked, and tokens of the whole distribution (--top-k 0, --top-p 1:
training rollouts' sampling) drawn, by one kernel over the logits; with a top-k above 1 or a
top-p below 1 the logits are read back and drawn from on the host.
Prints tokens/s (generated tokens / wall time), the forwards the engine ran (prefill included),
ms per forward and peak memory; for the model shapes, batch sizes and settings of the benchmarks
of bench/targets.toml, also their anchor (a reference implementation's figure) and whether their
target is met:{compared}
measured under:{settings}

Examples (H200):
  dice bench generate --config sdar-4b.json --device cuda --batch 1,128
  dice bench generate --config sdar-1.7b.json --device cuda --batch 128 --strategy dynamic \\
    --top-k 0   # BiC-RL's rollout sampling (temperature 1, threshold 0.9)

{}",
        crate::cmd::cuda_decoding_env!()
    )
}

#[derive(Serialize)]
struct GenerateBench<'a> {
    config: String,
    /// The name of the model of bench/targets.toml that the config has the shapes of.
    model: Option<&'a str>,
    device: String,
    dtype: String,
    /// Reading every weight once at the memory bandwidth of bench/targets.toml's machine.
    weight_read_ms_h200: f64,
    #[serde(flatten)]
    run: &'a ThroughputRun,
    rows: Vec<GenerateRow<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    profile: Option<&'a [ForwardProfile]>,
}

#[derive(Serialize)]
struct GenerateRow<'a> {
    #[serde(flatten)]
    measured: &'a ThroughputRow,
    /// The benchmark of bench/targets.toml this row is compared with: its target and anchor.
    reference: Option<&'a Benchmark>,
    target_met: Option<bool>,
}

/// The conditions of a run that a benchmark's `settings` name.
#[derive(Serialize)]
struct RunSettings<'a> {
    batch: usize,
    dtype: &'a str,
    block_length: usize,
    steps: usize,
    strategy: &'a str,
    /// 1: greedy; 0: the whole distribution sampled at `temperature`.
    top_k: usize,
    temperature: f32,
    prompt_tokens: PromptLengths,
    new_tokens: usize,
    /// The benchmark decodes without stop ids.
    stop: bool,
}

pub(super) fn run(args: GenerateBenchArgs) -> Result<()> {
    ensure!(
        !args.batch.is_empty() && args.batch.iter().all(|&b| b > 0),
        "--batch needs batch sizes of at least 1"
    );
    let (config, device, dtype) = args.model.resolve()?;
    if args.cuda_event_tracking {
        set_cuda_event_tracking(&device, true);
    }
    let targets = Targets::get();
    let bandwidth = targets.machine.memory_bandwidth_bytes_per_s;
    let throughput = ThroughputBench {
        batches: args.batch.clone(),
        prompt_tokens: args.prompt_tokens,
        new_tokens: args.new_tokens,
        block_length: args.block_length,
        steps: args.steps,
        strategy: args.strategy,
        sampling: args.sampling.params(),
        profile_bandwidth: args.profile.then_some(bandwidth),
    }
    .run(&config, dtype, &device)?;

    let benchmarks: Vec<&Benchmark> = targets
        .measured_by("bench generate")
        .filter(|b| b.fits_model(config.hidden_size, config.num_hidden_layers))
        .collect();
    let dtype_name = args.model.dtype.name();
    let settings = |batch| run_settings(batch, &dtype_name, &throughput.run);
    let mut rows = Vec::new();
    for measured in &throughput.rows {
        let run_settings = settings(measured.batch)?;
        let reference = benchmarks
            .iter()
            .copied()
            .find(|b| b.differing(&run_settings).next().is_none());
        let target_met = match reference {
            Some(b) => Some(b.met(metric(measured, b)?)),
            None => None,
        };
        rows.push(GenerateRow {
            measured,
            reference,
            target_met,
        });
    }
    let result = GenerateBench {
        config: args.model.config_name(),
        model: benchmarks
            .first()
            .and_then(|b| b.model.as_ref())
            .map(|m| m.name.as_str()),
        device: format!("{:?}", device.location()),
        dtype: format!("{dtype:?}"),
        weight_read_ms_h200: throughput.run.weight_bytes as f64 / bandwidth * 1e3,
        run: &throughput.run,
        rows,
        profile: throughput.profiles.as_deref(),
    };
    print_generate_bench(&result, &targets.machine);
    let any_batch = settings(0)?;
    let other_settings = benchmarks
        .iter()
        .all(|b| b.differing(&any_batch).any(|key| key != "batch"));
    if let (Some(b), true) = (benchmarks.first(), other_settings) {
        println!(
            "(the anchors of {} were measured under {}: not compared here)",
            result.model.unwrap_or(&b.name),
            describe_settings(&b.settings, &["batch"])
        );
    }
    for row in &throughput.rows {
        if let Some(steps) = &row.steps {
            let s = steps.summary(throughput.run.steps);
            println!(
                "engine steps at batch {} (synchronized after each): the first (prefill of every \
                 prompt + a forward) {:.1} ms; then {} steps in {:.1} ms: median {:.2} ms, {:.2} \
                 ms for every {}th (in lock-step, those that also store the block before)",
                row.batch,
                s.first_ms,
                s.later,
                s.later_total_ms,
                s.median_ms,
                s.median_storing_ms,
                throughput.run.steps,
            );
        }
    }
    for profile in throughput.profiles.iter().flatten() {
        print_profile(profile);
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// `greedy`, or `sampled at temperature 1` with the filters that apply.
fn describe_sampling(s: &SamplingParams) -> String {
    if s.is_greedy() {
        return "greedy".into();
    }
    let mut described = format!("sampled at temperature {}", s.temperature);
    if s.top_k > 1 {
        described.push_str(&format!(", top-k {}", s.top_k));
    }
    if s.top_p < 1.0 {
        described.push_str(&format!(", top-p {}", s.top_p));
    }
    described
}

/// The settings of the generations at `batch`, as a benchmark's `settings` name them.
fn run_settings(batch: usize, dtype: &str, run: &ThroughputRun) -> Result<toml::Table> {
    toml::Table::try_from(RunSettings {
        batch,
        dtype,
        block_length: run.block_length,
        steps: run.steps,
        strategy: run.strategy,
        top_k: run.sampling.top_k,
        temperature: run.sampling.temperature,
        prompt_tokens: run.prompt_tokens,
        new_tokens: run.new_tokens,
        stop: false,
    })
    .context("cannot write the run's settings as TOML")
}

/// The figure of `row` that `benchmark` sets its target on.
fn metric(row: &ThroughputRow, benchmark: &Benchmark) -> Result<f64> {
    Ok(match benchmark.metric.as_str() {
        "ms_per_forward" => row.ms_per_forward,
        "tokens_per_s" => row.tokens_per_s,
        other => bail!(
            "bench/targets.toml: the metric `{other}` of {} is none that dice bench generate \
             measures ({})",
            benchmark.name,
            METRICS.join(", ")
        ),
    })
}

fn print_generate_bench(b: &GenerateBench, machine: &Machine) {
    let run = b.run;
    println!(
        "generate with {} ({} parameters, {} weights, {}) on {}, built in {:.2} s; reading the \
         weights once takes {:.2} ms at the {}'s {} TB/s",
        b.config,
        run.parameters,
        gib(run.weight_bytes),
        b.dtype,
        b.device,
        run.build_s,
        b.weight_read_ms_h200,
        machine.name,
        machine.memory_bandwidth_bytes_per_s / 1e12,
    );
    println!(
        "block {}, {} steps, {}, {}, {}-token prompts, {} new tokens, no stop ids",
        run.block_length,
        run.steps,
        run.strategy,
        describe_sampling(&run.sampling),
        run.prompt_tokens,
        run.new_tokens
    );
    println!("| config | batch | tokens/s | forwards (prefill) | ms/forward | peak memory | anchor | target |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |");
    let config = b.model.map_or_else(|| b.config.clone(), String::from);
    for row in &b.rows {
        let r = row.measured;
        let (anchor, target) = match (row.reference, row.target_met) {
            (Some(reference), Some(met)) => (
                reference.describe_anchor(),
                format!(
                    "{}: {}",
                    reference.describe_target(),
                    if met { "met" } else { "NOT met" }
                ),
            ),
            _ => ("-".to_string(), "-".to_string()),
        };
        println!(
            "| {config} | {} | {:.1} | {} ({}) | {:.2} | {} | {anchor} | {target} |",
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
    fn every_benchmark_of_the_command_names_a_model_and_a_metric_it_measures() {
        let benchmarks: Vec<_> = Targets::get().measured_by("bench generate").collect();
        assert!(!benchmarks.is_empty());
        for b in benchmarks {
            assert!(b.model.is_some(), "{}", b.name);
            assert!(METRICS.contains(&b.metric.as_str()), "{}", b.name);
            assert!(b.settings.contains_key("batch"), "{}", b.name);
        }
    }

    #[derive(clap::Parser)]
    struct Command {
        #[command(flatten)]
        args: GenerateBenchArgs,
    }

    /// The settings a run with `flags` (and the model's) names.
    fn run_of(flags: &[&str]) -> ThroughputRun {
        let args = ["generate", "--config", "c.json"].iter().chain(flags);
        let args = <Command as clap::Parser>::try_parse_from(args)
            .unwrap()
            .args;
        assert_eq!(args.model.dtype.name(), "bf16");
        ThroughputRun {
            parameters: 0,
            weight_bytes: 0,
            build_s: 0.0,
            prompt_tokens: args.prompt_tokens,
            new_tokens: args.new_tokens,
            block_length: args.block_length,
            steps: args.steps,
            strategy: args.strategy.name(),
            sampling: args.sampling.params(),
            cuda_event_tracking: false,
        }
    }

    #[test]
    fn the_default_flags_in_bf16_are_the_settings_of_the_anchors() {
        // The evaluation's benchmarks run with the defaults, the rollouts' with the flags their
        // commands give.
        let evaluation = run_of(&[]);
        let rollout = run_of(&["--strategy", "dynamic", "--top-k", "0"]);
        for b in Targets::get().measured_by("bench generate") {
            let run = match b.name.starts_with("rollout-") {
                true => &rollout,
                false => &evaluation,
            };
            assert!(
                b.command.ends_with("--strategy dynamic --top-k 0")
                    == b.name.starts_with("rollout-"),
                "{}",
                b.name
            );
            let batch = b.settings["batch"].as_integer().unwrap() as usize;
            let settings = run_settings(batch, "bf16", run).unwrap();
            assert_eq!(b.differing(&settings).count(), 0, "{}", b.name);
            let settings = run_settings(batch, "f32", run).unwrap();
            assert_eq!(b.differing(&settings).collect::<Vec<_>>(), ["dtype"]);
            let other = match b.name.starts_with("rollout-") {
                true => &evaluation,
                false => &rollout,
            };
            let settings = run_settings(batch, "bf16", other).unwrap();
            assert!(b.differing(&settings).count() > 0, "{}", b.name);
        }
    }
}
