//! The DICE paper's figures (its Tables 2 and 6): Exec, fast_1 and fast_2 of a level, and the
//! row of them a run of several turns has at each turn. Below the reports, the comparison and
//! the turns, which all speak of them.

use crate::metrics::Scores;
use crate::ordered::OrderedMap;
use crate::threshold::{parse_thresholds, Threshold};
use serde::Serialize;

/// The paper's speedup thresholds: fast_1 and fast_2.
const PAPER_FAST_P: &str = "1,2";

/// The paper's three figures, as fractions of the level's problems (sample 0 of each).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PaperScores {
    /// Compiled and correct.
    pub exec: f64,
    /// Correct and faster than the baseline.
    pub fast_1: f64,
    /// Correct and more than twice as fast as the baseline.
    pub fast_2: f64,
}

impl PaperScores {
    /// `scores` were computed with `thresholds`, the paper's.
    pub(crate) fn of(scores: &Scores, thresholds: &[Threshold]) -> PaperScores {
        let fast = |i: usize| {
            *scores
                .fast_p
                .get(&thresholds[i].label)
                .expect("scores computed with the paper's thresholds")
        };
        PaperScores {
            exec: scores.correct,
            fast_1: fast(0),
            fast_2: fast(1),
        }
    }

    /// The figures' names, in the paper's column order.
    pub const NAMES: [&'static str; 3] = ["Exec", "fast_1", "fast_2"];

    /// The figures in the order of [`PaperScores::NAMES`].
    pub fn values(&self) -> [f64; 3] {
        [self.exec, self.fast_1, self.fast_2]
    }
}

pub(crate) fn paper_thresholds() -> Vec<Threshold> {
    parse_thresholds(PAPER_FAST_P).expect("the paper's thresholds parse")
}

/// One turn of one level of a run, each sample at its best so far.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TurnRow {
    /// 1 for the first answers.
    pub turn: u32,
    /// Samples answered and judged at this turn (the others had stopped).
    pub answered: usize,
    /// The headline Exec, fast_1 and fast_2 (sample 0 of each problem).
    pub scores: PaperScores,
    /// The headline pass@k over all samples, keyed by k (with several samples per problem).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pass_at_k: Option<OrderedMap<f64>>,
    /// Samples correct (headline scoring) for the first time at this turn.
    pub fixed: usize,
    /// `fixed` over the samples that were not correct before this turn.
    pub fixed_share: f64,
    /// Tokens generated for the level's samples in turns 1 … this one; `None` when the model's
    /// side did not report some answer's.
    pub tokens: Option<usize>,
    /// `tokens` over the samples correct at this turn; `None` without tokens or correct samples.
    pub tokens_per_correct: Option<f64>,
}
