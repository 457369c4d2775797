//! What a training run reports: one JSON object per line in `metrics.jsonl` (a step line per
//! optimizer step, an eval line per evaluation), an HTML page of the loss curves drawn from it,
//! the model FLOPs of a two-stream step (for tokens/s' companion, MFU), and peak memory.
//!
//! # FLOPs of an SFT step
//!
//! Model FLOPs, counted from the work the two-stream objective needs (spec §3.1, §6.3), not from
//! what an implementation happens to execute: a sample of n tokens is 2n positions (its noisy
//! and its clean copy), and every position goes through every layer.
//!
//! - Matmuls, per position and layer: `2·H·(Nq + 2·Nkv)` (q, k, v) + `2·Nq·H` (o) + `6·H·I`
//!   (gate, up, down).
//! - Attention, per layer and visible (query, key) pair: `4·Nq` (QKᵀ and PV). Only the pairs
//!   the two-stream mask allows are counted: for a block of s tokens starting c tokens into
//!   its sample, each of its s noisy queries sees the s noisy keys of its block and the c
//!   clean keys before it, and each of its s clean queries the c + s clean keys up to its
//!   block's end: `2·s·(c + s)` pairs per block.
//! - The head: `2·H·V` per scored position (the masked noisy positions; no other position's
//!   logits are needed).
//!
//! Training is three times the forward (the backward is twice it); the recomputation of
//! activation checkpointing is not counted, so MFU = model FLOPs / (seconds · peak · ranks) is
//! the usual model-FLOPs utilisation, never inflated by recomputed work. Norms, rotary,
//! softmax and the optimizer are left out, as is customary.

use anyhow::{Context, Result};
use dice_model::SdarConfig;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The FLOPs of one forward, backward and update on samples of `sample_lens` tokens (every
/// sample of every row, the rows' padding counting as one sample each) with `scored`
/// positions under the loss (module docs: the formula).
pub fn sft_step_flops(config: &SdarConfig, sample_lens: &[usize], scored: usize) -> f64 {
    let h = config.hidden_size as f64;
    let (nq, nkv) = (config.q_dim() as f64, config.kv_dim() as f64);
    let i = config.intermediate_size as f64;
    let layers = config.num_hidden_layers as f64;
    let per_position = 2.0 * h * (nq + 2.0 * nkv) + 2.0 * nq * h + 6.0 * h * i;
    let block = config.block_size.max(1);
    let mut positions = 0.0;
    let mut pairs = 0.0;
    for &n in sample_lens {
        positions += 2.0 * n as f64;
        for start in (0..n).step_by(block) {
            let s = block.min(n - start) as f64;
            pairs += 2.0 * s * (start as f64 + s);
        }
    }
    let forward = layers * (positions * per_position + pairs * 4.0 * nq)
        + scored as f64 * 2.0 * h * config.vocab_size as f64;
    3.0 * forward
}

/// The peak resident memory of this process in bytes (`VmHWM`), where the system tells it.
pub fn process_peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The line of one optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Optimizer steps done, this one included (from 1).
    pub step: u64,
    /// Epochs done, fractional: steps / steps per epoch.
    pub epoch: f64,
    /// The mean of the step's micro-batch losses (each normalised by its own loss tokens).
    pub loss: f64,
    /// The learning rate this step applied.
    pub lr: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// Packed-row tokens of the step (over every rank).
    pub tokens: u64,
    pub tokens_per_s: f64,
    /// Achieved model TFLOP/s (module docs).
    pub tflops: f64,
    /// Model FLOPs utilisation, when the device's peak is known.
    pub mfu: Option<f64>,
    /// Peak memory in bytes: the device's during the step on CUDA, the process's resident peak
    /// so far on the CPU; null where unknown.
    pub memory: Option<u64>,
    /// Wall seconds of the step.
    pub step_time_s: f64,
}

/// The line of one evaluation of the held-out rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalMetrics {
    pub step: u64,
    pub epoch: f64,
    /// The mean of the held-out micro-batches' losses, their noise drawn the same at every
    /// evaluation.
    pub eval_loss: f64,
    pub eval_rows: usize,
}

/// `metrics.jsonl`, appended line by line.
pub struct MetricsLog {
    path: PathBuf,
    file: File,
}

impl MetricsLog {
    /// Opens `path` for a run that starts after `step` completed steps: lines of later steps
    /// (written by an interrupted run after its last checkpoint) are dropped, so the file
    /// holds each step once.
    pub fn open(path: &Path, step: u64) -> Result<Self> {
        let kept: Vec<String> = match std::fs::read_to_string(path) {
            Ok(text) => text
                .lines()
                .filter(|line| line_step(line).is_some_and(|s| s <= step))
                .map(str::to_string)
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        dice_model::shards::write_atomically(path, |w| {
            for line in &kept {
                writeln!(w, "{line}")?;
            }
            Ok(())
        })?;
        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one line.
    pub fn write(&mut self, line: &impl Serialize) -> Result<()> {
        let mut text = serde_json::to_string(line)?;
        text.push('\n');
        self.file
            .write_all(text.as_bytes())
            .with_context(|| format!("cannot append to {}", self.path.display()))
    }
}

fn line_step(line: &str) -> Option<u64> {
    serde_json::from_str::<serde_json::Value>(line).ok()?["step"].as_u64()
}

/// Writes the loss curves of `metrics.jsonl` as a self-contained HTML page (inline SVG, no
/// script): the training loss and the evaluation loss against the step, and the learning rate.
pub fn write_html(metrics: &Path, html: &Path, title: &str) -> Result<()> {
    let text = std::fs::read_to_string(metrics)
        .with_context(|| format!("cannot read {}", metrics.display()))?;
    let (mut loss, mut eval, mut lr) = (Vec::new(), Vec::new(), Vec::new());
    let mut last = None;
    for line in text.lines() {
        let Ok(value) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let Some(step) = value["step"].as_f64() else {
            continue;
        };
        if let Some(l) = value["loss"].as_f64() {
            loss.push((step, l));
            lr.push((step, value["lr"].as_f64().unwrap_or(0.0)));
            last = Some(value.clone());
        }
        if let Some(l) = value["eval_loss"].as_f64() {
            eval.push((step, l));
        }
    }
    let mut page = String::new();
    let title = escape(title);
    writeln!(
        page,
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title>\n<style>\
body{{font-family:sans-serif;margin:2em;color:#222}} svg{{background:#fafafa;border:1px solid #ddd}}\
 .train{{stroke:#1f77b4}} .eval{{stroke:#d62728}} .lr{{stroke:#2ca02c}} text{{font-size:12px}}\
</style></head><body>\n<h1>{title}</h1>"
    )?;
    if let Some(last) = last {
        writeln!(
            page,
            "<p>step {} · epoch {:.3} · loss {:.4} · lr {:.3e} · grad norm {:.4} · {:.0} tokens/s</p>",
            last["step"],
            last["epoch"].as_f64().unwrap_or(0.0),
            last["loss"].as_f64().unwrap_or(f64::NAN),
            last["lr"].as_f64().unwrap_or(0.0),
            last["grad_norm"].as_f64().unwrap_or(f64::NAN),
            last["tokens_per_s"].as_f64().unwrap_or(0.0),
        )?;
    }
    page += &chart(
        "loss",
        &[("train", "train", &loss), ("eval", "eval", &eval)],
    );
    page += &chart("learning rate", &[("lr", "lr", &lr)]);
    page += "</body></html>\n";
    dice_model::shards::write_atomically(html, |w| Ok(w.write_all(page.as_bytes())?))
}

pub(crate) fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// One line of a chart: its label, its CSS class and its (step, value) points.
pub(crate) type Series<'a> = (&'a str, &'a str, &'a [(f64, f64)]);

/// One SVG line chart of the given series.
pub(crate) fn chart(title: &str, series: &[Series]) -> String {
    const W: f64 = 800.0;
    const H: f64 = 300.0;
    const PAD: f64 = 50.0;
    let points = series.iter().flat_map(|(_, _, p)| p.iter());
    let finite: Vec<&(f64, f64)> = points.filter(|(_, y)| y.is_finite()).collect();
    let mut svg = format!("<h2>{}</h2>\n", escape(title));
    if finite.is_empty() {
        svg += "<p>no data yet</p>\n";
        return svg;
    }
    let (x0, x1) = bounds(finite.iter().map(|p| p.0));
    let (y0, y1) = bounds(finite.iter().map(|p| p.1));
    let x = |v: f64| PAD + (v - x0) / (x1 - x0) * (W - 2.0 * PAD);
    let y = |v: f64| H - PAD - (v - y0) / (y1 - y0) * (H - 2.0 * PAD);
    svg += &format!("<svg width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\">\n");
    svg += &format!(
        "<line x1=\"{PAD}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"#888\"/>\
<line x1=\"{PAD}\" y1=\"{PAD}\" x2=\"{PAD}\" y2=\"{b}\" stroke=\"#888\"/>\n",
        b = H - PAD,
        r = W - PAD
    );
    for (v, anchor_y) in [(y0, H - PAD), (y1, PAD)] {
        svg += &format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n",
            PAD - 4.0,
            anchor_y + 4.0,
            label(v)
        );
    }
    for (v, anchor_x) in [(x0, PAD), (x1, W - PAD)] {
        svg += &format!(
            "<text x=\"{anchor_x}\" y=\"{}\" text-anchor=\"middle\">step {}</text>\n",
            H - PAD + 16.0,
            label(v)
        );
    }
    for (k, (name, class, points)) in series.iter().enumerate() {
        let path: Vec<String> = points
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|&(s, v)| format!("{:.1},{:.1}", x(s), y(v)))
            .collect();
        if path.is_empty() {
            continue;
        }
        svg += &format!(
            "<polyline class=\"{class}\" fill=\"none\" stroke-width=\"1.5\" points=\"{}\"/>\n",
            path.join(" ")
        );
        svg += &format!(
            "<text x=\"{}\" y=\"{}\" class=\"{class}\" fill=\"currentColor\">— {name}</text>\n",
            W - PAD - 80.0,
            PAD + 14.0 * k as f64
        );
    }
    svg += "</svg>\n";
    svg
}

/// The range of `values`, widened when it is a single value.
fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if hi > lo {
        (lo, hi)
    } else {
        (lo - 0.5, hi + 0.5)
    }
}

fn label(v: f64) -> String {
    if v != 0.0 && (v.abs() < 1e-2 || v.abs() >= 1e5) {
        format!("{v:.2e}")
    } else {
        format!("{v:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> SdarConfig {
        serde_json::from_value(serde_json::json!({
            "model_type": "sdar", "vocab_size": 10, "hidden_size": 4,
            "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 2, "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "block_size": 4
        }))
        .unwrap()
    }

    #[test]
    fn flops_count_both_streams_the_visible_pairs_and_the_scored_head() {
        // H 4, Nq 4, Nkv 2, I 8: per position and layer 2·4·8 + 2·4·4 + 6·4·8 = 288.
        // A sample of 6 tokens, blocks of 4 and 2: pairs 2·4·4 + 2·2·6 = 56; 12 positions.
        // Per layer 12·288 + 56·4·4 = 4352; two layers 8704; 3 scored positions 3·2·4·10 = 240.
        assert_eq!(sft_step_flops(&config(), &[6], 3), 3.0 * (8704.0 + 240.0));
        // Samples add up.
        assert_eq!(
            sft_step_flops(&config(), &[6, 6], 6),
            2.0 * sft_step_flops(&config(), &[6], 3)
        );
    }

    #[test]
    fn a_reopened_log_keeps_the_lines_up_to_its_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        std::fs::write(
            &path,
            "{\"step\":1,\"loss\":2.0}\n{\"step\":2,\"eval_loss\":1.5}\n{\"step\":3,\"loss\":1.0}\n{\"step\":3,\"eval_loss\":1.2}\n",
        )
        .unwrap();
        let mut log = MetricsLog::open(&path, 2).unwrap();
        log.write(&serde_json::json!({"loss": 0.5, "step": 3}))
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"step\":1,\"loss\":2.0}\n{\"step\":2,\"eval_loss\":1.5}\n{\"loss\":0.5,\"step\":3}\n"
        );
        let html = dir.path().join("metrics.html");
        write_html(&path, &html, "run <1>").unwrap();
        let page = std::fs::read_to_string(&html).unwrap();
        assert!(page.contains("<title>run &lt;1&gt;</title>"));
        assert!(page.contains("<polyline class=\"train\""));
        assert!(page.contains("<polyline class=\"eval\""));
        assert!(!page.contains("<script"));
    }
}
