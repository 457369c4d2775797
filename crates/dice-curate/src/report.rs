//! The run's report (`report.md`, `report.html`): the funnel from records read to pairs kept,
//! the speedups of correct pairs before and after the threshold, why pairs were dropped, and
//! the duplicate clusters; diversify's problems, attempts and why attempts were dropped; and the
//! RL tasks per curriculum level of the last export.

use crate::diversify::DiversifySummary;
use crate::export::DifficultySummary;
use crate::ingest::IngestSummary;
use crate::run::RunDir;
use crate::verify::VerifySummary;
use anyhow::{Context, Result};
use dice_chart::{escape, Axis, Bar, Chart, Series};
use std::fmt::Write;
use std::path::PathBuf;

/// The threshold line of the speedup chart.
const THRESHOLD_COLOUR: &str = "#c33";
/// Speedup histogram bins: powers of two from 2⁻⁶ to 2⁷ (values outside go to the end bins).
const BIN_EXPONENTS: std::ops::RangeInclusive<i32> = -6..=7;

/// What the report shows, read from the run folder.
struct Facts {
    ingest: Option<IngestSummary>,
    verify: Option<VerifySummary>,
    diversify: Option<DiversifySummary>,
    difficulty: Option<DifficultySummary>,
}

/// Writes `report.md` and `report.html` into the run folder; returns their paths.
pub fn write_report(run: &RunDir) -> Result<Vec<PathBuf>> {
    let facts = Facts {
        ingest: read_if_there(&run.ingest_summary())?,
        verify: read_if_there(&run.verify_summary())?,
        diversify: read_if_there(&run.diversify_summary())?,
        difficulty: read_if_there(&run.difficulty_summary())?,
    };
    if facts.ingest.is_none() && facts.diversify.is_none() {
        let dir = run.dir.display();
        anyhow::bail!(
            "{dir} holds no curate run: run `dice curate ingest --run {dir}` or `dice curate diversify --run {dir}` first"
        );
    }
    let md = run.dir.join("report.md");
    let html = run.dir.join("report.html");
    std::fs::write(&md, markdown(&facts))
        .with_context(|| format!("cannot write {}", md.display()))?;
    std::fs::write(&html, html_page(&facts))
        .with_context(|| format!("cannot write {}", html.display()))?;
    Ok(vec![md, html])
}

fn read_if_there<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> Result<Option<T>> {
    if path.exists() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> Result<T> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not this run's", path.display()))
}

/// `(stage, count)` from records read to pairs kept.
fn funnel(i: &IngestSummary, f: &Facts) -> Vec<(String, usize)> {
    let read: usize = i.read.values().sum();
    let mut rows = vec![
        ("records read".to_string(), read),
        ("readable".to_string(), read - i.rejected),
        (
            "without exact duplicates".to_string(),
            read - i.rejected - i.exact_duplicates,
        ),
        (
            format!("without near duplicates (J ≥ {})", i.threshold),
            i.kept,
        ),
        ("with a kernel".to_string(), i.kept - i.problem_only),
    ];
    if let Some(v) = &f.verify {
        rows.push(("correct and timed".to_string(), v.speedups_correct.len()));
        rows.push((
            format!(
                "kept: not deceptive, speedup ≥ {}x with 95 % confidence",
                v.min_speedup
            ),
            v.kept,
        ));
    }
    rows
}

fn histogram(speedups: &[f64]) -> Vec<usize> {
    let (lo, hi) = (*BIN_EXPONENTS.start(), *BIN_EXPONENTS.end());
    let mut bins = vec![0; BIN_EXPONENTS.count()];
    for s in speedups.iter().filter(|s| **s > 0.0) {
        let e = (s.log2().floor() as i32).clamp(lo, hi);
        bins[(e - lo) as usize] += 1;
    }
    bins
}

fn bin_label(e: i32) -> String {
    let bound = |e: i32| {
        if e >= 0 {
            format!("{}", 1u64 << e)
        } else {
            format!("1/{}", 1u64 << -e)
        }
    };
    format!("{}–{}x", bound(e), bound(e + 1))
}

fn markdown(f: &Facts) -> String {
    let mut out = String::from("# dice curate\n");
    if let Some(ingest) = &f.ingest {
        out.push_str(&ingest_markdown(ingest, f));
    }
    if let Some(d) = &f.diversify {
        out.push_str(&diversify_markdown(d));
    }
    if let Some(d) = &f.difficulty {
        out.push_str(&difficulty_markdown(d));
    }
    out
}

/// One line on where the levels came from and how many tasks have none of their own.
fn difficulty_origin(d: &DifficultySummary) -> String {
    format!(
        "{} RL tasks, levels by {} ({}); {} without a measure and {} whose measure gave no level are at the hardest level.",
        d.tasks.len(),
        d.method,
        d.source,
        d.unmeasured,
        d.fallback
    )
}

fn difficulty_markdown(d: &DifficultySummary) -> String {
    let mut out = format!(
        "\n## Difficulty\n\n{}\n\n| level | tasks |\n| --- | ---: |\n",
        difficulty_origin(d)
    );
    for (level, n) in &d.histogram {
        let _ = writeln!(out, "| {level} | {n} |");
    }
    out
}

/// The tasks per level as bars, easiest level left.
fn difficulty_svg(d: &DifficultySummary) -> String {
    let levels = d
        .histogram
        .iter()
        .map(|(level, _)| level.to_string())
        .collect();
    let bars = d
        .histogram
        .iter()
        .enumerate()
        .map(|(i, (level, n))| Bar {
            from: i as f64 - 0.35,
            to: i as f64 + 0.35,
            value: *n as f64,
            tip: format!("level {level}: {n} tasks"),
        })
        .collect();
    Chart::new(
        "RL tasks per curriculum level",
        Axis::categories("curriculum level", levels),
        Axis::integer("tasks").including(0.0),
    )
    .untitled()
    .size(480.0, 240.0)
    .with(
        Series::bars("RL tasks", bars)
            .colour("#4a7ebb")
            .with_values(),
    )
    .svg()
}

/// `(stage, count)` of diversify: problems drawn, attempts judged, problems kept.
fn diversify_counts(d: &DiversifySummary) -> Vec<(String, usize)> {
    vec![
        ("problems drawn".to_string(), d.problems),
        ("attempts judged".to_string(), d.attempts),
        (
            format!(
                "problems kept: not deceptive, speedup ≥ {}x with 95 % confidence",
                d.min_speedup
            ),
            d.kept,
        ),
    ]
}

fn diversify_markdown(d: &DiversifySummary) -> String {
    let mut out = String::from("\n## Diversify\n\n| stage | count |\n| --- | ---: |\n");
    for (stage, n) in diversify_counts(d) {
        let _ = writeln!(out, "| {stage} | {n} |");
    }
    out.push_str("\n| attempts dropped because | attempts |\n| --- | ---: |\n");
    for (reason, n) in &d.dropped {
        let _ = writeln!(out, "| {reason} | {n} |");
    }
    out
}

fn ingest_markdown(ingest: &IngestSummary, f: &Facts) -> String {
    let mut out = String::from("\n## Funnel\n\n| stage | pairs |\n| --- | ---: |\n");
    for (stage, n) in funnel(ingest, f) {
        let _ = writeln!(out, "| {stage} | {n} |");
    }
    let read: Vec<String> = ingest
        .read
        .iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    let _ = writeln!(out, "\nRecords read per format: {}.", read.join(", "));
    if let Some(v) = &f.verify {
        out.push_str("\n## Speedups of correct pairs\n\n");
        let _ = writeln!(
            out,
            "Threshold: the lower end of the 95 % interval ≥ {}x.\n",
            v.min_speedup
        );
        out.push_str("| speedup | correct | kept |\n| --- | ---: | ---: |\n");
        let (all, kept) = (histogram(&v.speedups_correct), histogram(&v.speedups_kept));
        for (k, e) in BIN_EXPONENTS.enumerate() {
            if all[k] > 0 {
                let _ = writeln!(out, "| {} | {} | {} |", bin_label(e), all[k], kept[k]);
            }
        }
        out.push_str("\n## Dropped pairs\n\n| reason | pairs |\n| --- | ---: |\n");
        for (reason, n) in &v.dropped {
            let _ = writeln!(out, "| {reason} | {n} |");
        }
    }
    out.push_str(&clusters_markdown(ingest));
    out
}

fn clusters_markdown(i: &IngestSummary) -> String {
    let mut out = format!(
        "\n## Duplicate clusters\n\n{} clusters: {} exact and {} near duplicates dropped in favour of the pair kept.\n\n",
        i.clusters.len(),
        i.exact_duplicates,
        i.near_duplicates
    );
    if i.clusters.is_empty() {
        return out;
    }
    out.push_str("| kept | dropped (similarity) |\n| --- | --- |\n");
    for c in &i.clusters {
        let dropped: Vec<String> = c
            .duplicates
            .iter()
            .map(|(origin, j)| format!("{origin} ({j:.2})"))
            .collect();
        let _ = writeln!(out, "| {} | {} |", c.kept, dropped.join("<br>"));
    }
    out
}

fn html_page(f: &Facts) -> String {
    let mut body = String::from("<h1>dice curate</h1>");
    if let Some(ingest) = &f.ingest {
        body.push_str(&ingest_html(ingest, f));
    }
    if let Some(d) = &f.diversify {
        body.push_str("<h2>Diversify</h2>");
        body.push_str(&html_table(["stage", "count"], &diversify_counts(d)));
        let dropped: Vec<(String, usize)> = d.dropped.clone().into_iter().collect();
        body.push_str(&html_table(
            ["attempts dropped because", "attempts"],
            &dropped,
        ));
    }
    if let Some(d) = &f.difficulty {
        let rows: Vec<(String, usize)> = d
            .histogram
            .iter()
            .map(|(level, n)| (level.to_string(), *n))
            .collect();
        let _ = write!(
            body,
            "<h2>Difficulty</h2><p>{}</p>{}",
            escape(&difficulty_origin(d)),
            difficulty_svg(d)
        );
        body.push_str(&html_table(["level", "tasks"], &rows));
    }
    format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>dice curate</title><style>\
body{{font-family:system-ui,sans-serif;max-width:60em;margin:2em auto;color:#222}}\
table{{border-collapse:collapse;margin:.5em 0 1.5em}}td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:left}}\
th{{background:#f2f2f2}}svg{{display:block;max-width:100%;height:auto;margin:.5em 0}}</style></head><body>{body}</body></html>\n"
    )
}

fn html_table(head: [&str; 2], rows: &[(String, usize)]) -> String {
    let mut table = format!("<table><tr><th>{}</th><th>{}</th></tr>", head[0], head[1]);
    for (label, n) in rows {
        let _ = write!(table, "<tr><td>{}</td><td>{n}</td></tr>", escape(label));
    }
    table.push_str("</table>");
    table
}

fn ingest_html(ingest: &IngestSummary, f: &Facts) -> String {
    let mut body = String::from("<h2>Funnel</h2>");
    body.push_str(&html_table(["stage", "pairs"], &funnel(ingest, f)));
    if let Some(v) = &f.verify {
        body.push_str("<h2>Speedups of correct pairs</h2>");
        body.push_str(&speedup_svg(v));
        body.push_str("<h2>Dropped pairs</h2>");
        let dropped: Vec<(String, usize)> = v.dropped.clone().into_iter().collect();
        body.push_str(&html_table(["reason", "pairs"], &dropped));
    }
    let _ = write!(
        body,
        "<h2>Duplicate clusters</h2><p>{} clusters: {} exact and {} near duplicates dropped.</p><table><tr><th>kept</th><th>dropped (similarity)</th></tr>",
        ingest.clusters.len(),
        ingest.exact_duplicates,
        ingest.near_duplicates
    );
    for c in &ingest.clusters {
        let dropped: Vec<String> = c
            .duplicates
            .iter()
            .map(|(origin, j)| format!("{} ({j:.2})", escape(origin)))
            .collect();
        let _ = write!(
            body,
            "<tr><td>{}</td><td>{}</td></tr>",
            escape(&c.kept),
            dropped.join("<br>")
        );
    }
    body.push_str("</table>");
    body
}

/// Bars per power-of-two bin, correct pairs in grey and kept ones in blue over them, with the
/// threshold as a red line.
fn speedup_svg(v: &VerifySummary) -> String {
    let (all, kept) = (histogram(&v.speedups_correct), histogram(&v.speedups_kept));
    let bars = |counts: &[usize]| -> Vec<Bar> {
        BIN_EXPONENTS
            .enumerate()
            .map(|(k, e)| Bar {
                from: f64::from(e).exp2(),
                to: f64::from(e + 1).exp2(),
                value: counts[k] as f64,
                tip: format!("{}: {} correct, {} kept", bin_label(e), all[k], kept[k]),
            })
            .collect()
    };
    Chart::new(
        "Speedups of correct pairs",
        Axis::ratio("speedup over the reference (log scale, power-of-two bins)"),
        Axis::integer("pairs").including(0.0),
    )
    .untitled()
    .with(
        Series::bars("correct", bars(&all))
            .colour("#bbb")
            .with_values(),
    )
    .with(Series::bars("kept", bars(&kept)).colour("#36c"))
    .rule_at_x(
        v.min_speedup,
        &format!("threshold {}×", v.min_speedup),
        THRESHOLD_COLOUR,
    )
    .svg()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speedups_fall_in_power_of_two_bins() {
        let bins = histogram(&[0.001, 0.75, 1.0, 1.9, 2.0, 500.0]);
        let at = |e: i32| bins[(e - BIN_EXPONENTS.start()) as usize];
        assert_eq!((at(-6), at(-1), at(0), at(1), at(7)), (1, 1, 2, 1, 1));
        assert_eq!(bin_label(-1), "1/2–1x");
        assert_eq!(bin_label(1), "2–4x");
    }
}
