//! Decoding throughput of the engine on a random-weight model of a real size: for each batch
//! size, an engine of that many slots generates a fixed number of greedy tokens (no stop ids)
//! after pseudo-random prompts for every sequence at once, and the wall time, the forwards run
//! and the peak device memory are measured. On request also where the time of one decoding and
//! one prefill forward goes ([`Sdar::profile_block_forward`]) and what every engine step costs.

use crate::{
    DecodeParams, DecodeSettings, Engine, EngineConfig, ForwardCounts, Request, SamplingParams,
    SdarDecoder, Strategy,
};
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device};
use dice_model::device::cuda_event_tracking;
use dice_model::init::splitmix64_mix;
use dice_model::memory::PeakMemory;
use dice_model::sdar::{BlockForwardShape, ForwardProfile, ProfileSettings};
use dice_model::{Sdar, SdarConfig};
use serde::Serialize;
use std::time::Instant;

/// The tokenizer's first special id (`<|endoftext|>`); prompt ids stay below it.
const FIRST_SPECIAL_ID: u32 = 151_643;

/// Warm-up and timed repetitions of a profiled decoding forward.
const DECODING_PROFILE: (usize, usize) = (3, 10);
/// A prefill forward is long: fewer repetitions give the same precision.
const PREFILL_PROFILE: (usize, usize) = (1, 2);

/// The prompt lengths of a benchmark's sequences: all one length, or spread evenly from the
/// shortest to the longest over a batch (as a rollout's task prompts differ, which puts the
/// sequences' block boundaries out of step: the cost a benchmark of equal prompts hides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLengths {
    pub shortest: usize,
    pub longest: usize,
}

impl PromptLengths {
    /// Every sequence `tokens` long.
    pub fn equal(tokens: usize) -> Self {
        Self {
            shortest: tokens,
            longest: tokens,
        }
    }

    /// The length of row `row` of `batch`: the shortest for the first, the longest for the
    /// last, evenly between.
    pub fn of_row(&self, row: usize, batch: usize) -> usize {
        let span = self.longest - self.shortest;
        self.shortest + span * row / batch.saturating_sub(1).max(1)
    }
}

impl std::fmt::Display for PromptLengths {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.shortest == self.longest {
            write!(f, "{}", self.longest)
        } else {
            write!(f, "{}-{}", self.shortest, self.longest)
        }
    }
}

impl std::str::FromStr for PromptLengths {
    type Err = String;

    /// `N` (every prompt N tokens) or `MIN-MAX` (spread evenly over the batch).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let number = |n: &str| {
            n.trim().parse::<usize>().map_err(|_| {
                format!("`{s}` is not a prompt length: give N or MIN-MAX (e.g. 512 or 811-1287)")
            })
        };
        let lengths = match s.split_once('-') {
            Some((shortest, longest)) => Self {
                shortest: number(shortest)?,
                longest: number(longest)?,
            },
            None => Self::equal(number(s)?),
        };
        if lengths.shortest > lengths.longest {
            return Err(format!(
                "`{s}`: the shortest prompt must not be longer than the longest"
            ));
        }
        Ok(lengths)
    }
}

/// A number for equal prompts (as the benchmarks of bench/targets.toml name them), else the
/// string `MIN-MAX`, which no fixed-length benchmark's setting equals.
impl Serialize for PromptLengths {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        if self.shortest == self.longest {
            serializer.serialize_u64(self.longest as u64)
        } else {
            serializer.collect_str(self)
        }
    }
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct ThroughputBench {
    /// Sequences decoded at once, one engine per entry (each at least 1).
    pub batches: Vec<usize>,
    pub prompt_tokens: PromptLengths,
    /// New tokens per sequence: every sequence runs to this limit.
    pub new_tokens: usize,
    pub block_length: usize,
    /// Denoising steps per block.
    pub steps: usize,
    pub strategy: Strategy,
    /// How each token is drawn (DICE's evaluation is greedy: top-k 1; training rollouts sample
    /// the whole distribution: top-k 0).
    pub sampling: SamplingParams,
    /// After the throughput runs, profile one decoding forward per batch size and one prefill
    /// forward of the largest, with byte floors at this memory bandwidth (bytes per second),
    /// and time every engine step of one more generation per batch size.
    pub profile_bandwidth: Option<f64>,
}

/// The run as a whole: the model and the decoding settings.
#[derive(Debug, Clone, Serialize)]
pub struct ThroughputRun {
    pub parameters: usize,
    pub weight_bytes: u64,
    /// Seconds to build the random weights on the device.
    pub build_s: f64,
    pub prompt_tokens: PromptLengths,
    pub new_tokens: usize,
    pub block_length: usize,
    pub steps: usize,
    pub strategy: &'static str,
    pub sampling: SamplingParams,
    /// Whether the CUDA device tracked buffer uses with events (false off CUDA).
    pub cuda_event_tracking: bool,
}

/// [`ThroughputBench::run`]'s result.
#[derive(Debug, Clone)]
pub struct Throughput {
    pub run: ThroughputRun,
    /// One per batch size, in the order asked.
    pub rows: Vec<ThroughputRow>,
    /// With [`ThroughputBench::profile_bandwidth`]: the decoding forward of each batch size,
    /// then the prefill forward of the largest (none for prompts shorter than a block).
    pub profiles: Option<Vec<ForwardProfile>>,
}

/// The generation of one batch size.
#[derive(Debug, Clone, Serialize)]
pub struct ThroughputRow {
    pub batch: usize,
    pub generated_tokens: usize,
    pub wall_s: f64,
    pub tokens_per_s: f64,
    pub forwards: ForwardCounts,
    pub total_forwards: u64,
    pub ms_per_forward: f64,
    /// Highest device memory in use during the timed generation; `None` on the CPU.
    pub peak_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<StepTimes>,
}

/// Wall time of each engine step of one generation, the device synchronized after each.
#[derive(Debug, Clone, Serialize)]
pub struct StepTimes {
    /// The first step: the prefill of every prompt, then the first decoding forward.
    pub first_ms: f64,
    /// Every later step, in order.
    pub later_ms: Vec<f64>,
}

/// [`StepTimes`] read as those of a batch in lock-step (as the benchmark's are unless sequences
/// fall behind): after the first step, every `steps`-th step is the first of a block and also
/// stores the block before; the last step only commits.
#[derive(Debug, Clone, Copy)]
pub struct StepSummary {
    pub first_ms: f64,
    /// Steps after the first, and their total time.
    pub later: usize,
    pub later_total_ms: f64,
    /// Median of the steps that store no block.
    pub median_ms: f64,
    /// Median of the steps that also store the block before.
    pub median_storing_ms: f64,
}

impl StepTimes {
    /// The summary for `steps` denoising steps per block.
    pub fn summary(&self, steps: usize) -> StepSummary {
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
        };
        let (mut storing, mut plain) = (Vec::new(), Vec::new());
        for (k, &ms) in self.later_ms.iter().enumerate() {
            if (k + 1) % steps.max(1) == 0 {
                storing.push(ms);
            } else {
                plain.push(ms);
            }
        }
        StepSummary {
            first_ms: self.first_ms,
            later: self.later_ms.len(),
            later_total_ms: self.later_ms.iter().sum(),
            median_ms: median(plain),
            median_storing_ms: median(storing),
        }
    }
}

impl ThroughputBench {
    /// DICE's evaluation (no stop ids) with the benchmark's block, steps, strategy and sampling.
    pub fn decode_params(&self) -> Result<DecodeParams> {
        DecodeSettings {
            strategy: Some(self.strategy),
            block_length: Some(self.block_length),
            steps: Some(self.steps),
            temperature: Some(self.sampling.temperature),
            top_k: Some(self.sampling.top_k),
            top_p: Some(self.sampling.top_p),
            ..DecodeSettings::default()
        }
        .over(&DecodeParams::dice_eval(self.new_tokens))
    }

    /// Builds a model of `config`'s shapes with random weights in `dtype` on `device`, then
    /// measures every batch size.
    pub fn run(&self, config: &SdarConfig, dtype: DType, device: &Device) -> Result<Throughput> {
        ensure!(
            !self.batches.is_empty() && self.batches.iter().all(|&b| b > 0),
            "a throughput run needs batch sizes of at least 1"
        );
        let params = self.decode_params()?;
        let start = Instant::now();
        let mut model = SdarDecoder::random(config, dtype, device, self.block_length)?;
        device.synchronize()?;
        let build_s = start.elapsed().as_secs_f64();
        let parameters = model.model().num_parameters();
        let prompt_bound = FIRST_SPECIAL_ID
            .min(config.mask_token_id)
            .min(config.vocab_size as u32);
        let mut rows = Vec::new();
        for &batch in &self.batches {
            let prompts = prompts(batch, self.prompt_tokens, prompt_bound);
            let time_steps = self.profile_bandwidth.is_some();
            let (row, back) = measure(model, &prompts, &params, time_steps)?;
            model = back;
            rows.push(row);
        }
        let profiles = self
            .profile_bandwidth
            .map(|bytes_per_s| self.profiles(model.model(), bytes_per_s))
            .transpose()?;
        Ok(Throughput {
            run: ThroughputRun {
                parameters,
                weight_bytes: (parameters * dtype.size_in_bytes()) as u64,
                build_s,
                prompt_tokens: self.prompt_tokens,
                new_tokens: self.new_tokens,
                block_length: params.block_length,
                steps: params.steps,
                strategy: params.strategy.name(),
                sampling: params.sampling,
                cuda_event_tracking: cuda_event_tracking(device),
            },
            rows,
            profiles,
        })
    }

    fn profiles(&self, model: &Sdar, bytes_per_s: f64) -> Result<Vec<ForwardProfile>> {
        let mut profiles = self
            .batches
            .iter()
            .map(|&batch| self.profile_decoding(model, batch, bytes_per_s))
            .collect::<Result<Vec<_>>>()?;
        let largest = self.batches.iter().copied().max().unwrap_or(1);
        profiles.extend(self.profile_prefill(model, largest, bytes_per_s)?);
        Ok(profiles)
    }

    /// Profiles the decoding forward of `batch` rows halfway through the generation: caches
    /// filled to the prompt plus half the new tokens (rounded down to whole blocks), in a cache
    /// as large as the engine's.
    fn profile_decoding(
        &self,
        model: &Sdar,
        batch: usize,
        bytes_per_s: f64,
    ) -> Result<ForwardProfile> {
        let block = model.config().block_size;
        let prompt_tokens = self.prompt_tokens.longest;
        let cached_tokens = (prompt_tokens + self.new_tokens / 2) / block * block;
        let shape = BlockForwardShape {
            batch,
            cached_tokens,
            capacity: engine_capacity(prompt_tokens, self.new_tokens, block)
                .max(cached_tokens + block),
            tokens: block,
        };
        profile(model, shape, DECODING_PROFILE, bytes_per_s, "decoding")
    }

    /// Profiles one prefill forward as the engine runs them for `batch` prompts: as many whole
    /// prompts per forward as its prefill chunk takes, over empty caches. `None` for prompts
    /// shorter than a block, which the engine does not prefill (they sit in the first block).
    fn profile_prefill(
        &self,
        model: &Sdar,
        batch: usize,
        bytes_per_s: f64,
    ) -> Result<Option<ForwardProfile>> {
        let block = model.config().block_size;
        let prompt_tokens = self.prompt_tokens.longest;
        let tokens = prompt_tokens / block * block;
        if tokens == 0 {
            return Ok(None);
        }
        let rows = (EngineConfig::default().max_prefill_tokens / tokens).clamp(1, batch);
        let shape = BlockForwardShape {
            batch: rows,
            cached_tokens: 0,
            capacity: engine_capacity(prompt_tokens, self.new_tokens, block),
            tokens,
        };
        profile(model, shape, PREFILL_PROFILE, bytes_per_s, "prefill").map(Some)
    }
}

fn profile(
    model: &Sdar,
    shape: BlockForwardShape,
    (warm_up, repetitions): (usize, usize),
    bytes_per_s: f64,
    kind: &str,
) -> Result<ForwardProfile> {
    let settings = ProfileSettings {
        warm_up,
        repetitions,
        bytes_per_s,
    };
    model
        .profile_block_forward(shape, settings)
        .with_context(|| format!("cannot profile the {kind} forward at batch {}", shape.batch))
}

/// Deterministic pseudo-random prompts of ids below `bound`, a different stream per sequence,
/// of `lengths` over the batch.
fn prompts(batch: usize, lengths: PromptLengths, bound: u32) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|row| {
            let stream = (row as u64) << 32;
            (0..lengths.of_row(row, batch) as u64)
                .map(|i| (splitmix64(stream | i) % u64::from(bound)) as u32)
                .collect()
        })
        .collect()
}

fn splitmix64(x: u64) -> u64 {
    splitmix64_mix(x.wrapping_add(0x9e37_79b9_7f4a_7c15))
}

/// Positions per KV-cache row of the benchmark's engine: the prompt and the new tokens, in whole
/// blocks (the profile runs in caches of this size too).
fn engine_capacity(prompt_tokens: usize, new_tokens: usize, block: usize) -> usize {
    (prompt_tokens + new_tokens).div_ceil(block) * block
}

/// Generates for every prompt at once in an engine of exactly that batch; gives the model back.
fn measure(
    model: SdarDecoder,
    prompts: &[Vec<u32>],
    params: &DecodeParams,
    time_steps: bool,
) -> Result<(ThroughputRow, SdarDecoder)> {
    let device = model.model().device().clone();
    let block = params.block_length;
    let prompt_tokens = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let requests = |params: &DecodeParams| -> Vec<Request> {
        prompts
            .iter()
            .map(|p| Request {
                prompt: p.clone(),
                params: params.clone(),
            })
            .collect()
    };
    // The allocator may still hold the previous batch's memory: measure from a settled state.
    device.synchronize()?;
    let peak = PeakMemory::start(&device)?;
    let mut engine = Engine::new(
        model,
        EngineConfig {
            max_batch: prompts.len(),
            max_seq_len: engine_capacity(prompt_tokens, params.max_new_tokens, block),
            ..EngineConfig::default()
        },
    )?;
    // One block per sequence allocates the KV cache and loads the prefill and decoding
    // kernels at these shapes before the timing starts.
    let warm_up = DecodeParams {
        max_new_tokens: block,
        ..params.clone()
    };
    engine.generate(requests(&warm_up))?;
    device.synchronize()?;
    let before = engine.forward_counts();
    let start = Instant::now();
    let completions = engine.generate(requests(params))?;
    device.synchronize()?;
    let wall_s = start.elapsed().as_secs_f64();
    let peak_bytes = peak.finish();
    let after = engine.forward_counts();
    let forwards = ForwardCounts {
        prefill: after.prefill - before.prefill,
        decode: after.decode - before.decode,
    };
    let generated_tokens = completions.iter().map(|c| c.token_ids.len()).sum();
    let steps = time_steps
        .then(|| step_times(&mut engine, requests(params), &device))
        .transpose()?;
    let row = ThroughputRow {
        batch: prompts.len(),
        generated_tokens,
        wall_s,
        tokens_per_s: generated_tokens as f64 / wall_s,
        forwards,
        total_forwards: forwards.total(),
        ms_per_forward: wall_s * 1e3 / forwards.total() as f64,
        peak_bytes,
        steps,
    };
    Ok((row, engine.into_model()))
}

fn step_times(
    engine: &mut Engine<SdarDecoder>,
    requests: Vec<Request>,
    device: &Device,
) -> Result<StepTimes> {
    for request in requests {
        engine.submit(request)?;
    }
    let mut times = Vec::new();
    while engine.has_work() {
        let start = Instant::now();
        engine.step()?;
        device.synchronize()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    let (first_ms, later_ms) = times.split_first().context("the generation took no step")?;
    Ok(StepTimes {
        first_ms: *first_ms,
        later_ms: later_ms.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn prompts_are_distinct_deterministic_and_below_the_bound() {
        let a = prompts(64, PromptLengths::equal(32), 1000);
        assert_eq!(a, prompts(64, PromptLengths::equal(32), 1000));
        for (i, row) in a.iter().enumerate() {
            assert_eq!(row.len(), 32);
            assert!(row.iter().all(|&t| t < 1000));
            assert!(a[..i].iter().all(|other| other != row), "row {i} repeats");
        }
    }

    #[test]
    fn ragged_prompts_spread_evenly_from_the_shortest_to_the_longest() {
        let lengths: PromptLengths = "10-17".parse().unwrap();
        assert_eq!(lengths.to_string(), "10-17");
        let rows = prompts(8, lengths, 1000);
        let lens: Vec<usize> = rows.iter().map(Vec::len).collect();
        assert_eq!(lens, [10, 11, 12, 13, 14, 15, 16, 17]);
        // Every residue modulo a block of 4: the sequences' block boundaries are out of step.
        assert_eq!(lens.iter().map(|l| l % 4).collect::<BTreeSet<_>>().len(), 4);
        assert_eq!(prompts(1, lengths, 1000)[0].len(), 10);
        assert_eq!(
            "512".parse::<PromptLengths>(),
            Ok(PromptLengths::equal(512))
        );
        assert_eq!(
            serde_json::to_value(PromptLengths::equal(512)).unwrap(),
            512
        );
        assert_eq!(serde_json::to_value(lengths).unwrap(), "10-17");
        for bad in ["17-10", "x", "1-", "-3"] {
            assert!(bad.parse::<PromptLengths>().is_err(), "{bad}");
        }
    }

    #[test]
    fn lock_step_summary_separates_the_storing_steps() {
        let times = StepTimes {
            first_ms: 9.0,
            later_ms: vec![1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0, 5.0, 0.5],
        };
        let summary = times.summary(4);
        assert_eq!(summary.later, 9);
        assert_eq!(summary.later_total_ms, 16.5);
        assert_eq!(summary.median_ms, 1.0);
        assert_eq!(summary.median_storing_ms, 5.0);
    }
}
