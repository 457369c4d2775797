//! Two-stream SFT batches (spec §3.1, §6.3): packed rows turned into the [noisy ⧺ clean]
//! per-sample layout the training forward consumes, with the masked positions whose loss is
//! taken (spec §6.4).

use anyhow::{ensure, Result};

/// One packed training row as the data pipeline produces it (spec §6.1-§6.2).
#[derive(Debug, Clone)]
pub struct PackedRow {
    /// Clean token ids.
    pub input_ids: Vec<u32>,
    /// The same ids with the noised positions replaced by the mask token.
    pub noisy_ids: Vec<u32>,
    /// Label per position; -100 marks positions without loss (prompts, row padding).
    pub labels: Vec<i64>,
    /// Position ids restarting at 0 for every packed sample; the row's trailing padding is a
    /// run of zeros.
    pub position_ids: Vec<u32>,
    /// Positions that were masked, ascending.
    pub masked_positions: Vec<usize>,
    /// Masking probability p of each masked position.
    pub p_mask: Vec<f32>,
}

/// Lengths of the packed samples of a row: a sample starts at every position id 0, except
/// that a trailing run of zero position ids (row padding) forms one sample, as
/// `modify_padded_position_ids_2d` rewrites it to 0, 1, 2, ... in the reference.
pub fn sample_lengths(position_ids: &[u32]) -> Vec<usize> {
    let trailing_zeros = position_ids.iter().rev().take_while(|&&p| p == 0).count();
    let body = position_ids.len() - trailing_zeros.min(position_ids.len());
    let mut lens = Vec::new();
    for (i, &p) in position_ids[..body].iter().enumerate() {
        if p == 0 || i == 0 {
            lens.push(0);
        }
        *lens.last_mut().expect("a sample was opened") += 1;
    }
    if trailing_zeros > 0 {
        lens.push(trailing_zeros);
    }
    lens
}

/// Packed rows flattened into one two-stream token sequence. Rows and samples never attend
/// each other, so all rows form a single sequence of samples, each laid out as
/// [noisy copy ⧺ clean copy] with duplicated position ids.
#[derive(Debug, Clone)]
pub struct TwoStreamBatch {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    sample_lens: Vec<usize>,
    selected: Vec<u32>,
    selected_labels: Vec<u32>,
    selected_p: Vec<f32>,
    num_loss_tokens: usize,
}

impl TwoStreamBatch {
    pub fn new(rows: &[PackedRow]) -> Result<Self> {
        let mut batch = Self {
            tokens: Vec::new(),
            positions: Vec::new(),
            sample_lens: Vec::new(),
            selected: Vec::new(),
            selected_labels: Vec::new(),
            selected_p: Vec::new(),
            num_loss_tokens: 0,
        };
        for (r, row) in rows.iter().enumerate() {
            batch.push_row(r, row)?;
        }
        Ok(batch)
    }

    fn push_row(&mut self, r: usize, row: &PackedRow) -> Result<()> {
        let n = row.input_ids.len();
        ensure!(
            row.noisy_ids.len() == n && row.labels.len() == n && row.position_ids.len() == n,
            "packed row {r}: input_ids, noisy_ids, labels and position_ids differ in length"
        );
        ensure!(
            row.masked_positions.len() == row.p_mask.len(),
            "packed row {r}: {} masked positions but {} p values",
            row.masked_positions.len(),
            row.p_mask.len()
        );
        // Flat index of position i's noisy copy, filled sample by sample.
        let mut noisy_index = vec![0u32; n];
        let mut start = 0;
        for len in sample_lengths(&row.position_ids) {
            let span = start..start + len;
            let base = self.tokens.len();
            for (k, i) in span.clone().enumerate() {
                noisy_index[i] = (base + k) as u32;
            }
            let positions: Vec<u32> = (0..len as u32).collect();
            self.tokens.extend_from_slice(&row.noisy_ids[span.clone()]);
            self.tokens.extend_from_slice(&row.input_ids[span]);
            self.positions.extend_from_slice(&positions);
            self.positions.extend_from_slice(&positions);
            self.sample_lens.push(len);
            start += len;
        }
        for (&i, &p) in row.masked_positions.iter().zip(&row.p_mask) {
            ensure!(
                i < n,
                "packed row {r}: masked position {i} is past the row length {n}"
            );
            let label = row.labels[i];
            ensure!(
                label >= 0,
                "packed row {r}: masked position {i} has no label (-100)"
            );
            ensure!(p > 0.0, "packed row {r}: masked position {i} has p = {p}");
            self.selected.push(noisy_index[i]);
            self.selected_labels.push(label as u32);
            self.selected_p.push(p);
        }
        self.num_loss_tokens += row.labels.iter().filter(|&&l| l != -100).count();
        Ok(())
    }

    /// Token ids of the flattened two-stream sequence.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Position ids of the flattened sequence (both copies of a token share one).
    pub fn positions(&self) -> &[u32] {
        &self.positions
    }

    /// Length n of every sample; it occupies 2n consecutive tokens.
    pub fn sample_lens(&self) -> &[usize] {
        &self.sample_lens
    }

    /// Flat indices of the noisy copies of the masked positions, row-major.
    pub fn selected(&self) -> &[u32] {
        &self.selected
    }

    pub fn selected_labels(&self) -> &[u32] {
        &self.selected_labels
    }

    pub fn selected_p(&self) -> &[f32] {
        &self.selected_p
    }

    /// Count of labels != -100 over all rows: the loss denominator (`answer_len`).
    pub fn num_loss_tokens(&self) -> usize {
        self.num_loss_tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_split_at_position_zero_and_padding_forms_one_sample() {
        assert_eq!(sample_lengths(&[0, 1, 2, 3, 0, 1, 0, 0, 0]), [4, 2, 3]);
        assert_eq!(sample_lengths(&[0, 1, 2, 3]), [4]);
    }

    #[test]
    fn two_stream_layout_doubles_each_sample() {
        let row = PackedRow {
            input_ids: vec![10, 11, 12, 13, 20, 21],
            noisy_ids: vec![10, 99, 12, 13, 99, 21],
            labels: vec![-100, 11, -100, -100, 20, 21],
            position_ids: vec![0, 1, 2, 3, 0, 1],
            masked_positions: vec![1, 4],
            p_mask: vec![0.5, 0.25],
        };
        let batch = TwoStreamBatch::new(&[row]).unwrap();
        assert_eq!(
            batch.tokens(),
            [10, 99, 12, 13, 10, 11, 12, 13, 99, 21, 20, 21]
        );
        assert_eq!(batch.positions(), [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 0, 1]);
        assert_eq!(batch.sample_lens(), [4, 2]);
        assert_eq!(batch.selected(), [1, 8]);
        assert_eq!(batch.selected_labels(), [11, 20]);
        assert_eq!(batch.num_loss_tokens(), 3);
    }
}
