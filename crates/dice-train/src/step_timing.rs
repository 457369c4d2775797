//! One timed SFT step of a real model size with random weights on a synthetic packed row: the
//! speed and peak memory of training at that size, without a dataset.

use crate::metrics::sft_step_flops;
use anyhow::{ensure, Result};
use candle_core::{DType, Device};
use dice_model::init::splitmix64_mix;
use dice_model::memory::PeakMemory;
use dice_model::sdar::{StepOverlap, StepProfile, QUERY_CHUNK};
use dice_model::{PackedRow, Sdar, SdarConfig, TwoStreamBatch};
use std::time::Instant;

/// Masking probability of every response token of [`synthetic_sft_row`].
const P_MASK: f32 = 0.5;

/// SplitMix64: a fixed-seed generator, so the synthetic row is the same on every run.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix64_mix(self.0)
    }
}

/// One packed row holding one sample of `tokens` (> 0) tokens: the first quarter is prompt
/// (labels -100), the rest response; every response token is masked with p = 0.5 by a
/// fixed-seed generator (the first response token is forced when none was drawn, as in spec
/// §6.2). Token ids are spread over the vocabulary below the mask token id.
pub fn synthetic_sft_row(config: &SdarConfig, tokens: usize) -> Result<PackedRow> {
    ensure!(tokens > 0, "a synthetic SFT row needs at least one token");
    let id_range = config.vocab_size.min(config.mask_token_id as usize) as u64;
    ensure!(
        id_range > 0,
        "the config leaves no token id below the mask token"
    );
    let mut rng = SplitMix64(0x5EED);
    let input_ids: Vec<u32> = (0..tokens)
        .map(|_| (rng.next() % id_range) as u32)
        .collect();
    let prompt = tokens / 4;
    let mut masked_positions: Vec<usize> = (prompt..tokens)
        .filter(|_| rng.next() < u64::MAX / 2)
        .collect();
    if masked_positions.is_empty() {
        masked_positions.push(prompt);
    }
    let mut noisy_ids = input_ids.clone();
    for &i in &masked_positions {
        noisy_ids[i] = config.mask_token_id;
    }
    let labels = input_ids
        .iter()
        .enumerate()
        .map(|(i, &id)| if i < prompt { -100 } else { i64::from(id) })
        .collect();
    Ok(PackedRow {
        labels,
        noisy_ids,
        position_ids: (0..tokens as u32).collect(),
        p_mask: vec![P_MASK; masked_positions.len()],
        masked_positions,
        input_ids,
    })
}

/// Result of [`time_sft_step`].
#[derive(Debug, Clone)]
pub struct SftStepTiming {
    /// Loss of the timed step.
    pub loss: f32,
    /// Wall-clock seconds of the timed step, device work included.
    pub seconds: f64,
    /// Positions of the two-stream sequence (twice the row's tokens).
    pub positions: usize,
    /// Masked (loss-bearing) positions.
    pub masked: usize,
    /// FLOPs of the step as the trainer counts them for its MFU ([`sft_step_flops`]: both
    /// streams, the visible attention pairs, the scored head).
    pub flops: f64,
    /// Highest device memory in use from the model's build to the last step's end; `None` on
    /// the CPU.
    pub peak_bytes: Option<u64>,
    /// Where the time of one more step went, phase by phase, when asked for.
    pub profile: Option<StepProfile>,
    /// With the profile, on CUDA: one more step run as unprofiled steps run (no
    /// synchronization), each phase marked on the device and on the host: where the device
    /// waited for the host.
    pub overlap: Option<StepOverlap>,
}

/// Random weights of `config` in `dtype` on `device`, [`synthetic_sft_row`] of `tokens` tokens,
/// then `steps` (>= 1) checkpointed loss-and-gradient steps ([`Sdar::sft_loss_and_grads`] with
/// [`QUERY_CHUNK`]-row chunks): the loss and wall time of the last step (earlier steps are
/// warm-up; each step's gradients are dropped before the next one starts). With `profile`, one
/// more step runs with its phases timed apart ([`Sdar::profile_sft_step`]), after the timed
/// one, which the profiling's synchronizations would slow, and on CUDA one more with its phases
/// marked without synchronizing ([`Sdar::overlap_sft_step`]).
pub fn time_sft_step(
    config: &SdarConfig,
    dtype: DType,
    device: &Device,
    tokens: usize,
    steps: usize,
    profile: bool,
) -> Result<SftStepTiming> {
    ensure!(steps > 0, "time at least one SFT step");
    let peak = PeakMemory::start(device)?;
    let batch = TwoStreamBatch::new(&[synthetic_sft_row(config, tokens)?])?;
    let model = Sdar::random(config, dtype, device)?;
    for _ in 1..steps {
        model.sft_loss_and_grads(&batch, QUERY_CHUNK)?;
    }
    device.synchronize()?;
    let start = Instant::now();
    let step = model.sft_loss_and_grads(&batch, QUERY_CHUNK)?;
    device.synchronize()?;
    let seconds = start.elapsed().as_secs_f64();
    drop(step.grads);
    let (profile, overlap) = if profile {
        let profile = model.profile_sft_step(&batch, QUERY_CHUNK)?.1;
        let overlap = model
            .overlap_sft_step(&batch, QUERY_CHUNK)?
            .map(|(_, overlap)| overlap);
        (Some(profile), overlap)
    } else {
        (None, None)
    };
    Ok(SftStepTiming {
        loss: step.loss,
        seconds,
        positions: batch.tokens().len(),
        masked: batch.selected().len(),
        flops: sft_step_flops(config, &[tokens], batch.selected().len()),
        peak_bytes: peak.finish(),
        profile,
        overlap,
    })
}
