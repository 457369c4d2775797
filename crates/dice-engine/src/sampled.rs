//! Sampled candidates drawn where the logits are (spec §4.3). On CUDA, for sampling without a
//! top-k or top-p filter (the training rollouts' setting), one kernel draws every position's
//! token from its uniform number and only the token, its probability and the entropy come back
//! to the host ([`dice_model::sample_summary`]), not the position's whole vocabulary of f32
//! logits: copying and scanning those on the host held a 1.7B rollout at 249 tokens/s on an
//! H200. Otherwise (the CPU, a filter, `DICE_DEVICE_SAMPLING=0`) the logits are read back and
//! [`sample_row`] draws on the host.

use crate::greedy::non_finite_logits;
use crate::sampling::{sample_row, Candidate, SamplingParams};
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Tensor};

/// One position's draw: its sampling settings and uniform number in [0, 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Draw {
    pub(crate) sampling: SamplingParams,
    pub(crate) uniform: f64,
    /// Whether the remasking strategy reads the candidate's entropy (else it is 0).
    pub(crate) with_entropy: bool,
}

/// The candidate of each row of `logits` (`[rows, vocab]`, any float dtype) drawn as
/// `draws[row]` says: what [`sample_row`] gives, where the device draws it (see the module docs)
/// up to the rounding of a sum taken in another order. Fails on NaN or +∞ logits.
pub(crate) fn sampled_candidates(logits: &Tensor, draws: &[Draw]) -> Result<Vec<Candidate>> {
    let (rows, vocab) = logits.dims2()?;
    ensure!(
        rows == draws.len(),
        "{rows} rows of logits for {} draws",
        draws.len()
    );
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() && device_sampling_enabled() {
        if let Some(candidates) = drawn_on_device(logits, draws, vocab)? {
            return Ok(candidates);
        }
    }
    let host = logits
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()
        .context("cannot read the logits back")?;
    if host.iter().any(|l| l.is_nan() || *l == f32::INFINITY) {
        return Err(non_finite_logits());
    }
    Ok(host
        .chunks_exact(vocab)
        .zip(draws)
        .map(|(row, d)| sample_row(row, &d.sampling, d.uniform, d.with_entropy))
        .collect())
}

/// Whether the device may draw: not under `DICE_DEVICE_SAMPLING=0`, which reads every sampled
/// position's logits back and draws on the host (the baseline the kernel is measured against).
#[cfg(feature = "cuda")]
fn device_sampling_enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| {
        std::env::var("DICE_DEVICE_SAMPLING")
            .as_deref()
            .map(str::trim)
            != Ok("0")
    })
}

/// The candidates [`dice_model::sample_summary`] draws, or `None` when a draw asks for a filter
/// the kernel does not apply (top-k below the vocabulary, top-p below 1).
#[cfg(feature = "cuda")]
fn drawn_on_device(
    logits: &Tensor,
    draws: &[Draw],
    vocab: usize,
) -> Result<Option<Vec<Candidate>>> {
    let unfiltered = |s: &SamplingParams| (s.top_k == 0 || s.top_k >= vocab) && s.top_p >= 1.0;
    if !draws.iter().all(|d| unfiltered(&d.sampling)) {
        return Ok(None);
    }
    let device = logits.device();
    let temperatures: Vec<f32> = draws.iter().map(|d| d.sampling.temperature).collect();
    let uniforms: Vec<f64> = draws.iter().map(|d| d.uniform).collect();
    let with_entropy = draws.iter().any(|d| d.with_entropy);
    let summary = dice_model::sample_summary(
        &logits.contiguous()?,
        &Tensor::new(temperatures.as_slice(), device)?,
        &Tensor::new(uniforms.as_slice(), device)?,
        with_entropy,
    )?
    .flatten_all()?
    .to_vec1::<u32>()
    .context("cannot read the sampled candidates back")?;
    let rows = draws.len();
    let (tokens, rest) = summary.split_at(rows);
    let (probs, rest) = rest.split_at(rows);
    let (entropies, unusable) = rest.split_at(rows);
    if unusable.iter().any(|&bad| bad != 0) {
        return Err(non_finite_logits());
    }
    Ok(Some(
        draws
            .iter()
            .enumerate()
            .map(|(r, d)| Candidate {
                token: tokens[r],
                prob: f32::from_bits(probs[r]),
                entropy: if d.with_entropy {
                    f32::from_bits(entropies[r])
                } else {
                    0.0
                },
            })
            .collect(),
    ))
}
