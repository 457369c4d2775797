//! `metrics.html` of an RL run: the curves of `metrics.jsonl`, one chart per quantity, as a
//! self-contained page (inline SVG, no script), rewritten after every step.

use crate::metrics::{chart, escape, Series};
use anyhow::{Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// Line colours, one CSS class per series of a chart.
const PALETTE: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];
const CLASSES: [&str; 8] = ["c0", "c1", "c2", "c3", "c4", "c5", "c6", "c7"];

/// The charts of the page: a title and the `metrics.jsonl` keys it draws, with their labels.
const CHARTS: [(&str, &[(&str, &str)]); 9] = [
    (
        "reward",
        &[
            ("reward_mean", "reward mean"),
            ("pass_rate", "pass rate"),
            ("deceptive_rate", "deceptive rate"),
            ("eval_pass_rate", "held-out pass rate"),
        ],
    ),
    ("KL (k3, mean per replay sample)", &[("kl", "kl")]),
    ("clip fraction", &[("clip_fraction", "clipped tokens")]),
    (
        "entropy (mean −log π_old of the decoded tokens)",
        &[("entropy", "entropy")],
    ),
    ("policy loss", &[("loss", "loss")]),
    (
        "gradient norm (before clipping)",
        &[("grad_norm", "grad norm")],
    ),
    (
        "advantages",
        &[
            ("advantage_mean", "mean"),
            ("advantage_std", "std"),
            ("advantage_abs_max", "|max|"),
        ],
    ),
    (
        "seconds per phase (rank 0)",
        &[
            ("seconds_rollout", "rollout"),
            ("seconds_judge", "judge (overlapping the rollout)"),
            ("seconds_idle", "idle (waiting for the judge)"),
            ("seconds_update", "update"),
            ("seconds_step", "step"),
        ],
    ),
    (
        "rollout tokens per second",
        &[("rollout_tokens_per_s", "tokens/s")],
    ),
];

/// Writes the curves of the RL run's `metrics` (its `metrics.jsonl`) to `html`.
pub fn write_html(metrics: &Path, html: &Path, title: &str) -> Result<()> {
    let text = std::fs::read_to_string(metrics)
        .with_context(|| format!("cannot read {}", metrics.display()))?;
    let lines: Vec<Value> = text
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect();
    let title = escape(title);
    let mut page = String::new();
    write!(
        page,
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title>\n<style>\
body{{font-family:sans-serif;margin:2em;color:#222}} svg{{background:#fafafa;border:1px solid #ddd}} \
text{{font-size:12px}}"
    )?;
    for (class, colour) in CLASSES.iter().zip(PALETTE) {
        write!(page, " .{class}{{stroke:{colour};color:{colour}}}")?;
    }
    writeln!(page, "</style></head><body>\n<h1>{title}</h1>")?;
    if let Some(last) = lines.iter().rev().find(|l| l.get("reward_mean").is_some()) {
        let number = |key: &str| last[key].as_f64().unwrap_or(f64::NAN);
        writeln!(
            page,
            "<p>step {} · reward {:.3} · pass rate {:.3} · deceptive {:.3} · kl {:.3e} · \
             clip {:.3} · {:.1} s per step</p>",
            last["step"],
            number("reward_mean"),
            number("pass_rate"),
            number("deceptive_rate"),
            number("kl"),
            number("clip_fraction"),
            number("seconds_step"),
        )?;
    }
    for (title, keys) in CHARTS {
        let series: Vec<(&str, Vec<(f64, f64)>)> = keys
            .iter()
            .map(|&(key, label)| (label, points(&lines, |line| line[key].as_f64())))
            .collect();
        page += &chart(title, &as_series(&series));
    }
    page += &chart("pass rate per level", &as_series(&level_series(&lines)));
    page += "</body></html>\n";
    dice_model::shards::write_atomically(html, |w| Ok(w.write_all(page.as_bytes())?))
}

/// (step, value) of every line `value` reads a number from.
fn points(lines: &[Value], value: impl Fn(&Value) -> Option<f64>) -> Vec<(f64, f64)> {
    lines
        .iter()
        .filter_map(|line| Some((line["step"].as_f64()?, value(line)?)))
        .collect()
}

/// One series per level of `pass_rate_by_level`, labelled by the level.
fn level_series(lines: &[Value]) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut levels: BTreeMap<u64, Vec<(f64, f64)>> = BTreeMap::new();
    for line in lines {
        let (Some(step), Some(rates)) = (
            line["step"].as_f64(),
            line["pass_rate_by_level"].as_object(),
        ) else {
            continue;
        };
        for (level, rate) in rates {
            if let (Ok(level), Some(rate)) = (level.parse(), rate.as_f64()) {
                levels.entry(level).or_default().push((step, rate));
            }
        }
    }
    levels
        .into_iter()
        .map(|(level, points)| (format!("level {level}"), points))
        .collect()
}

/// The charts' series, coloured in order.
fn as_series<L: AsRef<str>>(series: &[(L, Vec<(f64, f64)>)]) -> Vec<Series<'_>> {
    series
        .iter()
        .zip(CLASSES.iter().cycle())
        .map(|((label, points), class)| (label.as_ref(), *class, points.as_slice()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_draws_every_quantity_and_level() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        let step = |s: u64, reward: f64| {
            serde_json::json!({
                "step": s, "reward_mean": reward, "pass_rate": reward, "deceptive_rate": 0.0,
                "pass_rate_by_level": {"1": reward, "2": 0.0}, "kl": 1e-3, "clip_fraction": 0.1,
                "entropy": 2.0, "loss": -0.1, "grad_norm": 0.5, "advantage_mean": 0.0,
                "advantage_std": 1.0, "advantage_abs_max": 1.5, "seconds_rollout": 3.0,
                "seconds_judge": 2.0, "seconds_idle": 0.5, "seconds_update": 1.0,
                "seconds_step": 4.5, "rollout_tokens_per_s": 100.0
            })
            .to_string()
        };
        let eval = serde_json::json!({"step": 2, "eval_tasks": 3, "eval_pass_rate": 0.25});
        std::fs::write(
            &metrics,
            format!("{}\n{}\n{eval}\n", step(1, 0.25), step(2, 0.5)),
        )
        .unwrap();
        let html = dir.path().join("metrics.html");
        write_html(&metrics, &html, "rl <run>").unwrap();
        let page = std::fs::read_to_string(&html).unwrap();
        assert!(page.contains("<title>rl &lt;run&gt;</title>"));
        assert!(page.contains("step 2 · reward 0.500"), "{page}");
        for heading in [
            "reward",
            "KL",
            "clip fraction",
            "entropy",
            "seconds per phase",
        ] {
            assert!(
                page.contains(&format!("<h2>{heading}")),
                "no {heading} chart"
            );
        }
        // reward, pass, deceptive and held-out pass rate: four lines in the first chart.
        let reward_chart = page.split("<h2>").nth(1).unwrap();
        assert_eq!(reward_chart.matches("<polyline").count(), 4);
        let levels = page.split("<h2>pass rate per level").nth(1).unwrap();
        assert!(levels.contains("— level 1") && levels.contains("— level 2"));
        assert!(!page.contains("no data yet") && !page.contains("<script"));
    }
}
