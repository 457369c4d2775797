//! The formula golden's greedy generations (`cases.json` "generate") decoded by the engine on a
//! checkpoint of its weights, on any device and dtype, token for token against the reference's.

use crate::{DecodeParams, Engine, EngineConfig, Request, SdarDecoder};
use anyhow::{Context, Result};
use candle_core::{DType, Device};
use dice_model::golden::FormulaGolden;
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
