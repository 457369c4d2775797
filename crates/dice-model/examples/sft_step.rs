//! One checkpointed two-stream SFT step (loss + all gradients) of a random-weight model of a
//! real config: `cargo run --release --features cuda --example sft_step -- CONFIG.json [TOKENS]
//! [STEPS]`. TOKENS (default 4096) is the packed row length; the step sees twice as many
//! positions. Prints the loss and the wall time of the last of STEPS (default 2) steps, and the
//! peak device memory on CUDA.

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use dice_model::bench::time_sft_step;
use dice_model::memory::PeakMemory;
use dice_model::SdarConfig;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let config_path = args
        .get(1)
        .context("usage: sft_step CONFIG.json [TOKENS] [STEPS]")?;
    let tokens: usize = args.get(2).map_or(Ok(4096), |s| s.parse())?;
    let steps: usize = args.get(3).map_or(Ok(2), |s| s.parse())?;
    let config = SdarConfig::from_path(config_path.as_ref())?;
    let device = Device::cuda_if_available(0)?;
    let peak = PeakMemory::start(&device)?;
    let timing = time_sft_step(&config, DType::BF16, &device, tokens, steps)?;
    let peak = peak.finish();
    println!(
        "sft step: {tokens} tokens ({} positions, {} masked), loss {:.4}, {:.2} s, peak {}",
        timing.positions,
        timing.masked,
        timing.loss,
        timing.seconds,
        peak.map_or("n/a (cpu)".to_string(), |b| format!(
            "{:.2} GiB",
            b as f64 / (1u64 << 30) as f64
        ))
    );
    Ok(())
}
