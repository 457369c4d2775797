//! Packing as the spec's rules give it (§5.4, §6.1), checked token by token on samples whose
//! ids are known by hand.

use crate::common::*;
use dice_model::sft::sample_lengths;
use dice_model::TwoStreamBatch;
use dice_train::data::{
    select_datasets, CleanRow, DropReason, PackOptions, PackedDataset, Qwen3Encoder,
};
use dice_train::noise::Noiser;

/// Rows of 41 tokens: samples fill at most 40.
fn options() -> PackOptions {
    PackOptions {
        row_tokens: 41,
        cutoff_len: 40,
        ..PackOptions::default()
    }
}

fn pack(options: &PackOptions) -> PackedDataset {
    let tokenizer = tokenizer();
    let encoder = Qwen3Encoder::new(&tokenizer).unwrap();
    let datasets = select_datasets(&[fixture("packing.jsonl")], None, &[]).unwrap();
    PackedDataset::build(&datasets, &encoder, options).unwrap()
}

/// Sample A (= C): X → Y, 9 prompt + 4 thought + 3 response tokens = 16, no block pad.
fn sample_a() -> (Vec<u32>, Vec<i64>) {
    let prompt = user_turn(&[X]);
    let mut response = EMPTY_THOUGHT.to_vec();
    response.extend(assistant_turn(&[Y]));
    labelled(&prompt, &response)
}

/// Sample B: X → `<think>\nZ\n</think>\n\nY`, which has think tags, so no empty thought: 9 + 9
/// tokens, padded to 20 with two loss-bearing pads.
fn sample_b() -> (Vec<u32>, Vec<i64>) {
    let prompt = user_turn(&[X]);
    let mut response = vec![151667, NEWLINE, Z, NEWLINE, 151668, 271];
    response.extend(assistant_turn(&[Y]));
    response.extend([PAD, PAD]);
    labelled(&prompt, &response)
}

fn labelled(prompt: &[u32], response: &[u32]) -> (Vec<u32>, Vec<i64>) {
    let ids = [prompt, response].concat();
    let labels = prompt
        .iter()
        .map(|_| -100)
        .chain(response.iter().map(|&id| i64::from(id)))
        .collect();
    (ids, labels)
}

/// The row the samples make: positions restarting per sample, then pads (label -100,
/// position 0) to 41 tokens.
fn expected_row(samples: &[(Vec<u32>, Vec<i64>)]) -> CleanRow {
    let mut row = CleanRow {
        input_ids: Vec::new(),
        labels: Vec::new(),
        position_ids: Vec::new(),
    };
    for (ids, labels) in samples {
        row.input_ids.extend(ids);
        row.labels.extend(labels);
        row.position_ids.extend(0..ids.len() as u32);
    }
    let pads = 41 - row.input_ids.len();
    row.input_ids.extend(vec![PAD; pads]);
    row.labels.extend(vec![-100; pads]);
    row.position_ids.extend(vec![0; pads]);
    row
}

#[test]
fn rows_follow_the_reference_rules() {
    let packed = pack(&options());
    // Lengths 16 (A), 20 (B), 16 (C); D is 48 tokens and dropped. The knapsack fills a row
    // with the longest length that fits (B), then the longest that still fits (16), taking
    // the latest sample of that length (C); A opens the second row.
    assert_eq!(packed.len(), 2);
    assert_eq!(packed.row(0), expected_row(&[sample_b(), sample_a()]));
    assert_eq!(packed.row(1), expected_row(&[sample_a()]));
    // The row padding forms the model's trailing dummy sample.
    assert_eq!(sample_lengths(&packed.row(0).position_ids), [20, 16, 5]);
    assert_eq!(sample_lengths(&packed.row(1).position_ids), [16, 25]);

    let stats = packed.stats();
    assert_eq!(stats.total_records(), 4);
    assert_eq!(stats.samples, 3);
    let too_long = &stats.dropped[&DropReason::TooLong];
    assert_eq!(too_long.count, 1);
    assert_eq!(too_long.first.line, 4);
    assert_eq!(stats.dropped.len(), 1);
    assert_eq!(stats.rows, 2);
    assert_eq!(stats.sample_tokens, 52);
    assert_eq!(stats.block_pad_tokens, 2);
    assert_eq!(stats.loss_tokens, 7 + 11 + 7);
    assert_eq!(stats.row_pad_tokens(), 30);
    assert_eq!(stats.longest_sample, 20);
    assert!((stats.fill_ratio() - 52.0 / 82.0).abs() < 1e-12);
}

#[test]
fn the_knapsack_sees_one_preprocessing_batch_at_a_time() {
    let packed = pack(&PackOptions {
        preprocessing_batch_size: 2,
        ..options()
    });
    // Batches [A, B] and [C, D]: B then A fill the first row, C the second.
    assert_eq!(packed.len(), 2);
    assert_eq!(packed.row(0), expected_row(&[sample_b(), sample_a()]));
    assert_eq!(packed.row(1), expected_row(&[sample_a()]));
    assert_eq!(packed.row_samples(1).len(), 1);
}

#[test]
fn samples_longer_than_the_cutoff_are_dropped_not_truncated() {
    // With the cutoff at 16, B (20 after block padding) and D are dropped; A and C share a row.
    let packed = pack(&PackOptions {
        cutoff_len: 16,
        ..options()
    });
    assert_eq!(packed.len(), 1);
    assert_eq!(packed.row(0), expected_row(&[sample_a(), sample_a()]));
    assert_eq!(packed.stats().dropped[&DropReason::TooLong].count, 2);
}

#[test]
fn noised_rows_feed_the_two_stream_batch() {
    let packed = pack(&options());
    let noiser = Noiser::new(7, 151669);
    let rows: Vec<_> = (0..packed.len())
        .map(|r| noiser.noise(packed.row(r), 0, r as u64))
        .collect();
    for row in &rows {
        assert!(!row.masked_positions.is_empty());
        for &i in &row.masked_positions {
            assert_ne!(row.labels[i], -100, "only loss-bearing tokens are masked");
            assert_eq!(row.noisy_ids[i], 151669);
        }
    }
    let batch = TwoStreamBatch::new(&rows).unwrap();
    // Samples 20, 16, 5 (dummy) and 16, 25 (dummy), each doubled.
    assert_eq!(batch.sample_lens(), [20, 16, 5, 16, 25]);
    assert_eq!(batch.tokens().len(), 2 * 82);
    assert_eq!(batch.num_loss_tokens(), 25);
}
