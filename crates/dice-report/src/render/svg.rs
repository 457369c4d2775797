//! The report's charts (inline SVG, drawn by dice-chart).

use dice_chart::{Axis, Bar, Chart, Point, Series};
use std::collections::BTreeMap;

/// Speedups further than this many octaves from the baseline are drawn on that edge (the
/// tooltips keep the exact value).
const OCTAVES: i32 = 6;
/// Histogram bins per octave of speedup.
const BINS_PER_OCTAVE: f64 = 2.0;
const CORRECT_COLOUR: &str = "#2a9d8f";
const DECEPTIVE_COLOUR: &str = "#e63946";
const FAILED_COLOUR: &str = "#9a9a9a";
const BASELINE_COLOUR: &str = "#333";
const RAW_COLOUR: &str = "#2a9d8f";
const ROBUST_COLOUR: &str = "#264653";

/// How a point of the per-problem chart is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mark {
    Correct,
    Deceptive,
    Failed,
}

impl Mark {
    /// Legend label and colour.
    fn looks(self) -> (&'static str, &'static str) {
        match self {
            Mark::Correct => ("correct", CORRECT_COLOUR),
            Mark::Deceptive => ("deceptive (reward hack)", DECEPTIVE_COLOUR),
            Mark::Failed => ("failed", FAILED_COLOUR),
        }
    }
}

fn clamped(speedup: f64) -> f64 {
    let limit = f64::from(OCTAVES).exp2();
    speedup.clamp(1.0 / limit, limit)
}

/// Histogram of speedups on a log2 axis, half-octave bins, with the baseline at 1× (the page
/// titles it).
pub(super) fn speedup_histogram(speedups: &[f64]) -> String {
    let mut counts: BTreeMap<i64, usize> = BTreeMap::new();
    for &s in speedups.iter().filter(|s| **s > 0.0) {
        let bin = (clamped(s).log2() * BINS_PER_OCTAVE).floor() as i64;
        // The top edge (exactly 2^OCTAVES) belongs to the last bin.
        let last = i64::from(OCTAVES) * BINS_PER_OCTAVE as i64 - 1;
        *counts.entry(bin.min(last)).or_default() += 1;
    }
    let bars = counts
        .into_iter()
        .map(|(bin, count)| {
            let from = (bin as f64 / BINS_PER_OCTAVE).exp2();
            let to = ((bin + 1) as f64 / BINS_PER_OCTAVE).exp2();
            Bar {
                from,
                to,
                value: count as f64,
                tip: format!("{from:.3}× – {to:.3}×: {count} samples"),
            }
        })
        .collect();
    Chart::new(
        "Speedup histogram of correct samples",
        Axis::ratio("speedup over the baseline (log scale)").including(1.0),
        Axis::integer("samples").including(0.0),
    )
    .untitled()
    .with(Series::bars("correct samples", bars).colour(CORRECT_COLOUR))
    .rule_at_x(1.0, "1× (baseline)", BASELINE_COLOUR)
    .svg()
}

/// Per-problem chart: x = problem id, y = speedup on a log2 axis with the baseline at 1×;
/// samples without a speedup sit in a band under the axis.
pub(super) fn strip_chart(title: &str, points: &[(u32, Option<f64>, Mark)]) -> String {
    let mut chart = Chart::new(
        title,
        Axis::integer("problem"),
        Axis::ratio("speedup (log scale)").including(1.0),
    )
    .size(720.0, 280.0)
    .missing_band("no speedup")
    .rule_at_y(1.0, "baseline (1×)", BASELINE_COLOUR);
    for mark in [Mark::Correct, Mark::Deceptive, Mark::Failed] {
        let marked: Vec<Point> = points
            .iter()
            .filter(|p| p.2 == mark)
            .map(|&(id, speedup, _)| Point {
                x: f64::from(id),
                y: speedup.filter(|_| mark != Mark::Failed).map(clamped),
                tip: speedup.map_or(format!("problem {id}"), |s| format!("problem {id} {s:.3}×")),
            })
            .collect();
        if !marked.is_empty() {
            let (label, colour) = mark.looks();
            chart = chart.with(Series::points(label, marked).colour(colour));
        }
    }
    chart.svg()
}

/// One run's bars in a chart of rates: its raw and robust value, `None` when the run lacks what
/// the chart shows.
pub(super) struct RatePair<'a> {
    pub label: &'a str,
    pub raw_robust: Option<(f64, f64)>,
}

/// Bars on a 0–100 % axis, a raw and a robust bar per run.
pub(super) fn rate_bars(title: &str, runs: &[RatePair]) -> String {
    let labels: Vec<String> = runs.iter().map(|r| r.label.to_string()).collect();
    let raw = runs.iter().map(|r| r.raw_robust.map(|v| v.0)).collect();
    let robust = runs.iter().map(|r| r.raw_robust.map(|v| v.1)).collect();
    Chart::grouped_bars(
        title,
        ("", &labels),
        Axis::percent("of problems").with_range(0.0, 1.0),
        &[("raw", RAW_COLOUR, raw), ("robust", ROBUST_COLOUR, robust)],
        "not run",
    )
    .size(360.0, 250.0)
    .svg()
}
