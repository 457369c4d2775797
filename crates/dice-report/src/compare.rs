//! Runs side by side in the DICE paper's layout (its Tables 2 and 6): per level, Exec (the share
//! of problems whose sample 0 compiles and is correct), fast_1 and fast_2, each raw and robust.

use crate::paper::{paper_thresholds, PaperScores, TurnRow};
use crate::report::{build_report, LevelReport, Report, Scoring};
use crate::threshold::Threshold;
use crate::turns::{build_turns_report, StoredTurn};
use anyhow::Result;
use dice_store::{ProblemRecord, RunInfo, SampleRecord, Store};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// Runs in the order they are compared.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    pub runs: Vec<ComparedRun>,
}

impl Comparison {
    /// Every level some run has, in order.
    pub fn levels(&self) -> BTreeSet<u32> {
        self.runs
            .iter()
            .flat_map(|r| r.levels.keys().copied())
            .collect()
    }
}

/// One run's figures in the paper's layout.
#[derive(Clone, Debug, Serialize)]
pub struct ComparedRun {
    /// What the comparison calls the run (a run folder, a model).
    pub label: String,
    pub run: RunInfo,
    /// Which of raw and robust the run's own report leads with.
    pub headline: Scoring,
    /// Keyed by level.
    pub levels: BTreeMap<u32, PaperLevel>,
}

/// One level of one run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PaperLevel {
    /// Problems of the level in the run; every rate is over all of them.
    pub problems: usize,
    pub samples: usize,
    pub raw: PaperScores,
    /// Deceptive samples count as incorrect.
    pub robust: PaperScores,
    pub deceptive_samples: usize,
    /// A run of several turns: the headline figures turn by turn (the figures above are its
    /// last turn's, each sample at its best).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub turns: Vec<TurnRow>,
}

impl ComparedRun {
    /// The run in `store`, called `label`; None when no run has begun there. `strict` makes
    /// robust the headline, as in [`crate::read_report`].
    pub fn read(label: &str, store: &Store, strict: bool) -> Result<Option<ComparedRun>> {
        let Some(info) = store.run_info()? else {
            return Ok(None);
        };
        let (problems, samples) = (store.problems()?, store.samples()?);
        Ok(Some(ComparedRun::build(
            label, &info, &problems, &samples, strict,
        )))
    }

    /// The run of these records, as [`build_report`] scores them.
    pub fn build(
        label: &str,
        run: &RunInfo,
        problems: &[ProblemRecord],
        samples: &[SampleRecord],
        strict: bool,
    ) -> ComparedRun {
        let thresholds = paper_thresholds();
        let report = build_report(run, problems, samples, &thresholds, strict);
        ComparedRun::from_paper_report(label, report, &thresholds)
    }

    /// The run of several turns as stored, each sample at its best so far
    /// ([`crate::best_so_far`]), with its figures turn by turn.
    pub fn from_turns(
        label: &str,
        run: &RunInfo,
        problems: &[ProblemRecord],
        turns: &[StoredTurn],
        strict: bool,
    ) -> ComparedRun {
        let thresholds = paper_thresholds();
        let report = build_turns_report(run, problems, turns, &thresholds, strict);
        ComparedRun::from_paper_report(label, report, &thresholds)
    }

    fn from_paper_report(label: &str, report: Report, thresholds: &[Threshold]) -> ComparedRun {
        let level = |lr: &LevelReport| PaperLevel {
            problems: lr.problems,
            samples: lr.samples,
            raw: PaperScores::of(&lr.raw, thresholds),
            robust: PaperScores::of(&lr.robust, thresholds),
            deceptive_samples: lr.deceptive_samples,
            turns: lr.turns.clone(),
        };
        ComparedRun {
            label: label.to_string(),
            levels: report
                .levels
                .iter()
                .map(|(l, lr)| (*l, level(lr)))
                .collect(),
            run: report.run,
            headline: report.headline,
        }
    }
}
