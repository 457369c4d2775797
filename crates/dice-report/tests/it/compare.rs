//! Runs side by side in the paper's layout: Exec, fast_1 and fast_2 per level, raw and robust.

use crate::common::{problem, run, timing};
use dice_report::{render_comparison, ComparedRun, Comparison, Format, PaperScores};
use dice_store::{SampleRecord, Verdict};
use serde_json::Value;

/// Sample 0 of a problem; `speedup` for correct ones, `deceptive` flags it as a reward hack.
fn sample(level: u32, pid: u32, speedup: Option<f64>, deceptive: bool) -> SampleRecord {
    SampleRecord {
        code_hash: Some("ab".into()),
        candidate_timing: speedup.map(|s| timing(10.0 / s)),
        baseline_timing: speedup.map(|_| timing(10.0)),
        speedup,
        flags: if deceptive {
            vec!["no_candidate_kernel_launched".into()]
        } else {
            Vec::new()
        },
        deceptive,
        wall_s: 1.0,
        ..SampleRecord::new(
            level,
            pid,
            0,
            if speedup.is_some() {
                Verdict::Correct
            } else {
                Verdict::CompileError
            },
        )
    }
}

/// Run A: level 1 only, four problems: 1.5×, a deceptive 3×, 0.8×, a compile error.
/// Run B (strict): level 1 with one 2.5× problem of two, and level 2 with one problem failing.
fn comparison() -> Comparison {
    let a = ComparedRun::build(
        "runs/a",
        &run(false),
        &(1..=4).map(|id| problem(1, id)).collect::<Vec<_>>(),
        &[
            sample(1, 1, Some(1.5), false),
            sample(1, 2, Some(3.0), true),
            sample(1, 3, Some(0.8), false),
            sample(1, 4, None, false),
        ],
        false,
    );
    let b = ComparedRun::build(
        "runs/b",
        &run(true),
        &[problem(1, 1), problem(1, 2), problem(2, 1)],
        &[sample(1, 1, Some(2.5), false), sample(2, 1, None, false)],
        false,
    );
    Comparison { runs: vec![a, b] }
}

fn close(a: f64, b: f64) {
    assert!((a - b).abs() < 1e-12, "{a} != {b}");
}

#[test]
fn paper_figures_are_raw_and_robust_over_all_problems() {
    let c = comparison();
    let a = &c.runs[0].levels[&1];
    assert_eq!((a.problems, a.samples, a.deceptive_samples), (4, 4, 1));
    for (got, want) in a.raw.values().iter().zip([0.75, 0.5, 0.25]) {
        close(*got, want);
    }
    for (got, want) in a.robust.values().iter().zip([0.5, 0.25, 0.0]) {
        close(*got, want);
    }
    let b = &c.runs[1].levels;
    assert_eq!(
        b[&1].raw,
        PaperScores {
            exec: 0.5,
            fast_1: 0.5,
            fast_2: 0.5
        }
    );
    assert_eq!(b[&2].robust.values(), [0.0; 3]);
    assert_eq!(c.levels().into_iter().collect::<Vec<_>>(), [1, 2]);
}

#[test]
fn markdown_puts_each_run_in_a_raw_and_robust_column_pair() {
    let md = render_comparison(&comparison(), Format::Md).unwrap();
    assert!(
        md.contains("| metric | runs/a **raw** | runs/a robust | runs/b raw | runs/b **robust** |")
    );
    assert!(
        md.contains("| Exec | 75.0% | 50.0% | 50.0% | 50.0% |"),
        "{md}"
    );
    assert!(
        md.contains("| fast_2 | 25.0% | 0.0% | 50.0% | 50.0% |"),
        "{md}"
    );
    let level2 = &md[md.find("## Level 2").unwrap()..];
    assert!(
        level2.contains("| Exec | – | – | 0.0% | 0.0% |"),
        "{level2}"
    );
    assert!(level2.contains("runs/a none; runs/b 1 (1, 0)"), "{level2}");
}

#[test]
fn html_has_a_bar_chart_per_level_and_metric() {
    let html = render_comparison(&comparison(), Format::Html).unwrap();
    assert_eq!(html.matches("<svg").count(), 2 * 3);
    for title in ["Level 1: Exec", "Level 1: fast_1", "Level 2: fast_2"] {
        assert!(html.contains(&format!("<title>{title}</title>")), "{title}");
    }
    assert!(html.contains("<title>runs/a robust: 50.0%</title>"));
    assert_eq!(html.matches("<th colspan=\"2\">runs/b</th>").count(), 2);
    assert!(!html.contains("<script"));
}

#[test]
fn json_holds_every_figure_and_csv_is_refused() {
    let json = render_comparison(&comparison(), Format::Json).unwrap();
    let v: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["runs"][0]["label"], "runs/a");
    close(
        v["runs"][0]["levels"]["1"]["robust"]["exec"]
            .as_f64()
            .unwrap(),
        0.5,
    );
    assert_eq!(v["runs"][1]["headline"], "robust");
    let err = render_comparison(&comparison(), Format::Csv).unwrap_err();
    assert!(err.to_string().contains("one run"), "{err}");
}
