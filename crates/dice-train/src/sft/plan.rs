//! Which packed rows each optimizer step trains on: a held-out share chosen by the seed, then
//! epoch after epoch of the remaining rows in an order shuffled by (seed, epoch), cut into
//! steps of a fixed number of rows. Everything is a function of the seed and the step, so a
//! resumed run picks up the data exactly where the interrupted one was.

use anyhow::{ensure, Result};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};

/// The rows of a run, step by step.
#[derive(Debug, Clone)]
pub struct DataPlan {
    /// Training rows (indices into the packed dataset), in dataset order.
    train: Vec<usize>,
    /// Held-out rows of the packed dataset, in dataset order.
    held_out: Vec<usize>,
    seed: u64,
    rows_per_step: usize,
    steps_per_epoch: u64,
    total_steps: u64,
}

/// How long a run is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RunLength {
    /// Passes over the training rows (fractions allowed), rounded up to whole steps.
    Epochs(f64),
    Steps(u64),
}

impl DataPlan {
    /// A plan over `rows` packed rows: `ceil(rows · held_out_ratio)` of them held out, steps
    /// of `rows_per_step` rows (the last step of an epoch takes what is left), for `length`.
    pub fn new(
        rows: usize,
        held_out_ratio: f64,
        seed: u64,
        rows_per_step: usize,
        length: RunLength,
    ) -> Result<Self> {
        ensure!(rows_per_step > 0, "a step needs at least one row");
        let held = (rows as f64 * held_out_ratio).ceil() as usize;
        let mut order = permutation(seed, b"held out", 0, rows);
        let mut held_out = order.split_off(rows - held.min(rows));
        let mut train = order;
        ensure!(
            !train.is_empty(),
            "no packed rows left to train on ({rows} rows, {held} held out): add data or lower the held-out share"
        );
        train.sort_unstable();
        held_out.sort_unstable();
        let steps_per_epoch = train.len().div_ceil(rows_per_step) as u64;
        let total_steps = match length {
            RunLength::Steps(steps) => steps,
            RunLength::Epochs(epochs) => (epochs * steps_per_epoch as f64).ceil() as u64,
        };
        ensure!(total_steps > 0, "the run has no steps");
        Ok(Self {
            train,
            held_out,
            seed,
            rows_per_step,
            steps_per_epoch,
            total_steps,
        })
    }

    pub fn train_rows(&self) -> &[usize] {
        &self.train
    }

    pub fn held_out_rows(&self) -> &[usize] {
        &self.held_out
    }

    pub fn steps_per_epoch(&self) -> u64 {
        self.steps_per_epoch
    }

    pub fn total_steps(&self) -> u64 {
        self.total_steps
    }

    /// Epochs done after `steps` steps.
    pub fn epoch(&self, steps: u64) -> f64 {
        steps as f64 / self.steps_per_epoch as f64
    }

    /// The rows (packed-dataset indices) of step `step` (from 0), in the order they are
    /// noised and split among micro-batches and ranks.
    pub fn step_rows(&self, step: u64) -> Vec<usize> {
        let epoch = step / self.steps_per_epoch;
        let first = (step % self.steps_per_epoch) as usize * self.rows_per_step;
        let last = (first + self.rows_per_step).min(self.train.len());
        permutation(self.seed, b"data order", epoch, self.train.len())[first..last]
            .iter()
            .map(|&k| self.train[k])
            .collect()
    }
}

/// A permutation of `0..n`: Fisher–Yates driven by ChaCha8 keyed with the SHA-256 of
/// (purpose, seed, epoch).
fn permutation(seed: u64, purpose: &[u8], epoch: u64, n: usize) -> Vec<usize> {
    let mut hash = Sha256::new();
    hash.update(b"dice-train ");
    hash.update(purpose);
    hash.update(seed.to_le_bytes());
    hash.update(epoch.to_le_bytes());
    let mut rng = ChaCha8Rng::from_seed(hash.finalize().into());
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_epoch_visits_every_training_row_once_in_its_own_order() {
        let plan = DataPlan::new(10, 0.2, 7, 3, RunLength::Epochs(2.0)).unwrap();
        assert_eq!(plan.held_out_rows().len(), 2);
        assert_eq!(plan.train_rows().len(), 8);
        // 8 rows in steps of 3: 3 steps per epoch, the last of 2 rows.
        assert_eq!(plan.steps_per_epoch(), 3);
        assert_eq!(plan.total_steps(), 6);
        let epoch =
            |e: u64| -> Vec<usize> { (3 * e..3 * e + 3).flat_map(|s| plan.step_rows(s)).collect() };
        for e in 0..2 {
            let mut rows = epoch(e);
            assert_eq!(plan.step_rows(3 * e + 2).len(), 2);
            rows.sort_unstable();
            assert_eq!(rows, plan.train_rows());
        }
        assert_ne!(epoch(0), epoch(1));
        assert!(plan
            .held_out_rows()
            .iter()
            .all(|r| !plan.train_rows().contains(r)));
        // The same seed gives the same plan; another seed another order.
        let again = DataPlan::new(10, 0.2, 7, 3, RunLength::Epochs(2.0)).unwrap();
        assert_eq!(again.step_rows(4), plan.step_rows(4));
        let other = DataPlan::new(10, 0.2, 8, 3, RunLength::Epochs(2.0)).unwrap();
        assert_ne!(
            (0..3).flat_map(|s| other.step_rows(s)).collect::<Vec<_>>(),
            epoch(0)
        );
    }

    #[test]
    fn fractional_epochs_round_up_and_steps_are_taken_as_given() {
        let plan = DataPlan::new(10, 0.0, 1, 4, RunLength::Epochs(0.5)).unwrap();
        assert_eq!(plan.total_steps(), 2);
        let plan = DataPlan::new(10, 0.0, 1, 4, RunLength::Steps(7)).unwrap();
        assert_eq!(plan.total_steps(), 7);
        assert_eq!(plan.epoch(6), 2.0);
        assert!(DataPlan::new(1, 0.5, 1, 1, RunLength::Steps(1)).is_err());
    }
}
