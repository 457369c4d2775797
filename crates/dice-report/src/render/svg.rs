//! Inline SVG charts (no scripts, no external resources).

use super::esc;
use std::fmt::Write;

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 240.0;
const MARGIN: f64 = 40.0;
/// log2 speedups are clamped to ±this for display.
const LOG2_LIMIT: f64 = 6.0;

/// How a point of the strip chart is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mark {
    Correct,
    Deceptive,
    Failed,
}

impl Mark {
    fn colour(self) -> &'static str {
        match self {
            Mark::Correct => "#2a9d8f",
            Mark::Deceptive => "#e63946",
            Mark::Failed => "#9a9a9a",
        }
    }
}

fn log2_clamped(speedup: f64) -> f64 {
    speedup.log2().clamp(-LOG2_LIMIT, LOG2_LIMIT)
}

fn svg_open(title: &str, width: f64, height: f64) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {width} {height}\" \
         width=\"{width}\" height=\"{height}\" role=\"img\" aria-label=\"{title}\">\
         <title>{title}</title>"
    )
}

/// x position of a log2 speedup on the histogram's axis.
fn x_of(log2: f64) -> f64 {
    MARGIN + (log2 + LOG2_LIMIT) / (2.0 * LOG2_LIMIT) * (WIDTH - 2.0 * MARGIN)
}

/// Histogram of speedups on a log2 axis, half-octave bins, with a marker at 1×.
pub(super) fn speedup_histogram(speedups: &[f64]) -> String {
    const BINS_PER_OCTAVE: f64 = 2.0;
    let bins = (2.0 * LOG2_LIMIT * BINS_PER_OCTAVE) as usize;
    let mut counts = vec![0usize; bins];
    for &s in speedups.iter().filter(|s| **s > 0.0) {
        let i = ((log2_clamped(s) + LOG2_LIMIT) * BINS_PER_OCTAVE) as usize;
        counts[i.min(bins - 1)] += 1;
    }
    let max = counts.iter().copied().max().unwrap_or(0).max(1) as f64;
    let bin_w = (WIDTH - 2.0 * MARGIN) / bins as f64;
    let plot_h = HEIGHT - 2.0 * MARGIN;
    let mut svg = svg_open("Speedup histogram of correct samples", WIDTH, HEIGHT);
    for (i, &c) in counts.iter().enumerate().filter(|(_, c)| **c > 0) {
        let h = c as f64 / max * plot_h;
        let lo = i as f64 / BINS_PER_OCTAVE - LOG2_LIMIT;
        let _ = write!(
            svg,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{h:.1}\" fill=\"#2a9d8f\">\
             <title>{:.3}× – {:.3}×: {c}</title></rect>",
            MARGIN + i as f64 * bin_w,
            HEIGHT - MARGIN - h,
            bin_w - 1.0,
            lo.exp2(),
            (lo + 1.0 / BINS_PER_OCTAVE).exp2()
        );
    }
    axis_ticks(&mut svg);
    let _ = write!(
        svg,
        "<text x=\"{MARGIN}\" y=\"{:.0}\" font-size=\"11\">max bin: {max} samples</text></svg>",
        MARGIN - 12.0
    );
    svg
}

fn axis_ticks(svg: &mut String) {
    let base = HEIGHT - MARGIN;
    let _ = write!(
        svg,
        "<line x1=\"{MARGIN}\" y1=\"{base}\" x2=\"{}\" y2=\"{base}\" stroke=\"#333\"/>",
        WIDTH - MARGIN
    );
    for e in (-LOG2_LIMIT as i32..=LOG2_LIMIT as i32).step_by(2) {
        let x = x_of(e as f64);
        let label = if e >= 0 {
            format!("{}×", 1u64 << e)
        } else {
            format!("1/{}×", 1u64 << -e)
        };
        let _ = write!(
            svg,
            "<text x=\"{x:.1}\" y=\"{:.0}\" font-size=\"11\" text-anchor=\"middle\">{label}</text>",
            base + 16.0
        );
    }
    let one = x_of(0.0);
    let _ = write!(
        svg,
        "<line x1=\"{one:.1}\" y1=\"{MARGIN}\" x2=\"{one:.1}\" y2=\"{base}\" stroke=\"#333\" \
         stroke-dasharray=\"4 3\"/>"
    );
}

/// Per-problem strip chart: x = problem id, y = log2 speedup; failed samples sit in a
/// band under the axis.
pub(super) fn strip_chart(title: &str, points: &[(u32, Option<f64>, Mark)]) -> String {
    let max_id = points.iter().map(|p| p.0).max().unwrap_or(1).max(1) as f64;
    let fail_y = HEIGHT - MARGIN / 2.0;
    let plot_h = HEIGHT - 2.0 * MARGIN;
    let y_of = |log2: f64| MARGIN + (LOG2_LIMIT - log2) / (2.0 * LOG2_LIMIT) * plot_h;
    let x_of_id = |id: u32| MARGIN + id as f64 / max_id * (WIDTH - 2.0 * MARGIN);
    let mut svg = svg_open(title, WIDTH, HEIGHT);
    let one = y_of(0.0);
    let _ = write!(
        svg,
        "<line x1=\"{MARGIN}\" y1=\"{one:.1}\" x2=\"{}\" y2=\"{one:.1}\" stroke=\"#333\" \
         stroke-dasharray=\"4 3\"/><text x=\"4\" y=\"{:.1}\" font-size=\"11\">1×</text>\
         <text x=\"4\" y=\"{:.1}\" font-size=\"11\">{}×</text>\
         <text x=\"4\" y=\"{:.1}\" font-size=\"11\">1/{}×</text>\
         <text x=\"4\" y=\"{fail_y:.1}\" font-size=\"11\">failed</text>",
        WIDTH - MARGIN,
        one + 4.0,
        MARGIN + 4.0,
        1u64 << LOG2_LIMIT as u32,
        HEIGHT - MARGIN,
        1u64 << LOG2_LIMIT as u32,
    );
    for &(id, speedup, mark) in points {
        let y = match (mark, speedup) {
            (Mark::Failed, _) | (_, None) => fail_y,
            (_, Some(s)) => y_of(log2_clamped(s)),
        };
        let tip = speedup.map_or(String::new(), |s| format!(" {s:.3}×"));
        let _ = write!(
            svg,
            "<circle cx=\"{:.1}\" cy=\"{y:.1}\" r=\"3\" fill=\"{}\" fill-opacity=\"0.8\">\
             <title>problem {id}{tip}</title></circle>",
            x_of_id(id),
            mark.colour()
        );
    }
    svg.push_str("</svg>");
    svg
}

/// One run's bars in a chart of rates: its raw and robust value, `None` when the run lacks what
/// the chart shows.
pub(super) struct RatePair<'a> {
    pub label: &'a str,
    pub raw_robust: Option<(f64, f64)>,
}

const RAW_COLOUR: &str = "#2a9d8f";
const ROBUST_COLOUR: &str = "#264653";

/// Bars on a 0–100 % axis, a raw and a robust bar per run.
pub(super) fn rate_bars(title: &str, runs: &[RatePair]) -> String {
    const W: f64 = 340.0;
    const H: f64 = 220.0;
    const LEFT: f64 = 40.0;
    const TOP: f64 = 36.0;
    const BOTTOM: f64 = 34.0;
    let plot_h = H - TOP - BOTTOM;
    let base = H - BOTTOM;
    let slot = (W - LEFT - 10.0) / runs.len().max(1) as f64;
    let bar_w = (slot * 0.35).min(40.0);
    let title = esc(title);
    let mut svg = svg_open(&title, W, H);
    let _ = write!(
        svg,
        "<text x=\"{LEFT}\" y=\"14\" font-size=\"12\" font-weight=\"bold\">{title}</text>\
         <rect x=\"{:.0}\" y=\"5\" width=\"10\" height=\"10\" fill=\"{RAW_COLOUR}\"/>\
         <text x=\"{:.0}\" y=\"14\" font-size=\"11\">raw</text>\
         <rect x=\"{:.0}\" y=\"5\" width=\"10\" height=\"10\" fill=\"{ROBUST_COLOUR}\"/>\
         <text x=\"{:.0}\" y=\"14\" font-size=\"11\">robust</text>",
        W - 110.0,
        W - 96.0,
        W - 60.0,
        W - 46.0
    );
    for percent in [0, 50, 100] {
        let y = base - f64::from(percent) / 100.0 * plot_h;
        let _ = write!(
            svg,
            "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.0}\" y2=\"{y:.1}\" stroke=\"#ccc\"/>\
             <text x=\"{:.0}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">{percent}%</text>",
            W - 10.0,
            LEFT - 4.0,
            y + 4.0
        );
    }
    for (i, run) in runs.iter().enumerate() {
        let centre = LEFT + (i as f64 + 0.5) * slot;
        let label = esc(run.label);
        let _ = write!(
            svg,
            "<text x=\"{centre:.1}\" y=\"{:.0}\" font-size=\"11\" text-anchor=\"middle\">\
             {}</text>",
            base + 14.0,
            esc(&tail(run.label, (slot / 6.5) as usize))
        );
        let Some((raw, robust)) = run.raw_robust else {
            let _ = write!(
                svg,
                "<text x=\"{centre:.1}\" y=\"{:.0}\" font-size=\"11\" text-anchor=\"middle\">\
                 not run</text>",
                base - 4.0
            );
            continue;
        };
        for (x, value, colour, scoring) in [
            (centre - bar_w - 1.0, raw, RAW_COLOUR, "raw"),
            (centre + 1.0, robust, ROBUST_COLOUR, "robust"),
        ] {
            let h = value.clamp(0.0, 1.0) * plot_h;
            let shown = format!("{:.1}%", 100.0 * value);
            let _ = write!(
                svg,
                "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{bar_w:.1}\" height=\"{h:.1}\" \
                 fill=\"{colour}\"><title>{label} {scoring}: {shown}</title></rect>\
                 <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"middle\">{shown}</text>",
                base - h,
                x + bar_w / 2.0,
                base - h - 3.0
            );
        }
    }
    svg.push_str("</svg>");
    svg
}

/// The end of `label` in at most `chars` characters (run labels are often paths; their ends
/// tell them apart).
fn tail(label: &str, chars: usize) -> String {
    let count = label.chars().count();
    if count <= chars.max(2) {
        return label.to_string();
    }
    let kept: String = label.chars().skip(count + 1 - chars.max(2)).collect();
    format!("…{kept}")
}
