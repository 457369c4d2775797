//! `dice bench golden`: the reference implementation's outputs on its golden checkpoint,
//! recomputed here on any device and dtype, with the differences.
//!
//! The oracle folder (`shared/sdar/golden/tiny` in the development setup) holds a complete model
//! folder, `cases.json` (inputs and settings) and `expected.safetensors` (the reference's f32
//! outputs). This is how CUDA numerics are checked on a GPU machine, where the test suite
//! (CPU-only) does not run.

use super::generate::{DTypeArg, DeviceKind};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use dice_engine::{DecodeParams, Engine, EngineConfig, Request, SdarDecoder};
use dice_model::{KvCache, PackedRow, Sdar, TwoStreamBatch};
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

#[derive(Args)]
#[command(after_help = "\
Checks, on the chosen device and dtype: block-causal prefill logits, one cached decode step
(store_kv=false), the four greedy generations (token for token), and the two-stream SFT loss with
its gradients. Differences are max |ours - reference| against the reference's f32 outputs; for
bf16/fp16 they are also shown relative to the largest reference magnitude. Exits non-zero when a
check fails its tolerance (f32: 1e-4 and exact generations; bf16/fp16: --low-precision-tol
relative to the largest reference magnitude; generations are reported, not required, since a
near-tie may legitimately flip under rounding).

Example: dice bench golden --golden ../shared/sdar/golden/tiny --device cuda --dtype bf16")]
pub struct GoldenArgs {
    /// The oracle folder: model files, cases.json, expected.safetensors.
    #[arg(long)]
    pub golden: PathBuf,
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceKind,
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: DTypeArg,
    /// Tolerance of bf16/fp16 logit and gradient differences, relative to the largest
    /// reference magnitude of the same tensor [default: 5e-2 for bf16, 1e-2 for fp16: about
    /// 13 and 20 units of their rounding (2^-8 and 2^-11 relative), the spread that dozens of
    /// roundings through a forward and backward pass leave].
    #[arg(long)]
    pub low_precision_tol: Option<f64>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Check {
    name: String,
    /// Max absolute difference (tensors) or index of the first differing token (generations).
    max_abs: Option<f64>,
    /// `max_abs` over the largest reference magnitude.
    relative: Option<f64>,
    tokens_equal: Option<bool>,
    passed: bool,
}

pub fn run(args: GoldenArgs) -> Result<()> {
    let dir = &args.golden;
    let device = args.device.device()?;
    let dtype = args.dtype.dtype();
    let cases: Value = serde_json::from_slice(
        &std::fs::read(dir.join("cases.json"))
            .with_context(|| format!("cannot read {}/cases.json", dir.display()))?,
    )
    .with_context(|| format!("{}/cases.json is not valid JSON", dir.display()))?;
    let expected =
        candle_core::safetensors::load(dir.join("expected.safetensors"), &Device::Cpu)
            .with_context(|| format!("cannot read {}/expected.safetensors", dir.display()))?;
    let want = |name: &str| -> Result<&Tensor> {
        expected
            .get(name)
            .with_context(|| format!("expected.safetensors has no tensor `{name}`"))
    };
    let tol = Tolerance {
        dtype,
        low_precision: args.low_precision_tol.unwrap_or(match dtype {
            DType::BF16 => 5e-2,
            _ => 1e-2,
        }),
    };
    let mut checks = Vec::new();
    let model = Sdar::load(dir, dtype, &device)?;
    let (prefill, decode) = forward_cases(&model, &cases)?;
    checks.push(tol.tensor("prefill_logits", &prefill, want("prefill_logits")?)?);
    checks.push(tol.tensor("decode_logits", &decode, want("decode_logits")?)?);
    drop(model);

    let sft = sft_case(dir, dtype, &device, &cases["sft_loss"])?;
    let loss_want = cases["sft_loss"]["loss"]
        .as_f64()
        .context("cases.json sft_loss has no loss")?;
    let loss_abs = (sft.loss - loss_want).abs();
    checks.push(Check {
        name: "sft_loss".into(),
        max_abs: Some(loss_abs),
        relative: Some(loss_abs / loss_want.abs()),
        tokens_equal: None,
        passed: tol.passes(loss_abs, loss_abs / loss_want.abs()),
    });
    for (name, got) in &sft.grads {
        checks.push(tol.tensor(name, got, want(name)?)?);
    }

    for case in cases["generate"]
        .as_array()
        .context("cases.json has no generate list")?
    {
        let (name, equal, first_difference) = generation_case(dir, dtype, &device, case)?;
        checks.push(Check {
            name: format!("generate/{name}"),
            max_abs: first_difference.map(|i| i as f64),
            relative: None,
            tokens_equal: Some(equal),
            passed: equal || dtype != DType::F32,
        });
    }

    println!(
        "golden checks on {:?} in {dtype:?} ({})",
        device.location(),
        dir.display()
    );
    println!("| check | max abs diff / first differing token | relative | result |");
    println!("| --- | ---: | ---: | --- |");
    for c in &checks {
        let value = match (c.tokens_equal, c.max_abs) {
            (Some(true), _) => "tokens equal".to_string(),
            (Some(false), Some(i)) => format!("differs at token {i}"),
            (_, Some(v)) => format!("{v:.3e}"),
            _ => "-".into(),
        };
        let relative = c.relative.map_or("-".to_string(), |r| format!("{r:.2e}"));
        let result = if c.passed { "pass" } else { "FAIL" };
        println!("| {} | {value} | {relative} | {result} |", c.name);
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

/// f32 must agree to 1e-4 absolute; bf16/fp16 within a fraction of the reference's scale.
struct Tolerance {
    dtype: DType,
    low_precision: f64,
}

impl Tolerance {
    fn passes(&self, abs: f64, relative: f64) -> bool {
        match self.dtype {
            DType::F32 => abs <= 1e-4,
            _ => relative <= self.low_precision,
        }
    }

    fn tensor(&self, name: &str, got: &Tensor, reference: &Tensor) -> Result<Check> {
        let (abs, relative) = difference(got, reference)?;
        Ok(Check {
            name: name.to_string(),
            max_abs: Some(abs),
            relative: Some(relative),
            tokens_equal: None,
            passed: self.passes(abs, relative),
        })
    }
}

/// Max abs difference, and the same over the largest reference magnitude.
fn difference(got: &Tensor, reference: &Tensor) -> Result<(f64, f64)> {
    let got = got.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let reference = reference.to_dtype(DType::F64)?;
    if got.dims() != reference.dims() {
        bail!(
            "shape {:?} differs from the reference's {:?}",
            got.dims(),
            reference.dims()
        );
    }
    let abs = (&got - &reference)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()?;
    let scale = reference.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
    Ok((abs, abs / scale.max(f64::MIN_POSITIVE)))
}

fn u32s(v: &Value, what: &str) -> Result<Vec<u32>> {
    v.as_array()
        .with_context(|| format!("cases.json: {what} is not a list"))?
        .iter()
        .map(|x| {
            x.as_u64()
                .map(|n| n as u32)
                .with_context(|| format!("cases.json: {what} holds a non-integer"))
        })
        .collect()
}

/// Prefill logits of the prefill case, then the decode step over that cache.
fn forward_cases(model: &Sdar, cases: &Value) -> Result<(Tensor, Tensor)> {
    let device = model.device();
    let prompt = u32s(&cases["prefill"]["input_ids"], "prefill.input_ids")?;
    let block = u32s(&cases["decode"]["input_ids"], "decode.input_ids")?;
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

struct SftOutputs {
    loss: f64,
    grads: Vec<(String, Tensor)>,
}

fn sft_case(dir: &Path, dtype: DType, device: &Device, case: &Value) -> Result<SftOutputs> {
    let floats = |v: &Value| -> Vec<f64> {
        v.as_array()
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default()
    };
    let row = PackedRow {
        input_ids: u32s(&case["input_ids"], "sft_loss.input_ids")?,
        noisy_ids: u32s(&case["noisy_input_ids"], "sft_loss.noisy_input_ids")?,
        labels: floats(&case["labels"])
            .into_iter()
            .map(|x| x as i64)
            .collect(),
        position_ids: u32s(&case["position_ids"], "sft_loss.position_ids")?,
        masked_positions: u32s(&case["masked_positions"], "sft_loss.masked_positions")?
            .into_iter()
            .map(|p| p as usize)
            .collect(),
        p_mask: floats(&case["p_mask"])
            .into_iter()
            .map(|x| x as f32)
            .collect(),
    };
    let batch = TwoStreamBatch::new(&[row])?;
    let (model, vars) = Sdar::load_trainable(dir, dtype, device)?;
    let hidden = model.two_stream_hidden(&batch)?;
    let loss = model.sft_loss(&hidden, &batch)?;
    let grads = loss.backward()?;
    let vars = vars
        .data()
        .lock()
        .expect("the VarMap lock is never poisoned");
    let grad = |name: &str| -> Result<Tensor> {
        let var = vars
            .get(name)
            .with_context(|| format!("the model has no weight `{name}`"))?;
        grads
            .get(var.as_tensor())
            .cloned()
            .with_context(|| format!("no gradient reached `{name}`"))
    };
    let rows = Tensor::new(u32s(&case["grad_rows"], "sft_loss.grad_rows")?, device)?;
    Ok(SftOutputs {
        loss: loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
        grads: vec![
            (
                "sft_grad_embed_rows".into(),
                grad("model.embed_tokens.weight")?.index_select(&rows, 0)?,
            ),
            (
                "sft_grad_lm_head_rows".into(),
                grad("lm_head.weight")?.index_select(&rows, 0)?,
            ),
            (
                "sft_grad_layer0_q_proj".into(),
                grad("model.layers.0.self_attn.q_proj.weight")?,
            ),
        ],
    })
}

/// One greedy generation case: (name, equal, index of the first differing generated token).
fn generation_case(
    dir: &Path,
    dtype: DType,
    device: &Device,
    case: &Value,
) -> Result<(String, bool, Option<usize>)> {
    let name = case["name"].as_str().unwrap_or("unnamed").to_string();
    let prompt = u32s(&case["prompt_ids"], "generate.prompt_ids")?;
    let expected = u32s(&case["output_ids"], "generate.output_ids")?;
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
    Ok((name, first_difference.is_none(), first_difference))
}
