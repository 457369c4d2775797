//! The forward noising of block-diffusion SFT (spec §6.2, `forward_add_noise_packed`): one
//! noise level per packed sample, response tokens masked independently with it, redrawn when a
//! row ends up without a masked token.
//!
//! Every row draws from its own generator, seeded from (seed, step, row), so a row's noise
//! depends on nothing else: not on the rows drawn before it, the batch it is in, the device,
//! or whether the run was resumed.

use crate::data::CleanRow;
use dice_model::sft::sample_lengths;
use dice_model::PackedRow;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};

/// The smallest masking probability: p = (1 - eps)·t + eps.
pub const NOISE_EPS: f32 = 1e-3;
/// Draws of a row's noise levels and masks before one token is masked by force.
pub const MAX_TRIES: usize = 10;

/// Noises packed rows with the mask token.
#[derive(Debug, Clone, Copy)]
pub struct Noiser {
    seed: u64,
    mask_token_id: u32,
}

/// The generator of row `row` at optimizer step `step`: ChaCha8 keyed with the SHA-256 of the
/// three numbers, so streams of different (seed, step, row) are unrelated.
pub fn row_rng(seed: u64, step: u64, row: u64) -> ChaCha8Rng {
    let mut hash = Sha256::new();
    hash.update(b"dice-train noise");
    for n in [seed, step, row] {
        hash.update(n.to_le_bytes());
    }
    ChaCha8Rng::from_seed(hash.finalize().into())
}

/// Uniform in [0, 1) with 24 random bits, as `torch.rand` draws float32.
fn uniform(rng: &mut ChaCha8Rng) -> f32 {
    (rng.next_u32() >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

impl Noiser {
    pub fn new(seed: u64, mask_token_id: u32) -> Self {
        Self {
            seed,
            mask_token_id,
        }
    }

    /// Row `row` of optimizer step `step`, noised. `row` names the row within the step (its
    /// index in the step's batch, across micro-batches and ranks); the same (seed, step, row)
    /// always gives the same noise.
    pub fn noise(&self, clean: CleanRow, step: u64, row: u64) -> PackedRow {
        let mut rng = row_rng(self.seed, step, row);
        noise_row(clean, self.mask_token_id, || uniform(&mut rng))
    }
}

/// The noising of one row with uniforms from `draw`. Per try: one t per sample (the row's
/// padding counts as one, as the model's dummy sample), then one uniform per loss-bearing
/// token, masked when below its sample's p.
fn noise_row(clean: CleanRow, mask_token_id: u32, mut draw: impl FnMut() -> f32) -> PackedRow {
    let eligible: Vec<usize> = (0..clean.labels.len())
        .filter(|&i| clean.labels[i] != -100)
        .collect();
    let mut sample_of = Vec::with_capacity(clean.position_ids.len());
    let lengths = sample_lengths(&clean.position_ids);
    for (s, &len) in lengths.iter().enumerate() {
        sample_of.extend(std::iter::repeat_n(s, len));
    }
    let mut p = vec![NOISE_EPS; lengths.len()];
    let mut masked = Vec::new();
    if !eligible.is_empty() {
        for _ in 0..MAX_TRIES {
            for p in &mut p {
                *p = (1.0 - NOISE_EPS) * draw() + NOISE_EPS;
            }
            masked = eligible
                .iter()
                .copied()
                .filter(|&i| draw() < p[sample_of[i]])
                .collect();
            if !masked.is_empty() {
                break;
            }
        }
        if masked.is_empty() {
            let pick = (f64::from(draw()) * eligible.len() as f64) as usize;
            masked.push(eligible[pick]);
        }
    }
    let mut noisy_ids = clean.input_ids.clone();
    for &i in &masked {
        noisy_ids[i] = mask_token_id;
    }
    let p_mask = masked.iter().map(|&i| p[sample_of[i]]).collect();
    PackedRow {
        input_ids: clean.input_ids,
        noisy_ids,
        labels: clean.labels,
        position_ids: clean.position_ids,
        masked_positions: masked,
        p_mask,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MASK: u32 = 999;

    /// A row of one 4-token sample (prompt, prompt, response, block pad) and 2 row pads.
    fn row() -> CleanRow {
        CleanRow {
            input_ids: vec![10, 11, 12, 0, 0, 0],
            labels: vec![-100, -100, 12, 0, -100, -100],
            position_ids: vec![0, 1, 2, 3, 0, 0],
        }
    }

    #[test]
    fn a_row_left_unmasked_by_every_try_gets_one_token_masked_by_force() {
        // Per try: 2 noise levels (the sample, the padding) at t = 0, so p = eps, then 2 token
        // uniforms of 0.5 that never fall below it; after 10 tries 0.75 picks eligible token 1
        // of [2, 3].
        let mut draws = (0..MAX_TRIES)
            .flat_map(|_| [0.0, 0.0, 0.5, 0.5])
            .chain([0.75]);
        let noised = noise_row(row(), MASK, || {
            draws.next().expect("no more draws expected")
        });
        assert_eq!(draws.next(), None);
        assert_eq!(noised.masked_positions, [3]);
        assert_eq!(noised.p_mask, [NOISE_EPS]);
        assert_eq!(noised.noisy_ids, [10, 11, 12, MASK, 0, 0]);
    }

    #[test]
    fn masks_the_tokens_whose_uniform_is_below_their_samples_p() {
        // t = 0.5 gives p = 0.5005: the first response token (0.2) is masked, the pad (0.9) not.
        let mut draws = [0.5, 0.0, 0.2, 0.9].into_iter();
        let noised = noise_row(row(), MASK, || draws.next().unwrap());
        assert_eq!(noised.masked_positions, [2]);
        assert_eq!(noised.p_mask, [(1.0 - NOISE_EPS) * 0.5 + NOISE_EPS]);
        assert_eq!(noised.noisy_ids, [10, 11, MASK, 0, 0, 0]);
    }

    #[test]
    fn a_row_without_loss_tokens_stays_clean_and_draws_nothing() {
        let clean = CleanRow {
            labels: vec![-100; 6],
            ..row()
        };
        let noised = noise_row(clean, MASK, || panic!("nothing to draw"));
        assert!(noised.masked_positions.is_empty());
        assert_eq!(noised.noisy_ids, noised.input_ids);
    }
}
