//! Remasking strategies: which masked positions of a block take their candidate token in a
//! denoising step (spec §4.4).

use anyhow::anyhow;
use clap::builder::PossibleValue;
use clap::ValueEnum;
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::str::FromStr;

/// A remasking strategy with its threshold, if it has one. Parsed from its name (clap's
/// `--strategy`, an API request's `strategy`), a strategy takes its default threshold.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "snake_case")]
pub enum Strategy {
    /// The first `num_transfer[s]` masked positions, left to right.
    Sequential,
    /// The `num_transfer[s]` most confident masked positions.
    LowConfidenceStatic,
    /// Every masked position whose confidence exceeds `threshold` when there are at least
    /// `num_transfer[s]` of them, else the `num_transfer[s]` most confident ones.
    LowConfidenceDynamic { threshold: f32 },
    /// JetEngine's version: masked positions by ascending entropy, as many as keep the
    /// cumulative entropy below `threshold`, at least one.
    EntropyBounded { threshold: f32 },
}

impl Strategy {
    /// Every strategy, the threshold ones with their defaults: the reference's confidence τ
    /// and JetEngine's entropy bound ε.
    pub const ALL: [Strategy; 4] = [
        Strategy::Sequential,
        Strategy::LowConfidenceStatic,
        Strategy::LowConfidenceDynamic { threshold: 0.9 },
        Strategy::EntropyBounded { threshold: 0.35 },
    ];

    pub fn name(&self) -> &'static str {
        match self {
            Strategy::Sequential => "sequential",
            Strategy::LowConfidenceStatic => "low_confidence_static",
            Strategy::LowConfidenceDynamic { .. } => "low_confidence_dynamic",
            Strategy::EntropyBounded { .. } => "entropy_bounded",
        }
    }

    /// This strategy with `threshold` in place of its own; the strategies without one ignore it.
    pub fn with_threshold(self, threshold: f32) -> Self {
        match self {
            Strategy::LowConfidenceDynamic { .. } => Strategy::LowConfidenceDynamic { threshold },
            Strategy::EntropyBounded { .. } => Strategy::EntropyBounded { threshold },
            other => other,
        }
    }

    pub fn needs_entropy(&self) -> bool {
        matches!(self, Strategy::EntropyBounded { .. })
    }
}

impl ValueEnum for Strategy {
    fn value_variants<'a>() -> &'a [Self] {
        &Self::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        let value = PossibleValue::new(self.name());
        Some(match *self {
            Strategy::Sequential => value.help("the first masked positions, left to right"),
            Strategy::LowConfidenceStatic => value
                .alias("static")
                .help("the most confident masked positions (DICE's evaluation)"),
            Strategy::LowConfidenceDynamic { threshold } => value.alias("dynamic").help(format!(
                "every masked position more confident than the threshold (default \
                 {threshold}) when there are as many as static takes, else as static"
            )),
            Strategy::EntropyBounded { threshold } => value.help(format!(
                "the lowest-entropy masked positions whose entropies sum below the threshold \
                 (default {threshold}), at least one"
            )),
        })
    }
}

/// A strategy's name (or an alias) as the reference spells it, with its default threshold.
impl FromStr for Strategy {
    type Err = anyhow::Error;

    fn from_str(name: &str) -> anyhow::Result<Self> {
        <Self as ValueEnum>::from_str(name, false).map_err(|_| {
            anyhow!(
                "unknown remasking strategy `{name}`: use sequential, low_confidence_static, \
                 low_confidence_dynamic or entropy_bounded"
            )
        })
    }
}

/// What a step's schedule asks for when it exceeds the masks left in the block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overflow {
    /// Unmask only what is still masked (the correct behaviour).
    #[default]
    Clamp,
    /// The reference's `torch.topk` over confidences that are −∞ at unmasked positions: the
    /// surplus picks unmasked positions, lowest first, and overwrites them with their fresh
    /// candidates (this can rewrite prompt-tail tokens; reached e.g. with block 8, 4 steps and
    /// a prompt tail of more than 2 tokens).
    Reference,
}

/// One block position as the strategies see it: `None` when it is not masked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scored {
    pub confidence: f32,
    pub entropy: f32,
}

/// Positions to unmask (or, with [`Overflow::Reference`], rewrite) in this step, ascending.
/// `scores[i]` is `Some` for the masked positions; `count` is `num_transfer[s]`.
pub fn select_transfer(
    strategy: &Strategy,
    scores: &[Option<Scored>],
    count: usize,
    overflow: Overflow,
) -> Vec<usize> {
    let masked: Vec<usize> = (0..scores.len()).filter(|&i| scores[i].is_some()).collect();
    let mut chosen = match *strategy {
        Strategy::Sequential => masked.iter().copied().take(count).collect(),
        Strategy::LowConfidenceStatic => most_confident(scores, count, overflow),
        Strategy::LowConfidenceDynamic { threshold } => {
            let confident: Vec<usize> = masked
                .iter()
                .copied()
                .filter(|&i| confidence(scores, i) > threshold)
                .collect();
            if confident.len() >= count {
                confident
            } else {
                most_confident(scores, count, overflow)
            }
        }
        Strategy::EntropyBounded { threshold } => lowest_entropy_within(scores, &masked, threshold),
    };
    chosen.sort_unstable();
    chosen
}

fn confidence(scores: &[Option<Scored>], i: usize) -> f32 {
    scores[i].map_or(f32::NEG_INFINITY, |s| s.confidence)
}

/// Highest confidence first, lowest position among equals (the CUDA `torch.topk` rule the
/// reference results were produced with); unmasked positions rank as −∞.
fn most_confident(scores: &[Option<Scored>], count: usize, overflow: Overflow) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| {
        confidence(scores, b)
            .partial_cmp(&confidence(scores, a))
            .unwrap_or(Ordering::Equal)
            .then(a.cmp(&b))
    });
    let available = match overflow {
        Overflow::Clamp => scores.iter().filter(|s| s.is_some()).count(),
        Overflow::Reference => scores.len(),
    };
    order.truncate(count.min(available));
    order
}

fn lowest_entropy_within(
    scores: &[Option<Scored>],
    masked: &[usize],
    threshold: f32,
) -> Vec<usize> {
    let entropy = |i: usize| scores[i].map_or(f32::INFINITY, |s| s.entropy);
    let mut order = masked.to_vec();
    order.sort_by(|&a, &b| entropy(a).total_cmp(&entropy(b)).then(a.cmp(&b)));
    let mut cumulative = 0.0f32;
    let below = order
        .iter()
        .take_while(|&&i| {
            cumulative += entropy(i);
            cumulative < threshold
        })
        .count();
    order.truncate(below.max(1));
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn masked(confidence: f32) -> Option<Scored> {
        Some(Scored {
            confidence,
            entropy: 0.0,
        })
    }

    fn with_entropy(entropy: f32) -> Option<Scored> {
        Some(Scored {
            confidence: 0.5,
            entropy,
        })
    }

    #[test]
    fn equal_confidences_pick_the_lowest_positions() {
        let all = [masked(1.0); 4];
        let s = Strategy::LowConfidenceStatic;
        assert_eq!(select_transfer(&s, &all, 1, Overflow::Clamp), vec![0]);
        let tail = [None, masked(1.0), masked(1.0), masked(1.0)];
        assert_eq!(select_transfer(&s, &tail, 1, Overflow::Clamp), vec![1]);
        let two = [None, None, masked(1.0), masked(1.0)];
        assert_eq!(select_transfer(&s, &two, 1, Overflow::Clamp), vec![2]);
    }

    #[test]
    fn static_takes_the_most_confident() {
        let scores = [masked(0.2), masked(0.9), masked(0.5), masked(0.9)];
        let s = Strategy::LowConfidenceStatic;
        assert_eq!(select_transfer(&s, &scores, 2, Overflow::Clamp), vec![1, 3]);
        assert_eq!(
            select_transfer(&s, &scores, 3, Overflow::Clamp),
            vec![1, 2, 3]
        );
    }

    #[test]
    fn overflow_clamps_or_rewrites_the_lowest_unmasked_positions() {
        let scores = [None, None, masked(0.3), None];
        let s = Strategy::LowConfidenceStatic;
        assert_eq!(select_transfer(&s, &scores, 2, Overflow::Clamp), vec![2]);
        assert_eq!(
            select_transfer(&s, &scores, 2, Overflow::Reference),
            vec![0, 2]
        );
    }

    #[test]
    fn sequential_goes_left_to_right() {
        let scores = [None, masked(0.1), masked(0.9), masked(0.8)];
        let s = Strategy::Sequential;
        assert_eq!(select_transfer(&s, &scores, 2, Overflow::Clamp), vec![1, 2]);
        assert_eq!(
            select_transfer(&s, &scores, 5, Overflow::Clamp),
            vec![1, 2, 3]
        );
    }

    #[test]
    fn dynamic_takes_everything_above_the_threshold() {
        let s = Strategy::LowConfidenceDynamic { threshold: 0.9 };
        let scores = [masked(0.95), masked(0.2), masked(0.99), masked(0.91)];
        assert_eq!(
            select_transfer(&s, &scores, 1, Overflow::Clamp),
            vec![0, 2, 3]
        );
        let few = [masked(0.95), masked(0.2), masked(0.5), masked(0.3)];
        assert_eq!(select_transfer(&s, &few, 2, Overflow::Clamp), vec![0, 2]);
        let exact = [masked(0.9), masked(0.2)];
        assert_eq!(select_transfer(&s, &exact, 1, Overflow::Clamp), vec![0]);
    }

    #[test]
    fn entropy_bounded_keeps_cumulative_entropy_below_threshold() {
        let s = Strategy::EntropyBounded { threshold: 0.35 };
        let scores = [
            with_entropy(0.2),
            with_entropy(0.1),
            None,
            with_entropy(0.3),
        ];
        assert_eq!(select_transfer(&s, &scores, 1, Overflow::Clamp), vec![0, 1]);
        let high = [with_entropy(2.0), with_entropy(1.0)];
        assert_eq!(select_transfer(&s, &high, 1, Overflow::Clamp), vec![1]);
    }

    #[test]
    fn names_round_trip() {
        for name in [
            "sequential",
            "low_confidence_static",
            "low_confidence_dynamic",
            "entropy_bounded",
        ] {
            assert_eq!(name.parse::<Strategy>().unwrap().name(), name);
        }
        assert!("random".parse::<Strategy>().is_err());
    }

    #[test]
    fn a_named_strategy_takes_its_default_threshold_unless_given_one() {
        let dynamic: Strategy = "dynamic".parse().unwrap();
        assert_eq!(dynamic, Strategy::LowConfidenceDynamic { threshold: 0.9 });
        assert_eq!(
            "entropy_bounded".parse::<Strategy>().unwrap(),
            Strategy::EntropyBounded { threshold: 0.35 }
        );
        assert_eq!(
            dynamic.with_threshold(0.5),
            Strategy::LowConfidenceDynamic { threshold: 0.5 }
        );
        assert_eq!(
            Strategy::Sequential.with_threshold(0.5),
            Strategy::Sequential
        );
    }
}
