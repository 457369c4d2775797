//! Per-request decoding settings.

use crate::sampling::SamplingParams;
use crate::strategy::{Overflow, Strategy};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecodeParams {
    /// Tokens per diffusion block (4 for every DICE model).
    pub block_length: usize,
    /// Denoising steps per block (the transfer schedule's length).
    pub steps: usize,
    pub strategy: Strategy,
    pub sampling: SamplingParams,
    /// Generation ends with the block that holds the N-th new token (as the reference does).
    pub max_new_tokens: usize,
    /// Cut the output to exactly `max_new_tokens` tokens.
    pub exact_max: bool,
    /// Generation ends after a block holding one of these ids; the output ends with it.
    pub stop_ids: Vec<u32>,
    /// Seed of this sequence's own random stream (independent of batch composition).
    pub seed: u64,
    pub overflow: Overflow,
}

impl DecodeParams {
    /// DICE's KernelBench evaluation (spec §4.7): block 4, 4 steps, static, greedy, no stop.
    pub fn dice_eval(max_new_tokens: usize) -> Self {
        DecodeParams {
            block_length: 4,
            steps: 4,
            strategy: Strategy::LowConfidenceStatic,
            sampling: SamplingParams::GREEDY,
            max_new_tokens,
            exact_max: false,
            stop_ids: Vec::new(),
            seed: 0,
            overflow: Overflow::Clamp,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.block_length == 0 {
            bail!("block length must be at least 1");
        }
        if self.steps == 0 {
            bail!("denoising steps must be at least 1");
        }
        if self.max_new_tokens == 0 {
            bail!("max new tokens must be at least 1");
        }
        self.sampling.validate()
    }
}
