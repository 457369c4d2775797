//! Report output formats.

mod csv;
mod html;
mod markdown;
mod svg;

use crate::compare::{ComparedRun, Comparison};
use crate::paper::PaperScores;
use crate::paper::TurnRow;
use crate::report::{Report, SampleRow, Scoring};
use crate::Scores;
use anyhow::{bail, Result};
use dice_store::RunInfo;
use std::str::FromStr;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Markdown summary tables.
    Md,
    /// One row per sample.
    Csv,
    /// Everything, machine-readable.
    Json,
    /// One self-contained page: the tables plus inline SVG charts.
    Html,
}

impl FromStr for Format {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "md" | "markdown" => Format::Md,
            "csv" => Format::Csv,
            "json" => Format::Json,
            "html" => Format::Html,
            other => bail!("unknown report format `{other}` (use md, csv, json or html)"),
        })
    }
}

pub fn render(report: &Report, format: Format) -> Result<String> {
    Ok(match format {
        Format::Md => markdown::render(report),
        Format::Csv => csv::render(report),
        Format::Json => serde_json::to_string_pretty(report)? + "\n",
        Format::Html => html::render(report),
    })
}

/// Runs side by side as Markdown, JSON or HTML (CSV is one row per sample of one run).
pub fn render_comparison(comparison: &Comparison, format: Format) -> Result<String> {
    Ok(match format {
        Format::Md => markdown::render_comparison(comparison),
        Format::Json => serde_json::to_string_pretty(comparison)? + "\n",
        Format::Html => html::render_comparison(comparison),
        Format::Csv => {
            bail!("runs are compared as md, html or json; csv (one row per sample) takes one run")
        }
    })
}

/// What a comparison says about its figures, above the tables.
const COMPARISON_LEGEND: &str = "Exec: problems whose sample 0 compiles and is correct; fast_p: \
problems whose sample 0 is correct and more than p times as fast as the baseline (DICE, Tables 2 \
and 6). Every rate is over all problems of the level in the run. Raw: every sample that passes \
the correctness trials counts; robust: deceptive samples (reward hacks) count as incorrect.";

/// A compared run's settings: label, device, problems, correctness, timing.
fn compared_run_settings(r: &ComparedRun) -> [String; 5] {
    let run = &r.run;
    [
        r.label.clone(),
        format!("{} ({})", run.device, run.hardware),
        run.source.clone(),
        format!(
            "{} trials, atol {}, rtol {}",
            run.correctness_trials, run.atol, run.rtol
        ),
        timing_setting(run),
    ]
}

const COMPARED_RUN_COLUMNS: [&str; 5] = ["run", "device", "problems", "correctness", "timing"];

/// One metric line of a level table: label, raw value, robust value.
struct MetricRow {
    label: String,
    raw: String,
    robust: String,
}

/// The rows of the raw-vs-robust table of one level, in reading order.
fn metric_rows(raw: &Scores, robust: &Scores) -> Vec<MetricRow> {
    let row = |label: String, f: &dyn Fn(&Scores) -> String| MetricRow {
        label,
        raw: f(raw),
        robust: f(robust),
    };
    let mut rows = vec![
        row("compiled".into(), &|s| percent(s.compiled)),
        row("correct".into(), &|s| percent(s.correct)),
    ];
    for (p, _) in raw.fast_p.iter() {
        rows.push(row(format!("fast_{p}"), &|s| {
            percent(*s.fast_p.get(p).unwrap_or(&0.0))
        }));
    }
    rows.push(row("geomean speedup (correct)".into(), &|s| {
        s.geomean_speedup.map_or("–".into(), speedup)
    }));
    if let Some(pass) = &raw.pass_at_k {
        for (k, _) in pass.iter() {
            rows.push(row(format!("pass@{k}"), &|s| {
                percent(*s.pass_at_k.as_ref().and_then(|m| m.get(k)).unwrap_or(&0.0))
            }));
        }
    }
    if let Some(fast) = &raw.fast_p_at_k {
        for (p, by_k) in fast.iter() {
            for (k, _) in by_k.iter() {
                rows.push(row(format!("fast_{p}@{k}"), &|s| {
                    let v = s
                        .fast_p_at_k
                        .as_ref()
                        .and_then(|m| m.get(p)?.get(k).copied());
                    percent(v.unwrap_or(0.0))
                }));
            }
        }
    }
    rows
}

/// What a turn-by-turn table says, above it.
const TURNS_LEGEND: &str = "Turn by turn, each sample at its best so far (a sample that stopped, \
correct and fast enough, keeps its last answer); headline scoring. fixed: samples correct for the \
first time at that turn (and their share of those not correct before it); tokens: generated in \
all turns up to that one.";

/// The turn-by-turn table of one level of a run of several turns: its header and rows of cells.
fn turn_table(rows: &[TurnRow]) -> (Vec<String>, Vec<Vec<String>>) {
    let ks: Vec<String> = rows
        .first()
        .and_then(|r| r.pass_at_k.as_ref())
        .map(|m| m.iter().map(|(k, _)| k.to_string()).collect())
        .unwrap_or_default();
    let mut header: Vec<String> = ["turn", "answered"].map(String::from).to_vec();
    header.extend(PaperScores::NAMES.map(String::from));
    header.extend(ks.iter().map(|k| format!("pass@{k}")));
    header.extend(["fixed", "tokens", "tokens per correct kernel"].map(String::from));
    let cells = rows
        .iter()
        .map(|r| {
            let mut cells = vec![r.turn.to_string(), r.answered.to_string()];
            cells.extend(r.scores.values().map(percent));
            cells.extend(ks.iter().map(|k| {
                let at_k = r.pass_at_k.as_ref().and_then(|m| m.get(k).copied());
                at_k.map_or("–".into(), percent)
            }));
            cells.push(format!("{} ({})", r.fixed, percent(r.fixed_share)));
            cells.push(r.tokens.map_or("–".into(), |t| t.to_string()));
            cells.push(
                r.tokens_per_correct
                    .map_or("–".into(), |t| format!("{t:.0}")),
            );
            cells
        })
        .collect();
    (header, cells)
}

fn timing_setting(run: &RunInfo) -> String {
    format!(
        "{} trials, baseline {}, method {}",
        run.perf_trials, run.baseline, run.timing
    )
}

/// The run's settings as (label, value) lines, shared by the text formats.
fn run_settings(r: &Report) -> Vec<(&'static str, String)> {
    let run = &r.run;
    vec![
        ("device", format!("{} ({})", run.device, run.hardware)),
        (
            "software",
            format!(
                "torch {}, python {}, dice {}",
                run.torch_version, run.python_version, run.dice_version
            ),
        ),
        (
            "correctness",
            format!(
                "{} trials, atol {}, rtol {}",
                run.correctness_trials, run.atol, run.rtol
            ),
        ),
        ("timing", timing_setting(run)),
        ("problems", run.source.clone()),
        ("headline", headline_name(r.headline).to_string()),
    ]
}

fn headline_name(scoring: Scoring) -> &'static str {
    match scoring {
        Scoring::Raw => "raw (KernelBench: every sample passing the correctness trials counts)",
        Scoring::Robust => "robust (deceptive samples count as incorrect)",
    }
}

fn percent(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

fn speedup(x: f64) -> String {
    format!("{x:.3}×")
}

/// A sample's speedup with its 95 % interval, when it has one.
fn speedup_cell(s: &SampleRow) -> String {
    match (s.speedup, s.speedup_interval) {
        (Some(x), Some(i)) => format!("{} [{:.3}–{:.3}]", speedup(x), i.low, i.high),
        (Some(x), None) => speedup(x),
        (None, _) => String::new(),
    }
}

fn optional_ms(x: Option<f64>) -> String {
    x.map_or(String::new(), |v| format!("{v:.4}"))
}
