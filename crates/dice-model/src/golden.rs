//! The formula golden: the reference implementation's outputs on the weights of
//! [`crate::init::InitWeights::Formula`] (`tests/data/sdar/golden/formula/`, whose README says how
//! they were made and how each case is checked). It holds `config.json`, `cases.json` (inputs,
//! settings, generations, the SFT loss and gradient norms) and `expected.safetensors`
//! (per-row summaries of the logits and SFT gradient rows). [`FormulaGolden`] reads it and
//! measures outputs against it; [`Measurement::passes_f32`] applies the README's tolerances,
//! [`Measurement::passes`] those of the lower-precision dtypes too.

use crate::config::SdarConfig;
use crate::init::{InitWeights, ModelInit, WrittenModel};
use crate::sdar::{KvCache, Sdar};
use crate::sft::{PackedRow, TwoStreamBatch};
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde::Serialize;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Logits (and each value among them) must agree to this in f32.
const LOGIT_TOL: f64 = 1e-4;
/// Σ of a row's logits: a sum of ~150k values.
const SUM_TOL: f64 = 1e-2;
/// |Σ²/reference − 1| of a row.
const SUMSQ_REL_TOL: f64 = 1e-5;
/// The SFT loss and the stored gradient entries, absolute.
const SFT_TOL: f64 = 1e-4;
/// Each parameter's gradient norm, relative.
const GRAD_NORM_REL_TOL: f64 = 1e-3;
/// Rows of a query or loss-head chunk in the trainer's step the golden measures: several chunks
/// of each of its samples (as the CPU test's smallest), so chunking is checked too.
const SFT_STEP_CHUNK_ROWS: usize = 4;
/// Largest logits compared per row.
const TOP: usize = 32;

/// The default tolerance of a bf16 or fp16 difference relative to the reference's magnitude:
/// about 13 and 20 units of their rounding (2^-8 and 2^-11 relative), the spread that dozens of
/// roundings through a forward and backward pass leave.
pub fn low_precision_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 5e-2,
        _ => 1e-2,
    }
}

/// One comparison with the reference.
#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    /// `case/quantity`, e.g. `prefill/lse` or `sft/loss`.
    pub name: String,
    /// The largest difference: absolute, relative for `sumsq` and `grad_norms`, and a count of
    /// differing rows for `argmax`.
    pub max_diff: f64,
    /// The bound of `max_diff` in f32 (the README's).
    pub tolerance: f64,
    /// The reference magnitude that `max_diff` is measured against at lower precision
    /// (`max_diff / scale`); `None` for counts, which only f32 must get exactly right.
    pub scale: Option<f64>,
}

impl Measurement {
    pub fn passes_f32(&self) -> bool {
        self.max_diff <= self.tolerance
    }

    /// In f32 the README's tolerance; in a lower precision the difference relative to the
    /// reference's magnitude must stay within `low_precision_tol`, and counts (argmax rows) are
    /// reported, not required: a near-tie may legitimately flip under rounding.
    pub fn passes(&self, dtype: DType, low_precision_tol: f64) -> bool {
        match (dtype, self.relative()) {
            (DType::F32, _) => self.passes_f32(),
            (_, Some(relative)) => relative <= low_precision_tol,
            (_, None) => true,
        }
    }

    /// `max_diff` relative to the reference's magnitude, for the lower-precision dtypes.
    pub fn relative(&self) -> Option<f64> {
        self.scale
            .map(|scale| self.max_diff / scale.max(f64::MIN_POSITIVE))
    }
}

/// The two logits cases: a block-causal prefill, then one cached decode step over it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsCase {
    /// `prefill.input_ids` at positions 0.., the cache kept.
    Prefill,
    /// `decode.input_ids` over the prefill's cache, `store_kv = false`.
    Decode,
}

impl LogitsCase {
    pub fn name(self) -> &'static str {
        match self {
            LogitsCase::Prefill => "prefill",
            LogitsCase::Decode => "decode",
        }
    }
}

/// A formula golden folder, read.
pub struct FormulaGolden {
    dir: PathBuf,
    config: SdarConfig,
    cases: Value,
    expected: HashMap<String, Tensor>,
}

impl FormulaGolden {
    /// Reads `config.json`, `cases.json` and `expected.safetensors` of `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let config = SdarConfig::from_path(&dir.join("config.json"))?;
        let cases_path = dir.join("cases.json");
        let cases: Value = serde_json::from_slice(
            &std::fs::read(&cases_path)
                .with_context(|| format!("cannot read {}", cases_path.display()))?,
        )
        .with_context(|| format!("{} is not valid JSON", cases_path.display()))?;
        let expected_path = dir.join("expected.safetensors");
        let expected = candle_core::safetensors::load(&expected_path, &Device::Cpu)
            .with_context(|| format!("cannot read {}", expected_path.display()))?;
        if expected.contains_key("prefill_logits") {
            bail!(
                "{} holds full logits (the random-weight golden); this reads the formula golden (tests/data/sdar/golden/formula)",
                expected_path.display()
            );
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            cases,
            expected,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The model configuration of the golden's checkpoint.
    pub fn config(&self) -> &SdarConfig {
        &self.config
    }

    /// Writes the golden's checkpoint (the formula weights of its config) into `out`, with the
    /// tokenizer files of `tokenizer` when given; the model files of an earlier checkpoint there
    /// are replaced.
    pub fn write_checkpoint(&self, out: &Path, tokenizer: Option<&Path>) -> Result<WrittenModel> {
        ModelInit {
            tokenizer,
            overwrite: true,
            ..ModelInit::new(&self.config, InitWeights::Formula)
        }
        .write(out)
    }

    /// The whole `cases.json`.
    pub fn cases(&self) -> &Value {
        &self.cases
    }

    /// The input ids of a logits case.
    pub fn input_ids(&self, case: LogitsCase) -> Result<Vec<u32>> {
        u32s(
            &self.cases[case.name()]["input_ids"],
            &format!("{}.input_ids", case.name()),
        )
    }

    /// The four greedy generation cases (`prompt_ids`, settings, `output_ids`).
    pub fn generations(&self) -> Result<&[Value]> {
        self.cases["generate"]
            .as_array()
            .map(Vec::as_slice)
            .context("cases.json has no generate list")
    }

    /// The SFT case's packed row, with the recorded noise draw.
    pub fn sft_batch(&self) -> Result<TwoStreamBatch> {
        let case = &self.cases["sft_loss"];
        let row = PackedRow {
            input_ids: u32s(&case["input_ids"], "sft_loss.input_ids")?,
            noisy_ids: u32s(&case["noisy_input_ids"], "sft_loss.noisy_input_ids")?,
            labels: numbers(&case["labels"], "sft_loss.labels", Value::as_i64)?,
            position_ids: u32s(&case["position_ids"], "sft_loss.position_ids")?,
            masked_positions: u32s(&case["masked_positions"], "sft_loss.masked_positions")?
                .into_iter()
                .map(|p| p as usize)
                .collect(),
            p_mask: numbers(&case["p_mask"], "sft_loss.p_mask", Value::as_f64)?
                .into_iter()
                .map(|p| p as f32)
                .collect(),
        };
        TwoStreamBatch::new(&[row])
    }

    fn expected(&self, name: &str) -> Result<&Tensor> {
        self.expected
            .get(name)
            .with_context(|| format!("expected.safetensors has no tensor `{name}`"))
    }

    /// Measures the logits of a case ([rows, vocab], any device and dtype) against the stored
    /// summaries, computed here in f64 from f32 values: each row's logsumexp, Σ and Σ², the
    /// logits at the reference's top-32 indices, our own 32 largest values sorted, the logits at
    /// the fixed columns, and the argmax.
    pub fn measure_logits(&self, case: LogitsCase, logits: &Tensor) -> Result<Vec<Measurement>> {
        let name = case.name();
        let rows: Vec<Vec<f32>> = logits
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .to_vec2()?;
        let want_f64 = |key: &str| -> Result<Vec<f64>> {
            Ok(self
                .expected(&format!("{name}_{key}"))?
                .to_dtype(DType::F64)?
                .to_vec1()?)
        };
        let want_f32 = |key: &str| -> Result<Vec<Vec<f32>>> {
            Ok(self
                .expected(&format!("{name}_{key}"))?
                .to_dtype(DType::F32)?
                .to_vec2()?)
        };
        let (lse, sum, sumsq) = (want_f64("lse")?, want_f64("sum")?, want_f64("sumsq")?);
        let top_idx: Vec<Vec<i64>> = self.expected(&format!("{name}_top32_idx"))?.to_vec2()?;
        let top_val = want_f32("top32_val")?;
        let cols_val = want_f32("cols")?;
        let columns: Vec<i64> = self.expected("logit_columns")?.to_vec1()?;
        ensure!(
            rows.len() == lse.len(),
            "{name}: {} rows of logits, the reference has {}",
            rows.len(),
            lse.len()
        );
        let vocab = rows.first().map_or(0, Vec::len);
        ensure!(
            vocab == self.config.vocab_size,
            "{name}: rows of {vocab} logits, the vocabulary has {}",
            self.config.vocab_size
        );
        let at = |row: &[f32], index: i64| -> Result<f64> {
            usize::try_from(index)
                .ok()
                .and_then(|i| row.get(i))
                .map(|&v| f64::from(v))
                .with_context(|| format!("expected.safetensors: column {index} is out of range"))
        };

        let mut diff = Differences::default();
        for (r, row) in rows.iter().enumerate() {
            let stats = RowStatistics::of(row);
            diff.lse.add(stats.lse - lse[r], lse[r]);
            diff.sum
                .add(stats.sum - sum[r], (vocab as f64 * sumsq[r]).sqrt());
            diff.sumsq.add(stats.sumsq / sumsq[r] - 1.0, 1.0);
            for (&index, &value) in top_idx[r].iter().zip(&top_val[r]) {
                diff.top_at_index
                    .add(at(row, index)? - f64::from(value), f64::from(value));
            }
            for (ours, &value) in stats.top.iter().zip(&top_val[r]) {
                diff.top_sorted
                    .add(f64::from(*ours) - f64::from(value), f64::from(value));
            }
            for (&index, &value) in columns.iter().zip(&cols_val[r]) {
                diff.columns
                    .add(at(row, index)? - f64::from(value), f64::from(value));
            }
            if stats.argmax as i64 != top_idx[r][0] {
                diff.argmax_rows += 1;
            }
        }
        let named = |quantity: &str| format!("{name}/{quantity}");
        Ok(vec![
            diff.lse.measurement(named("lse"), LOGIT_TOL),
            diff.sum.measurement(named("sum"), SUM_TOL),
            diff.sumsq.measurement(named("sumsq"), SUMSQ_REL_TOL),
            diff.top_at_index
                .measurement(named("top32_at_reference_indices"), LOGIT_TOL),
            diff.top_sorted
                .measurement(named("top32_sorted"), LOGIT_TOL),
            diff.columns.measurement(named("columns"), LOGIT_TOL),
            Measurement {
                name: named("argmax"),
                max_diff: diff.argmax_rows as f64,
                tolerance: 0.0,
                scale: None,
            },
        ])
    }

    /// Measures the SFT loss and gradients (checkpoint name → gradient, any device and dtype):
    /// the loss, the stored rows of the embedding and lm_head gradients and the whole layer-0
    /// q_proj gradient, and every parameter's gradient norm (relative).
    pub fn measure_sft(
        &self,
        loss: f64,
        grads: &HashMap<String, Tensor>,
    ) -> Result<Vec<Measurement>> {
        let case = &self.cases["sft_loss"];
        let reference = case["loss"]
            .as_f64()
            .context("cases.json: sft_loss has no loss")?;
        let grad = |name: &str| -> Result<Tensor> {
            Ok(grads
                .get(name)
                .with_context(|| format!("no gradient of `{name}`"))?
                .to_device(&Device::Cpu)?
                .to_dtype(DType::F64)?)
        };
        let rows = Tensor::new(
            u32s(&case["grad_rows"], "sft_loss.grad_rows")?,
            &Device::Cpu,
        )?;
        let mut measurements = vec![Measurement {
            name: "sft/loss".into(),
            max_diff: (loss - reference).abs(),
            tolerance: SFT_TOL,
            scale: Some(reference.abs()),
        }];
        for (key, ours) in [
            (
                "sft_grad_embed_rows",
                grad("model.embed_tokens.weight")?.index_select(&rows, 0)?,
            ),
            (
                "sft_grad_lm_head_rows",
                grad("lm_head.weight")?.index_select(&rows, 0)?,
            ),
            (
                "sft_grad_layer0_q_proj",
                grad("model.layers.0.self_attn.q_proj.weight")?,
            ),
        ] {
            let want = self.expected(key)?.to_dtype(DType::F64)?;
            ensure!(
                ours.dims() == want.dims(),
                "{key}: shape {:?}, the reference's is {:?}",
                ours.dims(),
                want.dims()
            );
            measurements.push(Measurement {
                name: format!("sft/{key}"),
                max_diff: max_abs(&(&ours - &want)?)?,
                tolerance: SFT_TOL,
                scale: Some(max_abs(&want)?),
            });
        }
        let norms = case["grad_norms"]
            .as_object()
            .context("cases.json: sft_loss has no grad_norms")?;
        ensure!(
            norms.len() == grads.len(),
            "{} gradients, the reference has {} (one per checkpoint tensor)",
            grads.len(),
            norms.len()
        );
        let mut norm_diff = Largest::default();
        for (name, norm) in norms {
            let want = norm
                .as_f64()
                .with_context(|| format!("cases.json: grad_norms.{name} is not a number"))?;
            let ours = grad(name)?.sqr()?.sum_all()?.sqrt()?.to_scalar::<f64>()?;
            norm_diff.add(ours / want - 1.0, 1.0);
        }
        measurements.push(norm_diff.measurement("sft/grad_norms".into(), GRAD_NORM_REL_TOL));
        Ok(measurements)
    }

    /// Measures the checkpoint of `dir` (the golden's formula weights) in `dtype` on `device`:
    /// the prefill logits, the decode step over that cache, the SFT loss and every gradient
    /// through the single graph (`sft/…`), and again through the trainer's step (`sft-step/…`:
    /// checkpointed, and on a GPU the fused attention, layer and loss head the trainer runs).
    pub fn measure_checkpoint(
        &self,
        dir: &Path,
        dtype: DType,
        device: &Device,
    ) -> Result<Vec<Measurement>> {
        let model = Sdar::load(dir, dtype, device)?;
        let (prefill, decode) = self.forward_logits(&model)?;
        let mut measurements = self.measure_logits(LogitsCase::Prefill, &prefill)?;
        measurements.extend(self.measure_logits(LogitsCase::Decode, &decode)?);
        let step = model.sft_loss_and_grads(&self.sft_batch()?, SFT_STEP_CHUNK_ROWS)?;
        drop(model);
        let (loss, grads) = self.sft_loss_and_grads(dir, dtype, device)?;
        measurements.extend(self.measure_sft(loss, &grads)?);
        let trainer = self.measure_sft(f64::from(step.loss), &step.grads)?;
        measurements.extend(trainer.into_iter().map(|m| Measurement {
            name: m.name.replacen("sft/", "sft-step/", 1),
            ..m
        }));
        Ok(measurements)
    }

    /// The prefill case's logits, then those of the decode step over its cache.
    fn forward_logits(&self, model: &Sdar) -> Result<(Tensor, Tensor)> {
        let device = model.device();
        let prompt = self.input_ids(LogitsCase::Prefill)?;
        let block = self.input_ids(LogitsCase::Decode)?;
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

    /// The SFT loss of the golden's batch through the single-graph path, and every weight's
    /// gradient by checkpoint name.
    fn sft_loss_and_grads(
        &self,
        dir: &Path,
        dtype: DType,
        device: &Device,
    ) -> Result<(f64, HashMap<String, Tensor>)> {
        let batch = self.sft_batch()?;
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
}

/// Logsumexp, Σ and Σ² (f64), the 32 largest values (descending) and the first index of the
/// largest value of one row of logits.
struct RowStatistics {
    lse: f64,
    sum: f64,
    sumsq: f64,
    top: Vec<f32>,
    argmax: usize,
}

impl RowStatistics {
    fn of(row: &[f32]) -> Self {
        let mut argmax = 0;
        for (i, &v) in row.iter().enumerate() {
            if v > row[argmax] {
                argmax = i;
            }
        }
        let max = f64::from(row[argmax]);
        let exp_sum: f64 = row.iter().map(|&v| (f64::from(v) - max).exp()).sum();
        let mut top = row.to_vec();
        let by_value_descending = |a: &f32, b: &f32| b.total_cmp(a);
        if top.len() > TOP {
            top.select_nth_unstable_by(TOP - 1, by_value_descending);
            top.truncate(TOP);
        }
        top.sort_unstable_by(by_value_descending);
        Self {
            lse: max + exp_sum.ln(),
            sum: row.iter().map(|&v| f64::from(v)).sum(),
            sumsq: row.iter().map(|&v| f64::from(v).powi(2)).sum(),
            top,
            argmax,
        }
    }
}

/// The largest |difference| seen, and the largest reference magnitude beside it.
#[derive(Default)]
struct Largest {
    diff: f64,
    scale: f64,
}

impl Largest {
    fn add(&mut self, difference: f64, reference: f64) {
        // NaN never compares greater: keep it visible instead of losing it.
        if difference.is_nan() || difference.abs() > self.diff {
            self.diff = difference.abs();
        }
        self.scale = self.scale.max(reference.abs());
    }

    fn measurement(&self, name: String, tolerance: f64) -> Measurement {
        Measurement {
            name,
            max_diff: self.diff,
            tolerance,
            scale: Some(self.scale),
        }
    }
}

#[derive(Default)]
struct Differences {
    lse: Largest,
    sum: Largest,
    sumsq: Largest,
    top_at_index: Largest,
    top_sorted: Largest,
    columns: Largest,
    argmax_rows: usize,
}

fn max_abs(t: &Tensor) -> Result<f64> {
    Ok(t.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?)
}

fn numbers<T>(v: &Value, what: &str, number: impl Fn(&Value) -> Option<T>) -> Result<Vec<T>> {
    v.as_array()
        .with_context(|| format!("cases.json: {what} is not a list"))?
        .iter()
        .map(|x| number(x).with_context(|| format!("cases.json: {what} holds a non-number")))
        .collect()
}

fn u32s(v: &Value, what: &str) -> Result<Vec<u32>> {
    numbers(v, what, |x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lower_precisions_are_judged_relative_to_the_reference_and_counts_only_in_f32() {
        let logits = Measurement {
            name: "prefill/lse".into(),
            max_diff: 0.3,
            tolerance: LOGIT_TOL,
            scale: Some(10.0),
        };
        assert!(!logits.passes(DType::F32, 1.0));
        assert!(logits.passes(DType::BF16, low_precision_tolerance(DType::BF16)));
        assert!(!logits.passes(DType::F16, low_precision_tolerance(DType::F16)));
        let argmax = Measurement {
            name: "prefill/argmax".into(),
            max_diff: 1.0,
            tolerance: 0.0,
            scale: None,
        };
        assert!(!argmax.passes(DType::F32, 1.0));
        assert!(argmax.passes(DType::BF16, 0.0));
    }
}
