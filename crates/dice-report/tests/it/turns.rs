//! Runs of several turns: each sample at its best so far, the figures turn by turn, and a run
//! of one turn set beside one of three.

use crate::common::{problem, run, timing};
use dice_report::{
    best_so_far, build_turns_report, parse_thresholds, render, render_comparison, ComparedRun,
    Comparison, Format, StoredTurn,
};
use dice_store::{SampleRecord, Verdict};
use serde_json::Value;

/// Sample `sid` of level-1 problem `pid`: `verdict`, with `speedup` when correct.
fn sample(pid: u32, sid: u32, verdict: Verdict, speedup: Option<f64>) -> SampleRecord {
    SampleRecord {
        code_hash: Some("ab".into()),
        candidate_timing: speedup.map(|s| timing(10.0 / s)),
        baseline_timing: speedup.map(|_| timing(10.0)),
        speedup,
        wall_s: 1.0,
        ..SampleRecord::new(1, pid, sid, verdict)
    }
}

fn turn(samples: Vec<SampleRecord>, tokens: usize) -> StoredTurn {
    let tokens = samples
        .iter()
        .map(|s| ((s.level, s.problem_id, s.sample_id), Some(tokens)))
        .collect();
    StoredTurn { samples, tokens }
}

/// Two problems, two samples each, three turns:
/// * problem 1: sample 0 correct at 1.5× from turn 1 (stops: target 1×); sample 1 fails, then
///   is correct at 0.5× at turn 2, then fails again at turn 3 (its best stays turn 2's);
/// * problem 2: sample 0 mismatches, then is correct at 0.9× (turn 2), then at 2× (turn 3);
///   sample 1 a deceptive correct answer at turn 1, then an honest 1.2× at turn 2.
fn turns() -> Vec<StoredTurn> {
    let mut deceptive = sample(2, 1, Verdict::Correct, Some(5.0));
    deceptive.deceptive = true;
    deceptive.flags = vec!["no_custom_kernel".into()];
    vec![
        turn(
            vec![
                sample(1, 0, Verdict::Correct, Some(1.5)),
                sample(1, 1, Verdict::CompileError, None),
                sample(2, 0, Verdict::OutputMismatch, None),
                deceptive,
            ],
            100,
        ),
        turn(
            vec![
                sample(1, 1, Verdict::Correct, Some(0.5)),
                sample(2, 0, Verdict::Correct, Some(0.9)),
                sample(2, 1, Verdict::Correct, Some(1.2)),
            ],
            50,
        ),
        turn(
            vec![
                sample(1, 1, Verdict::RuntimeError, None),
                sample(2, 0, Verdict::Correct, Some(2.5)),
            ],
            10,
        ),
    ]
}

#[test]
fn each_sample_keeps_its_best_so_far() {
    let best = best_so_far(&turns());
    assert_eq!(best.len(), 3);
    let at = |turn: usize, pid: u32, sid: u32| {
        let r = best[turn]
            .iter()
            .find(|r| (r.problem_id, r.sample_id) == (pid, sid))
            .unwrap();
        (r.verdict, r.speedup, r.deceptive)
    };
    assert_eq!(at(0, 1, 0), (Verdict::Correct, Some(1.5), false));
    assert_eq!(at(2, 1, 0), (Verdict::Correct, Some(1.5), false));
    assert_eq!(at(2, 1, 1), (Verdict::Correct, Some(0.5), false));
    assert_eq!(at(1, 2, 0), (Verdict::Correct, Some(0.9), false));
    assert_eq!(at(2, 2, 0), (Verdict::Correct, Some(2.5), false));
    // An honest 1.2× beats a deceptive 5×.
    assert_eq!(at(0, 2, 1), (Verdict::Correct, Some(5.0), true));
    assert_eq!(at(1, 2, 1), (Verdict::Correct, Some(1.2), false));
}

#[test]
fn the_report_counts_turn_by_turn() {
    let thresholds = parse_thresholds("1,2").unwrap();
    let problems = [problem(1, 1), problem(1, 2)];
    let report = build_turns_report(&run(true), &problems, &turns(), &thresholds, false);
    let level = &report.levels[&1];
    // The last turn, each sample at its best: problem 1's sample 0 at 1.5×, problem 2's at 2.5×.
    assert_eq!(level.samples, 4);
    assert_eq!(level.robust.correct, 1.0);
    assert_eq!(level.robust.fast_p.get("2"), Some(&0.5));
    let rows = &level.turns;
    assert_eq!(rows.len(), 3);
    let figures: Vec<_> = rows
        .iter()
        .map(|r| {
            (
                r.turn,
                r.answered,
                r.scores.exec,
                r.scores.fast_1,
                r.scores.fast_2,
                r.fixed,
            )
        })
        .collect();
    // Robust headline (a strict run): the deceptive sample is not correct at turn 1.
    assert_eq!(
        figures,
        [
            (1, 4, 0.5, 0.5, 0.0, 1),
            (2, 3, 1.0, 0.5, 0.0, 3),
            (3, 2, 1.0, 1.0, 0.5, 0),
        ]
    );
    assert_eq!(rows[0].fixed_share, 0.25);
    assert_eq!(rows[1].fixed_share, 1.0);
    assert_eq!(rows[2].fixed_share, 0.0);
    let pass_at_1: Vec<f64> = rows
        .iter()
        .map(|r| *r.pass_at_k.as_ref().unwrap().get("1").unwrap())
        .collect();
    assert_eq!(pass_at_1, [0.25, 1.0, 1.0]);
    let tokens: Vec<_> = rows
        .iter()
        .map(|r| (r.tokens, r.tokens_per_correct))
        .collect();
    assert_eq!(
        tokens,
        [
            (Some(400), Some(400.0)),
            (Some(550), Some(137.5)),
            (Some(570), Some(142.5))
        ]
    );

    let md = render(&report, Format::Md).unwrap();
    assert!(md.contains("### Level 1, turn by turn"), "{md}");
    assert!(
        md.contains("| turn | answered | Exec | fast_1 | fast_2 | pass@1 | fixed | tokens | tokens per correct kernel |"),
        "{md}"
    );
    assert!(
        md.contains("| 2 | 3 | 100.0% | 50.0% | 0.0% | 100.0% | 3 (100.0%) | 550 | 138 |"),
        "{md}"
    );
    let json: Value = serde_json::from_str(&render(&report, Format::Json).unwrap()).unwrap();
    assert_eq!(json["levels"]["1"]["turns"][2]["fixed"], 0);
}

#[test]
fn an_answer_without_a_token_count_leaves_the_tokens_unknown() {
    let mut turns = turns();
    turns[1].tokens.insert((1, 2, 0), None);
    let report = build_turns_report(
        &run(false),
        &[problem(1, 1), problem(1, 2)],
        &turns,
        &parse_thresholds("1").unwrap(),
        false,
    );
    let tokens: Vec<_> = report.levels[&1].turns.iter().map(|r| r.tokens).collect();
    assert_eq!(tokens, [Some(400), None, None]);
}

#[test]
fn one_turn_beside_three() {
    let problems = [problem(1, 1), problem(1, 2)];
    let three = turns();
    let once = ComparedRun::build(
        "runs/once",
        &run(false),
        &problems,
        &three[0].samples,
        false,
    );
    let thrice = ComparedRun::from_turns("runs/thrice", &run(false), &problems, &three, false);
    assert!(once.levels[&1].turns.is_empty());
    assert_eq!(thrice.levels[&1].turns.len(), 3);
    let comparison = Comparison {
        runs: vec![once, thrice],
    };
    let md = render_comparison(&comparison, Format::Md).unwrap();
    assert!(
        md.contains("| fast_2 | 0.0% | 0.0% | 50.0% | 50.0% |"),
        "{md}"
    );
    assert!(
        md.contains("### Level 1, turn by turn: runs/thrice"),
        "{md}"
    );
    assert!(!md.contains("turn by turn: runs/once"), "{md}");
    let html = render_comparison(&comparison, Format::Html).unwrap();
    assert!(html.contains("<h3>Level 1, turn by turn: runs/thrice</h3>"));
    let json: Value =
        serde_json::from_str(&render_comparison(&comparison, Format::Json).unwrap()).unwrap();
    assert!(json["runs"][0]["levels"]["1"].get("turns").is_none());
    // Raw headline (not strict): the deceptive sample was correct already at turn 1.
    assert_eq!(json["runs"][1]["levels"]["1"]["turns"][1]["fixed"], 2);
}
