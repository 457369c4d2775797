//! Markdown: run settings, one raw-vs-robust table per level, problem errors, flagged samples;
//! or runs side by side, one table per level with a raw and a robust column per run.

use super::{
    compared_run_settings, metric_rows, percent, run_settings, speedup_cell, turn_table,
    COMPARED_RUN_COLUMNS, COMPARISON_LEGEND, TURNS_LEGEND,
};
use crate::compare::Comparison;
use crate::paper::PaperScores;
use crate::paper::TurnRow;
use crate::report::{Report, Scoring};
use std::fmt::Write;

pub(super) fn render(r: &Report) -> String {
    let mut out = String::from("# dice evaluation report\n\n");
    let settings = run_settings(r);
    out.push_str("| run | |\n|---|---|\n");
    for (k, v) in settings {
        let _ = writeln!(out, "| {k} | {} |", cell(&v));
    }

    for (level, lr) in &r.levels {
        let _ = write!(
            out,
            "\n## Level {level}: {} problems, {} samples\n\n",
            lr.problems, lr.samples
        );
        let (raw_h, robust_h) = match r.headline {
            Scoring::Raw => ("**raw**", "robust"),
            Scoring::Robust => ("raw", "**robust**"),
        };
        let _ = writeln!(out, "| metric | {raw_h} | {robust_h} |\n|---|---:|---:|");
        for row in metric_rows(&lr.raw, &lr.robust) {
            let _ = writeln!(out, "| {} | {} | {} |", row.label, row.raw, row.robust);
        }
        let verdicts: Vec<String> = lr
            .verdicts
            .iter()
            .map(|(v, n)| format!("{v} {n}"))
            .collect();
        let _ = write!(
            out,
            "\nVerdicts (all samples): {}. Deceptive samples: {}; flagged: {}.\n",
            if verdicts.is_empty() {
                "none".to_string()
            } else {
                verdicts.join(", ")
            },
            lr.deceptive_samples,
            lr.flagged_samples
        );
        if !lr.turns.is_empty() {
            let _ = write!(out, "\n### Level {level}, turn by turn\n\n");
            push_turns(&mut out, &lr.turns);
        }
    }

    if !r.problem_errors.is_empty() {
        out.push_str(
            "\n## Problems whose reference failed\n\nThey count as failures in the rates above.\n\n\
             | level | problem | name | error |\n|---:|---:|---|---|\n",
        );
        for e in &r.problem_errors {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                e.level,
                e.problem_id,
                cell(&e.name),
                cell(&e.reference_error)
            );
        }
    }

    if !r.evaluator_time.is_empty() {
        out.push_str(
            "\n## Where the evaluator's time went\n\nWall seconds per run-stage step; steps of \
             samples in flight at once overlap, so totals exceed the run's wall time.\n\n\
             | stage | samples | median s | total s |\n|---|---:|---:|---:|\n",
        );
        for t in &r.evaluator_time {
            let _ = writeln!(
                out,
                "| {} | {} | {:.3} | {:.1} |",
                cell(&t.stage),
                t.samples,
                t.median_s,
                t.total_s
            );
        }
    }

    let flagged: Vec<_> = r
        .samples
        .iter()
        .filter(|s| s.deceptive || !s.flags.is_empty())
        .collect();
    if !flagged.is_empty() {
        out.push_str(
            "\n## Flagged samples\n\n| level | problem | sample | verdict | speedup | deceptive | flags |\n\
             |---:|---:|---:|---|---:|---|---|\n",
        );
        for s in flagged {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} |",
                s.level,
                s.problem_id,
                s.sample_id,
                s.verdict,
                speedup_cell(s),
                if s.deceptive { "yes" } else { "no" },
                cell(&s.flags.join(", "))
            );
        }
    }
    out
}

pub(super) fn render_comparison(c: &Comparison) -> String {
    let mut out = format!(
        "# dice runs side by side\n\n{COMPARISON_LEGEND} **Bold**: the headline of the run's \
         own report.\n\n| {} |\n|{}\n",
        COMPARED_RUN_COLUMNS.join(" | "),
        "---|".repeat(COMPARED_RUN_COLUMNS.len())
    );
    for run in &c.runs {
        let cells: Vec<String> = compared_run_settings(run).iter().map(|v| cell(v)).collect();
        let _ = writeln!(out, "| {} |", cells.join(" | "));
    }
    for level in c.levels() {
        let _ = write!(out, "\n## Level {level}\n\n| metric |");
        for run in &c.runs {
            let (raw, robust) = match run.headline {
                Scoring::Raw => ("**raw**", "robust"),
                Scoring::Robust => ("raw", "**robust**"),
            };
            let label = cell(&run.label);
            let _ = write!(out, " {label} {raw} | {label} {robust} |");
        }
        let _ = writeln!(out, "\n|---|{}", "---:|".repeat(2 * c.runs.len()));
        for (i, name) in PaperScores::NAMES.iter().enumerate() {
            let _ = write!(out, "| {name} |");
            for run in &c.runs {
                match run.levels.get(&level) {
                    Some(l) => {
                        let (raw, robust) = (l.raw.values()[i], l.robust.values()[i]);
                        let _ = write!(out, " {} | {} |", percent(raw), percent(robust));
                    }
                    None => out.push_str(" – | – |"),
                }
            }
            out.push('\n');
        }
        let counts: Vec<String> = c
            .runs
            .iter()
            .map(|run| match run.levels.get(&level) {
                Some(l) => format!(
                    "{} {} ({}, {})",
                    cell(&run.label),
                    l.problems,
                    l.samples,
                    l.deceptive_samples
                ),
                None => format!("{} none", cell(&run.label)),
            })
            .collect();
        let _ = writeln!(
            out,
            "\nProblems (samples, deceptive samples): {}.",
            counts.join("; ")
        );
        for run in &c.runs {
            if let Some(l) = run.levels.get(&level).filter(|l| !l.turns.is_empty()) {
                let _ = write!(
                    out,
                    "\n### Level {level}, turn by turn: {}\n\n",
                    cell(&run.label)
                );
                push_turns(&mut out, &l.turns);
            }
        }
    }
    out
}

/// A level's turn-by-turn table, after its legend.
fn push_turns(out: &mut String, rows: &[TurnRow]) {
    let (header, rows) = turn_table(rows);
    let _ = write!(
        out,
        "{TURNS_LEGEND}\n\n| {} |\n|{}\n",
        header.join(" | "),
        "---:|".repeat(header.len())
    );
    for row in rows {
        let _ = writeln!(out, "| {} |", row.join(" | "));
    }
}

/// Keeps a table cell on one line and its pipes literal.
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace(['\n', '\r'], " ")
}
