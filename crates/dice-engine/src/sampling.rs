//! Candidate tokens from one row of logits: temperature, top-k, top-p, then a draw from the
//! resulting distribution (spec §4.3, `sample_with_temperature_topk_topp`).

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

/// The reference clamps probabilities at this value before taking `p·ln p` (JetEngine
/// entropy-bounded remasking), so filtered-out tokens still add a tiny amount each.
const ENTROPY_CLAMP: f32 = 1e-12;

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Logits are divided by this; must be positive (greedy decoding is `top_k = 1`).
    pub temperature: f32,
    /// Keep only logits ≥ the k-th largest (ties at the threshold all survive); 0 = off.
    pub top_k: usize,
    /// Nucleus: keep the most probable tokens up to and including the first one whose
    /// cumulative probability exceeds `top_p`; 1 = off.
    pub top_p: f32,
}

impl SamplingParams {
    /// The DICE evaluation setting (spec §4.7): temperature 1, top-k 1, top-p 1.
    pub const GREEDY: SamplingParams = SamplingParams {
        temperature: 1.0,
        top_k: 1,
        top_p: 1.0,
    };

    /// Top-k 1 keeps only the highest logit, leaving temperature and top-p nothing to act on:
    /// the engine picks such tokens on the logits' device ([`crate::greedy_candidates`]),
    /// the lowest index among exact ties.
    pub fn is_greedy(&self) -> bool {
        self.top_k == 1
    }

    pub fn validate(&self) -> Result<()> {
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            bail!(
                "temperature must be a positive number, got {} (use top-k 1 for greedy decoding)",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top-p must be in (0, 1], got {}", self.top_p);
        }
        Ok(())
    }
}

/// One position's candidate: the drawn token, its probability (the confidence used by the
/// remasking strategies) and, when asked for, the entropy of the whole distribution.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub token: u32,
    pub prob: f32,
    pub entropy: f32,
}

/// Draws a candidate from `logits` with the uniform number `u ∈ [0, 1)`.
pub fn sample_row(
    logits: &[f32],
    params: &SamplingParams,
    u: f64,
    with_entropy: bool,
) -> Candidate {
    let scaled: Cow<'_, [f32]> = if params.temperature == 1.0 {
        Cow::Borrowed(logits)
    } else {
        Cow::Owned(logits.iter().map(|l| l / params.temperature).collect())
    };
    let mut kept = top_k_survivors(&scaled, params.top_k);
    if params.top_p < 1.0 {
        kept = top_p_survivors(&scaled, kept, params.top_p);
    }
    let max = kept
        .iter()
        .map(|&i| scaled[i])
        .fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f32> = kept.iter().map(|&i| (scaled[i] - max).exp()).collect();
    let total: f32 = weights.iter().sum();
    let chosen = draw(&weights, total, u);
    let entropy = if with_entropy {
        entropy(&weights, total, logits.len() - kept.len())
    } else {
        0.0
    };
    Candidate {
        token: kept[chosen] as u32,
        prob: weights[chosen] / total,
        entropy,
    }
}

/// The candidate [`sample_row`] gives in greedy mode when `token` is the lowest of the `ties`
/// positions holding the highest of `vocab` logits: top-k 1 keeps exactly those positions,
/// each with weight `exp(0) = 1`, so probability and entropy follow from `ties` alone.
pub(crate) fn greedy_candidate(token: u32, ties: usize, vocab: usize) -> Candidate {
    let weights = vec![1.0f32; ties];
    let total: f32 = weights.iter().sum();
    Candidate {
        token,
        prob: weights[0] / total,
        entropy: entropy(&weights, total, vocab - ties),
    }
}

/// Entropy of the kept tokens' distribution (`weights / total`) as the reference takes it:
/// every probability clamped, the `filtered_out` tokens counted at the clamp.
fn entropy(weights: &[f32], total: f32, filtered_out: usize) -> f32 {
    let clamped_term = -ENTROPY_CLAMP * ENTROPY_CLAMP.ln();
    weights
        .iter()
        .map(|w| {
            let p = (w / total).max(ENTROPY_CLAMP);
            -p * p.ln()
        })
        .sum::<f32>()
        + filtered_out as f32 * clamped_term
}

/// Indices (ascending) of the logits ≥ the k-th largest one; every index when `k` is 0 or
/// not smaller than the vocabulary.
fn top_k_survivors(logits: &[f32], k: usize) -> Vec<usize> {
    if k == 0 || k >= logits.len() {
        return (0..logits.len()).collect();
    }
    let threshold = if k == 1 {
        logits.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    } else {
        let mut copy = logits.to_vec();
        let (_, kth, _) = copy.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        *kth
    };
    (0..logits.len())
        .filter(|&i| logits[i] >= threshold)
        .collect()
}

/// Nucleus filter of the reference: sort descending, drop a token when the cumulative
/// probability of the tokens before it already exceeds `p` (so the top token always stays).
fn top_p_survivors(logits: &[f32], kept: Vec<usize>, p: f32) -> Vec<usize> {
    let mut order = kept;
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let max = logits[order[0]];
    let weights: Vec<f32> = order.iter().map(|&i| (logits[i] - max).exp()).collect();
    let total: f32 = weights.iter().sum();
    let mut cumulative = 0.0f32;
    let mut survivors = Vec::new();
    for (&index, w) in order.iter().zip(&weights) {
        if cumulative > p {
            break;
        }
        survivors.push(index);
        cumulative += w / total;
    }
    survivors.sort_unstable();
    survivors
}

/// Inverse-CDF draw over `weights` (not normalized) with `u ∈ [0, 1)`.
fn draw(weights: &[f32], total: f32, u: f64) -> usize {
    let target = u * f64::from(total);
    let mut cumulative = 0.0f64;
    for (i, w) in weights.iter().enumerate() {
        cumulative += f64::from(*w);
        if target < cumulative {
            return i;
        }
    }
    weights.iter().rposition(|w| *w > 0.0).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
        }
    }

    #[test]
    fn greedy_picks_argmax_with_probability_one() {
        let logits = [0.5, 3.0, -1.0, 2.9];
        for u in [0.0, 0.5, 0.999] {
            let c = sample_row(&logits, &SamplingParams::GREEDY, u, true);
            assert_eq!(c.token, 1);
            assert_eq!(c.prob, 1.0);
            assert!(c.entropy < 1e-9, "entropy {}", c.entropy);
        }
    }

    #[test]
    fn exact_ties_at_top_k_share_the_probability() {
        let logits = [2.0, 1.0, 2.0];
        let low = sample_row(&logits, &SamplingParams::GREEDY, 0.1, false);
        let high = sample_row(&logits, &SamplingParams::GREEDY, 0.9, false);
        assert_eq!((low.token, high.token), (0, 2));
        assert_eq!(low.prob, 0.5);
    }

    #[test]
    fn full_distribution_draw_follows_the_cdf() {
        let logits = [0.0f32, 0.0, (2.0f32).ln()];
        let p = params(1.0, 0, 1.0);
        assert_eq!(sample_row(&logits, &p, 0.1, false).token, 0);
        assert_eq!(sample_row(&logits, &p, 0.3, false).token, 1);
        let last = sample_row(&logits, &p, 0.6, false);
        assert_eq!(last.token, 2);
        assert!((last.prob - 0.5).abs() < 1e-6);
    }

    #[test]
    fn top_p_keeps_the_token_that_crosses_p() {
        // probabilities 0.5, 0.3, 0.2: with p = 0.6 the first two survive.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let p = params(1.0, 0, 0.6);
        let last = sample_row(&logits, &p, 0.99, false);
        assert_eq!(last.token, 1);
        assert!((last.prob - 0.375).abs() < 1e-6);
        let tiny = params(1.0, 0, 0.01);
        assert_eq!(sample_row(&logits, &tiny, 0.99, false).token, 0);
    }

    #[test]
    fn temperature_sharpens_and_flattens() {
        let logits = [1.0f32, 0.0];
        let cold = sample_row(&logits, &params(0.5, 0, 1.0), 0.0, false);
        let hot = sample_row(&logits, &params(2.0, 0, 1.0), 0.0, false);
        let plain = sample_row(&logits, &params(1.0, 0, 1.0), 0.0, false);
        assert!(cold.prob > plain.prob && plain.prob > hot.prob);
    }

    #[test]
    fn top_k_two_keeps_two_tokens() {
        let logits = [1.0f32, 5.0, 3.0, 4.0];
        let p = params(1.0, 2, 1.0);
        let tokens: Vec<u32> = [0.0, 0.99]
            .iter()
            .map(|&u| sample_row(&logits, &p, u, false).token)
            .collect();
        assert_eq!(tokens, vec![1, 3]);
    }

    #[test]
    fn uniform_entropy_is_ln_n() {
        let logits = [0.0f32; 8];
        let c = sample_row(&logits, &params(1.0, 0, 1.0), 0.5, true);
        assert!((c.entropy - 8f32.ln()).abs() < 1e-5);
    }

    #[test]
    fn invalid_parameters_are_rejected() {
        assert!(params(0.0, 1, 1.0).validate().is_err());
        assert!(params(1.0, 1, 0.0).validate().is_err());
        assert!(params(1.0, 1, 1.5).validate().is_err());
        assert!(SamplingParams::GREEDY.validate().is_ok());
    }
}
