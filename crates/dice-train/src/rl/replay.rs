//! TraceRL replay (spec bicrl §8, `collect_training_data` of the reference's `rl_sdar.py`): every
//! response is replayed the way it was decoded. Its trace says in which denoising pass each
//! token was unmasked; round r of a block predicts the tokens of the block's r-th pass from the
//! block with every token not yet decoded masked, next to the clean earlier blocks. All blocks
//! of a response are replayed at once, so a response gives as many samples as its busiest
//! block has passes.
//!
//! A sample is the sequence `[prompt (L0) | clean response (L1) | noisy response (L1)]` under
//! a mask in which each noisy block sees the prompt, the clean blocks before it and itself; the
//! loss reads the noisy rows at the tokens decoded in that round, against the clean tokens.
//!
//! Two block grids ([`BlockGrid`]): the engine decodes in blocks on absolute positions, so the
//! first generated block also holds the last `p mod B` prompt tokens, while the reference's
//! trainer cuts the response into blocks from its start. The default replays every trace on
//! the grid it was recorded on.

use anyhow::{ensure, Result};
use candle_core::{Device, Tensor};
use dice_model::masks::KeySpans;
use dice_model::MaskedSequence;

/// One response to train on, as the rollout produced it.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRecord {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// The generated token ids (the engine's `Completion::token_ids`).
    pub response: Vec<u32>,
    /// Per response token, the 1-based denoising pass of this response that unmasked it (the
    /// engine's `Completion::trace`, TraceRL's `step_map`).
    pub trace: Vec<u32>,
    /// The response's advantage within its task's group ([`super::advantage`]).
    pub advantage: f64,
}

/// Where the replay cuts blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BlockGrid {
    /// The grid each trace was recorded on: blocks on absolute positions of the unpadded prompt
    /// and response. The last `p mod B` prompt tokens open the first response block: in every
    /// round they are a clean, loss-free part of its noisy copy, as they sat in the engine's
    /// working block next to the masks. Realised by moving them from the prompt region into the
    /// response region as already decoded tokens; the prompt region then ends on a block
    /// boundary, so its blocks are absolute too. The loss normaliser stays the reference's L1.
    #[default]
    Rollout,
    /// The reference trainer's grid (spec bicrl §16.3): response blocks from the response
    /// start, prompt blocks from the prompt end. Where `p mod B ≠ 0` the replayed contexts
    /// differ from the sampled ones.
    Reference,
}

/// The replay's settings (spec bicrl §2 `training.*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplaySettings {
    /// Training block length.
    pub block_size: usize,
    /// Consecutive distinct passes of a block merged into one round (`collapse_k_unique`); 1
    /// replays every pass.
    pub shrink: usize,
    /// Pad (= EOS) tokens of a sample that keep their loss, counted along the row; `None`
    /// keeps all. With 0, as DICE runs, the end-of-text token never gets a gradient.
    pub post_num: Option<usize>,
    /// Records whose prompt is longer are dropped.
    pub max_prompt_len: usize,
    /// Responses are cut to this many tokens.
    pub max_response_len: usize,
    pub mask_id: u32,
    /// Pads prompts (left) and responses (right); also the end-of-text token.
    pub pad_id: u32,
    pub grid: BlockGrid,
}

impl Default for ReplaySettings {
    /// DICE's stage-1 settings (stage 2 drops prompts past 1,500 tokens) on the rollout grid.
    fn default() -> Self {
        Self {
            block_size: 4,
            shrink: 1,
            post_num: Some(0),
            max_prompt_len: 2000,
            max_response_len: 4096,
            mask_id: 151669,
            pad_id: 151643,
            grid: BlockGrid::Rollout,
        }
    }
}

/// A record as replayed: its clean sequence and positions, shared by all its samples.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayedRecord {
    /// Index of the record in the list given to [`Replay::build`].
    pub source: usize,
    pub advantage: f64,
    /// Prompt tokens moved into the response region (`p mod B` on the rollout grid, else 0):
    /// response token t sits at region position `tail + t`.
    pub tail: usize,
    /// `[left pads | prompt | region | right pads]`, L0 + L1 ids.
    pub clean_ids: Vec<u32>,
    /// Position ids of the whole L0 + 2·L1 sample: real prompt tokens count from 0 (left pads
    /// get 1, invisible anyway), the region continues including its right pads, and the noisy
    /// copy repeats the region's ids.
    pub position_ids: Vec<u32>,
    /// Rounds replayed, the empty ones (dropped) included.
    pub rounds: usize,
    /// Leading pad ids of the prompt region.
    leading_pads: usize,
}

/// One training sample: a round of a record.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplaySample {
    /// Index into [`Replay::records`].
    pub record: usize,
    /// The round, counted from 0 before empty rounds were dropped.
    pub round: usize,
    /// The noisy copy of the region (L1 ids): every token not decoded before this round masked.
    pub noisy_ids: Vec<u32>,
    /// Region positions whose loss is taken, ascending: the tokens decoded in this round,
    /// without the pads past `post_num`.
    pub loss_positions: Vec<usize>,
}

/// The training samples of one RL step.
#[derive(Debug, Clone, PartialEq)]
pub struct Replay {
    /// L0: the width of the (left-padded) prompt region.
    pub prompt_width: usize,
    /// L1: the width of the (right-padded) response region.
    pub region_width: usize,
    /// What the per-sample loss sums are divided by: the reference's L1, the longest
    /// response after truncation (the region is wider by the moved prompt tail on the rollout
    /// grid, the normaliser is not).
    pub loss_normaliser: usize,
    /// The kept records, in input order.
    pub records: Vec<ReplayedRecord>,
    /// Samples in record → round order.
    pub samples: Vec<ReplaySample>,
    /// Input indices of the records dropped for their prompt length.
    pub dropped: Vec<usize>,
    block_size: usize,
    pad_id: u32,
}

/// A record cut into the prompt head that stays in the prompt region and the region that is
/// replayed, with the region's trace (`None` = clean from the start).
struct Split<'a> {
    source: usize,
    record: &'a TraceRecord,
    head: &'a [u32],
    tail: usize,
    region: Vec<u32>,
    trace: Vec<Option<u32>>,
}

impl Replay {
    /// Replays `records` (spec bicrl §8.1–§8.5). Records whose prompt is longer than
    /// `max_prompt_len` are dropped with their response, trace and advantage (the reference
    /// drops only the prompt, misaligning the rest: spec §8.1).
    pub fn build(records: &[TraceRecord], settings: &ReplaySettings) -> Result<Self> {
        let b = settings.block_size;
        ensure!(b > 0, "the training block size must be positive");
        ensure!(settings.shrink > 0, "shrink must be positive");
        for (i, r) in records.iter().enumerate() {
            ensure!(
                r.trace.len() == r.response.len(),
                "record {i} has {} response tokens but {} trace entries: pass the engine's trace of that completion",
                r.response.len(),
                r.trace.len()
            );
        }
        let (kept, dropped): (Vec<_>, Vec<_>) = records
            .iter()
            .enumerate()
            .partition(|(_, r)| r.prompt.len() <= settings.max_prompt_len);
        let dropped = dropped.into_iter().map(|(i, _)| i).collect();

        let loss_normaliser = kept
            .iter()
            .map(|(_, r)| r.response.len())
            .max()
            .unwrap_or(0)
            .min(settings.max_response_len);
        let splits: Vec<Split> = kept
            .into_iter()
            .map(|(source, record)| {
                let tail = match settings.grid {
                    BlockGrid::Rollout => record.prompt.len() % b,
                    BlockGrid::Reference => 0,
                };
                let (head, moved) = record.prompt.split_at(record.prompt.len() - tail);
                let len = record.response.len().min(loss_normaliser);
                let region = [moved, &record.response[..len]].concat();
                let trace = std::iter::repeat_n(None, tail)
                    .chain(record.trace[..len].iter().copied().map(Some))
                    .collect();
                Split {
                    source,
                    record,
                    head,
                    tail,
                    region,
                    trace,
                }
            })
            .collect();
        let l0 = splits.iter().map(|s| s.head.len()).max().unwrap_or(0);
        let l1 = splits.iter().map(|s| s.region.len()).max().unwrap_or(0);

        let mut replay = Self {
            prompt_width: l0,
            region_width: l1,
            loss_normaliser,
            records: Vec::with_capacity(splits.len()),
            samples: Vec::new(),
            dropped,
            block_size: b,
            pad_id: settings.pad_id,
        };
        for split in splits {
            replay.push_record(split, settings);
        }
        Ok(replay)
    }

    fn push_record(&mut self, split: Split, settings: &ReplaySettings) {
        let (l0, l1, b, pad) = (
            self.prompt_width,
            self.region_width,
            self.block_size,
            self.pad_id,
        );
        let mut clean_ids = vec![pad; l0 - split.head.len()];
        clean_ids.extend_from_slice(split.head);
        clean_ids.extend_from_slice(&split.region);
        clean_ids.resize(l0 + l1, pad);

        // Right pads are decoded after every real token (`max + 1`): inside a mixed block they
        // come last, a pad-only block goes in the first round.
        let after_last = split.record.trace.iter().max().map_or(0, |&m| m + 1);
        let mut trace = split.trace;
        trace.resize(l1, Some(after_last));
        for block in trace.chunks_mut(b) {
            collapse_passes(block, settings.shrink);
        }

        let mut valid = 0u32;
        let mut position_ids: Vec<u32> = clean_ids
            .iter()
            .enumerate()
            .map(|(k, &id)| {
                if k >= l0 || id != pad {
                    valid += 1;
                    valid - 1
                } else {
                    1
                }
            })
            .collect();
        position_ids.extend_from_within(l0..);

        let record = self.records.len();
        let mut rounds = 0;
        while let Some(decoded) = next_round(&mut trace, b) {
            let region = &clean_ids[l0..];
            let noisy_ids = region
                .iter()
                .zip(&trace)
                .enumerate()
                .map(|(t, (&id, pass))| {
                    if pass.is_some() || decoded.contains(&t) {
                        settings.mask_id
                    } else {
                        id
                    }
                })
                .collect();
            let mut pads = 0;
            let loss_positions: Vec<usize> = decoded
                .into_iter()
                .filter(|&t| {
                    if region[t] != pad {
                        return true;
                    }
                    pads += 1;
                    settings.post_num.is_none_or(|keep| pads <= keep)
                })
                .collect();
            if !loss_positions.is_empty() {
                self.samples.push(ReplaySample {
                    record,
                    round: rounds,
                    noisy_ids,
                    loss_positions,
                });
            }
            rounds += 1;
        }
        let leading_pads = clean_ids[..l0].iter().take_while(|&&id| id == pad).count();
        self.records.push(ReplayedRecord {
            source: split.source,
            advantage: split.record.advantage,
            tail: split.tail,
            clean_ids,
            position_ids,
            rounds,
            leading_pads,
        });
    }

    /// The sample's input ids: `[clean ids (L0 + L1) | noisy ids (L1)]`.
    pub fn input_ids(&self, sample: &ReplaySample) -> Vec<u32> {
        [
            self.records[sample.record].clean_ids.as_slice(),
            &sample.noisy_ids,
        ]
        .concat()
    }

    /// The response token index (from 0, the moved prompt tail not counted) of each loss
    /// position of `sample`.
    pub fn response_positions(&self, sample: &ReplaySample) -> Vec<usize> {
        let tail = self.records[sample.record].tail;
        sample.loss_positions.iter().map(|&t| t - tail).collect()
    }

    /// Whether row `query` of a sample of `record` may attend column `key` (spec bicrl §8.6,
    /// `make_basic_block_attention` then `process_pad`).
    pub fn visible(&self, record: usize, query: usize, key: usize) -> bool {
        let (l0, l1, b) = (self.prompt_width, self.region_width, self.block_size);
        let record = &self.records[record];
        let hidden_pad = key < l0 && record.clean_ids[key] == self.pad_id;
        if query < l0 {
            // Prompt blocks are aligned to the prompt's end; a row sees its block and the
            // blocks before it.
            let block_end = l0 - (l0 - 1 - query) / b * b;
            if block_end <= record.leading_pads {
                // Nothing but pads to see: the row sees itself, so that softmax stays finite.
                return key == query;
            }
            return key < block_end && !hidden_pad;
        }
        if hidden_pad {
            return false;
        }
        if query < l0 + l1 {
            let block = (query - l0) / b;
            return key < l0 + ((block + 1) * b).min(l1);
        }
        let block = (query - l0 - l1) / b;
        let noisy_start = l0 + l1 + block * b;
        key < l0 + block * b || (noisy_start..noisy_start + b).contains(&key)
    }

    /// The additive `[N, N]` mask of [`Replay::visible`] for the samples of `record` (0 where
    /// a row may attend, -inf elsewhere), N = L0 + 2·L1.
    pub fn attention_mask(&self, record: usize, device: &Device) -> Result<Tensor> {
        let n = self.prompt_width + 2 * self.region_width;
        let data: Vec<f32> = (0..n * n)
            .map(|i| {
                if self.visible(record, i / n, i % n) {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        Ok(Tensor::from_vec(data, (n, n), device)?)
    }

    /// [`Replay::visible`] for the samples of `record` as key ranges, which the fused training
    /// attention takes instead of the mask; `None` where a row sees more than two ranges (pads
    /// inside the prompt).
    pub fn key_spans(&self, record: usize) -> Option<KeySpans> {
        let n = self.prompt_width + 2 * self.region_width;
        KeySpans::from_predicate(n, |query, key| self.visible(record, query, key))
    }

    /// The model's input for `sample` under `mask` and `spans` (its record's
    /// [`Replay::attention_mask`], where the model needs it, and [`Replay::key_spans`]): the
    /// loss positions are scored on their noisy rows against the clean tokens.
    pub fn sequence(
        &self,
        sample: &ReplaySample,
        mask: Option<Tensor>,
        spans: Option<KeySpans>,
    ) -> MaskedSequence {
        let (l0, l1) = (self.prompt_width, self.region_width);
        let record = &self.records[sample.record];
        MaskedSequence {
            tokens: self.input_ids(sample),
            positions: record.position_ids.clone(),
            mask,
            spans,
            rows: sample
                .loss_positions
                .iter()
                .map(|&t| (l0 + l1 + t) as u32)
                .collect(),
            labels: sample
                .loss_positions
                .iter()
                .map(|&t| record.clean_ids[l0 + t])
                .collect(),
        }
    }
}

/// `collapse_k_unique` on one block's undecoded passes: the distinct passes, sorted, are cut
/// into runs of `shrink`, and every pass becomes the last of its run.
fn collapse_passes(block: &mut [Option<u32>], shrink: usize) {
    let mut passes: Vec<u32> = block.iter().flatten().copied().collect();
    passes.sort_unstable();
    passes.dedup();
    for pass in block.iter_mut().flatten() {
        let rank = passes.binary_search(pass).expect("every pass is listed");
        *pass = passes[(rank / shrink * shrink + shrink - 1).min(passes.len() - 1)];
    }
}

/// One round of `one_round_vectorized`: in every block, the positions holding the block's
/// smallest undecoded pass are decoded now (returned, ascending, and marked decoded). `None`
/// once everything is decoded.
fn next_round(trace: &mut [Option<u32>], block_size: usize) -> Option<Vec<usize>> {
    let mut decoded = Vec::new();
    for (j, block) in trace.chunks_mut(block_size).enumerate() {
        let Some(first) = block.iter().flatten().min().copied() else {
            continue;
        };
        for (i, pass) in block.iter_mut().enumerate() {
            if *pass == Some(first) {
                *pass = None;
                decoded.push(j * block_size + i);
            }
        }
    }
    (!decoded.is_empty()).then_some(decoded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collapse_merges_runs_of_distinct_passes() {
        let mut block = [Some(5), Some(9), Some(6), Some(5)];
        collapse_passes(&mut block, 2);
        assert_eq!(block, [Some(6), Some(9), Some(6), Some(6)]);
        let mut block = [None, Some(3), Some(1), Some(2)];
        collapse_passes(&mut block, 1);
        assert_eq!(block, [None, Some(3), Some(1), Some(2)]);
    }

    #[test]
    fn rounds_take_each_blocks_next_pass() {
        // The spec's example: [5,5,6,7] predicts 0,1 then 2 then 3; [9,9,9,9] only in round 1.
        let mut trace: Vec<_> = [5, 5, 6, 7, 9, 9, 9, 9].into_iter().map(Some).collect();
        assert_eq!(next_round(&mut trace, 4), Some(vec![0, 1, 4, 5, 6, 7]));
        assert_eq!(next_round(&mut trace, 4), Some(vec![2]));
        assert_eq!(next_round(&mut trace, 4), Some(vec![3]));
        assert_eq!(next_round(&mut trace, 4), None);
    }
}
