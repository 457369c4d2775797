//! The `tracerl` case of the formula golden (tests/data/sdar/golden/formula/README.md, "Training
//! case tracerl"): one TraceRL computation of the reference's `rl_sdar.py` in f32 on the
//! formula weights, for the trainer's block grid and the rollout grid, with one zero-variance
//! group dropped and with both groups kept. Checked as the README says: advantages, the replay
//! samples and their tensors exactly, old log-probabilities, per-sample and total losses at
//! ratio 1 and after an SGD step θ − 0.01·g with our own g (with its clipped tokens and
//! ratios), and the gradients at both points.

use crate::common::TrainingGolden;
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use dice_model::Sdar;
use dice_train::rl::advantage::{group_advantages, z_scores};
use dice_train::rl::{
    old_log_probs, policy_loss_and_grads, BlockGrid, PolicyLoss, PolicyLossSettings, Replay,
    ReplaySettings, TraceRecord,
};
use serde_json::Value;
use std::collections::HashMap;

/// Old log-probabilities, ratios, losses and gradient entries, absolute.
const TOL: f64 = 1e-4;
/// Each parameter's gradient norm, relative.
const GRAD_NORM_REL_TOL: f64 = 1e-3;

fn f64s(v: &Value, what: &str) -> Result<Vec<f64>> {
    v.as_array()
        .with_context(|| format!("cases.json: tracerl {what} is not a list"))?
        .iter()
        .map(|x| {
            x.as_f64()
                .with_context(|| format!("cases.json: tracerl {what} holds a non-number"))
        })
        .collect()
}

fn usize_of(v: &Value, what: &str) -> Result<usize> {
    v.as_u64()
        .map(|n| n as usize)
        .with_context(|| format!("cases.json: tracerl {what} is not a count"))
}

fn usizes(v: &Value, what: &str) -> Result<Vec<usize>> {
    Ok(f64s(v, what)?.into_iter().map(|x| x as usize).collect())
}

fn u32s(v: &Value, what: &str) -> Result<Vec<u32>> {
    Ok(f64s(v, what)?.into_iter().map(|x| x as u32).collect())
}

/// One of the case's four runs.
struct Run {
    name: &'static str,
    grid: BlockGrid,
    /// Group 1 gets correct {0, 1} instead of {1, 1}, so it is kept.
    both_kept: bool,
    /// The gradient views stored for this run in expected_train.safetensors.
    stored_grads: &'static [&'static str],
}

struct Case {
    training: TrainingGolden,
}

impl Case {
    fn open() -> Result<Self> {
        Ok(Self {
            training: TrainingGolden::open()?,
        })
    }

    fn tracerl(&self) -> &Value {
        &self.training.golden.cases()["tracerl"]
    }

    fn tensor(&self, prefix: &str, key: &str) -> Result<&Tensor> {
        let name = format!("{prefix}_{key}");
        self.training
            .expected
            .get(&name)
            .with_context(|| format!("expected_train.safetensors has no `{name}`"))
    }

    /// The training records of the groups that are kept, after checking every group's
    /// advantages, which groups are kept and where the records come from.
    fn records(&self, run: &Run) -> Result<Vec<TraceRecord>> {
        let case = self.tracerl();
        let groups = case["groups"]
            .as_array()
            .context("cases.json: tracerl groups is not a list")?;
        let mut records = Vec::new();
        let mut origins = Vec::new();
        for (g, group) in groups.iter().enumerate() {
            let variant = &case["variant_both_kept"];
            let (correct, want) = if run.both_kept {
                let correct = match g {
                    1 => f64s(&variant["group2_correct"], "group2_correct")?,
                    _ => f64s(&group["correct"], "correct")?,
                };
                (correct, f64s(&variant["advantages"][g], "advantages")?)
            } else {
                (
                    f64s(&group["correct"], "correct")?,
                    f64s(&group["advantages"], "advantages")?,
                )
            };
            ensure!(
                z_scores(&correct) == want,
                "group {g}: advantages {:?}, the reference's {want:?}",
                z_scores(&correct)
            );
            let kept = group_advantages(&correct);
            let want_kept = run.both_kept || group["kept"].as_bool() == Some(true);
            ensure!(
                kept.is_some() == want_kept,
                "group {g}: kept {}, the reference keeps it: {want_kept}",
                kept.is_some()
            );
            let Some(advantages) = kept else { continue };
            let responses = group["responses"]
                .as_array()
                .context("cases.json: tracerl responses is not a list")?;
            for (j, (response, advantage)) in responses.iter().zip(advantages).enumerate() {
                records.push(TraceRecord {
                    prompt: u32s(&group["prompt_ids"], "prompt_ids")?,
                    response: u32s(&response["ids"], "response ids")?,
                    trace: u32s(&response["step_map"], "step_map")?,
                    advantage,
                });
                origins.push((g, j, advantage));
            }
        }
        let want: Vec<(usize, usize, f64)> = self.run_json(run)["records"]
            .as_array()
            .context("cases.json: tracerl records is not a list")?
            .iter()
            .map(|r| {
                Ok((
                    usize_of(&r["group"], "record group")?,
                    usize_of(&r["response"], "record response")?,
                    r["advantage"].as_f64().context("advantage")?,
                ))
            })
            .collect::<Result<_>>()?;
        ensure!(
            origins == want,
            "training records {origins:?}, the reference's {want:?}"
        );
        Ok(records)
    }

    fn run_json(&self, run: &Run) -> &Value {
        &self.tracerl()["runs"][run.name]
    }

    fn settings(&self, run: &Run) -> Result<(ReplaySettings, PolicyLossSettings)> {
        let case = self.tracerl();
        let s = &case["settings"];
        ensure!(
            s["method"] == "TraceRL" && s["use_kl_estimator_k3"] == true,
            "cases.json: tracerl is not TraceRL with the k3 estimator"
        );
        let replay = ReplaySettings {
            block_size: usize_of(&s["block_size"], "block_size")?,
            shrink: usize_of(&s["shrink"], "shrink")?,
            post_num: Some(usize_of(&s["post_num"], "post_num")?),
            max_prompt_len: usize_of(&s["max_prompt_len"], "max_prompt_len")?,
            max_response_len: usize_of(&s["max_gen_length"], "max_gen_length")?,
            mask_id: usize_of(&case["mask_token_id"], "mask_token_id")? as u32,
            pad_id: usize_of(&case["pad_token_id"], "pad_token_id")? as u32,
            grid: run.grid,
        };
        let loss = PolicyLossSettings {
            clip_eps: s["eps"].as_f64().context("eps")? as f32,
            kl_beta: s["beta"].as_f64().context("beta")? as f32,
        };
        Ok((replay, loss))
    }

    /// The replay's layout, sample list and tensors, which must match exactly.
    fn check_replay(&self, run: &Run, replay: &Replay) -> Result<()> {
        let json = self.run_json(run);
        let prefix = json["tensor_prefix"]
            .as_str()
            .context("cases.json: tensor_prefix")?;
        let (l0, l1) = (replay.prompt_width, replay.region_width);
        let widths = [l0, l1, replay.loss_normaliser];
        let want_widths = [
            usize_of(&json["L0"], "L0")?,
            usize_of(&json["L1"], "L1")?,
            usize_of(&json["loss_normaliser_L1"], "loss_normaliser_L1")?,
        ];
        ensure!(
            widths == want_widths,
            "L0, L1 and the normaliser are {widths:?}, the reference's {want_widths:?}"
        );
        let tails: Vec<usize> = replay.records.iter().map(|r| r.tail).collect();
        let want_tails = usizes(
            &json["prompt_tail_moved_into_response_region"],
            "prompt_tail_moved_into_response_region",
        )?;
        ensure!(
            tails == want_tails,
            "moved prompt tails {tails:?}, the reference's {want_tails:?}"
        );
        let rounds: Vec<usize> = replay.records.iter().map(|r| r.rounds).collect();
        let mut want_rounds = vec![0; replay.records.len()];
        for pair in json["replay_rounds_before_drop"]
            .as_array()
            .context("replay_rounds_before_drop")?
        {
            let record = usize_of(&pair[0], "replay round record")?;
            *want_rounds
                .get_mut(record)
                .context("a replay round of a record we do not have")? += 1;
        }
        ensure!(
            rounds == want_rounds,
            "rounds per record {rounds:?}, the reference's {want_rounds:?}"
        );

        let want_samples = json["samples"].as_array().context("samples")?;
        ensure!(
            replay.samples.len() == want_samples.len(),
            "{} samples, the reference's {}",
            replay.samples.len(),
            want_samples.len()
        );
        let ids: Vec<Vec<i64>> = self.tensor(prefix, "extended_input_ids")?.to_vec2()?;
        let positions: Vec<Vec<i64>> = self.tensor(prefix, "position_ids")?.to_vec2()?;
        let p_mask: Vec<Vec<u8>> = self.tensor(prefix, "p_mask")?.to_vec2()?;
        for (n, (sample, want)) in replay.samples.iter().zip(want_samples).enumerate() {
            let origin = (
                sample.record,
                sample.round,
                replay.response_positions(sample),
            );
            let want_origin = (
                usize_of(&want["record"], "sample record")?,
                usize_of(&want["round"], "sample round")?,
                usizes(&want["loss_positions"], "loss_positions")?,
            );
            ensure!(
                origin == want_origin,
                "sample {n} (record, round, loss positions) is {origin:?}, the reference's {want_origin:?}"
            );
            let ours: Vec<i64> = replay
                .input_ids(sample)
                .into_iter()
                .map(i64::from)
                .collect();
            ensure!(
                ours == ids[n],
                "sample {n} input ids {ours:?}, the reference's {:?}",
                ids[n]
            );
            let record = &replay.records[sample.record];
            let ours: Vec<i64> = record.position_ids.iter().map(|&p| i64::from(p)).collect();
            ensure!(
                ours == positions[n],
                "sample {n} position ids {ours:?}, the reference's {:?}",
                positions[n]
            );
            let ours: Vec<usize> = sample.loss_positions.iter().map(|t| l0 + t).collect();
            let want: Vec<usize> = (0..l0 + l1).filter(|&c| p_mask[n][c] == 1).collect();
            ensure!(
                ours == want,
                "sample {n} loss columns {ours:?}, the reference's {want:?}"
            );
        }

        let masks: Vec<Vec<Vec<u8>>> = self.tensor(prefix, "attention_mask")?.to_vec3()?;
        ensure!(
            masks.len() == replay.records.len(),
            "{} stored masks for {} records",
            masks.len(),
            replay.records.len()
        );
        for (r, mask) in masks.iter().enumerate() {
            // The reference's masks (left padding included) are two key ranges per row at most,
            // so the fused attention takes every record of the golden.
            let spans = replay
                .key_spans(r)
                .with_context(|| format!("record {r}: a row sees more than two key ranges"))?;
            for (q, row) in mask.iter().enumerate() {
                for (k, &allowed) in row.iter().enumerate() {
                    ensure!(
                        replay.visible(r, q, k) == (allowed == 1),
                        "record {r}: row {q} {} column {k}, the reference's mask says otherwise",
                        if allowed == 1 { "may not see" } else { "sees" }
                    );
                    ensure!(
                        spans.sees(q, k) == (allowed == 1),
                        "record {r}: the key spans of row {q} disagree with the reference's mask \
                         at column {k}"
                    );
                }
            }
        }
        Ok(())
    }

    /// Per-sample and total losses, and the gradients, at one point (`ratio1` or
    /// `perturbed`); returns the largest differences.
    fn check_point(&self, run: &Run, point: &str, loss: &PolicyLoss) -> Result<String> {
        let json = self.run_json(run);
        let prefix = json["tensor_prefix"].as_str().context("tensor_prefix")?;
        let want = f64s(&json[format!("loss_{point}")], "per-sample losses")?;
        ensure!(
            loss.samples.len() == want.len(),
            "{point}: {} sample losses, the reference's {}",
            loss.samples.len(),
            want.len()
        );
        let mut loss_diff = 0f64;
        for (n, (ours, want)) in loss.samples.iter().zip(&want).enumerate() {
            let diff = (f64::from(ours.loss) - want).abs();
            ensure!(
                diff <= TOL,
                "{point}: sample {n} loss {}, the reference's {want}",
                ours.loss
            );
            loss_diff = loss_diff.max(diff);
        }
        let want_total = json[format!("total_loss_{point}")]
            .as_f64()
            .context("total loss")?;
        let total_diff = (f64::from(loss.total) - want_total).abs();
        ensure!(
            total_diff <= TOL,
            "{point}: total loss {}, the reference's {want_total}",
            loss.total
        );

        let norms = &json[format!("grad_norms_{point}")];
        let names = norms.as_object().context("grad norms")?;
        ensure!(
            names.len() == loss.grads.len(),
            "{point}: {} gradients, the reference has {}",
            loss.grads.len(),
            names.len()
        );
        let mut norm_diff = 0f64;
        for (name, want) in names {
            let want = want.as_f64().context("grad norm")?;
            let grad = loss
                .grads
                .get(name)
                .with_context(|| format!("no gradient for {name}"))?;
            let norm = grad
                .to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .sqrt()?
                .to_scalar::<f64>()?;
            let diff = (norm / want - 1.0).abs();
            ensure!(
                diff <= GRAD_NORM_REL_TOL,
                "{point}: ‖∇ {name}‖ = {norm}, the reference's {want}"
            );
            norm_diff = norm_diff.max(diff);
        }

        let rows = Tensor::new(u32s(&json["grad_rows"], "grad_rows")?, &Device::Cpu)?;
        let mut grad_diff = 0f64;
        for &view in run.stored_grads {
            let ours = match view {
                "layer0_q_proj" => loss.grads["model.layers.0.self_attn.q_proj.weight"].clone(),
                "lm_head_rows" => loss.grads["lm_head.weight"].index_select(&rows, 0)?,
                "embed_rows" => loss.grads["model.embed_tokens.weight"].index_select(&rows, 0)?,
                _ => anyhow::bail!("unknown gradient view {view}"),
            };
            let want = self.tensor(prefix, &format!("grad_{point}_{view}"))?;
            let diff = (ours - want)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            ensure!(
                f64::from(diff) <= TOL,
                "{point}: ∇ {view} differs from the reference's by up to {diff}"
            );
            grad_diff = grad_diff.max(f64::from(diff));
        }
        Ok(format!(
            " {point}: losses Δ {loss_diff:.1e}, total Δ {total_diff:.1e}, grads Δ {grad_diff:.1e}, norms rel Δ {norm_diff:.1e};"
        ))
    }

    /// After the SGD step: the KL parts, every ratio and the clipped tokens.
    fn check_perturbed_tokens(
        &self,
        run: &Run,
        replay: &Replay,
        loss: &PolicyLoss,
    ) -> Result<String> {
        let json = self.run_json(run);
        let prefix = json["tensor_prefix"].as_str().context("tensor_prefix")?;
        let want_kl = f64s(&json["loss_perturbed_kl_part"], "loss_perturbed_kl_part")?;
        let rho: Vec<Vec<f32>> = self.tensor(prefix, "rho_perturbed")?.to_vec2()?;
        let clipped: Vec<Vec<u8>> = self.tensor(prefix, "clipped")?.to_vec2()?;
        let l0 = replay.prompt_width;
        let mut rho_diff = 0f64;
        for (n, ((ours, sample), want_kl)) in loss
            .samples
            .iter()
            .zip(&replay.samples)
            .zip(want_kl)
            .enumerate()
        {
            ensure!(
                (ours.kl - want_kl).abs() <= TOL,
                "sample {n}: KL part {}, the reference's {want_kl}",
                ours.kl
            );
            for ((&t, &ratio), &is_clipped) in sample
                .loss_positions
                .iter()
                .zip(&ours.ratios)
                .zip(&ours.clipped)
            {
                let want = rho[n][l0 + t];
                let diff = f64::from((ratio - want).abs());
                ensure!(
                    diff <= TOL,
                    "sample {n} position {t}: ρ {ratio}, the reference's {want}"
                );
                rho_diff = rho_diff.max(diff);
                ensure!(
                    is_clipped == (clipped[n][l0 + t] == 1),
                    "sample {n} position {t} (ρ {ratio}): clipped {is_clipped}, the reference's {}",
                    clipped[n][l0 + t] == 1
                );
            }
        }
        let want_clipped = usize_of(&json["n_clipped_perturbed"], "n_clipped_perturbed")?;
        let want_tokens = usize_of(&json["n_loss_tokens"], "n_loss_tokens")?;
        let counts = (loss.clipped_tokens(), loss.loss_tokens());
        ensure!(
            counts == (want_clipped, want_tokens),
            "(clipped, loss tokens) = {counts:?}, the reference's ({want_clipped}, {want_tokens})"
        );
        Ok(format!(
            " {want_clipped} of {want_tokens} clipped, ρ Δ {rho_diff:.1e};"
        ))
    }

    fn check(&self, run: &Run) -> Result<String> {
        let records = self.records(run)?;
        let (replay_settings, loss_settings) = self.settings(run)?;
        let replay = Replay::build(&records, &replay_settings)?;
        ensure!(replay.dropped.is_empty(), "no prompt is too long here");
        self.check_replay(run, &replay)?;

        let (model, vars) =
            Sdar::load_trainable(self.training.model_dir.path(), DType::F32, &Device::Cpu)?;
        let json = self.run_json(run);
        let prefix = json["tensor_prefix"].as_str().context("tensor_prefix")?;
        // One sample per model input, as the reference computes them.
        let old = old_log_probs(&model, &replay, 0)?;
        let want_old: Vec<Vec<f32>> = self.tensor(prefix, "logp_old")?.to_vec2()?;
        let mut old_diff = 0f64;
        for (n, (sample, ours)) in replay.samples.iter().zip(&old).enumerate() {
            for (&t, &lp) in sample.loss_positions.iter().zip(ours) {
                let want = want_old[n][replay.prompt_width + t];
                let diff = f64::from((lp - want).abs());
                ensure!(
                    diff <= TOL,
                    "sample {n} position {t}: log π_old {lp}, the reference's {want}"
                );
                old_diff = old_diff.max(diff);
            }
        }
        let mut report = format!("{}: logp_old Δ {old_diff:.1e};", run.name);

        let all = 0..replay.samples.len();
        let at_start =
            policy_loss_and_grads(&model, &replay, all.clone(), &old, &loss_settings, 0)?;
        ensure!(
            at_start.clipped_tokens() == 0 && at_start.kl().abs() <= TOL,
            "at ratio 1 nothing is clipped and the KL is 0, not {} tokens and {}",
            at_start.clipped_tokens(),
            at_start.kl()
        );
        report += &self.check_point(run, "ratio1", &at_start)?;
        report += &check_packed(&model, &replay, &old, &loss_settings, &at_start)?;

        let lr = self.tracerl()["sgd_lr"].as_f64().context("sgd_lr")?;
        let weights: HashMap<String, Var> = vars.data().lock().expect("not poisoned").clone();
        for (name, var) in &weights {
            let step = (&at_start.grads[name] * lr)?;
            var.set(&(var.as_tensor() - step)?)?;
        }
        let perturbed = policy_loss_and_grads(&model, &replay, all, &old, &loss_settings, 0)?;
        report += &self.check_point(run, "perturbed", &perturbed)?;
        report += &self.check_perturbed_tokens(run, &replay, &perturbed)?;
        Ok(report)
    }
}

/// The same replay with every sample packed into one model input, each sample seeing only its
/// own tokens (a block-diagonal mask on the CPU; shifted key spans where the fused attention
/// runs), gives what one sample per input gives: log π_old, the per-sample losses and the
/// gradients, up to f32 summation order.
fn check_packed(
    model: &Sdar,
    replay: &Replay,
    old: &[Vec<f32>],
    settings: &PolicyLossSettings,
    alone: &PolicyLoss,
) -> Result<String> {
    ensure!(replay.samples.len() > 1, "packing needs several samples");
    let packed_old = old_log_probs(model, replay, usize::MAX)?;
    let old_diff = old
        .iter()
        .flatten()
        .zip(packed_old.iter().flatten())
        .map(|(a, b)| f64::from((a - b).abs()))
        .fold(0f64, f64::max);
    ensure!(
        packed_old.iter().map(Vec::len).eq(old.iter().map(Vec::len)) && old_diff <= 1e-5,
        "packed log π_old differ by {old_diff}"
    );
    let all = 0..replay.samples.len();
    let packed = policy_loss_and_grads(model, replay, all, old, settings, usize::MAX)?;
    for (n, (a, b)) in alone.samples.iter().zip(&packed.samples).enumerate() {
        ensure!(
            (a.loss - b.loss).abs() <= 1e-5 && a.clipped == b.clipped,
            "sample {n}: loss {} alone, {} packed",
            a.loss,
            b.loss
        );
    }
    let mut grad_diff = 0f64;
    for (name, grad) in &alone.grads {
        let scale = f64::from(grad.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?);
        let diff = (grad - &packed.grads[name])?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        grad_diff = grad_diff.max(f64::from(diff) / scale.max(1e-12));
    }
    ensure!(
        grad_diff <= 1e-4,
        "packed gradients differ by {grad_diff} (relative)"
    );
    Ok(format!(
        " packed: Δ logp {old_diff:.1e}, Δ grad {grad_diff:.1e} (rel);"
    ))
}

fn check(run: Run) {
    let case = Case::open().expect("the formula golden and its checkpoint");
    match case.check(&run) {
        Ok(report) => println!("{report}"),
        Err(e) => panic!("{}: {e:#}", run.name),
    }
}

#[test]
fn reference_grid_matches_rl_sdar() {
    check(Run {
        name: "reference",
        grid: BlockGrid::Reference,
        both_kept: false,
        stored_grads: &["layer0_q_proj", "lm_head_rows", "embed_rows"],
    });
}

#[test]
fn rollout_grid_matches_the_shifted_reference() {
    check(Run {
        name: "rollout_grid",
        grid: BlockGrid::Rollout,
        both_kept: false,
        stored_grads: &["lm_head_rows"],
    });
}

#[test]
fn reference_grid_with_left_padded_prompts() {
    check(Run {
        name: "both_kept_reference",
        grid: BlockGrid::Reference,
        both_kept: true,
        stored_grads: &["lm_head_rows"],
    });
}

#[test]
fn rollout_grid_with_left_padded_prompts() {
    check(Run {
        name: "both_kept_rollout_grid",
        grid: BlockGrid::Rollout,
        both_kept: true,
        stored_grads: &["lm_head_rows"],
    });
}
