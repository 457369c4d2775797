//! Where the time of one cached decoding forward goes: [`Sdar::profile_block_forward`] runs
//! the real forward (the same code, through a [`Probe`]) with every stage timed on its own
//! between two device synchronizations, beside the same forward run as inference runs it.
//!
//! Next to each stage's time stand the tensors it creates (a measured count, see
//! [`ComponentProfile::tensors`]) and its byte floor: the weights it reads plus the KV cache
//! it reads or writes, at a given memory bandwidth. A stage far above its floor is bound by
//! per-op overhead (launches, allocations, copies), not by memory traffic.

use super::stage::{Probe, Stage};
use super::{DecoderLayer, KvCache, Sdar};
use anyhow::ensure;
use candle_core::{DType, Device, Tensor};
use serde::Serialize;
use std::time::Instant;

/// The shapes of the profiled forward: `tokens` new tokens per row over `cached_tokens`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct BlockForwardShape {
    /// Rows decoded at once.
    pub batch: usize,
    /// Committed positions of every row (a multiple of the block size).
    pub cached_tokens: usize,
    /// Positions each cache row can hold (at least `cached_tokens` + `tokens`).
    pub capacity: usize,
    /// New tokens per row, a multiple of the block size: one block when decoding, a prompt's
    /// whole blocks when prefilling.
    pub tokens: usize,
}

#[derive(Debug, Clone, Copy)]
pub struct ProfileSettings {
    /// Untimed forwards before the timing.
    pub warm_up: usize,
    /// Timed forwards (each way); times are their means.
    pub repetitions: usize,
    /// Memory bandwidth of the byte floors, in bytes per second.
    pub bytes_per_s: f64,
}

/// Result of [`Sdar::profile_block_forward`].
#[derive(Debug, Clone, Serialize)]
pub struct ForwardProfile {
    #[serde(flatten)]
    pub shape: BlockForwardShape,
    pub warm_up: usize,
    pub repetitions: usize,
    pub bytes_per_s: f64,
    /// Mean ms of the forward as inference runs it: synchronized once, at the end.
    pub forward_ms: f64,
    /// Tensors that forward creates (see [`ComponentProfile::tensors`]).
    pub forward_tensors: Option<u64>,
    /// Mean ms of a timed stage that runs no op: what every stage run adds to the stages' sum
    /// for its synchronizations alone.
    pub empty_stage_ms: f64,
    /// Every [`Stage`], in the order of [`Stage::ALL`].
    pub components: Vec<ComponentProfile>,
}

impl ForwardProfile {
    /// Sum of the components' times: the instrumented forward, which exceeds
    /// [`ForwardProfile::forward_ms`] by what the synchronizations keep from overlapping.
    pub fn components_ms(&self) -> f64 {
        self.components.iter().map(|c| c.ms).sum()
    }
}

/// One stage of [`ForwardProfile`].
#[derive(Debug, Clone, Serialize)]
pub struct ComponentProfile {
    pub stage: Stage,
    pub name: &'static str,
    /// Times the stage runs per forward (over all layers).
    pub runs: u64,
    /// Mean ms per forward, summed over the decoder layers for a stage inside them.
    pub ms: f64,
    /// Mean ms in each decoder layer; empty for a stage outside the layers.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub per_layer_ms: Vec<f64>,
    /// Tensors the stage creates per forward (over all layers): one per candle op, views
    /// (reshape, transpose, narrow) included; ops that write in place (the KV-cache write)
    /// create none. Read from candle's process-wide tensor counter, so tensors other threads
    /// create meanwhile count too. `None` when candle does not show the counter.
    pub tensors: Option<u64>,
    /// Weight bytes the stage reads, plus the KV-cache bytes it reads (attention) or writes
    /// (cache write); the embedding reads only the rows of the tokens.
    pub floor_bytes: u64,
    /// `floor_bytes` at the profile's bandwidth.
    pub floor_ms: f64,
}

/// The id candle gives the next tensor it creates: candle numbers tensors from one counter and
/// shows the number only in `TensorId`'s Debug form, `TensorId(42)`. Reading it creates one
/// tensor. `None` if that form ever changes.
fn tensor_counter() -> Option<u64> {
    let marker = Tensor::zeros((), DType::U8, &Device::Cpu).ok()?;
    format!("{:?}", marker.id())
        .strip_prefix("TensorId(")?
        .strip_suffix(')')?
        .parse()
        .ok()
}

/// Tensors created between two [`tensor_counter`] readings, the later reading's own excluded.
fn created_between(first: Option<u64>, last: Option<u64>) -> Option<u64> {
    last?.checked_sub(first?)?.checked_sub(1)
}

fn add_counts(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    Some(a? + b?)
}

/// A [`Probe`] that synchronizes the device before and after every stage and adds up each
/// stage's wall time (per layer) and created tensors.
struct StageTimer<'d> {
    device: &'d Device,
    layer: usize,
    /// Per stage of [`Stage::ALL`]: seconds in each layer (one entry outside the layers).
    seconds: Vec<Vec<f64>>,
    runs: Vec<u64>,
    tensors: Vec<Option<u64>>,
}

impl<'d> StageTimer<'d> {
    fn new(device: &'d Device, layers: usize) -> Self {
        Self {
            device,
            layer: 0,
            seconds: Stage::ALL
                .iter()
                .map(|s| vec![0.0; if s.in_layer() { layers } else { 1 }])
                .collect(),
            runs: vec![0; Stage::ALL.len()],
            tensors: vec![Some(0); Stage::ALL.len()],
        }
    }
}

fn stage_index(stage: Stage) -> usize {
    Stage::ALL
        .iter()
        .position(|&s| s == stage)
        .expect("Stage::ALL lists every stage")
}

impl Probe for StageTimer<'_> {
    fn enter_layer(&mut self, layer: usize) {
        self.layer = layer;
    }

    fn stage<T, E: From<candle_core::Error>>(
        &mut self,
        stage: Stage,
        ops: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        self.device.synchronize()?;
        let first = tensor_counter();
        let start = Instant::now();
        let out = ops()?;
        self.device.synchronize()?;
        let seconds = start.elapsed().as_secs_f64();
        let created = created_between(first, tensor_counter());
        let i = stage_index(stage);
        let slot = if stage.in_layer() { self.layer } else { 0 };
        self.seconds[i][slot] += seconds;
        self.runs[i] += 1;
        self.tensors[i] = add_counts(self.tensors[i], created);
        Ok(out)
    }
}

/// Stage-less synchronization pairs timed for [`ForwardProfile::empty_stage_ms`].
const EMPTY_STAGES: usize = 100;

fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

impl Sdar {
    /// Profiles one cached forward ([`Sdar::forward`]: hidden states and logits of every
    /// position) of `tokens` mask tokens per row (a decoding block, or a prefill) over caches
    /// holding `cached_tokens` positions, read-only so that every repetition sees the same
    /// cache. After `settings.warm_up` forwards, `settings.repetitions` forwards as inference
    /// runs them, then as many with every [`Stage`] timed on its own.
    ///
    /// The cache holds zeros at those lengths instead of a prefilled prompt: the work of a
    /// forward depends on its shapes, not on the values.
    pub fn profile_block_forward(
        &self,
        shape: BlockForwardShape,
        settings: ProfileSettings,
    ) -> anyhow::Result<ForwardProfile> {
        let cfg = &self.config;
        let (block, tokens) = (cfg.block_size, shape.tokens);
        ensure!(shape.batch > 0, "profile a batch of at least one row");
        ensure!(
            tokens > 0 && tokens.is_multiple_of(block),
            "{tokens} new tokens per row is not a positive multiple of the block size {block}"
        );
        ensure!(settings.repetitions > 0, "profile at least one repetition");
        ensure!(
            shape.cached_tokens.is_multiple_of(block),
            "{} cached tokens is not a multiple of the block size {block}",
            shape.cached_tokens
        );
        ensure!(
            shape.capacity >= shape.cached_tokens + tokens,
            "a cache of {} positions cannot take {tokens} tokens after {} cached tokens",
            shape.capacity,
            shape.cached_tokens
        );
        let device = self.device();
        let mut cache = KvCache::new(cfg, shape.batch, shape.capacity, self.dtype(), device)?;
        cache.lens.fill(shape.cached_tokens);
        let ids = Tensor::full(cfg.mask_token_id, (shape.batch, tokens), device)?;
        let read_only = vec![0; shape.batch];

        for _ in 0..settings.warm_up {
            self.forward(&ids, &mut cache, &read_only)?;
        }
        let (mut forward_s, mut forward_tensors) = (0.0, Some(0));
        for _ in 0..settings.repetitions {
            device.synchronize()?;
            let first = tensor_counter();
            let start = Instant::now();
            self.forward(&ids, &mut cache, &read_only)?;
            device.synchronize()?;
            forward_s += start.elapsed().as_secs_f64();
            forward_tensors = add_counts(forward_tensors, created_between(first, tensor_counter()));
        }
        let mut timer = StageTimer::new(device, self.layers.len());
        for _ in 0..settings.repetitions {
            self.probed_forward(&ids, &mut cache, &read_only, &mut timer)?;
        }
        let mut empty_s = 0.0;
        for _ in 0..EMPTY_STAGES {
            device.synchronize()?;
            let start = Instant::now();
            device.synchronize()?;
            empty_s += start.elapsed().as_secs_f64();
        }

        let reps = settings.repetitions;
        let per_forward = |n: Option<u64>| n.map(|n| n / reps as u64);
        let components = Stage::ALL
            .iter()
            .zip(timer.seconds.iter().zip(&timer.tensors).zip(&timer.runs))
            .map(|(&stage, ((seconds, &tensors), &runs))| {
                let per_layer_ms: Vec<f64> =
                    seconds.iter().map(|s| s * 1e3 / reps as f64).collect();
                let floor_bytes = self.floor_bytes(stage, &shape);
                ComponentProfile {
                    stage,
                    name: stage.name(),
                    runs: runs / reps as u64,
                    ms: per_layer_ms.iter().sum(),
                    per_layer_ms: if stage.in_layer() {
                        per_layer_ms
                    } else {
                        Vec::new()
                    },
                    tensors: per_forward(tensors),
                    floor_bytes,
                    floor_ms: floor_bytes as f64 / settings.bytes_per_s * 1e3,
                }
            })
            // The candle forward and the fused one run different stages.
            .filter(|c| c.runs > 0)
            .collect();
        Ok(ForwardProfile {
            shape,
            warm_up: settings.warm_up,
            repetitions: reps,
            bytes_per_s: settings.bytes_per_s,
            forward_ms: forward_s * 1e3 / reps as f64,
            forward_tensors: per_forward(forward_tensors),
            empty_stage_ms: empty_s * 1e3 / EMPTY_STAGES as f64,
            components,
        })
    }

    /// Bytes `stage` must move per forward at `shape`: see [`ComponentProfile::floor_bytes`].
    fn floor_bytes(&self, stage: Stage, shape: &BlockForwardShape) -> u64 {
        let cfg = &self.config;
        let layer_weights = |pick: fn(&DecoderLayer) -> Vec<&Tensor>| -> u64 {
            self.layers.iter().flat_map(pick).map(tensor_bytes).sum()
        };
        let dtype_bytes = self.dtype().size_in_bytes() as u64;
        // K and V of one position of every row, over all layers.
        let kv_position = 2
            * (self.layers.len() * shape.batch * cfg.num_key_value_heads * cfg.head_dim) as u64
            * dtype_bytes;
        let tokens = shape.tokens as u64;
        match stage {
            Stage::Setup
            | Stage::HeadTranspose
            | Stage::Rotary
            | Stage::Residual
            | Stage::SiluMul => 0,
            Stage::Embedding => shape.batch as u64 * tokens * cfg.hidden_size as u64 * dtype_bytes,
            Stage::InputNorm => layer_weights(|l| vec![&l.input_layernorm]),
            Stage::QkvProjection => layer_weights(|l| vec![&l.q_proj, &l.k_proj, &l.v_proj]),
            Stage::QkNorm => layer_weights(|l| vec![&l.q_norm, &l.k_norm]),
            Stage::KvCacheWrite => kv_position * tokens,
            Stage::QkNormRotaryCacheWrite => {
                layer_weights(|l| vec![&l.q_norm, &l.k_norm]) + kv_position * tokens
            }
            Stage::Attention => kv_position * (shape.cached_tokens as u64 + tokens),
            Stage::OProjection => layer_weights(|l| vec![&l.o_proj]),
            Stage::PostAttentionNorm => layer_weights(|l| vec![&l.post_attention_layernorm]),
            Stage::GateUpProjection => layer_weights(|l| vec![&l.gate_proj, &l.up_proj]),
            Stage::DownProjection => layer_weights(|l| vec![&l.down_proj]),
            Stage::ResidualNorm => {
                layer_weights(|l| vec![&l.input_layernorm, &l.post_attention_layernorm])
                    + tensor_bytes(&self.norm)
            }
            Stage::FinalNorm => tensor_bytes(&self.norm),
            Stage::LmHead => tensor_bytes(&self.lm_head),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SdarConfig;

    fn tiny_random() -> Sdar {
        let config: SdarConfig = serde_json::from_value(serde_json::json!({
            "model_type": "sdar", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
            "rope_theta": 1e4, "block_size": 4, "mask_token_id": 63
        }))
        .unwrap();
        Sdar::random(&config, DType::F32, &Device::Cpu).unwrap()
    }

    /// The probe only observes: the timed forward computes exactly what the plain one does,
    /// on rows of equal lengths (one mask-free write) and of different lengths (scatter, mask).
    #[test]
    fn the_timed_forward_gives_the_plain_forward_bit_for_bit() {
        let model = tiny_random();
        for lens in [[8, 8], [8, 4]] {
            let mut cache = KvCache::new(model.config(), 2, 16, DType::F32, &Device::Cpu).unwrap();
            cache.lens.copy_from_slice(&lens);
            let ids = Tensor::new(&[[1u32, 2, 3, 4], [5, 6, 7, 8]], &Device::Cpu).unwrap();
            let plain = model.forward(&ids, &mut cache, &[0, 0]).unwrap();
            let mut timer = StageTimer::new(&Device::Cpu, 2);
            let timed = model
                .probed_forward(&ids, &mut cache, &[0, 0], &mut timer)
                .unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                let values = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                values.iter().map(|v| v.to_bits()).collect()
            };
            assert_eq!(bits(&plain), bits(&timed), "lens {lens:?}");
            assert!(timer.seconds.iter().flatten().any(|&s| s > 0.0));
        }
    }

    #[test]
    fn floors_add_up_to_the_weights_read_and_the_kv_cache() {
        let model = tiny_random();
        let shape = BlockForwardShape {
            batch: 3,
            cached_tokens: 8,
            capacity: 16,
            tokens: 4,
        };
        let floor = |stages: &[Stage]| -> u64 {
            stages.iter().map(|&s| model.floor_bytes(s, &shape)).sum()
        };
        // The fused forward's stages move what the candle stages they replace move.
        let fused = [Stage::QkNormRotaryCacheWrite, Stage::ResidualNorm];
        assert_eq!(
            floor(&fused[..1]),
            floor(&[Stage::QkNorm, Stage::Rotary, Stage::KvCacheWrite])
        );
        assert_eq!(
            floor(&fused[1..]),
            floor(&[Stage::InputNorm, Stage::PostAttentionNorm, Stage::FinalNorm])
        );
        let candle_path: Vec<Stage> = Stage::ALL
            .into_iter()
            .filter(|s| !fused.contains(s))
            .collect();
        let total = floor(&candle_path);
        let cfg = model.config();
        let embedding = model.embed_tokens.elem_count() as u64 * 4;
        let rows_read = 3 * 4 * cfg.hidden_size as u64 * 4;
        let weights = model.num_parameters() as u64 * 4 - embedding + rows_read;
        let kv_read_and_written = 2 * 2 * 3 * 2 * 8 * (8 + 4 + 4) * 4;
        assert_eq!(total, weights + kv_read_and_written);
    }
}
