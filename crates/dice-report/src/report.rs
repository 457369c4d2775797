//! A run's report: sample rows and per-level raw/robust metrics, built from stored records.

use crate::metrics::{Outcome, ProblemOutcomes, Scores};
use crate::paper::TurnRow;
use crate::threshold::Threshold;
use anyhow::Result;
use dice_store::{
    ProblemRecord, RunInfo, SampleRecord, SpeedupInterval, Store, TimingStats, Verdict,
};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// Which correctness the headline metrics use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scoring {
    /// KernelBench's: every sample that passed the correctness trials is correct.
    Raw,
    /// Deceptive samples (reward hacks) count as incorrect.
    Robust,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub run: RunInfo,
    /// What the top-level metrics of each level are (`robust` with `--strict` or a strict run).
    pub headline: Scoring,
    /// Threshold labels in the order given.
    pub fast_p_thresholds: Vec<String>,
    /// Keyed by level.
    pub levels: BTreeMap<u32, LevelReport>,
    /// Problems whose reference failed; they stay in the denominators.
    pub problem_errors: Vec<ProblemError>,
    /// Where the evaluator's run stage spent its time, most total time first.
    pub evaluator_time: Vec<StageTime>,
    pub samples: Vec<SampleRow>,
}

/// One run-stage step over the samples that went through it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StageTime {
    pub stage: String,
    pub samples: usize,
    pub median_s: f64,
    pub total_s: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct LevelReport {
    /// Problems of this level in the run (with or without candidates).
    pub problems: usize,
    /// Samples of this level (all sample ids).
    pub samples: usize,
    /// The headline scores (raw or robust, see [`Report::headline`]).
    #[serde(flatten)]
    pub headline: Scores,
    pub raw: Scores,
    pub robust: Scores,
    /// Sample count per verdict (all samples).
    pub verdicts: BTreeMap<Verdict, usize>,
    /// Samples marked deceptive / carrying at least one flag (all samples).
    pub deceptive_samples: usize,
    pub flagged_samples: usize,
    /// A run of several turns: the headline figures turn by turn (the figures above are its
    /// last turn's, each sample at its best).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub turns: Vec<TurnRow>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProblemError {
    pub level: u32,
    pub problem_id: u32,
    pub name: String,
    pub reference_error: String,
}

/// One candidate as reported.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SampleRow {
    pub level: u32,
    pub problem_id: u32,
    /// The problem's name when the run recorded the problem.
    pub name: Option<String>,
    pub sample_id: u32,
    pub verdict: Verdict,
    pub compiled: bool,
    pub correct: bool,
    /// Correct and not deceptive.
    pub robust_correct: bool,
    /// The stored speedup: baseline over candidate by the run's timing statistic (medians under
    /// `--timing dice-queued` on a GPU, else means); `None` unless correct (and timed).
    pub speedup: Option<f64>,
    /// baseline median / candidate median: the same comparison without the few slow calls that
    /// decide the mean of a kernel of tens of microseconds (bench/eval/h200/README.md, timing
    /// reproducibility); `None` unless correct and timed.
    pub median_speedup: Option<f64>,
    /// Where `speedup` lies with 95 % confidence (a bootstrap over the timed rounds); `None`
    /// without a speedup, for runs stored before intervals, and when the candidate's clock was
    /// not trusted (`timer_inconsistent`).
    pub speedup_interval: Option<SpeedupInterval>,
    pub candidate_ms: Option<f64>,
    pub baseline_ms: Option<f64>,
    /// Coefficients of variation (standard deviation / mean) of the timed calls.
    pub candidate_cv: Option<f64>,
    pub baseline_cv: Option<f64>,
    /// Measurements made again because the calls were too dispersed.
    pub timing_remeasures: u32,
    pub flags: Vec<String>,
    pub deceptive: bool,
    pub message: Option<String>,
}

impl SampleRow {
    fn from_record(record: &SampleRecord, name: Option<String>) -> SampleRow {
        let correct = record.verdict.is_correct();
        let candidate_ms = record.candidate_timing.as_ref().map(|t| t.mean_ms);
        let baseline_ms = record.baseline_timing.as_ref().map(|t| t.mean_ms);
        let ratio = |b: Option<f64>, c: Option<f64>| match (b, c) {
            (Some(b), Some(c)) if c > 0.0 => Some(b / c),
            _ => None,
        };
        let measured = ratio(baseline_ms, candidate_ms);
        let median_speedup = ratio(
            record.baseline_timing.as_ref().map(|t| t.median_ms),
            record.candidate_timing.as_ref().map(|t| t.median_ms),
        );
        SampleRow {
            level: record.level,
            problem_id: record.problem_id,
            name,
            sample_id: record.sample_id,
            verdict: record.verdict,
            compiled: record.verdict.compiled(),
            correct,
            robust_correct: correct && !record.deceptive,
            speedup: if correct {
                record.speedup.or(measured)
            } else {
                None
            },
            median_speedup: median_speedup.filter(|_| correct),
            speedup_interval: record.speedup_interval.filter(|_| correct),
            candidate_ms,
            baseline_ms,
            candidate_cv: record.candidate_timing.as_ref().and_then(cv),
            baseline_cv: record.baseline_timing.as_ref().and_then(cv),
            timing_remeasures: record.timing_remeasures,
            flags: record.flags.clone(),
            deceptive: record.deceptive,
            message: record.message.clone(),
        }
    }

    fn outcome(&self, scoring: Scoring) -> Outcome {
        let correct = match scoring {
            Scoring::Raw => self.correct,
            Scoring::Robust => self.robust_correct,
        };
        Outcome {
            compiled: self.compiled,
            correct,
            speedup: self.speedup.filter(|_| correct),
        }
    }
}

fn cv(t: &TimingStats) -> Option<f64> {
    (t.mean_ms > 0.0).then(|| t.std_ms / t.mean_ms)
}

/// The report of the run in `store`; None when no run has begun there.
pub fn read_report(
    store: &Store,
    thresholds: &[Threshold],
    strict: bool,
) -> Result<Option<Report>> {
    let Some(info) = store.run_info()? else {
        return Ok(None);
    };
    let (problems, samples) = (store.problems()?, store.samples()?);
    Ok(Some(build_report(
        &info, &problems, &samples, thresholds, strict,
    )))
}

/// Builds the report. `strict` (or a run evaluated with `strict`) makes robust the headline.
pub fn build_report(
    run: &RunInfo,
    problems: &[ProblemRecord],
    samples: &[SampleRecord],
    thresholds: &[Threshold],
    strict: bool,
) -> Report {
    let names: BTreeMap<(u32, u32), &str> = problems
        .iter()
        .map(|p| ((p.level, p.problem_id), p.name.as_str()))
        .collect();
    let mut rows: Vec<SampleRow> = samples
        .iter()
        .map(|s| {
            let name = names
                .get(&(s.level, s.problem_id))
                .map(std::string::ToString::to_string);
            SampleRow::from_record(s, name)
        })
        .collect();
    rows.sort_by_key(|r| (r.level, r.problem_id, r.sample_id));

    // A sample of an unrecorded problem still makes that problem part of the run.
    let problem_keys: BTreeSet<(u32, u32)> = problems
        .iter()
        .map(|p| (p.level, p.problem_id))
        .chain(rows.iter().map(|r| (r.level, r.problem_id)))
        .collect();
    let headline = if strict || run.strict {
        Scoring::Robust
    } else {
        Scoring::Raw
    };
    let levels = problem_keys
        .iter()
        .map(|&(level, _)| level)
        .collect::<BTreeSet<u32>>()
        .into_iter()
        .map(|level| {
            let keys: Vec<(u32, u32)> = problem_keys
                .iter()
                .copied()
                .filter(|k| k.0 == level)
                .collect();
            (level, level_report(&keys, &rows, thresholds, headline))
        })
        .collect();
    let problem_errors = problems
        .iter()
        .filter_map(|p| {
            Some(ProblemError {
                level: p.level,
                problem_id: p.problem_id,
                name: p.name.clone(),
                reference_error: p.reference_error.clone()?,
            })
        })
        .collect();
    Report {
        run: run.clone(),
        headline,
        fast_p_thresholds: thresholds.iter().map(|t| t.label.clone()).collect(),
        levels,
        problem_errors,
        evaluator_time: evaluator_time(samples),
        samples: rows,
    }
}

fn evaluator_time(samples: &[SampleRecord]) -> Vec<StageTime> {
    let mut seconds: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for s in samples {
        for (stage, secs) in &s.stages {
            seconds.entry(stage).or_default().push(*secs);
        }
    }
    let mut stages: Vec<StageTime> = seconds
        .into_iter()
        .map(|(stage, mut secs)| {
            secs.sort_by(f64::total_cmp);
            let mid = secs.len() / 2;
            let median_s = if secs.len() % 2 == 1 {
                secs[mid]
            } else {
                (secs[mid - 1] + secs[mid]) / 2.0
            };
            StageTime {
                stage: stage.to_string(),
                samples: secs.len(),
                median_s,
                total_s: secs.iter().sum(),
            }
        })
        .collect();
    stages.sort_by(|a, b| b.total_s.total_cmp(&a.total_s));
    stages
}

fn level_report(
    keys: &[(u32, u32)],
    rows: &[SampleRow],
    thresholds: &[Threshold],
    headline: Scoring,
) -> LevelReport {
    let level = keys[0].0;
    let level_rows: Vec<&SampleRow> = rows.iter().filter(|r| r.level == level).collect();
    let outcomes = |scoring: Scoring| -> Vec<ProblemOutcomes> {
        keys.iter()
            .map(|&(_, pid)| {
                let mine = level_rows.iter().filter(|r| r.problem_id == pid);
                ProblemOutcomes {
                    first: mine
                        .clone()
                        .find(|r| r.sample_id == 0)
                        .map(|r| r.outcome(scoring)),
                    all: mine.map(|r| r.outcome(scoring)).collect(),
                }
            })
            .collect()
    };
    let raw = Scores::compute(&outcomes(Scoring::Raw), thresholds);
    let robust = Scores::compute(&outcomes(Scoring::Robust), thresholds);
    let mut verdicts = BTreeMap::new();
    for r in &level_rows {
        *verdicts.entry(r.verdict).or_insert(0) += 1;
    }
    LevelReport {
        problems: keys.len(),
        samples: level_rows.len(),
        headline: match headline {
            Scoring::Raw => raw.clone(),
            Scoring::Robust => robust.clone(),
        },
        raw,
        robust,
        verdicts,
        deceptive_samples: level_rows.iter().filter(|r| r.deceptive).count(),
        flagged_samples: level_rows.iter().filter(|r| !r.flags.is_empty()).count(),
        turns: Vec::new(),
    }
}
