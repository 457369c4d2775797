//! Runs of several turns (`dice kernelbench --turns N`): each sample answered again after the
//! judge's feedback until it is correct and fast enough or the turns run out. The run's figures
//! at turn t take each sample at its best so far (its best verdict of turns 1 … t; a sample that
//! stopped keeps its last), so every figure of a turn is what the run would report had it
//! stopped there.
//!
//! A sample's best is the first of its turns with the highest rank: correct and not deceptive,
//! then correct, then the highest speedup, then the furthest verdict (compiled over not, …).
//! Robust figures never fall from one turn to the next; a raw figure may, where an honest
//! program replaces a faster deceptive one.

use crate::paper::{paper_thresholds, PaperScores, TurnRow};
use crate::report::{build_report, Report, Scoring};
use dice_store::{ProblemRecord, RunInfo, SampleRecord};
use std::collections::{BTreeMap, BTreeSet};

/// A sample of a run: (level, problem id, sample id).
pub type SampleKey = (u32, u32, u32);

/// One turn of a run as stored: the verdicts of the samples answered at that turn, and the
/// generated tokens of each answer (judged or not; `None` where the model's side did not say).
#[derive(Clone, Debug, Default)]
pub struct StoredTurn {
    pub samples: Vec<SampleRecord>,
    pub tokens: BTreeMap<SampleKey, Option<usize>>,
}

/// Each turn's records with every sample at its best so far: entry t holds every sample
/// answered in turns 1 … t+1.
pub fn best_so_far(turns: &[StoredTurn]) -> Vec<Vec<SampleRecord>> {
    let mut best: BTreeMap<SampleKey, &SampleRecord> = BTreeMap::new();
    turns
        .iter()
        .map(|turn| {
            for record in &turn.samples {
                let key = (record.level, record.problem_id, record.sample_id);
                let better = best
                    .get(&key)
                    .is_none_or(|held| rank(record).gt(&rank(held)));
                if better {
                    best.insert(key, record);
                }
            }
            best.values().map(|r| (*r).clone()).collect()
        })
        .collect()
}

/// The order of [`best_so_far`]: (correct and not deceptive, correct, speedup, verdict).
fn rank(r: &SampleRecord) -> (bool, bool, Speedup, dice_store::Verdict) {
    let correct = r.verdict.is_correct();
    (
        correct && !r.deceptive,
        correct,
        Speedup(r.speedup.filter(|_| correct).unwrap_or(0.0)),
        r.verdict,
    )
}

/// A speedup, totally ordered.
#[derive(Clone, Copy, PartialEq)]
struct Speedup(f64);

impl PartialOrd for Speedup {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.0.total_cmp(&other.0))
    }
}

/// The report of a run of several turns, at its last turn, with each level's figures turn by
/// turn ([`crate::LevelReport::turns`]).
pub fn build_turns_report(
    run: &RunInfo,
    problems: &[ProblemRecord],
    turns: &[StoredTurn],
    thresholds: &[crate::Threshold],
    strict: bool,
) -> Report {
    let best = best_so_far(turns);
    let last = best.last().map_or(&[][..], Vec::as_slice);
    let mut report = build_report(run, problems, last, thresholds, strict);
    let mut rows = turn_rows(run, problems, turns, &best, strict);
    for (level, lr) in &mut report.levels {
        lr.turns = rows.remove(level).unwrap_or_default();
    }
    report
}

/// Each level's figures turn by turn, from the turns as stored and [`best_so_far`] of them.
pub(crate) fn turn_rows(
    run: &RunInfo,
    problems: &[ProblemRecord],
    turns: &[StoredTurn],
    best: &[Vec<SampleRecord>],
    strict: bool,
) -> BTreeMap<u32, Vec<TurnRow>> {
    let thresholds = paper_thresholds();
    let mut rows: BTreeMap<u32, Vec<TurnRow>> = BTreeMap::new();
    let mut correct_before: BTreeSet<SampleKey> = BTreeSet::new();
    let mut tokens: BTreeMap<u32, Option<usize>> = BTreeMap::new();
    for (index, (turn, records)) in turns.iter().zip(best).enumerate() {
        let report = build_report(run, problems, records, &thresholds, strict);
        let robust = report.headline == Scoring::Robust;
        let correct: BTreeSet<SampleKey> = records
            .iter()
            .filter(|r| r.counts_as_correct(robust))
            .map(|r| (r.level, r.problem_id, r.sample_id))
            .collect();
        for (key, count) in &turn.tokens {
            let sum = tokens.entry(key.0).or_insert(Some(0));
            *sum = sum.zip(*count).map(|(a, b)| a + b);
        }
        for (&level, lr) in &report.levels {
            let in_level = |key: &&SampleKey| key.0 == level;
            let samples = records.iter().filter(|r| r.level == level).count();
            let fixed = correct.difference(&correct_before).filter(in_level).count();
            let open = samples - correct_before.iter().filter(in_level).count();
            let correct_now = correct.iter().filter(in_level).count();
            let level_tokens = tokens.get(&level).copied().flatten();
            rows.entry(level).or_default().push(TurnRow {
                turn: index as u32 + 1,
                answered: turn.samples.iter().filter(|r| r.level == level).count(),
                scores: PaperScores::of(&lr.headline, &thresholds),
                pass_at_k: lr.headline.pass_at_k.clone(),
                fixed,
                fixed_share: if open == 0 {
                    0.0
                } else {
                    fixed as f64 / open as f64
                },
                tokens: level_tokens,
                tokens_per_correct: level_tokens
                    .filter(|_| correct_now > 0)
                    .map(|t| t as f64 / correct_now as f64),
            });
        }
        correct_before = correct;
    }
    rows
}
