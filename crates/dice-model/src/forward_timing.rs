//! Speed and peak memory of the two inference forwards of a real model size with random
//! weights: the block-causal prefill of a context, and the cached block forward over it that a
//! block-diffusion decoder repeats.

use crate::config::SdarConfig;
use crate::memory::PeakMemory;
use crate::sdar::{KvCache, Sdar};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use serde::Serialize;
use std::time::Instant;

/// Untimed block forwards before the timed ones.
const WARM_UP: usize = 3;

/// [`time_random_model`]'s result.
#[derive(Debug, Clone, Serialize)]
pub struct ModelTiming {
    pub parameters: usize,
    pub weight_bytes: u64,
    /// Seconds to build the random weights on the device.
    pub build_s: f64,
    pub rows: Vec<ForwardTiming>,
}

/// The forwards of one batch size.
#[derive(Debug, Clone, Serialize)]
pub struct ForwardTiming {
    pub batch: usize,
    /// Prompt tokens per row, in whole blocks.
    pub context: usize,
    pub prefill_ms: f64,
    pub prefill_tokens_per_s: f64,
    /// Median of the timed read-only block forwards.
    pub block_forward_ms: f64,
    pub kv_cache_bytes: u64,
    /// Highest device memory in use while the batch ran; `None` on the CPU.
    pub peak_bytes: Option<u64>,
}

/// Builds a model of `config`'s shapes with random weights on `device`, then times each batch
/// size of `batches`: a prefill of `context` tokens per row (rounded down to whole blocks), and
/// the median of `iters` read-only block forwards over that cache.
pub fn time_random_model(
    config: &SdarConfig,
    dtype: DType,
    device: &Device,
    batches: &[usize],
    context: usize,
    iters: usize,
) -> Result<ModelTiming> {
    let start = Instant::now();
    let model = Sdar::random(config, dtype, device)?;
    device.synchronize()?;
    let build_s = start.elapsed().as_secs_f64();
    let rows = batches
        .iter()
        .map(|&batch| time_forwards(&model, batch, context, iters))
        .collect::<Result<_>>()?;
    Ok(ModelTiming {
        parameters: model.num_parameters(),
        weight_bytes: (model.num_parameters() * dtype.size_in_bytes()) as u64,
        build_s,
        rows,
    })
}

/// Times the prefill of `batch` rows of `context` tokens (whole blocks) and the read-only block
/// forward over that cache.
pub fn time_forwards(
    model: &Sdar,
    batch: usize,
    context: usize,
    iters: usize,
) -> Result<ForwardTiming> {
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
    for _ in 0..WARM_UP {
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
    Ok(ForwardTiming {
        batch,
        context,
        prefill_ms,
        prefill_tokens_per_s: (batch * context) as f64 / (prefill_ms / 1e3),
        block_forward_ms: times[times.len() / 2],
        kv_cache_bytes,
        peak_bytes: peak.finish(),
    })
}
