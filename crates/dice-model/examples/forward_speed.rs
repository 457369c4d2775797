//! Forward-pass timings of a random-weight model of a real config:
//! `cargo run --release --features cuda --example forward_speed -- CONFIG.json [BATCH] [CONTEXT]`.
//! Prints one line per measurement: a block-causal prefill of CONTEXT tokens per row, then a
//! read-only decoding step (one block per row) over that cache.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use dice_model::{KvCache, Sdar, SdarConfig};
use std::time::Instant;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let config_path = args
        .get(1)
        .context("usage: forward_speed CONFIG.json [BATCH] [CONTEXT]")?;
    let batch: usize = args.get(2).map_or(Ok(1), |s| s.parse())?;
    let context: usize = args.get(3).map_or(Ok(1024), |s| s.parse())?;
    let config = SdarConfig::from_path(config_path.as_ref())?;
    let device = Device::cuda_if_available(0)?;
    let start = Instant::now();
    let model = Sdar::random(&config, DType::BF16, &device)?;
    device.synchronize()?;
    println!(
        "random {} parameters in {:.1}s",
        model.num_parameters(),
        start.elapsed().as_secs_f64()
    );
    let bs = config.block_size;
    let mut cache = KvCache::new(&config, batch, context + bs, DType::BF16, &device)?;
    let ids: Vec<u32> = (0..batch * context)
        .map(|i| (i * 7919 % 150000) as u32)
        .collect();
    let prompt = Tensor::from_vec(ids, (batch, context), &device)?;
    let start = Instant::now();
    let hidden = model.forward_hidden(&prompt, &mut cache, &vec![context; batch])?;
    device.synchronize()?;
    drop(hidden);
    println!(
        "prefill {batch}x{context}: {:.1} ms",
        start.elapsed().as_secs_f64() * 1e3
    );
    let block = Tensor::full(config.mask_token_id, (batch, bs), &device)?;
    for _ in 0..3 {
        model.block_forward(&block, &mut cache, &vec![false; batch])?;
    }
    device.synchronize()?;
    let steps = 20;
    let start = Instant::now();
    for _ in 0..steps {
        model.block_forward(&block, &mut cache, &vec![false; batch])?;
    }
    device.synchronize()?;
    let ms = start.elapsed().as_secs_f64() * 1e3 / steps as f64;
    println!("decode step {batch}x{bs} over {context} cached: {ms:.2} ms ({:.0} tokens/s at one token per step)", batch as f64 * 1e3 / ms);
    Ok(())
}
