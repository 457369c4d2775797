//! Samples packed into fixed-length rows as the reference packs them (spec §6.1, LlamaFactory's
//! `PackedSupervisedDatasetProcessor` with the SDAR fork's block padding and
//! `truncate_mode: drop`).

use super::source::{Converted, DatasetSpec, DropReason, Location};
use super::template::{Qwen3Encoder, Sample};
use anyhow::{ensure, Context, Result};
use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::path::Path;

/// How samples become rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackOptions {
    /// Tokens per packed row. Samples fill at most `row_tokens - 1` of them, so every row ends
    /// with at least one pad token (LlamaFactory's `cutoff_len` with packing: the yaml's 6144
    /// becomes a capacity of 6143 and rows of 6143 + 1).
    pub row_tokens: usize,
    /// Longest sample kept, counted after block padding; longer ones are dropped
    /// (`truncate_mode: drop`). At most `row_tokens - 1`.
    pub cutoff_len: usize,
    /// Every sample is padded to a multiple of this (the model's `block_size`).
    pub block_length: usize,
    /// Records packed together: LlamaFactory maps its preprocessing over batches of this many
    /// records, and the knapsack only sees one batch.
    pub preprocessing_batch_size: usize,
    /// LlamaFactory's `preprocessing_num_workers`: the records are first split into this many
    /// contiguous shards, each batched on its own.
    pub preprocessing_num_workers: usize,
}

impl Default for PackOptions {
    /// The DICE recipe (spec §6.5) and LlamaFactory's preprocessing defaults.
    fn default() -> Self {
        Self {
            row_tokens: 6144,
            cutoff_len: 6143,
            block_length: 4,
            preprocessing_batch_size: 1000,
            preprocessing_num_workers: 1,
        }
    }
}

impl PackOptions {
    pub fn validate(&self) -> Result<()> {
        ensure!(self.row_tokens >= 2, "rows must hold at least 2 tokens");
        ensure!(
            self.block_length >= 1,
            "the block length must be at least 1"
        );
        ensure!(
            self.cutoff_len < self.row_tokens,
            "the cutoff ({}) must be below the row length ({}): every row ends with a pad token",
            self.cutoff_len,
            self.row_tokens
        );
        ensure!(
            self.preprocessing_batch_size >= 1 && self.preprocessing_num_workers >= 1,
            "the preprocessing batch size and worker count must be at least 1"
        );
        Ok(())
    }

    /// Tokens the samples of one row may fill.
    fn capacity(&self) -> usize {
        self.row_tokens - 1
    }
}

/// The `block_size` of a model folder's `config.json`, or SDAR's 4 when the folder has no
/// config (a tokenizer-only folder) or the config does not say.
pub fn model_block_length(dir: &Path) -> Result<usize> {
    let path = dir.join("config.json");
    if !path.exists() {
        return Ok(4);
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let config: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    match config.get("block_size") {
        None => Ok(4),
        Some(v) => v
            .as_u64()
            .filter(|&b| b > 0)
            .map(|b| b as usize)
            .with_context(|| {
                format!(
                    "{}: block_size must be a positive integer, got {v}",
                    path.display()
                )
            }),
    }
}

/// One packed row before noising.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CleanRow {
    pub input_ids: Vec<u32>,
    /// -100 on prompts and row padding; the id itself on responses and block pads.
    pub labels: Vec<i64>,
    /// 0, 1, ... per sample; the row padding is a run of zeros (the model's dummy sample).
    pub position_ids: Vec<u32>,
}

/// Records dropped for one reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    pub count: usize,
    pub first: Location,
}

/// What packing did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackStats {
    /// Records read, per dataset in order.
    pub records: Vec<(String, usize)>,
    /// Samples packed into rows.
    pub samples: usize,
    pub dropped: BTreeMap<DropReason, Dropped>,
    pub rows: usize,
    pub row_tokens: usize,
    pub cutoff_len: usize,
    /// Tokens of the packed samples, block pads included.
    pub sample_tokens: usize,
    pub block_pad_tokens: usize,
    /// Tokens with a label (responses and block pads): the loss denominator over all rows.
    pub loss_tokens: usize,
    pub longest_sample: usize,
}

impl PackStats {
    pub fn total_records(&self) -> usize {
        self.records.iter().map(|(_, n)| n).sum()
    }

    pub fn total_dropped(&self) -> usize {
        self.dropped.values().map(|d| d.count).sum()
    }

    /// Row padding tokens (the trailing dummy samples).
    pub fn row_pad_tokens(&self) -> usize {
        self.rows * self.row_tokens - self.sample_tokens
    }

    /// Share of row tokens that belong to samples.
    pub fn fill_ratio(&self) -> f64 {
        if self.rows == 0 {
            return 0.0;
        }
        self.sample_tokens as f64 / (self.rows * self.row_tokens) as f64
    }
}

impl fmt::Display for PackStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let per_dataset: Vec<String> = self
            .records
            .iter()
            .map(|(name, n)| format!("{name}: {n}"))
            .collect();
        writeln!(
            f,
            "records      {} ({})",
            self.total_records(),
            per_dataset.join(", ")
        )?;
        writeln!(
            f,
            "samples      {} packed, {} dropped",
            self.samples,
            self.total_dropped()
        )?;
        for (reason, dropped) in &self.dropped {
            let reason = match reason {
                DropReason::TooLong => format!("longer than {} tokens", self.cutoff_len),
                other => other.describe().to_string(),
            };
            writeln!(
                f,
                "  dropped    {} {reason} (first: {})",
                dropped.count, dropped.first
            )?;
        }
        writeln!(
            f,
            "rows         {} of {} tokens",
            self.rows, self.row_tokens
        )?;
        writeln!(
            f,
            "tokens       {} in samples ({} block pads), {} row padding",
            self.sample_tokens,
            self.block_pad_tokens,
            self.row_pad_tokens()
        )?;
        writeln!(f, "loss tokens  {}", self.loss_tokens)?;
        writeln!(f, "longest      {} tokens", self.longest_sample)?;
        writeln!(f, "fill ratio   {:.2} %", 100.0 * self.fill_ratio())
    }
}

/// A dataset packed into rows. Samples are stored once; rows are made on demand.
#[derive(Debug, Clone)]
pub struct PackedDataset {
    /// Samples in row order, block-padded.
    samples: Vec<Sample>,
    /// The samples of each row.
    rows: Vec<Range<usize>>,
    row_tokens: usize,
    pad_id: u32,
    stats: PackStats,
}

/// Record indices `0..n` as LlamaFactory's `datasets.map(batched=True, num_proc=W)` hands
/// them to the processor: W contiguous shards (the first `n % W` one longer), each cut into
/// batches.
fn preprocessing_batches(n: usize, options: &PackOptions) -> Vec<Range<usize>> {
    let shards = options.preprocessing_num_workers.min(n).max(1);
    let (size, longer) = (n / shards, n % shards);
    let mut batches = Vec::new();
    let mut start = 0;
    for shard in 0..shards {
        let end = start + size + usize::from(shard < longer);
        let mut batch_start = start;
        while batch_start < end {
            let batch_end = (batch_start + options.preprocessing_batch_size).min(end);
            batches.push(batch_start..batch_end);
            batch_start = batch_end;
        }
        start = end;
    }
    batches
}

/// LlamaFactory's `greedy_knapsack` with the processor's choice of sample per length: each row
/// takes the longest remaining length that still fits until none does, and of the samples of
/// that length the latest one (`length2indexes[length].pop()`). Returns indices into `lengths`.
fn greedy_knapsack(lengths: &[usize], capacity: usize) -> Vec<Vec<usize>> {
    let mut by_length: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (index, &length) in lengths.iter().enumerate() {
        by_length.entry(length).or_default().push(index);
    }
    let mut rows = Vec::new();
    while !by_length.is_empty() {
        let mut row = Vec::new();
        let mut remaining = capacity;
        while let Some((&length, indices)) = by_length.range_mut(..=remaining).next_back() {
            row.push(indices.pop().expect("lengths without samples are removed"));
            if indices.is_empty() {
                by_length.remove(&length);
            }
            remaining -= length;
        }
        assert!(!row.is_empty(), "every sample fits a row");
        rows.push(row);
    }
    rows
}

impl PackedDataset {
    /// Reads, encodes and packs `datasets` (concatenated in order). Samples are padded with
    /// the tokenizer's pad token (else its eos token, as LlamaFactory falls back).
    pub fn build(
        datasets: &[DatasetSpec],
        encoder: &Qwen3Encoder,
        options: &PackOptions,
    ) -> Result<Self> {
        options.validate()?;
        let tokenizer = encoder.tokenizer();
        let pad_id = tokenizer
            .pad_token_id()
            .or(tokenizer.eos_token_id())
            .context("the tokenizer has neither a pad token nor an eos token to pad with")?;
        let mut records = Vec::new();
        let mut counts = Vec::new();
        for (d, dataset) in datasets.iter().enumerate() {
            let read = dataset.read()?;
            counts.push((dataset.name.clone(), read.len()));
            records.extend(read.into_iter().map(|r| (d, r)));
        }
        let mut packed = Self {
            samples: Vec::new(),
            rows: Vec::new(),
            row_tokens: options.row_tokens,
            pad_id,
            stats: PackStats {
                records: counts,
                samples: 0,
                dropped: BTreeMap::new(),
                rows: 0,
                row_tokens: options.row_tokens,
                cutoff_len: options.cutoff_len,
                sample_tokens: 0,
                block_pad_tokens: 0,
                loss_tokens: 0,
                longest_sample: 0,
            },
        };
        let mut records = records.into_iter();
        for batch in preprocessing_batches(records.len(), options) {
            let mut batch_samples = Vec::with_capacity(batch.len());
            for (d, record) in records.by_ref().take(batch.len()) {
                let dataset = &datasets[d];
                let conversation = match dataset.convert(&record)? {
                    Converted::Sample(conversation) => conversation,
                    Converted::Dropped(reason) => {
                        packed.drop_record(reason, &record.location);
                        continue;
                    }
                };
                let mut sample = encoder.encode(&conversation).with_context(|| {
                    format!("{}: dataset \"{}\"", record.location, dataset.name)
                })?;
                let block_pads = sample.len().next_multiple_of(options.block_length) - sample.len();
                // Block pads carry loss: their label is the pad id itself.
                sample
                    .input_ids
                    .extend(std::iter::repeat_n(pad_id, block_pads));
                sample.trained.extend(std::iter::repeat_n(true, block_pads));
                if sample.len() > options.cutoff_len {
                    packed.drop_record(DropReason::TooLong, &record.location);
                    continue;
                }
                packed.stats.block_pad_tokens += block_pads;
                batch_samples.push(sample);
            }
            let lengths: Vec<usize> = batch_samples.iter().map(Sample::len).collect();
            let mut batch_samples: Vec<Option<Sample>> =
                batch_samples.into_iter().map(Some).collect();
            for row in greedy_knapsack(&lengths, options.capacity()) {
                let start = packed.samples.len();
                for index in row {
                    let sample = batch_samples[index]
                        .take()
                        .expect("a sample is packed once");
                    packed.stats.sample_tokens += sample.len();
                    packed.stats.loss_tokens += sample.trained.iter().filter(|&&t| t).count();
                    packed.stats.longest_sample = packed.stats.longest_sample.max(sample.len());
                    packed.samples.push(sample);
                }
                packed.rows.push(start..packed.samples.len());
            }
        }
        packed.stats.samples = packed.samples.len();
        packed.stats.rows = packed.rows.len();
        Ok(packed)
    }

    fn drop_record(&mut self, reason: DropReason, location: &Location) {
        self.stats
            .dropped
            .entry(reason)
            .and_modify(|d| d.count += 1)
            .or_insert_with(|| Dropped {
                count: 1,
                first: location.clone(),
            });
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn stats(&self) -> &PackStats {
        &self.stats
    }

    /// The samples of row `index`, in row order.
    pub fn row_samples(&self, index: usize) -> &[Sample] {
        &self.samples[self.rows[index].clone()]
    }

    /// Row `index`: its samples with positions restarting at 0, then pad tokens (label -100,
    /// position 0) up to the row length.
    pub fn row(&self, index: usize) -> CleanRow {
        let mut row = CleanRow {
            input_ids: Vec::with_capacity(self.row_tokens),
            labels: Vec::with_capacity(self.row_tokens),
            position_ids: Vec::with_capacity(self.row_tokens),
        };
        for sample in self.row_samples(index) {
            row.input_ids.extend_from_slice(&sample.input_ids);
            row.labels.extend(sample.labels());
            row.position_ids.extend(0..sample.len() as u32);
        }
        let pads = self.row_tokens - row.input_ids.len();
        row.input_ids.extend(std::iter::repeat_n(self.pad_id, pads));
        row.labels.extend(std::iter::repeat_n(-100, pads));
        row.position_ids.extend(std::iter::repeat_n(0, pads));
        row
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knapsack_takes_the_longest_fitting_length_and_the_latest_sample_of_it() {
        // Lengths 4, 8, 4, 12 into capacity 16: [12 (#3), 4 (#2)], then [8 (#1), 4 (#0)].
        assert_eq!(
            greedy_knapsack(&[4, 8, 4, 12], 16),
            [vec![3, 2], vec![1, 0]]
        );
        assert_eq!(greedy_knapsack(&[], 16), Vec::<Vec<usize>>::new());
    }

    #[test]
    fn preprocessing_splits_shards_then_batches() {
        let options = PackOptions {
            preprocessing_batch_size: 2,
            preprocessing_num_workers: 2,
            ..PackOptions::default()
        };
        // 7 records: shards of 4 and 3, each in batches of 2.
        assert_eq!(preprocessing_batches(7, &options), [0..2, 2..4, 4..6, 6..7]);
        let one_worker = PackOptions {
            preprocessing_num_workers: 1,
            ..options
        };
        assert_eq!(preprocessing_batches(5, &one_worker), [0..2, 2..4, 4..5]);
    }
}
