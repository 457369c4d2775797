//! Rollouts (spec bicrl §5): the trainer's weights decode the step's prompts in the engine, in
//! memory (the decoder's model is built over the trainer's own `Var`s, so an update is seen by
//! the next rollout without a copy through the disk), and each completion is handed on as it
//! finishes, with its trace.

use super::config::{EvalConfig, RolloutConfig};
use anyhow::{Context, Result};
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use dice_engine::{
    Completion, DecodeParams, Engine, EngineConfig, Event, Overflow, Request, SamplingParams,
    SdarDecoder, Strategy,
};
use dice_model::{Sdar, SdarConfig};
use std::collections::BTreeMap;

/// The decoding of training rollouts: dynamic threshold, temperature sampling, stopping at
/// `stop_ids` or exactly `max_tokens` tokens.
pub fn rollout_params(rollout: &RolloutConfig, stop_ids: Vec<u32>) -> DecodeParams {
    DecodeParams {
        block_length: rollout.block_length,
        steps: rollout.denoising_steps,
        strategy: Strategy::LowConfidenceDynamic {
            threshold: rollout.dynamic_threshold,
        },
        sampling: SamplingParams {
            temperature: rollout.temperature,
            top_k: rollout.top_k,
            top_p: rollout.top_p,
        },
        max_new_tokens: rollout.max_tokens,
        exact_max: true,
        stop_ids,
        seed: 0,
        overflow: Overflow::Clamp,
    }
}

/// The decoding of evaluations (spec bicrl §11): top-k 1 with the static strategy, one token
/// per pass.
pub fn eval_params(rollout: &RolloutConfig, eval: &EvalConfig, stop_ids: Vec<u32>) -> DecodeParams {
    DecodeParams {
        strategy: Strategy::LowConfidenceStatic,
        sampling: SamplingParams::GREEDY,
        max_new_tokens: eval.max_tokens,
        ..rollout_params(rollout, stop_ids)
    }
}

/// The seed of one completion: a function of the run's seed, the step, and the completion's
/// place in it, so that a resumed step draws the same samples.
pub fn sample_seed(seed: u64, step: u64, slot: usize) -> u64 {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ step.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ (slot as u64).wrapping_mul(0x1656_67B1_9E37_79F9)
}

/// A decoder over the weights of `vars` (the trainer's, shared, not copied on the CPU; on CUDA
/// the decoder stacks its projections into buffers of its own).
pub fn decoder(
    config: &SdarConfig,
    vars: &VarMap,
    dtype: DType,
    device: &Device,
    block_length: usize,
) -> Result<SdarDecoder> {
    let config = SdarConfig {
        block_size: block_length,
        ..config.clone()
    };
    let model = Sdar::new(&config, VarBuilder::from_varmap(vars, dtype, device))
        .context("cannot build the rollout model from the trainer's weights")?;
    SdarDecoder::new(model)
}

/// Decodes `requests` (each with the caller's slot number) with up to `max_active` at once,
/// handing each completion to `finished` as soon as it is done.
pub fn roll_out(
    decoder: SdarDecoder,
    requests: Vec<(usize, Request)>,
    max_active: usize,
    mut finished: impl FnMut(usize, Completion) -> Result<()>,
) -> Result<()> {
    let Some(max_seq_len) = requests
        .iter()
        .map(|(_, r)| {
            let b = r.params.block_length;
            (r.prompt.len() + r.params.max_new_tokens).div_ceil(b) * b
        })
        .max()
    else {
        return Ok(());
    };
    let config = EngineConfig {
        max_batch: max_active.clamp(1, requests.len()),
        max_seq_len,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(decoder, config)?;
    let mut slots = BTreeMap::new();
    for (slot, request) in requests {
        slots.insert(engine.submit(request)?, slot);
    }
    while engine.has_work() {
        for event in engine.step()? {
            if let Event::Finished(completion) = event {
                let slot = slots
                    .remove(&completion.id)
                    .context("the engine finished a request it was not given")?;
                finished(slot, completion)?;
            }
        }
    }
    Ok(())
}
