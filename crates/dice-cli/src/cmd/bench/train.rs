//! `dice bench train`: one timed checkpointed SFT step of a random-weight model
//! ([`dice_train::step_timing`]), beside the peak-memory bound of `bench/targets.toml`.

use super::format::gib;
use crate::cmd::args::RandomModelArgs;
use anyhow::{Context, Result};
use clap::Args;
use dice_model::config::SdarConfig;
use dice_model::sdar::{StepOverlap, StepProfile, STARVED_LEAD_SECONDS};
use dice_report::targets::Targets;
use dice_train::metrics::HOPPER_BF16_PEAK_TFLOPS;
use dice_train::step_timing::time_sft_step;
use serde::Serialize;
use std::path::PathBuf;

pub(super) const AFTER_HELP: &str = "\
Builds a model of CONFIG's real shapes with random weights, packs one synthetic sample of TOKENS
tokens (a quarter prompt, the response masked with p = 0.5), and runs STEPS checkpointed
training steps (forward and backward of the two-stream loss over 2 x TOKENS positions). Prints
the last step's wall time, its TFLOP/s and MFU (FLOPs counted as `dice train sft` counts them:
both streams, the attention pairs the mask leaves, the scored head; against --peak-tflops) and
the peak device memory, beside the bound (--bound-gib; by default the target of
bench/targets.toml where it holds: the 1.7B config's shapes, 4,096 tokens, bf16; no bound
otherwise). On CUDA in bf16/f16 the step runs dice's fused training kernels: the
attention (FlashAttention-2 style over the two-stream mask's key ranges) and the hand-written
layer and loss head (cuBLAS GEMMs between fused RMSNorm, q/k norm + rotary, SwiGLU and
log-softmax kernels, no autograd), and as many layers as the free device memory allows keep their
forward activations for the backward instead of recomputing them. The baselines of the same
binary: DICE_RECOMPUTE=all recomputes every layer; DICE_FUSED_LAYER=0 runs the layers and the
head through candle's composite ops and autograd (the fused attention stays);
DICE_FUSED_ATTENTION=0 takes the composite attention too; DICE_KEEP_POOL=0 hands freed device
memory back to the driver at every synchronization (CUDA's default; dice keeps it pooled).

Example (H200): dice bench train --config sdar-1.7b.json --device cuda --tokens 4096";

#[derive(Args)]
pub(crate) struct TrainBenchArgs {
    #[command(flatten)]
    pub model: RandomModelArgs,
    /// Tokens of the packed row (the step sees twice as many positions).
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
    /// Steps to run; all but the last are warm-up.
    #[arg(long, default_value_t = 2)]
    pub steps: usize,
    /// The peak-memory bound to check against, in GiB [default: bench/targets.toml's target
    /// for runs of its model shapes, tokens and dtype; none for others].
    #[arg(long)]
    pub bound_gib: Option<f64>,
    /// Peak dense TFLOP/s of the device in the compute dtype, the MFU's denominator [default:
    /// 989 (H100/H200 SXM, bf16) on CUDA; no MFU on the CPU].
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// Also run one more step with each phase timed on its own (forward projections,
    /// attention, MLP, loss head, and their backward), between device synchronizations, and
    /// print where the step's time goes; on CUDA, then one more as unprofiled steps run, each
    /// phase marked by events on the device and by the clock on the host, and print where the
    /// device waited for the host (phases whose runs ended with the device caught up).
    #[arg(long)]
    pub profile: bool,
    /// Also write the result as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The peak-memory target of `dice bench train` (bench/targets.toml) where it holds for a run of
/// `config` at `tokens` in `dtype`: its model's shapes and its settings; None elsewhere.
fn peak_memory_target_gib(config: &SdarConfig, tokens: usize, dtype: &str) -> Option<f64> {
    let settings = toml::Table::from_iter([
        ("tokens".to_string(), (tokens as i64).into()),
        ("dtype".to_string(), dtype.into()),
    ]);
    Targets::get()
        .measured_by("bench train")
        .find(|b| {
            b.fits_model(config.hidden_size, config.num_hidden_layers)
                && b.differing(&settings).next().is_none()
        })
        .map(|b| b.target)
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
    tflops: f64,
    mfu: Option<f64>,
    peak_bytes: Option<u64>,
    bound_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    profile: Option<StepProfile>,
    #[serde(skip_serializing_if = "Option::is_none")]
    overlap: Option<StepOverlap>,
}

pub(super) fn run(args: TrainBenchArgs) -> Result<()> {
    let (config, device, dtype) = args.model.resolve()?;
    let step = time_sft_step(
        &config,
        dtype,
        &device,
        args.tokens,
        args.steps,
        args.profile,
    )?;
    let peak_tflops = args
        .peak_tflops
        .or(device.is_cuda().then_some(HOPPER_BF16_PEAK_TFLOPS));
    let tflops = step.flops / step.seconds / 1e12;
    let bound_gib = args
        .bound_gib
        .or_else(|| peak_memory_target_gib(&config, args.tokens, &args.model.dtype.name()));
    let result = TrainBench {
        config: args.model.config_name(),
        dtype: format!("{dtype:?}"),
        tokens: args.tokens,
        positions: step.positions,
        masked: step.masked,
        loss: step.loss,
        step_s: step.seconds,
        tflops,
        mfu: peak_tflops.map(|peak| tflops / peak),
        peak_bytes: step.peak_bytes,
        bound_bytes: bound_gib.map(|g| (g * (1u64 << 30) as f64) as u64),
        profile: step.profile,
        overlap: step.overlap,
    };
    let bound = match (result.peak_bytes, result.bound_bytes) {
        (None, _) => "not measured on the CPU".to_string(),
        (Some(_), None) => "no bound for this run".to_string(),
        (Some(peak), Some(bound)) => format!(
            "bound {}: {}",
            gib(bound),
            if peak <= bound { "met" } else { "NOT met" }
        ),
    };
    println!(
        "sft step of {} ({}): {} tokens, {} positions, {} masked; loss {:.4}; {:.2} s, {:.1} TFLOP/s, MFU {}; peak {} ({bound})",
        result.config,
        result.dtype,
        result.tokens,
        result.positions,
        result.masked,
        result.loss,
        result.step_s,
        result.tflops,
        result.mfu.map_or("-".to_string(), |m| format!("{:.1} %", 100.0 * m)),
        result.peak_bytes.map_or("-".to_string(), gib),
    );
    if let Some(profile) = &result.profile {
        print!("{}", profile_table(profile));
    }
    if let Some(overlap) = &result.overlap {
        print!("{}", overlap_table(overlap));
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// The profiled step as a Markdown table: each phase's runs, time and share of the step, then
/// what ran between the phases.
fn profile_table(profile: &StepProfile) -> String {
    let step_ms = 1e3 * profile.step_seconds;
    let share = |ms: f64| 100.0 * ms / step_ms.max(f64::MIN_POSITIVE);
    let mut table = format!(
        "profiled step: {step_ms:.1} ms, each phase between device synchronizations\n\
         | phase | runs | ms | share |\n| --- | ---: | ---: | ---: |\n"
    );
    let mut phases_ms = 0.0;
    for phase in &profile.phases {
        let ms = 1e3 * phase.seconds;
        phases_ms += ms;
        table += &format!(
            "| {} | {} | {ms:.1} | {:.1} % |\n",
            phase.name,
            phase.runs,
            share(ms)
        );
    }
    let rest = step_ms - phases_ms;
    table += &format!(
        "| between phases (host bookkeeping) | | {rest:.1} | {:.1} % |\n",
        share(rest)
    );
    table
}

/// The overlapped step as a Markdown table: each phase's time on the device and on the host,
/// how far the device trailed the host at the end of its runs at least, and the runs whose end
/// found the device caught up (it waited for the host).
fn overlap_table(overlap: &StepOverlap) -> String {
    let ms = |seconds: f64| 1e3 * seconds;
    let mut table = format!(
        "overlapped step (no synchronization; CUDA events and the host clock): {:.1} ms on the \
         device, enqueued in {:.1} ms on the host\n\
         | phase | runs | device ms | host ms | least lead ms | runs with the device caught up (< {:.0} µs) |\n\
         | --- | ---: | ---: | ---: | ---: | ---: |\n",
        ms(overlap.device_seconds),
        ms(overlap.host_seconds),
        1e6 * STARVED_LEAD_SECONDS,
    );
    let mut inside = 0.0;
    for phase in &overlap.phases {
        inside += phase.device_seconds;
        table += &format!(
            "| {} | {} | {:.1} | {:.1} | {:.3} | {} |\n",
            phase.name,
            phase.runs,
            ms(phase.device_seconds),
            ms(phase.host_seconds),
            ms(phase.least_lead_seconds),
            phase.starved_runs
        );
    }
    table += &format!(
        "| between phases | | {:.1} | | | |\n",
        ms(overlap.device_seconds - inside)
    );
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// The peak-memory target holds for runs of its shapes, tokens and dtype, and only those.
    #[test]
    fn the_peak_memory_bound_applies_where_the_target_holds() {
        let bounds: Vec<_> = Targets::get().measured_by("bench train").collect();
        assert_eq!(bounds.len(), 1);
        assert_eq!(bounds[0].unit, "GiB");
        let configs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/sdar/configs");
        let config = |name: &str| SdarConfig::from_path(&configs.join(name)).unwrap();
        let (small, large) = (config("sdar-1.7b.json"), config("sdar-4b.json"));
        assert_eq!(
            peak_memory_target_gib(&small, 4096, "bf16"),
            Some(bounds[0].target)
        );
        assert_eq!(peak_memory_target_gib(&small, 6144, "bf16"), None);
        assert_eq!(peak_memory_target_gib(&small, 4096, "f32"), None);
        assert_eq!(peak_memory_target_gib(&large, 4096, "bf16"), None);
    }
}
