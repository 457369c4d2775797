//! KernelBench's metrics over per-problem outcomes (pure functions, no I/O).

use crate::ordered::OrderedMap;
use crate::pass_at_k::{k_values, pass_at_k};
use crate::threshold::Threshold;
use serde::Serialize;

/// One sample as a metric sees it, under one scoring (raw or robust).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Outcome {
    pub compiled: bool,
    pub correct: bool,
    /// The stored speedup (baseline over candidate by the run's timing statistic: medians under
    /// `--timing dice-queued` on a GPU, else means), for correct samples that were timed.
    pub speedup: Option<f64>,
}

impl Outcome {
    /// Correct and strictly faster than `p` times the baseline.
    fn is_fast(&self, p: f64) -> bool {
        self.correct && self.speedup.is_some_and(|s| s > p)
    }
}

/// The samples of one problem: `first` is sample 0 (the one KernelBench scores), `all`
/// every sample (for pass@k). A problem without candidates has `first: None`, `all: []`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProblemOutcomes {
    pub first: Option<Outcome>,
    pub all: Vec<Outcome>,
}

/// A level's metrics; every fraction is over all of its problems.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Scores {
    pub compiled: f64,
    pub correct: f64,
    /// Keyed by threshold label.
    pub fast_p: OrderedMap<f64>,
    /// Geometric mean of sample-0 speedups over correct, timed problems; `None` when none.
    pub geomean_speedup: Option<f64>,
    /// Keyed by k; present when some problem has several samples.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pass_at_k: Option<OrderedMap<f64>>,
    /// Keyed by threshold label, then k.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fast_p_at_k: Option<OrderedMap<OrderedMap<f64>>>,
}

impl Scores {
    pub fn compute(problems: &[ProblemOutcomes], thresholds: &[Threshold]) -> Scores {
        let rate = |hit: &dyn Fn(&Outcome) -> bool| {
            let hits = problems
                .iter()
                .filter(|p| p.first.as_ref().is_some_and(hit))
                .count();
            fraction(hits, problems.len())
        };
        let fast_p = thresholds
            .iter()
            .map(|t| (t.label.clone(), rate(&|o: &Outcome| o.is_fast(t.value))))
            .collect();
        let (pass_at_k, fast_p_at_k) = match sample_k_values(problems) {
            None => (None, None),
            Some(ks) => (
                Some(mean_at_k(problems, &ks, &|o| o.correct)),
                Some(
                    thresholds
                        .iter()
                        .map(|t| {
                            let at_k = mean_at_k(problems, &ks, &|o| o.is_fast(t.value));
                            (t.label.clone(), at_k)
                        })
                        .collect(),
                ),
            ),
        };
        Scores {
            compiled: rate(&|o| o.compiled),
            correct: rate(&|o| o.correct),
            fast_p,
            geomean_speedup: geometric_mean(
                problems
                    .iter()
                    .filter_map(|p| p.first.filter(|o| o.correct).and_then(|o| o.speedup)),
            ),
            pass_at_k,
            fast_p_at_k,
        }
    }
}

fn fraction(hits: usize, total: usize) -> f64 {
    if total == 0 {
        0.0
    } else {
        hits as f64 / total as f64
    }
}

fn geometric_mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let logs: Vec<f64> = values.filter(|v| *v > 0.0).map(f64::ln).collect();
    (!logs.is_empty()).then(|| (logs.iter().sum::<f64>() / logs.len() as f64).exp())
}

/// The k to report: up to the fewest samples any sampled problem has; `None` when no
/// problem has more than one sample.
fn sample_k_values(problems: &[ProblemOutcomes]) -> Option<Vec<usize>> {
    let counts = problems.iter().map(|p| p.all.len()).filter(|&n| n > 0);
    if counts.clone().max()? < 2 {
        return None;
    }
    Some(k_values(counts.min()?))
}

/// pass@k averaged over problems (a problem without samples scores 0), keyed by k.
fn mean_at_k(
    problems: &[ProblemOutcomes],
    ks: &[usize],
    success: &dyn Fn(&Outcome) -> bool,
) -> OrderedMap<f64> {
    ks.iter()
        .map(|&k| {
            let total: f64 = problems
                .iter()
                .filter(|p| !p.all.is_empty())
                .map(|p| pass_at_k(p.all.len(), p.all.iter().filter(|o| success(o)).count(), k))
                .sum();
            (k.to_string(), total / problems.len().max(1) as f64)
        })
        .collect()
}
