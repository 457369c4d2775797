//! `dice bench golden`: the reference implementation's outputs on the formula golden
//! (`tests/data/sdar/golden/formula`), recomputed here on any device and dtype, with the
//! differences ([`dice_model::golden`] measures the forward passes and the SFT step,
//! [`dice_engine::golden`] the greedy generations). The golden stores no weights: its checkpoint
//! is generated from the formula ([`dice_model::init`]) into a temporary folder, unless `--model`
//! names one. This is how CUDA numerics are checked on a GPU machine, where the test suite
//! (CPU-only) does not run.

use crate::cmd::args::{candle_device, DTypeArg};
use anyhow::{bail, Context, Result};
use candle_core::DType;
use clap::Args;
use dice_engine::golden::{check_generations, check_sampling, SamplingCheck};
use dice_eval::Device;
use dice_model::golden::{low_precision_tolerance, FormulaGolden};
use dice_train::golden::{AdamWGolden, ADAMW_RUNS};
use serde::Serialize;
use std::path::PathBuf;

#[derive(Args)]
#[command(after_help = "\
Checks, on the chosen device and dtype, as the golden's README says: the block-causal prefill
and one cached decode step (store_kv=false) against each row's stored logsumexp, sum and sum of
squares, the logits at the reference's top-32 indices, our own 32 largest values, the logits at
512 fixed columns and the argmax; the four greedy generations (token for token); the two-stream
SFT loss, the stored gradient rows and every gradient norm, through one autograd graph (sft/…)
and through the trainer's step (sft-step/…: checkpointed, in query and head chunks of 4 rows,
and on CUDA the fused training attention, layer and loss head); in f32, the training case adamw
(two clipped AdamW steps through the trainer's step and optimizer, at weight decay 0.01 and 0:
losses, gradient norms and updated weights, its margins printed below the table); and 64 tokens
drawn from the whole distribution of random logits over a 151,936-token vocabulary as the engine
draws them on the device (one kernel on CUDA), each where the f64 running sum of its row's
weights crosses the uniform number (all required), its probability and the entropy within 1e-4
of the host's arithmetic (both beyond what the host's f32 total of the weights itself rounds).
Prints each check's largest difference beside its f32 tolerance (README: 1e-4 on logits, loss
and gradients, 1e-2 on a row's sum, 1e-5 relative on its sum of squares, 1e-3 relative on
gradient norms, argmax and generations exact). Exits non-zero when a check fails: in f32 its
tolerance; in bf16/fp16 the difference relative to the reference's magnitude must stay within
--low-precision-tol, while argmax and generations are reported, not required (a near-tie may
legitimately flip under rounding).

Examples:
  dice bench golden --golden tests/data/sdar/golden/formula
  dice bench golden --golden tests/data/sdar/golden/formula --device cuda --dtype f32")]
pub(crate) struct GoldenArgs {
    /// The formula golden folder: config.json, cases.json, expected.safetensors.
    #[arg(long, value_name = "DIR")]
    pub golden: PathBuf,
    /// A checkpoint of the golden's formula weights to check (e.g. written by `dice model init
    /// --weights formula`) [default: one generated into a temporary folder].
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Where to run (cuda needs a binary built with `--features cuda`).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
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
    /// What a check of several values measured (the AdamW runs' margins), or why it failed.
    detail: Option<String>,
    passed: bool,
}

pub(super) fn run(args: GoldenArgs) -> Result<()> {
    let golden = FormulaGolden::open(&args.golden)?;
    let device = candle_device(args.device)?;
    let dtype = args.dtype.dtype();
    let low_precision_tol = args
        .low_precision_tol
        .unwrap_or_else(|| low_precision_tolerance(dtype));
    let generated;
    let model_dir = match &args.model {
        Some(dir) => dir.as_path(),
        None => {
            generated = tempfile::tempdir().context("cannot create a temporary folder")?;
            golden.write_checkpoint(generated.path(), None)?;
            generated.path()
        }
    };

    let mut checks: Vec<Check> = golden
        .measure_checkpoint(model_dir, dtype, &device)?
        .into_iter()
        .map(|m| Check {
            passed: m.passes(dtype, low_precision_tol),
            relative: m.relative(),
            max_diff: Some(m.max_diff),
            tolerance: Some(m.tolerance),
            tokens_equal: None,
            detail: None,
            name: m.name,
        })
        .collect();
    let sampling = check_sampling(dtype, &device)?;
    checks.push(Check {
        passed: sampling.passes(),
        name: "sampling/whole-distribution draws".into(),
        max_diff: Some(sampling.max_relative_diff),
        tolerance: Some(SamplingCheck::TOLERANCE),
        relative: None,
        tokens_equal: None,
        detail: None,
    });
    for case in check_generations(&golden, model_dir, dtype, &device)? {
        checks.push(Check {
            passed: case.passes(dtype),
            name: format!("generate/{}", case.name),
            max_diff: case.first_difference.map(|i| i as f64),
            tolerance: None,
            relative: None,
            tokens_equal: Some(case.first_difference.is_none()),
            detail: None,
        });
    }
    // The training case: two clipped AdamW steps through the trainer's step and optimizer, in
    // f32 (as the golden computed them).
    if dtype == DType::F32 {
        let case = AdamWGolden::open(&golden)?;
        for run in ADAMW_RUNS {
            let outcome = case.check_run(model_dir, run, &device);
            checks.push(Check {
                name: format!("adamw/{run}"),
                passed: outcome.is_ok(),
                detail: Some(outcome.unwrap_or_else(|e| format!("{e:#}"))),
                max_diff: None,
                tolerance: None,
                relative: None,
                tokens_equal: None,
            });
        }
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
            _ if c.detail.is_some() => "below".to_string(),
            (Some(true), _) => "tokens equal".to_string(),
            (Some(false), Some(i)) => format!("differs at token {i}"),
            (_, Some(v)) => format!("{v:.3e}"),
            _ => "-".into(),
        };
        let tolerance = match c.tolerance {
            Some(t) if t > 0.0 => format!("{t:.0e}"),
            _ if c.detail.is_some() => "the README's".to_string(),
            _ => "exact".to_string(),
        };
        let relative = c.relative.map_or("-".to_string(), |r| format!("{r:.2e}"));
        let result = if c.passed { "pass" } else { "FAIL" };
        println!(
            "| {} | {value} | {tolerance} | {relative} | {result} |",
            c.name
        );
    }
    println!(
        "sampling: {} of {} draws where the running sum crosses u x total; {} the host's own \
         token (its f32 total may move the crossing on flat distributions)",
        sampling.valid_draws, sampling.rows, sampling.equal_to_host
    );
    for c in checks.iter().filter(|c| c.detail.is_some()) {
        println!("{}: {}", c.name, c.detail.as_deref().unwrap_or_default());
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

#[cfg(test)]
mod tests {
    use candle_core::DType;
    use dice_model::golden::low_precision_tolerance;
    use dice_report::targets::Targets;

    #[test]
    fn low_precision_golden_targets_are_the_oracles_tolerances() {
        let targets = Targets::get();
        for (name, dtype) in [
            ("golden-bf16-cuda", DType::BF16),
            ("golden-fp16-cuda", DType::F16),
        ] {
            let b = targets.benchmark.iter().find(|b| b.name == name).unwrap();
            assert_eq!(b.target, low_precision_tolerance(dtype), "{name}");
        }
    }
}
