//! Per-request decoding parameters, and the one way to build them from what a user sets.

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
            strategy: strategy_name
                .parse::<Strategy>()?
                .with_threshold(number("confidence_threshold")? as f32),
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

    /// These parameters for the `i`-th sample of a prompt: seeded with `seed + i`, so that the
    /// samples differ and each can be reproduced alone.
    pub fn for_sample(&self, i: usize) -> DecodeParams {
        DecodeParams {
            seed: self.seed.wrapping_add(i as u64),
            ..self.clone()
        }
    }

    /// The KV-cache positions a sequence of these parameters takes after a prompt of
    /// `prompt_len` tokens: the prompt and `max_new_tokens`, rounded up to whole blocks.
    pub fn positions(&self, prompt_len: usize) -> usize {
        (prompt_len + self.max_new_tokens).div_ceil(self.block_length) * self.block_length
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

/// What a user may set for decoding, each optional: the flags of `dice generate`, `dice serve`
/// and `dice bench generate`, the fields of an API request. [`DecodeSettings::over`] is the one
/// place where decoding parameters are built from them: a strategy takes its default threshold
/// unless given one, and the result is checked.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecodeSettings {
    pub strategy: Option<Strategy>,
    /// Replaces the threshold of the strategy (this one or the base's); the strategies without
    /// a threshold ignore it.
    pub threshold: Option<f32>,
    pub block_length: Option<usize>,
    pub steps: Option<usize>,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub max_new_tokens: Option<usize>,
    pub exact_max: Option<bool>,
    pub stop_ids: Option<Vec<u32>>,
    pub seed: Option<u64>,
    pub overflow: Option<Overflow>,
}

impl DecodeSettings {
    /// `base` with these settings in place of its own.
    pub fn over(self, base: &DecodeParams) -> Result<DecodeParams> {
        let strategy = self.strategy.unwrap_or(base.strategy);
        let params = DecodeParams {
            block_length: self.block_length.unwrap_or(base.block_length),
            steps: self.steps.unwrap_or(base.steps),
            strategy: match self.threshold {
                Some(threshold) => strategy.with_threshold(threshold),
                None => strategy,
            },
            sampling: SamplingParams {
                temperature: self.temperature.unwrap_or(base.sampling.temperature),
                top_k: self.top_k.unwrap_or(base.sampling.top_k),
                top_p: self.top_p.unwrap_or(base.sampling.top_p),
            },
            max_new_tokens: self.max_new_tokens.unwrap_or(base.max_new_tokens),
            exact_max: self.exact_max.unwrap_or(base.exact_max),
            stop_ids: self.stop_ids.unwrap_or_else(|| base.stop_ids.clone()),
            seed: self.seed.unwrap_or(base.seed),
            overflow: self.overflow.unwrap_or(base.overflow),
        };
        params.validate()?;
        Ok(params)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_replace_what_they_set_and_keep_the_rest() {
        let base = DecodeParams {
            strategy: Strategy::LowConfidenceDynamic { threshold: 0.6 },
            stop_ids: vec![7],
            ..DecodeParams::dice_eval(32)
        };
        let unchanged = DecodeSettings::default().over(&base).unwrap();
        assert_eq!(unchanged, base);
        let threshold = DecodeSettings {
            threshold: Some(0.8),
            seed: Some(3),
            ..DecodeSettings::default()
        };
        let params = threshold.over(&base).unwrap();
        assert_eq!(
            params.strategy,
            Strategy::LowConfidenceDynamic { threshold: 0.8 }
        );
        assert_eq!((params.seed, params.stop_ids), (3, vec![7]));
        let named = DecodeSettings {
            strategy: Some("entropy_bounded".parse().unwrap()),
            ..DecodeSettings::default()
        };
        assert_eq!(
            named.over(&base).unwrap().strategy,
            Strategy::EntropyBounded { threshold: 0.35 }
        );
        let zero_steps = DecodeSettings {
            steps: Some(0),
            ..DecodeSettings::default()
        };
        assert!(zero_steps.over(&base).is_err());
    }
}
