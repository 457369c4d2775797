//! Per-request decoding settings.

use crate::sampling::SamplingParams;
use crate::strategy::{Overflow, Strategy};
use anyhow::{bail, Context, Result};
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

    /// The settings of one generation case of the reference's golden `cases.json` (keys
    /// `block_length`, `denoising_steps`, `remasking_strategy`, `confidence_threshold`,
    /// `temperature`, `top_k`, `top_p`, `gen_length`): no stop ids, and the reference's own
    /// overflow rule, which its block-8 case reaches (2 transfers asked for, 1 mask left).
    pub fn from_reference_case(case: &serde_json::Value) -> Result<Self> {
        let number = |key: &str| -> Result<f64> {
            case[key]
                .as_f64()
                .with_context(|| format!("generation case has no number `{key}`"))
        };
        let strategy_name = case["remasking_strategy"]
            .as_str()
            .context("generation case has no `remasking_strategy`")?;
        Ok(DecodeParams {
            block_length: number("block_length")? as usize,
            steps: number("denoising_steps")? as usize,
            strategy: Strategy::from_name(strategy_name, number("confidence_threshold")? as f32)?,
            sampling: SamplingParams {
                temperature: number("temperature")? as f32,
                top_k: number("top_k")? as usize,
                top_p: number("top_p")? as f32,
            },
            max_new_tokens: number("gen_length")? as usize,
            exact_max: false,
            stop_ids: Vec::new(),
            seed: 0,
            overflow: Overflow::Reference,
        })
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
