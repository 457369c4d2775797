//! The formula golden's greedy generations (`cases.json` "generate") decoded by the engine on a
//! checkpoint of its weights, on any device and dtype, token for token against the reference's;
//! and the engine's draws of sampled tokens on the device against the host's arithmetic
//! ([`check_sampling`]).

use crate::sampled::{sampled_candidates, Draw};
use crate::{sample_row, DecodeParams, Engine, EngineConfig, Request, SamplingParams, SdarDecoder};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use dice_model::golden::FormulaGolden;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use std::path::Path;

/// One generation case against the reference.
#[derive(Debug, Clone)]
pub struct GenerationCheck {
    /// The case's name in `cases.json`.
    pub name: String,
    /// The index of the first generated token that differs from the reference's (or where one
    /// output ends before the other), if any.
    pub first_difference: Option<usize>,
}

impl GenerationCheck {
    /// In f32 the tokens must be equal; in a lower precision a near-tie may legitimately flip
    /// under rounding, so the difference is reported, not required.
    pub fn passes(&self, dtype: DType) -> bool {
        self.first_difference.is_none() || dtype != DType::F32
    }
}

/// Decodes every generation case of `golden` with the checkpoint of `dir`, each in an engine
/// of its own (one slot).
pub fn check_generations(
    golden: &FormulaGolden,
    dir: &Path,
    dtype: DType,
    device: &Device,
) -> Result<Vec<GenerationCheck>> {
    golden
        .generations()?
        .iter()
        .map(|case| check_generation(dir, dtype, device, case))
        .collect()
}

fn check_generation(
    dir: &Path,
    dtype: DType,
    device: &Device,
    case: &Value,
) -> Result<GenerationCheck> {
    let name = case["name"].as_str().unwrap_or("unnamed").to_string();
    let prompt = token_ids(&case["prompt_ids"], "generate.prompt_ids")?;
    let expected = token_ids(&case["output_ids"], "generate.output_ids")?;
    let params = DecodeParams::from_reference_case(case)
        .with_context(|| format!("cases.json generate case {name}"))?;
    let decoder = SdarDecoder::load(dir, dtype, device, params.block_length)?;
    let mut engine = Engine::new(
        decoder,
        EngineConfig {
            max_batch: 1,
            max_seq_len: expected.len() + params.block_length,
            max_prefill_tokens: 4096,
        },
    )?;
    let out = engine
        .generate(vec![Request {
            prompt: prompt.clone(),
            params,
        }])?
        .remove(0);
    let want = &expected[prompt.len().min(expected.len())..];
    let first_difference = out
        .token_ids
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .or((out.token_ids.len() != want.len()).then(|| out.token_ids.len().min(want.len())));
    Ok(GenerationCheck {
        name,
        first_difference,
    })
}

fn token_ids(v: &Value, what: &str) -> Result<Vec<u32>> {
    serde_json::from_value(v.clone())
        .with_context(|| format!("cases.json: {what} is not a list of token ids"))
}

/// [`check_sampling`]'s result.
#[derive(Debug, Clone)]
pub struct SamplingCheck {
    pub rows: usize,
    /// Rows whose drawn token is where the f64 running sum of the row's weights, in index order,
    /// crosses the uniform number times their total (within 1e-6 of the total, plus the
    /// difference of the host's f32 total from it: on the CPU the host's own draw is checked).
    pub valid_draws: usize,
    /// Rows whose token is the one the host's [`sample_row`] draws (its f32 total may move the
    /// crossing by a token on flat distributions, so this is reported, not required).
    pub equal_to_host: usize,
    /// Largest relative difference of a drawn token's probability from its weight over the
    /// total, and of the entropy from the host's, beyond the host's f32 total's own rounding.
    pub max_relative_diff: f64,
}

impl SamplingCheck {
    /// Relative difference allowed between the device's and the host's f32 sums.
    pub const TOLERANCE: f64 = 1e-4;

    pub fn passes(&self) -> bool {
        self.valid_draws == self.rows && self.max_relative_diff <= Self::TOLERANCE
    }
}

/// Draws one token of the whole distribution (no top-k or top-p; temperatures 1 and 0.7) from
/// each of 64 rows of random logits over a real model's vocabulary, in `dtype` on `device`, the
/// way the engine draws them there (on CUDA, one kernel: [`dice_model::sample_summary`]), and
/// checks every draw against the host's arithmetic on the same logits.
pub fn check_sampling(dtype: DType, device: &Device) -> Result<SamplingCheck> {
    const ROWS: usize = 64;
    const VOCAB: usize = 151_936;
    let mut rng = StdRng::seed_from_u64(5);
    let values: Vec<f32> = (0..ROWS * VOCAB)
        .map(|_| (rng.random::<f32>() - 0.5) * 24.0)
        .collect();
    let logits = Tensor::from_vec(values, (ROWS, VOCAB), device)?.to_dtype(dtype)?;
    let draws: Vec<Draw> = (0..ROWS)
        .map(|r| Draw {
            sampling: SamplingParams {
                temperature: if r % 2 == 0 { 1.0 } else { 0.7 },
                top_k: 0,
                top_p: 1.0,
            },
            uniform: rng.random::<f64>(),
            with_entropy: true,
        })
        .collect();
    let drawn = sampled_candidates(&logits, &draws)?;
    let host = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let mut check = SamplingCheck {
        rows: ROWS,
        valid_draws: 0,
        equal_to_host: 0,
        max_relative_diff: 0.0,
    };
    for ((row, draw), candidate) in host.iter().zip(&draws).zip(&drawn) {
        let t = draw.sampling.temperature;
        let scaled: Vec<f32> = row
            .iter()
            .map(|&l| if t == 1.0 { l } else { l / t })
            .collect();
        let max = scaled.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = scaled.iter().map(|&s| (s - max).exp()).collect();
        let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
        // The host adds the f32 weights one after another into an f32 total (`sample_row`): its
        // rounding may move the crossing and every probability by this much, relative.
        let host_total: f32 = weights.iter().sum();
        let total_rounding = (f64::from(host_total) - total).abs() / total;
        let token = candidate.token as usize;
        let target = draw.uniform * total;
        let slack = (1e-6 + total_rounding) * total;
        if let Some(&weight) = weights.get(token) {
            let weight = f64::from(weight);
            let before: f64 = weights[..token].iter().map(|&w| f64::from(w)).sum();
            if weight > 0.0 && before <= target + slack && target < before + weight + slack {
                check.valid_draws += 1;
            }
            let beyond_rounding =
                |got: f64, want: f64| (got - want).abs() / want.abs().max(1e-30) - total_rounding;
            let on_host = sample_row(row, &draw.sampling, draw.uniform, true);
            check.equal_to_host += usize::from(on_host.token == candidate.token);
            check.max_relative_diff = check
                .max_relative_diff
                .max(beyond_rounding(f64::from(candidate.prob), weight / total))
                .max(beyond_rounding(
                    f64::from(candidate.entropy),
                    f64::from(on_host.entropy),
                ));
        }
    }
    Ok(check)
}
