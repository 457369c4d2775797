//! Greedy candidates picked where the logits are (spec §4.3 with top-k 1): only a token and
//! a tie count per position come back to the host, not the whole vocabulary.

use crate::sampling::{greedy_candidate, Candidate};
use anyhow::{anyhow, ensure, Context, Result};
use candle_core::{DType, Tensor, D};

/// The error of logits that decoding must not continue from.
pub(crate) fn non_finite_logits() -> anyhow::Error {
    // fp16 activations can overflow (spec Q7); decoding on NaN would be silent garbage.
    anyhow!("the model produced NaN or infinite logits (an fp16 overflow?): use bf16 or f32")
}

/// The greedy candidate of every position of `logits` (`[.., vocab]`, any float dtype,
/// row-major): the lowest index holding the highest logit, with the probability and entropy
/// [`crate::sample_row`] gives in greedy mode. Fails on NaN or +∞ logits and on positions
/// whose logits are all −∞.
pub fn greedy_candidates(logits: &Tensor) -> Result<Vec<Candidate>> {
    let vocab = logits.dim(D::Minus1)?;
    ensure!(
        u32::try_from(vocab).is_ok(),
        "a vocabulary of {vocab} tokens does not fit token ids of 32 bits"
    );
    let summary = summary(logits)?
        .flatten_all()?
        .to_vec1::<u32>()
        .context("cannot read the greedy candidates back")?;
    let positions = summary.len() / 3;
    let (lowest, rest) = summary.split_at(positions);
    let (ties, non_finite) = rest.split_at(positions);
    // No tie at all is the CUDA form of a position of −∞ only: its maximum starts at the
    // lowest finite value, which no logit then equals.
    if non_finite
        .iter()
        .zip(ties)
        .any(|(&bad, &ties)| bad != 0 || ties == 0)
    {
        return Err(non_finite_logits());
    }
    Ok(lowest
        .iter()
        .zip(ties)
        .map(|(&token, &ties)| greedy_candidate(token, ties as usize, vocab))
        .collect())
}

/// u32 `[3, positions]`: per position the lowest index of the highest logit, how many logits
/// equal it, and whether the position is unusable (NaN, +∞ maximum, or −∞ only; or, on CUDA's
/// candle ops, no tie at all, see [`greedy_candidates`]). Candle ops; on CUDA one kernel
/// ([`dice_model::greedy_summary`]) instead.
fn summary(logits: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() && logits.is_contiguous() {
        return Ok(dice_model::greedy_summary(logits)?);
    }
    let device = logits.device();
    let shape = logits.shape();
    let vocab = logits.dim(D::Minus1)?;
    // Comparisons in the logits' own dtype: widening to f32 is exact, so it moves no maximum.
    let max = logits.max_keepdim(D::Minus1)?;
    let at_max = logits.broadcast_eq(&max)?;
    let indices = Tensor::arange(0u32, vocab as u32, device)?.broadcast_as(shape)?;
    let beyond = Tensor::new(vocab as u32, device)?.broadcast_as(shape)?;
    let lowest = at_max.where_cond(&indices, &beyond)?.min(D::Minus1)?;
    let ties = at_max.to_dtype(DType::U32)?.sum(D::Minus1)?;
    let nan = logits.ne(logits)?.max(D::Minus1)?;
    // ±∞: a +∞ logit, or a position whose logits are all −∞ (nothing to pick).
    let infinite = max.squeeze(D::Minus1)?.abs()?.eq(f64::INFINITY)?;
    let non_finite = nan.maximum(&infinite)?.to_dtype(DType::U32)?;
    Ok(Tensor::stack(&[&lowest, &ties, &non_finite], 0)?.flatten_to(1)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{sample_row, SamplingParams};
    use candle_core::Device;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const VOCAB: usize = 50;

    /// Logits on a coarse grid so that exact ties at the maximum are common, some −∞.
    fn tie_prone_logits(rng: &mut StdRng, positions: usize) -> Vec<f32> {
        (0..positions * VOCAB)
            .map(|_| match rng.random_range(0..10) {
                0 => f32::NEG_INFINITY,
                _ => rng.random_range(-4..=4) as f32 * 0.5,
            })
            .collect()
    }

    fn assert_matches_sample_row(values: &[f32], candidates: &[Candidate]) {
        assert_eq!(candidates.len() * VOCAB, values.len());
        for (row, candidate) in values.chunks_exact(VOCAB).zip(candidates) {
            // u = 0 draws the first survivor: the lowest index among the tied maxima.
            let expected = sample_row(row, &SamplingParams::GREEDY, 0.0, true);
            assert_eq!(*candidate, expected, "row {row:?}");
        }
    }

    #[test]
    fn greedy_candidates_equal_sample_row_in_greedy_mode() {
        let mut rng = StdRng::seed_from_u64(7);
        let (rows, block) = (6, 4);
        let values = tie_prone_logits(&mut rng, rows * block);
        let logits = Tensor::from_vec(values.clone(), (rows, block, VOCAB), &Device::Cpu).unwrap();
        let candidates = greedy_candidates(&logits).unwrap();
        assert_matches_sample_row(&values, &candidates);
        assert!(
            candidates.iter().any(|c| c.prob < 1.0),
            "the test logits hold no tie at the maximum"
        );
        let continuous: Vec<f32> = (0..rows * block * VOCAB)
            .map(|_| rng.random_range(-20.0..20.0))
            .collect();
        let logits = Tensor::from_vec(continuous.clone(), (rows * block, VOCAB), &Device::Cpu);
        assert_matches_sample_row(&continuous, &greedy_candidates(&logits.unwrap()).unwrap());
    }

    #[test]
    fn greedy_candidates_of_bf16_logits_are_those_of_their_f32_values() {
        let mut rng = StdRng::seed_from_u64(8);
        let values = tie_prone_logits(&mut rng, 12);
        let logits = Tensor::from_vec(values, (12, VOCAB), &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let widened: Vec<f32> = logits
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_matches_sample_row(&widened, &greedy_candidates(&logits).unwrap());
    }

    #[test]
    fn nan_infinity_or_a_position_of_negative_infinity_only_fails() {
        for bad in [f32::NAN, f32::INFINITY] {
            let mut values = vec![0.0f32; 3 * VOCAB];
            values[VOCAB + 5] = bad;
            let logits = Tensor::from_vec(values, (3, VOCAB), &Device::Cpu).unwrap();
            let error = greedy_candidates(&logits).unwrap_err();
            assert!(format!("{error}").contains("NaN or infinite"), "{error}");
        }
        let logits = Tensor::full(f32::NEG_INFINITY, (2, VOCAB), &Device::Cpu).unwrap();
        let error = greedy_candidates(&logits).unwrap_err();
        assert!(format!("{error}").contains("NaN or infinite"), "{error}");
    }
}
