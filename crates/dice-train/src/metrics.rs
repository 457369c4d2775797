//! What a training run reports: one JSON object per line in `metrics.jsonl` (a step line per
//! optimizer step, an eval line per evaluation), an HTML page of its curves (every quantity
//! against the step), the model FLOPs of a two-stream step (for tokens/s' companion, MFU), and
//! peak memory.
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
use dice_chart::{escape, format_number, Axis, Chart, Series};
use dice_model::SdarConfig;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// H100 / H200 SXM dense bf16 tensor-core peak, TFLOP/s: the MFU's denominator on CUDA unless
/// told otherwise.
pub const HOPPER_BF16_PEAK_TFLOPS: f64 = 989.0;

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
    /// Of which the micro-batches' forwards and backwards with their gradients summed, the
    /// device synchronised after them (absent from lines written before it was recorded).
    #[serde(default)]
    pub forward_backward_s: f64,
    /// And the update: the gradients' reduction over the ranks, clipping and AdamW.
    #[serde(default)]
    pub update_s: f64,
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

/// What a metrics page shows: the keys of its summary line and its charts. Keys of
/// `metrics.jsonl` no chart names get a chart of their own, so the page draws every quantity
/// the run records.
pub(crate) struct Page {
    /// `(key, label)` of the values the line above the charts gives for the last line that has
    /// the first key.
    pub(crate) summary: &'static [(&'static str, &'static str)],
    pub(crate) charts: &'static [ChartSpec],
}

/// A chart of a metrics page: its title, what its y axis measures and the `(key, label)` of
/// its lines. A key is a path through the line's objects and arrays (`pass_rate_by_level.*`,
/// `seconds_per_rank.*.rollout`), a `*` standing for any one step of it, which replaces the
/// `*` of the label (`level *` → `level 2`).
pub(crate) struct ChartSpec {
    pub(crate) title: &'static str,
    pub(crate) y: Quantity,
    pub(crate) keys: &'static [(&'static str, &'static str)],
}

impl ChartSpec {
    pub(crate) const fn new(
        title: &'static str,
        y: Quantity,
        keys: &'static [(&'static str, &'static str)],
    ) -> Self {
        Self { title, y, keys }
    }
}

/// What a chart's values are, with its y axis title.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Quantity {
    /// Any real value (a loss, an advantage): the axis spans the values.
    Real(&'static str),
    /// A size (seconds, tokens/s, a norm): the axis starts at 0, so heights compare.
    Amount(&'static str),
    /// Whole numbers from 0: ticks on whole numbers only.
    Count(&'static str),
    /// Shares from 0 to 1, read in percent.
    Share(&'static str),
    /// Bytes from 0, drawn in GiB.
    Bytes(&'static str),
}

const GIB: f64 = (1u64 << 30) as f64;

impl Quantity {
    fn axis(self) -> Axis {
        match self {
            Quantity::Real(title) => Axis::real(title),
            Quantity::Amount(title) | Quantity::Bytes(title) => Axis::real(title).including(0.0),
            Quantity::Count(title) => Axis::integer(title).including(0.0),
            Quantity::Share(title) => Axis::percent(title).including(0.0),
        }
    }

    /// A recorded value in the chart's units.
    fn drawn(self, value: f64) -> f64 {
        match self {
            Quantity::Bytes(_) => value / GIB,
            _ => value,
        }
    }

    fn format(self, value: f64) -> String {
        match self {
            Quantity::Bytes(_) => format!("{} GiB", format_number(value / GIB)),
            _ => self.axis().format(value),
        }
    }
}

/// The chart of the checkpoints' lines ([`crate::run::checkpoint::CheckpointMetrics`]) on
/// every trainer's page: the time a save holds the training up against its background write.
pub(crate) const CHECKPOINT_SECONDS: ChartSpec = ChartSpec::new(
    "checkpoint seconds",
    Quantity::Amount("seconds"),
    &[
        ("seconds_checkpoint", "training waited (the state's copy)"),
        ("seconds_checkpoint_write", "background write"),
    ],
);

/// The chart of the checkpoints' sizes on every trainer's page.
pub(crate) const CHECKPOINT_BYTES: ChartSpec = ChartSpec::new(
    "checkpoint size",
    Quantity::Bytes("GiB"),
    &[("checkpoint_bytes", "bytes on disk")],
);

/// The charts of an SFT run's page.
const SFT_PAGE: Page = Page {
    summary: &[
        ("loss", "loss"),
        ("epoch", "epoch"),
        ("lr", "lr"),
        ("grad_norm", "grad norm"),
        ("tokens_per_s", "tokens/s"),
        ("mfu", "MFU"),
        ("memory", "peak memory"),
    ],
    charts: &[
        ChartSpec::new(
            "loss",
            Quantity::Real("loss"),
            &[("loss", "train"), ("eval_loss", "held-out")],
        ),
        ChartSpec::new(
            "learning rate",
            Quantity::Real("learning rate"),
            &[("lr", "learning rate")],
        ),
        ChartSpec::new(
            "gradient norm (before clipping)",
            Quantity::Amount("global norm"),
            &[("grad_norm", "gradient norm")],
        ),
        ChartSpec::new(
            "throughput",
            Quantity::Amount("tokens/s"),
            &[("tokens_per_s", "tokens/s (every rank)")],
        ),
        ChartSpec::new(
            "model FLOP/s",
            Quantity::Amount("TFLOP/s"),
            &[("tflops", "model TFLOP/s")],
        ),
        ChartSpec::new(
            "model FLOPs utilisation",
            Quantity::Share("MFU"),
            &[("mfu", "MFU")],
        ),
        ChartSpec::new(
            "peak memory",
            Quantity::Bytes("GiB"),
            &[("memory", "peak memory")],
        ),
        ChartSpec::new(
            "seconds per step",
            Quantity::Amount("seconds"),
            &[
                ("step_time_s", "wall seconds"),
                ("forward_backward_s", "forwards and backwards"),
                ("update_s", "update (reduction, clipping, AdamW)"),
            ],
        ),
        ChartSpec::new(
            "tokens per step",
            Quantity::Count("tokens"),
            &[("tokens", "packed-row tokens (every rank)")],
        ),
        ChartSpec::new(
            "epoch",
            Quantity::Amount("epochs"),
            &[("epoch", "epochs done")],
        ),
        ChartSpec::new(
            "held-out rows",
            Quantity::Count("rows"),
            &[("eval_rows", "rows evaluated")],
        ),
        CHECKPOINT_SECONDS,
        CHECKPOINT_BYTES,
    ],
};

/// Writes the curves of an SFT run's `metrics.jsonl` as a self-contained HTML page (inline
/// SVG, no script): every quantity against the step.
pub fn write_html(metrics: &Path, html: &Path, title: &str) -> Result<()> {
    write_page(metrics, html, title, &SFT_PAGE)
}

/// Writes the curves of `metrics` as `page` lays them out to `html`.
pub(crate) fn write_page(metrics: &Path, html: &Path, title: &str, page: &Page) -> Result<()> {
    let text = std::fs::read_to_string(metrics)
        .with_context(|| format!("cannot read {}", metrics.display()))?;
    let lines: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect();
    let html_text = render_page(&lines, title, page);
    dice_model::shards::write_atomically(html, |w| Ok(w.write_all(html_text.as_bytes())?))
}

fn render_page(lines: &[serde_json::Value], title: &str, page: &Page) -> String {
    let title = escape(title);
    let mut html = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>\n<style>\
body{{font-family:system-ui,sans-serif;margin:2em;color:#222}}\
.charts{{display:grid;grid-template-columns:repeat(auto-fill,minmax(480px,1fr));gap:1.5em 2em}}\
figure{{margin:0}}h2{{font-size:1.05em;margin:0 0 .2em}}svg{{display:block;width:100%;height:auto}}\
</style></head><body>\n<h1>{title}</h1>\n"
    );
    if let Some(summary) = summary(lines, page) {
        let _ = writeln!(html, "<p>{}</p>", escape(&summary));
    }
    let recorded = Recorded::read(lines);
    if recorded.keys.is_empty() {
        html.push_str("<p>no data yet</p>\n");
    }
    html.push_str("<div class=\"charts\">\n");
    for chart in charts(&recorded, page) {
        // The keys on hover: where to find the numbers in `metrics.jsonl`.
        let _ = writeln!(
            html,
            "<figure title=\"metrics.jsonl: {}\"><h2>{}</h2>{}</figure>",
            escape(&chart.paths.join(", ")),
            escape(&chart.title),
            chart.chart.svg()
        );
    }
    html.push_str("</div>\n</body></html>\n");
    html
}

/// `step N · label value · …` of the last line with the summary's first key.
fn summary(lines: &[serde_json::Value], page: &Page) -> Option<String> {
    let (first, _) = page.summary.first()?;
    let last = lines.iter().rev().find(|l| l[first].is_number())?;
    let mut parts = vec![format!("step {}", last["step"])];
    for &(key, label) in page.summary {
        if let Some(value) = last[key].as_f64() {
            let quantity = page
                .charts
                .iter()
                .find(|c| c.keys.iter().any(|(k, _)| *k == key))
                .map_or(Quantity::Real(""), |c| c.y);
            parts.push(format!("{label} {}", quantity.format(value)));
        }
    }
    Some(parts.join(" · "))
}

/// Every number of `metrics.jsonl` by its key path, in the order the keys first appear.
struct Recorded {
    keys: Vec<RecordedKey>,
}

struct RecordedKey {
    /// The path through the line: `loss`, `pass_rate_by_level.2`, `seconds_per_rank.0.idle`.
    path: String,
    /// `(step, value)` of the lines that have it.
    points: Vec<(f64, f64)>,
    /// Whether every value is a whole number as written (counts).
    whole: bool,
}

impl Recorded {
    fn read(lines: &[serde_json::Value]) -> Self {
        let mut keys: Vec<RecordedKey> = Vec::new();
        for line in lines {
            let Some(step) = line["step"].as_f64() else {
                continue;
            };
            let mut numbers = Vec::new();
            flatten(String::new(), line, &mut numbers);
            for (path, value, whole) in numbers {
                if path == "step" {
                    continue;
                }
                match keys.iter_mut().find(|k| k.path == path) {
                    Some(key) => {
                        key.points.push((step, value));
                        key.whole &= whole;
                    }
                    None => keys.push(RecordedKey {
                        path,
                        points: vec![(step, value)],
                        whole,
                    }),
                }
            }
        }
        Self { keys }
    }

    /// The first and last step.
    fn steps(&self) -> Option<(f64, f64)> {
        let steps = self.keys.iter().flat_map(|k| k.points.iter().map(|p| p.0));
        steps.fold(None, |range, s| match range {
            None => Some((s, s)),
            Some((lo, hi)) => Some((f64::min(lo, s), f64::max(hi, s))),
        })
    }
}

/// The numbers of `value` with their key paths and whether they are written as whole numbers.
fn flatten(path: String, value: &serde_json::Value, out: &mut Vec<(String, f64, bool)>) {
    let join = |key: &str| {
        if path.is_empty() {
            key.to_string()
        } else {
            format!("{path}.{key}")
        }
    };
    match value {
        serde_json::Value::Number(n) => {
            if let Some(v) = n.as_f64() {
                out.push((path.clone(), v, n.is_i64() || n.is_u64()));
            }
        }
        serde_json::Value::Object(map) => {
            for (key, v) in map {
                flatten(join(key), v, out);
            }
        }
        serde_json::Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                flatten(join(&i.to_string()), v, out);
            }
        }
        _ => {}
    }
}

/// What `pattern` (`*` standing for one step of the path) captures of `path`: `Some("")` for an
/// exact match, `Some(step)` for the step under the `*`, `None` when it does not match.
fn capture<'p>(pattern: &str, path: &'p str) -> Option<&'p str> {
    let (pattern, path): (Vec<&str>, Vec<&'p str>) =
        (pattern.split('.').collect(), path.split('.').collect());
    if pattern.len() != path.len() {
        return None;
    }
    let mut captured = "";
    for (p, s) in pattern.iter().zip(path) {
        if *p == "*" {
            captured = s;
        } else if p != &s {
            return None;
        }
    }
    Some(captured)
}

/// The key paths of `lines` that none of `page`'s charts names (they get charts of their own).
#[cfg(test)]
pub(crate) fn layout_misses(lines: &[serde_json::Value], page: &Page) -> Vec<String> {
    charts(&Recorded::read(lines), page)
        .into_iter()
        .filter(|c| !page.charts.iter().any(|spec| spec.title == c.title))
        .flat_map(|c| c.paths)
        .collect()
}

/// A chart of a page with the key paths it draws.
struct PageChart {
    title: String,
    chart: Chart,
    paths: Vec<String>,
}

/// The page's charts that have data, then one chart per recorded key none of them draws.
fn charts(recorded: &Recorded, page: &Page) -> Vec<PageChart> {
    let step_axis = || {
        let axis = Axis::integer("step");
        match recorded.steps() {
            // Every chart of the page spans the same steps, so they line up.
            Some((first, last)) => axis.including(first).including(last),
            None => axis,
        }
    };
    let mut drawn = vec![false; recorded.keys.len()];
    let mut charts = Vec::new();
    for spec in page.charts {
        let mut chart = Chart::new(spec.title, step_axis(), spec.y.axis())
            .untitled()
            .size(560.0, 250.0);
        let mut paths = Vec::new();
        for &(pattern, label) in spec.keys {
            let mut matched: Vec<(&str, usize)> = recorded
                .keys
                .iter()
                .enumerate()
                .filter(|(i, _)| !drawn[*i])
                .filter_map(|(i, k)| Some((capture(pattern, &k.path)?, i)))
                .collect();
            // Levels and ranks in numeric order (a JSON object's keys come sorted as text).
            matched.sort_by_key(|(part, _)| part.parse::<u64>().unwrap_or(u64::MAX));
            for (part, i) in matched {
                drawn[i] = true;
                let key = &recorded.keys[i];
                let points = key.points.iter().map(|&(s, v)| (s, spec.y.drawn(v)));
                chart = chart.with(Series::line(&label.replace('*', part), points.collect()));
                paths.push(key.path.clone());
            }
        }
        if !paths.is_empty() {
            charts.push(PageChart {
                title: spec.title.to_string(),
                chart,
                paths,
            });
        }
    }
    for (key, _) in recorded.keys.iter().zip(&drawn).filter(|(_, d)| !**d) {
        let y = if key.whole {
            Axis::integer(&key.path)
        } else {
            Axis::real(&key.path)
        };
        let chart = Chart::new(&key.path, step_axis(), y)
            .untitled()
            .size(560.0, 250.0)
            .with(Series::line(&key.path, key.points.clone()));
        charts.push(PageChart {
            title: key.path.clone(),
            chart,
            paths: vec![key.path.clone()],
        });
    }
    charts
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
        let loss = page.split("<h2>loss</h2>").nth(1).unwrap();
        let loss = &loss[..loss.find("</figure>").unwrap()];
        assert_eq!(loss.matches("<polyline").count(), 2);
        assert!(loss.contains(">train</text></g>") && loss.contains(">held-out</text></g>"));
        assert!(!page.contains("<script"));
    }

    /// The lines an SFT run writes: every field of its step, eval and checkpoint lines.
    fn sft_lines(steps: u64) -> Vec<serde_json::Value> {
        let mut lines = Vec::new();
        for step in 1..=steps {
            let s = step as f64;
            lines.push(
                serde_json::to_value(StepMetrics {
                    step,
                    epoch: s / steps as f64,
                    loss: 2.5 / s.sqrt(),
                    lr: 3e-5 * s.min(5.0) / 5.0,
                    grad_norm: 1.5 / s.sqrt(),
                    tokens: 65_536,
                    tokens_per_s: 12_000.0 + 100.0 * (s % 3.0),
                    tflops: 310.5,
                    mfu: Some(0.31 + 0.001 * s),
                    memory: Some(70 << 30),
                    step_time_s: 5.4,
                    forward_backward_s: 4.9,
                    update_s: 0.5,
                })
                .unwrap(),
            );
            if step % 10 == 0 {
                lines.push(
                    serde_json::to_value(EvalMetrics {
                        step,
                        epoch: s / steps as f64,
                        eval_loss: 2.0 / s.sqrt(),
                        eval_rows: 64,
                    })
                    .unwrap(),
                );
                lines.push(
                    serde_json::to_value(crate::run::checkpoint::CheckpointMetrics {
                        step,
                        checkpoint: format!("checkpoint-{step}"),
                        checkpoint_bytes: 28 << 30,
                        seconds_checkpoint: 1.5,
                        seconds_checkpoint_write: 40.0,
                        checkpoint_snapshot: crate::optim::SnapshotPlace::Host,
                    })
                    .unwrap(),
                );
            }
        }
        lines
    }

    #[test]
    fn every_key_of_the_sft_lines_has_its_own_named_chart() {
        let lines = sft_lines(40);
        assert_eq!(layout_misses(&lines, &SFT_PAGE), Vec::<String>::new());
        let page = render_page(&lines, "sft", &SFT_PAGE);
        for heading in [
            "loss",
            "learning rate",
            "gradient norm (before clipping)",
            "throughput",
            "model FLOPs utilisation",
            "peak memory",
            "seconds per step",
        ] {
            assert!(page.contains(&format!("<h2>{heading}</h2>")), "{heading}");
        }
        assert!(
            page.contains(
                "<p>step 40 · loss 0.3953 · epoch 1 · lr 3e-5 · grad norm 0.2372 · \
                 tokens/s 12100 · MFU 35.0% · peak memory 70 GiB</p>"
            ),
            "{page}"
        );
        // Steps tick on whole numbers, never `step 1.000`.
        for step in ["1", "10", "20", "30", "40"] {
            assert!(page.contains(&format!("text-anchor=\"middle\">{step}</text>")));
        }
        assert!(!page.contains(".000<") && !page.contains("step 1.0"));
        assert!(page.contains(">step</text>"));
        // MFU in percent, memory in GiB.
        let mfu = page
            .split("<h2>model FLOPs utilisation</h2>")
            .nth(1)
            .unwrap();
        assert!(mfu[..mfu.find("</figure>").unwrap()].contains("%</text>"));
        let memory = page.split("<h2>peak memory</h2>").nth(1).unwrap();
        assert!(memory[..memory.find("</figure>").unwrap()]
            .contains("<title>peak memory, step 40: 70</title>"));
    }

    #[test]
    fn a_key_no_chart_names_gets_a_chart_of_its_own() {
        let lines: Vec<serde_json::Value> = [
            r#"{"step":1,"loss":2.0,"novel":3,"nested":{"a":[0.5,1.5]}}"#,
            r#"{"step":2,"loss":1.0,"novel":4,"nested":{"a":[0.25,1.0]}}"#,
            r#"{"step":2,"eval_loss":1.5,"flag":true,"name":"x"}"#,
        ]
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
        let recorded = Recorded::read(&lines);
        let mut drawn: Vec<String> = charts(&recorded, &SFT_PAGE)
            .into_iter()
            .flat_map(|c| c.paths)
            .collect();
        drawn.sort();
        assert_eq!(
            drawn,
            ["eval_loss", "loss", "nested.a.0", "nested.a.1", "novel"]
        );
        let mut misses = layout_misses(&lines, &SFT_PAGE);
        misses.sort();
        assert_eq!(misses, ["nested.a.0", "nested.a.1", "novel"]);
        let page = render_page(&lines, "sft", &SFT_PAGE);
        assert!(page.contains("<h2>novel</h2>") && page.contains("<h2>nested.a.1</h2>"));
        // A count keeps whole-number ticks.
        let novel = page.split("<h2>novel</h2>").nth(1).unwrap();
        assert!(!novel[..novel.find("</figure>").unwrap()].contains(".5</text>"));
    }

    #[test]
    fn an_empty_log_says_there_is_no_data_yet() {
        let page = render_page(&[], "sft", &SFT_PAGE);
        assert!(page.contains("<p>no data yet</p>") && !page.contains("<svg"));
    }
}
