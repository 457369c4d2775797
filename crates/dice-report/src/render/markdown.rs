//! Markdown: run settings, one raw-vs-robust table per level, problem errors, flagged samples.

use super::{metric_rows, run_settings, speedup};
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
                s.speedup.map_or(String::new(), speedup),
                if s.deceptive { "yes" } else { "no" },
                cell(&s.flags.join(", "))
            );
        }
    }
    out
}

/// Keeps a table cell on one line and its pipes literal.
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace(['\n', '\r'], " ")
}
