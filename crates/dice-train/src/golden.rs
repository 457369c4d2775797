//! The formula golden's training case `adamw` (tests/data/sdar/golden/formula/README.md,
//! "Training case adamw") on any device: from the formula weights in f32, two clipped AdamW steps
//! on the `sft_loss` batch with its recorded noise draw, through the trainer's step
//! ([`Sdar::sft_loss_and_grads`]: on a GPU the fused attention, layer and loss head) and the
//! optimizer (on a GPU its fused kernel), at weight decay 0.01 and 0. Losses, pre-clip gradient
//! norms and the updated weights must match torch 2.11's within the README's tolerances, and the
//! rows that get no gradient must move by exactly the decay. The CPU test
//! (tests/it/adamw_golden.rs) and `dice bench golden` (in f32, on the chosen device) run it.

use crate::dist::SingleProcess;
use crate::optim::{grad_clip, AdamW, AdamWConfig};
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use dice_model::golden::FormulaGolden;
use dice_model::sdar::QUERY_CHUNK;
use dice_model::{Sdar, TwoStreamBatch};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

const LOSS_TOL: f64 = 1e-4;
const GRAD_NORM_REL_TOL: f64 = 1e-4;
/// |w − ref| ≤ REL·|ref| + ABS for every stored weight but the loose ones.
const WEIGHT_REL_TOL: f64 = 1e-5;
const WEIGHT_ABS_TOL: f64 = 1e-6;
/// |w − ref| for the few elements whose step-1 gradient is a cancelled sum near ε.
const LOOSE_TOL: f64 = 5e-5;

const EMBED: &str = "model.embed_tokens.weight";
const LM_HEAD: &str = "lm_head.weight";
const Q_PROJ: &str = "model.layers.0.self_attn.q_proj.weight";
const NORM: &str = "model.norm.weight";

/// Embedding rows whose gradient is exactly zero at every step: rows 0 and 151935 are not in
/// the batch, and no masked row sees the clean-stream positions of 42, 43 and 62–66.
const ZERO_GRADIENT_ROWS: [u32; 9] = [0, 151935, 42, 43, 62, 63, 64, 65, 66];

fn number(v: &Value, what: &str) -> Result<f64> {
    v.as_f64()
        .with_context(|| format!("cases.json: adamw {what} is not a number"))
}

fn ids(v: &Value, what: &str) -> Result<Vec<u32>> {
    v.as_array()
        .with_context(|| format!("cases.json: adamw {what} is not a list"))?
        .iter()
        .map(|id| {
            id.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .with_context(|| format!("cases.json: adamw {what} holds a non-id"))
        })
        .collect()
}

fn values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .to_vec1()?)
}

/// The case's settings of weight decay, as cases.json names them.
pub const ADAMW_RUNS: [&str; 2] = ["wd001", "wd0"];

/// The formula golden's `adamw` case: its cases, batch and the weights torch computed.
pub struct AdamWGolden<'a> {
    golden: &'a FormulaGolden,
    batch: TwoStreamBatch,
    /// `expected_train.safetensors`, on the CPU.
    expected: HashMap<String, Tensor>,
}

impl<'a> AdamWGolden<'a> {
    /// Reads the case from `golden` (its folder's `expected_train.safetensors` too).
    pub fn open(golden: &'a FormulaGolden) -> Result<Self> {
        let path = golden.dir().join("expected_train.safetensors");
        let expected = candle_core::safetensors::load(&path, &Device::Cpu)
            .with_context(|| format!("reading {}", path.display()))?;
        Ok(Self {
            golden,
            batch: golden.sft_batch()?,
            expected,
        })
    }

    fn adamw(&self) -> &Value {
        &self.golden.cases()["adamw"]
    }

    /// The stored rows of our weights under the golden's key names (without the prefix).
    fn stored_views(&self, weights: &HashMap<String, Var>) -> Result<Vec<(&'static str, Tensor)>> {
        let rows = |key: &str| -> Result<Tensor> {
            Ok(Tensor::new(ids(&self.adamw()[key], key)?, &Device::Cpu)?)
        };
        // Read on the CPU, where the reference's rows are.
        let weight = |name: &str| -> Result<Tensor> {
            Ok(weights
                .get(name)
                .with_context(|| format!("the model has no `{name}`"))?
                .as_detached_tensor()
                .to_device(&Device::Cpu)?)
        };
        Ok(vec![
            ("layer0_q_proj", weight(Q_PROJ)?),
            ("model_norm", weight(NORM)?),
            (
                "embed_rows",
                weight(EMBED)?.index_select(&rows("embed_row_ids")?, 0)?,
            ),
            (
                "lm_head_rows",
                weight(LM_HEAD)?.index_select(&rows("lm_head_row_ids")?, 0)?,
            ),
        ])
    }

    /// Runs one weight-decay setting (of [`ADAMW_RUNS`]) on the formula checkpoint in
    /// `model_dir`, in f32 on `device`, and checks it: an error names the first value outside
    /// its tolerance; otherwise a line of the measured margins.
    pub fn check_run(&self, model_dir: &Path, run_name: &str, device: &Device) -> Result<String> {
        let case = self.adamw();
        let run = &case["runs"][run_name];
        let lr = number(&case["lr"], "lr")?;
        let max_grad_norm = number(&case["max_grad_norm"], "max_grad_norm")?;
        let config = AdamWConfig {
            weight_decay: number(&run["weight_decay"], "weight_decay")?,
            ..AdamWConfig::default()
        };
        ensure!(
            [config.beta1, config.beta2, config.eps]
                == [
                    number(&case["betas"][0], "betas")?,
                    number(&case["betas"][1], "betas")?,
                    number(&case["eps"], "eps")?,
                ],
            "the golden's betas and eps are not AdamWConfig's defaults"
        );

        let (model, vars) = Sdar::load_trainable(model_dir, DType::F32, device)?;
        let weights: HashMap<String, Var> = vars.data().lock().expect("not poisoned").clone();
        let embed = weights[EMBED].as_detached_tensor();
        let zero_rows = Tensor::new(&ZERO_GRADIENT_ROWS, device)?;
        let initial_zero_rows = values(&embed.index_select(&zero_rows, 0)?)?;
        let mut optimizer = AdamW::new(weights.clone(), config)?;

        let mut report = String::new();
        for step in 1..=2 {
            let step_result = model.sft_loss_and_grads(&self.batch, QUERY_CHUNK)?;
            let loss = f64::from(step_result.loss);
            let want_loss = number(&run[format!("loss_step{step}")], "loss")?;
            ensure!(
                (loss - want_loss).abs() <= LOSS_TOL,
                "{run_name} step {step}: loss {loss}, the reference's {want_loss}"
            );
            let zero = step_result.grads[EMBED]
                .index_select(&zero_rows, 0)?
                .abs()?
                .max_keepdim(1)?;
            ensure!(
                values(&zero)?.iter().all(|&g| g == 0.0),
                "{run_name} step {step}: embedding rows {ZERO_GRADIENT_ROWS:?} should get no gradient, their largest |g| are {:?}",
                values(&zero)?
            );
            let clip = grad_clip(&step_result.grads, max_grad_norm, &SingleProcess)?;
            let norm = f64::from(clip.norm);
            let want_norm = number(
                &run[format!("grad_norm_before_clip_step{step}")],
                "grad norm",
            )?;
            let norm_diff = (norm / want_norm - 1.0).abs();
            ensure!(
                norm_diff <= GRAD_NORM_REL_TOL,
                "{run_name} step {step}: gradient norm {norm}, the reference's {want_norm}"
            );
            optimizer.step(&step_result.grads, lr, clip.factor)?;
            report += &format!(
                " step {step} loss Δ {:.1e}, norm rel Δ {norm_diff:.1e};",
                (loss - want_loss).abs()
            );
        }

        let hidden = model.two_stream_hidden(&self.batch)?;
        let loss_after = f64::from(model.sft_loss(&hidden, &self.batch)?.to_scalar::<f32>()?);
        let want_after = number(&run["loss_after_step2"], "loss_after_step2")?;
        ensure!(
            (loss_after - want_after).abs() <= LOSS_TOL,
            "{run_name}: loss after step 2 {loss_after}, the reference's {want_after}"
        );
        report += &format!(" loss after Δ {:.1e};", (loss_after - want_after).abs());

        let prefix = run["tensor_prefix"]
            .as_str()
            .context("cases.json: adamw tensor_prefix is not a string")?;
        let loose = self.loose_indices()?;
        for (key, ours) in self.stored_views(&weights)? {
            let name = format!("{prefix}_{key}");
            let reference = self
                .expected
                .get(&name)
                .with_context(|| format!("expected_train.safetensors has no `{name}`"))?;
            ensure!(
                ours.dims() == reference.dims(),
                "{name}: shape {:?}, the reference's {:?}",
                ours.dims(),
                reference.dims()
            );
            let (mut worst_strict, mut worst_loose) = (0f64, 0f64);
            for (i, (&w, &r)) in values(&ours)?.iter().zip(&values(reference)?).enumerate() {
                let (w, r) = (f64::from(w), f64::from(r));
                let diff = (w - r).abs();
                if key == "layer0_q_proj" && loose.contains(&i) {
                    ensure!(
                        diff <= LOOSE_TOL,
                        "{name}[{i}] (loose): {w}, the reference's {r}"
                    );
                    worst_loose = worst_loose.max(diff);
                } else {
                    let tol = WEIGHT_REL_TOL * r.abs() + WEIGHT_ABS_TOL;
                    ensure!(
                        diff <= tol,
                        "{name}[{i}]: {w}, the reference's {r} (tolerance {tol:e})"
                    );
                    worst_strict = worst_strict.max(diff / tol);
                }
            }
            report += &format!(" {key} ≤ {worst_strict:.2}·tol");
            if key == "layer0_q_proj" {
                report += &format!(" (loose {worst_loose:.1e})");
            }
            report += ";";
        }

        // Adam's update of a zero-gradient element is 0 / (0 + ε) = 0: only the decay moves it,
        // once per step, by the f32 factor torch multiplies with.
        let decay = (1.0 - lr * config.weight_decay) as f32;
        let after = values(
            &weights[EMBED]
                .as_detached_tensor()
                .index_select(&zero_rows, 0)?,
        )?;
        for (i, (&w, &w0)) in after.iter().zip(&initial_zero_rows).enumerate() {
            ensure!(
                w.to_bits() == (w0 * decay * decay).to_bits(),
                "{run_name}: zero-gradient embedding element {i} is {w}, expected {} exactly",
                w0 * decay * decay
            );
        }
        Ok(report.trim().to_string())
    }

    /// Row-major indices in the layer-0 q_proj of `adamw.loose_elements`.
    fn loose_indices(&self) -> Result<Vec<usize>> {
        let q_proj_cols = self.golden.config().hidden_size;
        self.adamw()["loose_elements"]
            .as_array()
            .context("cases.json: adamw loose_elements is not a list")?
            .iter()
            .map(|e| {
                ensure!(
                    e["tensor"] == "layer0_q_proj",
                    "cases.json: a loose element outside layer0_q_proj"
                );
                let index = number(&e["index"], "loose index")? as usize;
                let (row, col) = (
                    number(&e["row"], "loose row")?,
                    number(&e["col"], "loose col")?,
                );
                ensure!(
                    index == row as usize * q_proj_cols + col as usize,
                    "cases.json: loose element {index} is not at ({row}, {col})"
                );
                Ok(index)
            })
            .collect()
    }
}
