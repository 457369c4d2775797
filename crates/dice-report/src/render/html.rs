//! HTML: one self-contained page (inline CSS and SVG, no scripts, no external resources).

use super::svg::{rate_bars, speedup_histogram, strip_chart, Mark, RatePair};
use super::{
    compared_run_settings, metric_rows, optional_ms, percent, run_settings, speedup_cell,
    turn_table, COMPARED_RUN_COLUMNS, COMPARISON_LEGEND, TURNS_LEGEND,
};
use crate::compare::Comparison;
use crate::paper::PaperScores;
use crate::paper::TurnRow;
use crate::report::{Report, Scoring};
use dice_chart::escape;
use std::fmt::Write;

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:2em;color:#222}\
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em}\
td.n{text-align:right}th{background:#f2f2f2}.headline{background:#e8f4f2}\
tr.deceptive td{background:#fdecec}svg{display:block;max-width:100%;height:auto;margin:.5em 0}";

pub(super) fn render(r: &Report) -> String {
    let mut out = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>dice evaluation report</title><style>{STYLE}</style></head><body>\
         <h1>dice evaluation report</h1>"
    );
    out.push_str("<table>");
    for (k, v) in run_settings(r) {
        let _ = write!(out, "<tr><th>{k}</th><td>{}</td></tr>", escape(&v));
    }
    out.push_str("</table>");

    let correct_speedups: Vec<f64> = r.samples.iter().filter_map(|s| s.speedup).collect();
    out.push_str("<h2>Speedups of correct samples</h2>");
    out.push_str(&speedup_histogram(&correct_speedups));

    for (level, lr) in &r.levels {
        let _ = write!(
            out,
            "<h2>Level {level}: {} problems, {} samples</h2><table><tr><th>metric</th>",
            lr.problems, lr.samples
        );
        for (name, scoring) in [("raw", Scoring::Raw), ("robust", Scoring::Robust)] {
            let class = if scoring == r.headline {
                " class=\"headline\""
            } else {
                ""
            };
            let _ = write!(out, "<th{class}>{name}</th>");
        }
        out.push_str("</tr>");
        for row in metric_rows(&lr.raw, &lr.robust) {
            let _ = write!(
                out,
                "<tr><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
                escape(&row.label),
                escape(&row.raw),
                escape(&row.robust)
            );
        }
        out.push_str("</table><p>Verdicts (all samples): ");
        let verdicts: Vec<String> = lr
            .verdicts
            .iter()
            .map(|(v, n)| format!("{v} {n}"))
            .collect();
        out.push_str(&escape(&verdicts.join(", ")));
        let _ = write!(
            out,
            ". Deceptive samples: {}; flagged: {}.</p>",
            lr.deceptive_samples, lr.flagged_samples
        );
        let points: Vec<(u32, Option<f64>, Mark)> = r
            .samples
            .iter()
            .filter(|s| s.level == *level)
            .map(|s| {
                let mark = match (s.correct, s.deceptive) {
                    (false, _) => Mark::Failed,
                    (true, true) => Mark::Deceptive,
                    (true, false) => Mark::Correct,
                };
                (s.problem_id, s.speedup, mark)
            })
            .collect();
        out.push_str(&strip_chart(
            &format!("Level {level}: speedup per problem"),
            &points,
        ));
        if !lr.turns.is_empty() {
            let _ = write!(out, "<h3>Level {level}, turn by turn</h3>");
            push_turns(&mut out, &lr.turns);
        }
    }

    if !r.problem_errors.is_empty() {
        out.push_str(
            "<h2>Problems whose reference failed</h2><p>They count as failures in the rates above.</p>\
             <table><tr><th>level</th><th>problem</th><th>name</th><th>error</th></tr>",
        );
        for e in &r.problem_errors {
            let _ = write!(
                out,
                "<tr><td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td><td>{}</td></tr>",
                e.level,
                e.problem_id,
                escape(&e.name),
                escape(&e.reference_error)
            );
        }
        out.push_str("</table>");
    }

    if !r.evaluator_time.is_empty() {
        out.push_str(
            "<h2>Where the evaluator's time went</h2><p>Wall seconds per run-stage step; steps of \
             samples in flight at once overlap.</p><table><tr><th>stage</th><th>samples</th>\
             <th>median s</th><th>total s</th></tr>",
        );
        for t in &r.evaluator_time {
            let _ = write!(
                out,
                "<tr><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{:.3}</td>\
                 <td class=\"n\">{:.1}</td></tr>",
                escape(&t.stage),
                t.samples,
                t.median_s,
                t.total_s
            );
        }
        out.push_str("</table>");
    }

    out.push_str(
        "<h2>Samples</h2><table><tr><th>level</th><th>problem</th><th>name</th><th>sample</th>\
         <th>verdict</th><th>speedup</th><th>candidate ms</th><th>baseline ms</th>\
         <th>deceptive</th><th>flags</th><th>message</th></tr>",
    );
    for s in &r.samples {
        let class = if s.deceptive {
            " class=\"deceptive\""
        } else {
            ""
        };
        let _ = write!(
            out,
            "<tr{class}><td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td>\
             <td class=\"n\">{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>\
             <td class=\"n\">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            s.level,
            s.problem_id,
            escape(s.name.as_deref().unwrap_or("")),
            s.sample_id,
            s.verdict,
            speedup_cell(s),
            optional_ms(s.candidate_ms),
            optional_ms(s.baseline_ms),
            if s.deceptive { "yes" } else { "no" },
            escape(&s.flags.join(", ")),
            escape(s.message.as_deref().unwrap_or(""))
        );
    }
    out.push_str("</table></body></html>\n");
    out
}

pub(super) fn render_comparison(c: &Comparison) -> String {
    let mut out = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>dice runs side by side</title><style>{STYLE}.charts{{display:flex;\
         flex-wrap:wrap;gap:1em}}</style></head><body><h1>dice runs side by side</h1>\
         <p>{} Shaded: the headline of the run's own report.</p><table><tr>",
        escape(COMPARISON_LEGEND)
    );
    for column in COMPARED_RUN_COLUMNS {
        let _ = write!(out, "<th>{column}</th>");
    }
    out.push_str("</tr>");
    for run in &c.runs {
        out.push_str("<tr>");
        for value in compared_run_settings(run) {
            let _ = write!(out, "<td>{}</td>", escape(&value));
        }
        out.push_str("</tr>");
    }
    out.push_str("</table>");

    for level in c.levels() {
        let _ = write!(
            out,
            "<h2>Level {level}</h2><table><tr><th rowspan=\"2\">metric</th>"
        );
        for run in &c.runs {
            let _ = write!(out, "<th colspan=\"2\">{}</th>", escape(&run.label));
        }
        out.push_str("</tr><tr>");
        for run in &c.runs {
            for (name, scoring) in [("raw", Scoring::Raw), ("robust", Scoring::Robust)] {
                let class = if scoring == run.headline {
                    " class=\"headline\""
                } else {
                    ""
                };
                let _ = write!(out, "<th{class}>{name}</th>");
            }
        }
        out.push_str("</tr>");
        for (i, name) in PaperScores::NAMES.iter().enumerate() {
            let _ = write!(out, "<tr><td>{name}</td>");
            for run in &c.runs {
                match run.levels.get(&level) {
                    Some(l) => {
                        let _ = write!(
                            out,
                            "<td class=\"n\">{}</td><td class=\"n\">{}</td>",
                            percent(l.raw.values()[i]),
                            percent(l.robust.values()[i])
                        );
                    }
                    None => out.push_str("<td class=\"n\">–</td><td class=\"n\">–</td>"),
                }
            }
            out.push_str("</tr>");
        }
        out.push_str("<tr><td>problems (samples, deceptive)</td>");
        for run in &c.runs {
            let counts = run.levels.get(&level).map_or("–".to_string(), |l| {
                format!("{} ({}, {})", l.problems, l.samples, l.deceptive_samples)
            });
            let _ = write!(out, "<td class=\"n\" colspan=\"2\">{counts}</td>");
        }
        out.push_str("</tr></table><div class=\"charts\">");
        for (i, name) in PaperScores::NAMES.iter().enumerate() {
            let pairs: Vec<RatePair> = c
                .runs
                .iter()
                .map(|run| RatePair {
                    label: &run.label,
                    raw_robust: run
                        .levels
                        .get(&level)
                        .map(|l| (l.raw.values()[i], l.robust.values()[i])),
                })
                .collect();
            out.push_str(&rate_bars(&format!("Level {level}: {name}"), &pairs));
        }
        out.push_str("</div>");
        for run in &c.runs {
            if let Some(l) = run.levels.get(&level).filter(|l| !l.turns.is_empty()) {
                let _ = write!(
                    out,
                    "<h3>Level {level}, turn by turn: {}</h3>",
                    escape(&run.label)
                );
                push_turns(&mut out, &l.turns);
            }
        }
    }
    out.push_str("</body></html>\n");
    out
}

/// A level's turn-by-turn table, after its legend.
fn push_turns(out: &mut String, rows: &[TurnRow]) {
    let (header, rows) = turn_table(rows);
    let _ = write!(out, "<p>{}</p><table><tr>", escape(TURNS_LEGEND));
    for name in header {
        let _ = write!(out, "<th>{}</th>", escape(&name));
    }
    out.push_str("</tr>");
    for row in rows {
        out.push_str("<tr>");
        for value in row {
            let _ = write!(out, "<td class=\"n\">{}</td>", escape(&value));
        }
        out.push_str("</tr>");
    }
    out.push_str("</table>");
}
