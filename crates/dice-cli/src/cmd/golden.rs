//! `dice bench golden`: the reference implementation's outputs on the formula golden
//! (`tests/data/sdar/golden/formula`), recomputed here on any device and dtype, with the
//! differences. The golden stores no weights: its checkpoint is generated from the formula
//! ([`dice_model::init`]) into a temporary folder, unless `--model` names one. This is how CUDA
//! numerics are checked on a GPU machine, where the test suite (CPU-only) does not run.

use super::generate::{DTypeArg, DeviceKind};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use dice_engine::{DecodeParams, Engine, EngineConfig, Request, SdarDecoder};
use dice_model::golden::{FormulaGolden, LogitsCase};
use dice_model::{KvCache, Sdar};
use serde::Serialize;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

#[derive(Args)]
#[command(after_help = "\
Checks, on the chosen device and dtype, as the golden's README says: the block-causal prefill
and one cached decode step (store_kv=false) against each row's stored logsumexp, sum and sum of
squares, the logits at the reference's top-32 indices, our own 32 largest values, the logits at
512 fixed columns and the argmax; the four greedy generations (token for token); the two-stream
SFT loss, the stored gradient rows and every gradient norm. Prints each check's largest
difference beside its f32 tolerance (README: 1e-4 on logits, loss and gradients, 1e-2 on a
row's sum, 1e-5 relative on its sum of squares, 1e-3 relative on gradient norms, argmax and
generations exact). Exits non-zero when a check fails: in f32 its tolerance; in bf16/fp16 the
difference relative to the reference's magnitude must stay within --low-precision-tol, while
argmax and generations are reported, not required (a near-tie may legitimately flip under
rounding).

Examples:
  dice bench golden --golden tests/data/sdar/golden/formula
  dice bench golden --golden tests/data/sdar/golden/formula --device cuda --dtype f32")]
pub struct GoldenArgs {
    /// The formula golden folder: config.json, cases.json, expected.safetensors.
    #[arg(long, value_name = "DIR")]
    pub golden: PathBuf,
    /// A checkpoint of the golden's formula weights to check (e.g. written by `dice model init
    /// --weights formula`) [default: one generated into a temporary folder].
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Where to run (cuda needs a binary built with `--features cuda`).
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceKind,
    /// Weight and activation dtype; the README's tolerances hold for f32.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: DTypeArg,
    /// Tolerance of bf16/fp16 differences, relative to the reference's magnitude of the same
    /// quantity [default: 5e-2 for bf16, 1e-2 for fp16: about 13 and 20 units of their rounding
    /// (2^-8 and 2^-11 relative), the spread that dozens of roundings through a forward and
    /// backward pass leave].
    #[arg(long, value_name = "TOL")]
    pub low_precision_tol: Option<f64>,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Check {
    name: String,
    /// Largest difference (see `Measurement::max_diff`), or the index of the first differing
    /// token of a generation.
    max_diff: Option<f64>,
    /// The bound in f32.
    tolerance: Option<f64>,
    /// `max_diff` over the reference's magnitude.
    relative: Option<f64>,
    tokens_equal: Option<bool>,
    passed: bool,
}

pub fn run(args: GoldenArgs) -> Result<()> {
    let golden = FormulaGolden::open(&args.golden)?;
    let device = args.device.device()?;
    let dtype = args.dtype.dtype();
    let low_precision_tol = args.low_precision_tol.unwrap_or(match dtype {
        DType::BF16 => 5e-2,
        _ => 1e-2,
    });
    let generated;
    let model_dir = match &args.model {
        Some(dir) => dir.as_path(),
        None => {
            generated = tempfile::tempdir().context("cannot create a temporary folder")?;
            golden.write_checkpoint(generated.path(), None)?;
            generated.path()
        }
    };

    let mut measurements = Vec::new();
    let model = Sdar::load(model_dir, dtype, &device)?;
    let (prefill, decode) = forward_cases(&model, &golden)?;
    drop(model);
    measurements.extend(golden.measure_logits(LogitsCase::Prefill, &prefill)?);
    measurements.extend(golden.measure_logits(LogitsCase::Decode, &decode)?);
    let (loss, grads) = sft_case(model_dir, dtype, &device, &golden)?;
    measurements.extend(golden.measure_sft(loss, &grads)?);
    let mut checks: Vec<Check> = measurements
        .into_iter()
        .map(|m| {
            let passed = match (dtype, m.relative()) {
                (DType::F32, _) => m.passes_f32(),
                (_, Some(relative)) => relative <= low_precision_tol,
                (_, None) => true,
            };
            Check {
                relative: m.relative(),
                name: m.name,
                max_diff: Some(m.max_diff),
                tolerance: Some(m.tolerance),
                tokens_equal: None,
                passed,
            }
        })
        .collect();
    for case in golden.generations()? {
        let (name, first_difference) = generation_case(model_dir, dtype, &device, case)?;
        checks.push(Check {
            name: format!("generate/{name}"),
            max_diff: first_difference.map(|i| i as f64),
            tolerance: None,
            relative: None,
            tokens_equal: Some(first_difference.is_none()),
            passed: first_difference.is_none() || dtype != DType::F32,
        });
    }

    println!(
        "golden checks on {:?} in {dtype:?} ({}, weights {})",
        device.location(),
        args.golden.display(),
        args.model
            .as_ref()
            .map_or("generated from the formula".to_string(), |d| d
                .display()
                .to_string())
    );
    println!("| check | max diff / first differing token | f32 tolerance | relative | result |");
    println!("| --- | ---: | ---: | ---: | --- |");
    for c in &checks {
        let value = match (c.tokens_equal, c.max_diff) {
            (Some(true), _) => "tokens equal".to_string(),
            (Some(false), Some(i)) => format!("differs at token {i}"),
            (_, Some(v)) => format!("{v:.3e}"),
            _ => "-".into(),
        };
        let tolerance = match c.tolerance {
            Some(t) if t > 0.0 => format!("{t:.0e}"),
            _ => "exact".to_string(),
        };
        let relative = c.relative.map_or("-".to_string(), |r| format!("{r:.2e}"));
        let result = if c.passed { "pass" } else { "FAIL" };
        println!(
            "| {} | {value} | {tolerance} | {relative} | {result} |",
            c.name
        );
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&checks)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let failed: Vec<&str> = checks
        .iter()
        .filter(|c| !c.passed)
        .map(|c| c.name.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("golden checks failed: {}", failed.join(", "));
    }
    Ok(())
}

/// Prefill logits of the prefill case, then the decode step over that cache.
fn forward_cases(model: &Sdar, golden: &FormulaGolden) -> Result<(Tensor, Tensor)> {
    let device = model.device();
    let prompt = golden.input_ids(LogitsCase::Prefill)?;
    let block = golden.input_ids(LogitsCase::Decode)?;
    let mut cache = KvCache::new(
        model.config(),
        1,
        prompt.len() + block.len(),
        model.dtype(),
        device,
    )?;
    let ids = Tensor::from_vec(prompt.clone(), (1, prompt.len()), device)?;
    let prefill = model.prefill(&ids, &mut cache)?.squeeze(0)?;
    let ids = Tensor::from_vec(block.clone(), (1, block.len()), device)?;
    let decode = model
        .block_forward(&ids, &mut cache, &[false])?
        .squeeze(0)?;
    Ok((prefill, decode))
}

/// The SFT loss of the golden's batch and every weight's gradient, by checkpoint name.
fn sft_case(
    dir: &Path,
    dtype: DType,
    device: &Device,
    golden: &FormulaGolden,
) -> Result<(f64, HashMap<String, Tensor>)> {
    let batch = golden.sft_batch()?;
    let (model, vars) = Sdar::load_trainable(dir, dtype, device)?;
    let hidden = model.two_stream_hidden(&batch)?;
    let loss = model.sft_loss(&hidden, &batch)?;
    let grads = loss.backward()?;
    let vars = vars
        .data()
        .lock()
        .expect("the VarMap lock is never poisoned");
    let grads = vars
        .iter()
        .map(|(name, var)| {
            let grad = grads
                .get(var.as_tensor())
                .with_context(|| format!("no gradient reached `{name}`"))?;
            Ok((name.clone(), grad.clone()))
        })
        .collect::<Result<_>>()?;
    Ok((loss.to_dtype(DType::F64)?.to_scalar::<f64>()?, grads))
}

/// One greedy generation case: its name and the index of the first generated token that differs
/// from the reference's, if any.
fn generation_case(
    dir: &Path,
    dtype: DType,
    device: &Device,
    case: &Value,
) -> Result<(String, Option<usize>)> {
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
    Ok((name, first_difference))
}

fn token_ids(v: &Value, what: &str) -> Result<Vec<u32>> {
    serde_json::from_value(v.clone())
        .with_context(|| format!("cases.json: {what} is not a list of token ids"))
}
