//! SDAR / DICE block-diffusion decoder (Qwen3 architecture), spec §1-§3.
//!
//! The model is stateless: weights only. KV caches belong to the caller and are passed into
//! every cached forward.
//!
//! # Inference API and KV-cache layout
//!
//! [`KvCache`] holds, per layer, keys and values of shape `[B, kv_heads, capacity, head_dim]`
//! and one committed length per row. Row i's valid K/V occupy slots `0..lens[i]` (rows are
//! left-aligned; lengths may differ per row, which is what continuous batching needs). Every
//! length is a multiple of the block size.
//!
//! [`Sdar::forward`] runs `T` new tokens per row (`T` a multiple of the block size):
//! - the new token t of row i has position `lens[i] + t` (positions are implied by the cache);
//! - it attends the cached prefix of its row plus the new tokens of its own and earlier
//!   blocks (block-causal prefill, spec §3.2; with `T` = one block this is the all-ones
//!   decoding mask of §3.3);
//! - the new K/V are written into slots `lens[i]..lens[i]+T` of every row, and `commit[i]`
//!   (0 or a multiple of the block size, at most `T`) of them become part of row i:
//!   `lens[i] += commit[i]`. With `commit[i] == 0` (`store_kv=False`) the visible content of
//!   the row is unchanged: the slots past `lens[i]` are scratch space, overwritten by the next
//!   forward. This is JetEngine's write-then-advance scheme (spec §3.3) and needs
//!   `lens[i] + T <= capacity` even for read-only rows.
//! - Rows with unequal lengths get one additive key mask `[B, 1, 1, T, S]` (S = max(lens) + T);
//!   equal lengths share one `[T, S]` mask; a single block on equal lengths (every step at
//!   batch size 1) uses no mask at all, and writes with one `slice_set` per layer instead of a
//!   scatter, so B = 1 pays nothing for the batching support.
//! - A row that is not needed in a step can be given any tokens and `commit = 0`.
//!
//! Batched prefill of prompts of different lengths: right-pad the ids to a common `T` and pass
//! each row's whole-block length as `commit[i]`; the padded tokens are never visible to the
//! real tokens (block-causal), and their outputs are to be ignored.
//!
//! Rows are managed with [`KvCache::select_rows`] (drop finished sequences),
//! [`KvCache::copy_row_from`] (put a freshly prefilled sequence into a free row) and
//! [`KvCache::truncate_row`].
//!
//! Attention never expands K/V for GQA (query heads are grouped onto their KV head by a
//! reshape) and masks are broadcast over heads. Scores are computed in the activation dtype,
//! softmax in f32.
//!
//! On CUDA, cached forwards (decoding and prefill alike) run the fused forward instead
//! (`sdar/fused.rs`: dice's own kernels for q/k norms + rotary + cache write, block attention
//! over the cache, residual add + RMSNorm and SiLU × up, with the same roundings as candle's ops;
//! `DICE_FUSED_ATTENTION=0` turns it off), and [`DecodeGraph`] captures it in a CUDA graph for
//! replay at every decoding step (`DICE_CUDA_GRAPHS=0` turns graphs off).
//!
//! # Training API
//!
//! The two-stream SFT forward and loss of spec §3.1 / §6.3-§6.4 live in [`training`]:
//! [`Sdar::two_stream_hidden`] + [`Sdar::sft_loss`] build one autograd graph over the whole
//! model (with weights from [`Sdar::load_trainable`], `loss.backward()` yields every gradient;
//! memory grows with layers x positions), and [`Sdar::sft_loss_and_grads`] computes the same
//! loss and gradients with layer-wise activation checkpointing and query-chunked attention
//! (memory of one layer and one chunk at a time, see its docs). A [`MaskedSequence`] (tokens,
//! positions and an explicit attention mask: a TraceRL replay sample) gets the same
//! machinery: [`Sdar::masked_log_probs`] without autograd, [`Sdar::masked_loss_and_grads`] for
//! any loss of its label log-probabilities.
//!
//! # Profiling
//!
//! The cached forward runs each of its [`Stage`]s through a probe: inference and training run
//! them as they are, [`Sdar::profile_block_forward`] runs the same code timing each stage
//! between device synchronizations (where a decoding forward's time goes, for benchmarks).
//!
//! # Numerics (HF reference, spec §2)
//! RMSNorm: f32 normalisation times the f32 weight, rounded once to the activation dtype (the
//! fused candle kernel does exactly that on CUDA; CPU half types use the composite form).
//! RoPE: cos/sin in f32 cast to the activation dtype, products in that dtype. qk-norm before
//! RoPE. SiLU in f32, rounded once, times `up` in the activation dtype. No logit shift: the
//! logit row of position i predicts the token at position i.

use crate::checkpoint;
use crate::config::SdarConfig;
use crate::masks;
use anyhow::{bail, ensure, Context};
use candle_core::{DType, Device, Result, Shape, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use std::path::Path;

#[cfg(feature = "cuda")]
mod fused;
#[cfg(feature = "cuda")]
mod graph;
mod profile;
mod stage;
mod step_profile;
pub mod training;

#[cfg(feature = "cuda")]
pub use graph::DecodeGraph;
pub use profile::{BlockForwardShape, ComponentProfile, ForwardProfile, ProfileSettings};
pub use stage::Stage;
use stage::{Probe, Unprobed};
pub use step_profile::{
    PhaseOverlap, PhaseTime, StepOverlap, StepPhase, StepProfile, STARVED_LEAD_SECONDS,
};
pub use training::{LossGradients, MaskedSequence};

/// Which implementation of the fused operations a forward uses. Inference takes candle's fused
/// kernels (no backward); training takes composite ops that autograd can differentiate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernels {
    Fused,
    Differentiable,
}

fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64, kernels: Kernels) -> Result<Tensor> {
    let fused_is_exact = x.device().is_cuda() || x.dtype() == DType::F32;
    if kernels == Kernels::Fused && fused_is_exact {
        return candle_nn::ops::rms_norm(x, weight, eps as f32);
    }
    let x32 = x.to_dtype(DType::F32)?;
    let rstd = (x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    x32.broadcast_mul(&rstd)?
        .broadcast_mul(&weight.to_dtype(DType::F32)?)?
        .to_dtype(x.dtype())
}

fn linear(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let mut out_dims = x.dims().to_vec();
    let last = out_dims.len() - 1;
    out_dims[last] = weight.dim(0)?;
    x.flatten_to(last - 1)?
        .matmul(&weight.t()?)?
        .reshape(out_dims)
}

fn silu_in_f32(x: &Tensor) -> Result<Tensor> {
    x.to_dtype(DType::F32)?.silu()?.to_dtype(x.dtype())
}

fn softmax_last_dim(x: &Tensor, kernels: Kernels) -> Result<Tensor> {
    match kernels {
        Kernels::Fused => candle_nn::ops::softmax_last_dim(x),
        Kernels::Differentiable => candle_nn::ops::softmax(x, D::Minus1),
    }
}

/// Rotary tables for one forward: cos and sin of shape `[T, head_dim/2]` (positions shared by
/// all rows) or `[B, T, head_dim/2]`, already in the activation dtype.
struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    /// `positions`: u32 tensor `[T]` or `[B, T]`.
    fn new(inv_freq: &Tensor, positions: &Tensor, dtype: DType) -> Result<Self> {
        let angles = positions
            .to_dtype(DType::F32)?
            .unsqueeze(D::Minus1)?
            .broadcast_mul(inv_freq)?;
        Ok(Self {
            cos: angles.cos()?.to_dtype(dtype)?,
            sin: angles.sin()?.to_dtype(dtype)?,
        })
    }

    /// Rotate-half RoPE on `x` of shape `[B, heads, T, head_dim]`.
    fn apply(&self, x: &Tensor, kernels: Kernels) -> Result<Tensor> {
        if kernels == Kernels::Fused {
            return candle_nn::rotary_emb::rope(&x.contiguous()?, &self.cos, &self.sin);
        }
        let full = |t: &Tensor| -> Result<Tensor> {
            let t = Tensor::cat(&[t, t], D::Minus1)?;
            match t.rank() {
                2 => t.unsqueeze(0)?.unsqueeze(0),
                _ => t.unsqueeze(1),
            }
        };
        let half = x.dim(D::Minus1)? / 2;
        let rotated = Tensor::cat(
            &[
                &x.narrow(D::Minus1, half, half)?.neg()?,
                &x.narrow(D::Minus1, 0, half)?,
            ],
            D::Minus1,
        )?;
        x.broadcast_mul(&full(&self.cos)?)? + rotated.broadcast_mul(&full(&self.sin)?)?
    }
}

/// Softmax attention with GQA by grouping: `q [B, Hq, T, Dh]`, `k`/`v` `[B, Hkv, S, Dh]`,
/// `mask` additive f32 broadcastable to `[B, Hkv, Hq/Hkv, T, S]`. Returns `[B, T, Hq*Dh]`.
fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    kernels: Kernels,
) -> Result<Tensor> {
    let (b, hq, t, dh) = q.dims4()?;
    let (hkv, s) = (k.dim(1)?, k.dim(2)?);
    let groups = hq / hkv;
    let q = q.contiguous()?.reshape((b, hkv, groups * t, dh))?;
    let scores = (q.matmul(&k.t()?)?.to_dtype(DType::F32)? * (1.0 / (dh as f64).sqrt()))?;
    let scores = match mask {
        Some(mask) => scores
            .reshape((b, hkv, groups, t, s))?
            .broadcast_add(mask)?
            .reshape((b, hkv, groups * t, s))?,
        None => scores,
    };
    let probs = softmax_last_dim(&scores, kernels)?.to_dtype(v.dtype())?;
    probs
        .matmul(v)?
        .reshape((b, hq, t, dh))?
        .transpose(1, 2)?
        .reshape((b, t, hq * dh))
}

/// Query rows per attention call in inference, and the default chunk of the checkpointed
/// training step ([`Sdar::sft_loss_and_grads`]): bounds the f32 score tensor of a long sequence
/// to `[B, Hkv, groups * QUERY_CHUNK, S]`.
pub const QUERY_CHUNK: usize = 1024;

/// Bytes one f32 score tensor of an inference attention chunk may take. A softmax keeps a few
/// such tensors alive at once, so this bounds the transient memory of a long prefill (at batch 1
/// that is what separates the peak from weights + KV cache).
const INFERENCE_SCORE_BYTES: usize = 128 << 20;

/// Query rows per inference attention chunk: the most (up to [`QUERY_CHUNK`], at least 16) whose
/// f32 scores over `keys` keys for `batch_heads` batch rows × heads fit [`INFERENCE_SCORE_BYTES`].
fn inference_query_rows(batch_heads: usize, keys: usize) -> usize {
    (INFERENCE_SCORE_BYTES / (batch_heads * keys * 4).max(1)).clamp(16, QUERY_CHUNK)
}

/// `(start, len)` of consecutive chunks of at most `rows` (> 0) of `0..total`.
fn row_chunks(total: usize, rows: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..total)
        .step_by(rows)
        .map(move |start| (start, rows.min(total - start)))
}

/// [`attention`] of the query rows `start..start + len` only; `mask` has the query axis at dim 3.
fn attention_rows(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    (start, len): (usize, usize),
    kernels: Kernels,
) -> Result<Tensor> {
    let mask = mask.map(|m| m.narrow(3, start, len)).transpose()?;
    attention(&q.narrow(2, start, len)?, k, v, mask.as_ref(), kernels)
}

/// [`attention`] over consecutive chunks of `rows` queries. Without autograd each chunk's
/// intermediates are freed before the next chunk runs; under autograd the graph keeps them all.
fn chunked_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    rows: usize,
    kernels: Kernels,
) -> Result<Tensor> {
    let t = q.dim(2)?;
    if t <= rows {
        return attention(q, k, v, mask, kernels);
    }
    let outputs = row_chunks(t, rows)
        .map(|chunk| attention_rows(q, k, v, mask, chunk, kernels))
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&outputs, 1)
}

/// A layer's q/k/v weights and its gate/up weights, each group stacked into one matrix, so that
/// the fused decoding forward runs one matmul per group (at batch 1 fewer, larger matrix-vector
/// products). The layer's own q/k/v/gate/up weights are then views into these.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct ConcatenatedProjections {
    qkv: Tensor,
    gate_up: Tensor,
}

struct DecoderLayer {
    input_layernorm: Tensor,
    q_proj: Tensor,
    k_proj: Tensor,
    v_proj: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    o_proj: Tensor,
    post_attention_layernorm: Tensor,
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
    /// Set by [`Sdar::concatenate_projections`].
    concatenated: Option<ConcatenatedProjections>,
}

impl DecoderLayer {
    /// Checkpoint names of the layer's tensors relative to `model.layers.{l}.`, in the order of
    /// [`DecoderLayer::tensors`].
    const NAMES: [&'static str; 11] = [
        "input_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "self_attn.o_proj.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ];

    fn new(cfg: &SdarConfig, vb: VarBuilder) -> Result<Self> {
        let (h, i, q, kv) = (
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.q_dim(),
            cfg.kv_dim(),
        );
        let shapes: [Shape; 11] = [
            h.into(),
            (q, h).into(),
            (kv, h).into(),
            (kv, h).into(),
            cfg.head_dim.into(),
            cfg.head_dim.into(),
            (h, q).into(),
            h.into(),
            (i, h).into(),
            (i, h).into(),
            (h, i).into(),
        ];
        let tensors = Self::NAMES
            .iter()
            .zip(shapes)
            .map(|(name, shape)| vb.get(shape, name))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::from_tensors(tensors))
    }

    /// The layer from its tensors in the order of [`DecoderLayer::NAMES`].
    fn from_tensors(tensors: Vec<Tensor>) -> Self {
        let mut tensors = tensors.into_iter();
        // Struct fields are evaluated in the order written, which is the order of NAMES.
        let mut next = || {
            tensors
                .next()
                .expect("a decoder layer is built from exactly its 11 tensors")
        };
        Self {
            input_layernorm: next(),
            q_proj: next(),
            k_proj: next(),
            v_proj: next(),
            q_norm: next(),
            k_norm: next(),
            o_proj: next(),
            post_attention_layernorm: next(),
            gate_proj: next(),
            up_proj: next(),
            down_proj: next(),
            concatenated: None,
        }
    }

    /// Stacks q/k/v and gate/up into [`ConcatenatedProjections`] and makes the separate weights
    /// views into them (no memory is kept twice).
    fn concatenate_projections(&mut self) -> Result<()> {
        let qkv = Tensor::cat(&[&self.q_proj, &self.k_proj, &self.v_proj], 0)?;
        let (q, kv) = (self.q_proj.dim(0)?, self.k_proj.dim(0)?);
        self.q_proj = qkv.narrow(0, 0, q)?;
        self.k_proj = qkv.narrow(0, q, kv)?;
        self.v_proj = qkv.narrow(0, q + kv, kv)?;
        let gate_up = Tensor::cat(&[&self.gate_proj, &self.up_proj], 0)?;
        let i = self.gate_proj.dim(0)?;
        self.gate_proj = gate_up.narrow(0, 0, i)?;
        self.up_proj = gate_up.narrow(0, i, i)?;
        self.concatenated = Some(ConcatenatedProjections { qkv, gate_up });
        Ok(())
    }

    /// The same layer with every tensor replaced by `f(tensor)`: detached views for a forward
    /// without autograd, `Var`s for a recomputation with it.
    fn map(&self, f: impl FnMut(&Tensor) -> Result<Tensor>) -> Result<Self> {
        let tensors = self.tensors().into_iter().map(f).collect::<Result<_>>()?;
        Ok(Self::from_tensors(tensors))
    }

    fn tensors(&self) -> [&Tensor; 11] {
        [
            &self.input_layernorm,
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.q_norm,
            &self.k_norm,
            &self.o_proj,
            &self.post_attention_layernorm,
            &self.gate_proj,
            &self.up_proj,
            &self.down_proj,
        ]
    }

    /// Pre-norm, projections, qk-norm and RoPE: q `[B, Hq, T, Dh]`, k and v `[B, Hkv, T, Dh]`.
    fn qkv(
        &self,
        cfg: &SdarConfig,
        h: &Tensor,
        rope: &Rope,
        kernels: Kernels,
        probe: &mut impl Probe,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = h.dims3()?;
        let eps = cfg.rms_norm_eps;
        let x = probe.stage(Stage::InputNorm, || {
            rms_norm(h, &self.input_layernorm, eps, kernels)
        })?;
        let mut heads = |w: &Tensor, n: usize, norm: Option<&Tensor>| -> Result<Tensor> {
            let y = probe.stage(Stage::QkvProjection, || {
                linear(&x, w)?.reshape((b, t, n, cfg.head_dim))
            })?;
            let y = match norm {
                Some(norm) => probe.stage(Stage::QkNorm, || rms_norm(&y, norm, eps, kernels))?,
                None => y,
            };
            probe.stage(Stage::HeadTranspose, || y.transpose(1, 2)?.contiguous())
        };
        let q = heads(&self.q_proj, cfg.num_attention_heads, Some(&self.q_norm))?;
        let k = heads(&self.k_proj, cfg.num_key_value_heads, Some(&self.k_norm))?;
        let v = heads(&self.v_proj, cfg.num_key_value_heads, None)?;
        let q = probe.stage(Stage::Rotary, || rope.apply(&q, kernels))?;
        let k = probe.stage(Stage::Rotary, || rope.apply(&k, kernels))?;
        Ok((q, k, v))
    }

    /// Output projection, residual, and the SwiGLU block with its residual.
    fn finish(
        &self,
        cfg: &SdarConfig,
        residual: &Tensor,
        attn: &Tensor,
        kernels: Kernels,
        probe: &mut impl Probe,
    ) -> Result<Tensor> {
        let o = probe.stage(Stage::OProjection, || linear(attn, &self.o_proj))?;
        let h = probe.stage(Stage::Residual, || residual + o)?;
        let x = probe.stage(Stage::PostAttentionNorm, || {
            rms_norm(
                &h,
                &self.post_attention_layernorm,
                cfg.rms_norm_eps,
                kernels,
            )
        })?;
        let gate = probe.stage(Stage::GateUpProjection, || linear(&x, &self.gate_proj))?;
        let gate = probe.stage(Stage::SiluMul, || silu_in_f32(&gate))?;
        let up = probe.stage(Stage::GateUpProjection, || linear(&x, &self.up_proj))?;
        let gated = probe.stage(Stage::SiluMul, || gate * up)?;
        let m = probe.stage(Stage::DownProjection, || linear(&gated, &self.down_proj))?;
        probe.stage(Stage::Residual, || h + m)
    }
}

/// Where the new K/V of a forward go in the cache.
enum SlotWrite {
    /// Every row writes at the same slot offset.
    Uniform(usize),
    /// Per-row offsets: u32 slot indices of shape `[B, Hkv, T, Dh]` for `scatter_set`.
    PerRow(Tensor),
}

/// Caller-owned KV cache of a batch of sequences; see the module docs for the layout.
#[derive(Clone)]
pub struct KvCache {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    lens: Vec<usize>,
    /// Which buffers the tensors are: clones share them (and the id), a new cache or a row
    /// selection gets new ones. A captured forward ([`DecodeGraph`]) writes into exactly one.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    buffers: u64,
}

/// A new [`KvCache::buffers`] id.
fn new_buffers_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl KvCache {
    /// An empty cache of `batch` rows, each able to hold `capacity` positions.
    pub fn new(
        cfg: &SdarConfig,
        batch: usize,
        capacity: usize,
        dtype: DType,
        device: &Device,
    ) -> anyhow::Result<Self> {
        let shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim);
        let alloc = || Tensor::zeros(shape, dtype, device);
        let keys = (0..cfg.num_hidden_layers)
            .map(|_| alloc())
            .collect::<Result<Vec<_>>>();
        let values = (0..cfg.num_hidden_layers)
            .map(|_| alloc())
            .collect::<Result<Vec<_>>>();
        let context =
            || format!("cannot allocate a KV cache of {batch} rows x {capacity} positions");
        Ok(Self {
            keys: keys.with_context(context)?,
            values: values.with_context(context)?,
            lens: vec![0; batch],
            buffers: new_buffers_id(),
        })
    }

    /// Device bytes of a cache [`KvCache::new`] would allocate: keys and values of every layer.
    pub fn bytes(cfg: &SdarConfig, batch: usize, capacity: usize, dtype: DType) -> usize {
        2 * cfg.num_hidden_layers * batch * capacity * cfg.kv_dim() * dtype.size_in_bytes()
    }

    pub fn batch_size(&self) -> usize {
        self.lens.len()
    }

    /// Committed (visible) positions of each row.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    pub fn capacity(&self) -> usize {
        self.keys.first().map_or(0, |k| k.dims()[2])
    }

    pub fn dtype(&self) -> DType {
        self.keys
            .first()
            .map_or(DType::F32, candle_core::Tensor::dtype)
    }

    /// Bytes held by the cache tensors.
    pub fn size_in_bytes(&self) -> usize {
        self.keys
            .iter()
            .chain(&self.values)
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    /// A new cache holding the given rows of this one, in that order.
    pub fn select_rows(&self, rows: &[usize]) -> anyhow::Result<Self> {
        for &r in rows {
            ensure!(
                r < self.batch_size(),
                "row {r} is out of range for a KV cache of {} rows",
                self.batch_size()
            );
        }
        let index = Tensor::new(
            rows.iter().map(|&r| r as u32).collect::<Vec<_>>(),
            self.device(),
        )?;
        let pick = |ts: &[Tensor]| -> Result<Vec<Tensor>> {
            ts.iter().map(|t| t.index_select(&index, 0)).collect()
        };
        Ok(Self {
            keys: pick(&self.keys)?,
            values: pick(&self.values)?,
            lens: rows.iter().map(|&r| self.lens[r]).collect(),
            buffers: new_buffers_id(),
        })
    }

    /// Overwrites row `row` with row `src_row` of `src` (same model, dtype and capacity), in
    /// place: how a sequence prefilled on its own joins a running batch.
    pub fn copy_row_from(
        &mut self,
        row: usize,
        src: &KvCache,
        src_row: usize,
    ) -> anyhow::Result<()> {
        ensure!(
            row < self.batch_size(),
            "row {row} is out of range for a KV cache of {} rows",
            self.batch_size()
        );
        ensure!(
            src_row < src.batch_size(),
            "source row {src_row} is out of range for a KV cache of {} rows",
            src.batch_size()
        );
        ensure!(
            src.capacity() == self.capacity() && src.keys.len() == self.keys.len(),
            "KV caches differ in capacity or layer count ({} vs {} positions)",
            src.capacity(),
            self.capacity()
        );
        for (dst, s) in self
            .keys
            .iter()
            .zip(&src.keys)
            .chain(self.values.iter().zip(&src.values))
        {
            dst.slice_set(&s.narrow(0, src_row, 1)?, 0, row)?;
        }
        self.lens[row] = src.lens[src_row];
        Ok(())
    }

    /// Forgets everything of row `row` past `len` (a multiple of the block size); `len = 0`
    /// frees the row for a new sequence.
    pub fn truncate_row(&mut self, row: usize, len: usize) -> anyhow::Result<()> {
        ensure!(
            row < self.batch_size(),
            "row {row} is out of range for a KV cache of {} rows",
            self.batch_size()
        );
        ensure!(
            len <= self.lens[row],
            "cannot truncate row {row} of length {} to {len}",
            self.lens[row]
        );
        self.lens[row] = len;
        Ok(())
    }

    /// The committed lengths as a u32 `[B]` tensor on the cache's device: what the fused
    /// decoding kernels read positions from.
    #[cfg(feature = "cuda")]
    fn device_lens(&self) -> Result<Tensor> {
        Tensor::from_vec(self.lens_u32(), self.batch_size(), self.device())
    }

    #[cfg(feature = "cuda")]
    fn lens_u32(&self) -> Vec<u32> {
        self.lens.iter().map(|&l| l as u32).collect()
    }

    /// Where the tensors live (the CPU for a cache of no layers).
    fn device(&self) -> &Device {
        self.keys.first().map_or(&Device::Cpu, |k| k.device())
    }

    /// Fails unless every row has room for `t` more slots (even read-only rows write them).
    fn check_room(&self, t: usize) -> anyhow::Result<()> {
        let cap = self.capacity();
        if let Some((row, len)) = self.lens.iter().enumerate().find(|(_, &l)| l + t > cap) {
            bail!("KV cache row {row} holds {len} positions; {t} more exceed its capacity {cap}: allocate a larger cache");
        }
        Ok(())
    }

    /// Makes `commit[i]` of the slots just written part of row i.
    fn advance(&mut self, commit: &[usize]) {
        for (len, c) in self.lens.iter_mut().zip(commit) {
            *len += c;
        }
    }

    /// Slot placement of `t` new tokens per row (that they fit is [`Sdar::check_forward`]'s
    /// to check).
    fn slot_write(&self, t: usize, kv_heads: usize, head_dim: usize) -> anyhow::Result<SlotWrite> {
        if self.lens.iter().all(|&l| l == self.lens[0]) {
            return Ok(SlotWrite::Uniform(self.lens[0]));
        }
        let mut index = Vec::with_capacity(self.lens.len() * kv_heads * t * head_dim);
        for &len in &self.lens {
            for _ in 0..kv_heads {
                for p in 0..t {
                    index.extend(std::iter::repeat_n((len + p) as u32, head_dim));
                }
            }
        }
        let shape = (self.lens.len(), kv_heads, t, head_dim);
        Ok(SlotWrite::PerRow(Tensor::from_vec(
            index,
            shape,
            self.keys[0].device(),
        )?))
    }
}

/// Whether two tensors are views of one buffer.
fn same_buffer(a: &Tensor, b: &Tensor) -> bool {
    let address = |t: &Tensor| std::ptr::from_ref(&*t.storage_and_layout().0) as usize;
    address(a) == address(b)
}

/// An SDAR causal-LM: embeddings, decoder layers, final norm and (untied) lm_head.
pub struct Sdar {
    config: SdarConfig,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: Tensor,
    lm_head: Tensor,
    inv_freq: Tensor,
}

impl Sdar {
    /// Builds the model from any `VarBuilder` whose tensors use the checkpoint key names.
    pub fn new(config: &SdarConfig, vb: VarBuilder) -> Result<Self> {
        let (v, h) = (config.vocab_size, config.hidden_size);
        let embed_tokens = vb.get((v, h), "model.embed_tokens.weight")?;
        let layers = (0..config.num_hidden_layers)
            .map(|l| DecoderLayer::new(config, vb.pp(format!("model.layers.{l}"))))
            .collect::<Result<Vec<_>>>()?;
        let norm = vb.get(h, "model.norm.weight")?;
        let lm_head = if config.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            vb.get((v, h), "lm_head.weight")?
        };
        let half = config.head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / (config.rope_theta as f32).powf(2.0 * i as f32 / config.head_dim as f32))
            .collect();
        let inv_freq = Tensor::from_vec(inv_freq, half, vb.device())?;
        Ok(Self {
            config: config.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq,
        })
    }

    /// Loads a checkpoint directory (`config.json` + single or sharded safetensors) in `dtype`
    /// on `device`, memory-mapped.
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> anyhow::Result<Self> {
        let config = SdarConfig::from_path(dir)?;
        let vb = checkpoint::mmaped_var_builder(dir, &config, dtype, device)?;
        Self::new(&config, vb)
            .with_context(|| format!("cannot build the model from {}", dir.display()))
    }

    /// Loads a checkpoint with every weight a trainable `Var` (keyed by checkpoint name in the
    /// returned `VarMap`, ready for a candle optimizer).
    pub fn load_trainable(
        dir: &Path,
        dtype: DType,
        device: &Device,
    ) -> anyhow::Result<(Self, VarMap)> {
        let config = SdarConfig::from_path(dir)?;
        let (varmap, vb) = checkpoint::trainable_var_builder(dir, &config, dtype, device)?;
        let model = Self::new(&config, vb)
            .with_context(|| format!("cannot build the model from {}", dir.display()))?;
        Ok((model, varmap))
    }

    /// Random weights (normal(0, initializer_range) matrices, unit norms) for a config, created on the
    /// device in `dtype`: for speed and memory benchmarks of the real model sizes.
    pub fn random(config: &SdarConfig, dtype: DType, device: &Device) -> anyhow::Result<Self> {
        config.validate()?;
        let vb = checkpoint::random_var_builder(config.initializer_range, dtype, device);
        Self::new(config, vb).context("cannot allocate random weights")
    }

    pub fn config(&self) -> &SdarConfig {
        &self.config
    }

    /// Stacks every layer's q/k/v weights into one matrix and its gate/up weights into another,
    /// the separate weights becoming views into them: the fused decoding forward on CUDA then
    /// runs one matmul per group. Every forward gives the same results as before; the weights
    /// take no more memory once done (each layer briefly holds both forms while it is stacked).
    /// For inference models only: trainable weights would no longer be the optimizer's `Var`s.
    pub fn concatenate_projections(&mut self) -> anyhow::Result<()> {
        for layer in &mut self.layers {
            layer
                .concatenate_projections()
                .context("cannot stack the q/k/v and gate/up weights")?;
        }
        Ok(())
    }

    /// Gives every weight `weights`' current values again, in place, so that a model built
    /// over a trainer's weights follows its updates: a weight that is `weights`' own tensor
    /// (a `VarMap`'s, which the optimizer sets in place) already holds them and is left alone;
    /// any other (a view into the stacks of [`Sdar::concatenate_projections`]) gets them copied
    /// into its buffer. No buffer is replaced, so a CUDA graph captured over the model
    /// ([`DecodeGraph`]) stays valid; the copies run on the device's stream, after the updates
    /// before them and before the forwards after them.
    pub fn refresh_weights(&self, weights: &VarBuilder) -> anyhow::Result<()> {
        let named = self.config.tensor_shapes();
        let held = self.weights();
        ensure!(
            named.len() == held.len(),
            "internal error: {} weights held for {} checkpoint tensors",
            held.len(),
            named.len()
        );
        for ((name, shape), weight) in named.into_iter().zip(held) {
            let source = weights
                .get(shape, &name)
                .with_context(|| format!("cannot read the weight {name} to refresh"))?;
            if !same_buffer(weight, &source) {
                weight
                    .slice_set(&source.to_dtype(weight.dtype())?, 0, 0)
                    .with_context(|| format!("cannot refresh the weight {name}"))?;
            }
        }
        Ok(())
    }

    /// The weights in the order of [`SdarConfig::tensor_shapes`] (a tied lm_head is the
    /// embedding, listed once).
    fn weights(&self) -> Vec<&Tensor> {
        let mut weights = vec![&self.embed_tokens];
        weights.extend(self.layers.iter().flat_map(DecoderLayer::tensors));
        weights.push(&self.norm);
        if !self.config.tie_word_embeddings {
            weights.push(&self.lm_head);
        }
        weights
    }

    pub fn dtype(&self) -> DType {
        self.embed_tokens.dtype()
    }

    pub fn device(&self) -> &Device {
        self.embed_tokens.device()
    }

    /// Number of parameters actually held (a tied lm_head counts once).
    pub fn num_parameters(&self) -> usize {
        let lm_head = if self.config.tie_word_embeddings {
            0
        } else {
            self.lm_head.elem_count()
        };
        self.embed_tokens.elem_count()
            + self.norm.elem_count()
            + lm_head
            + self
                .layers
                .iter()
                .flat_map(DecoderLayer::tensors)
                .map(candle_core::Tensor::elem_count)
                .sum::<usize>()
    }

    fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        let mut dims = input_ids.dims().to_vec();
        dims.push(self.config.hidden_size);
        self.embed_tokens
            .index_select(&input_ids.flatten_all()?, 0)?
            .reshape(dims)
    }

    /// Final norm: hidden states to the input of the lm_head.
    fn final_norm(&self, h: &Tensor, kernels: Kernels) -> Result<Tensor> {
        rms_norm(h, &self.norm, self.config.rms_norm_eps, kernels)
    }

    /// Logits (model dtype, not upcast) of final-normed hidden states `[..., H]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        linear(hidden, &self.lm_head)
    }

    /// The cached block forward of the module docs: `input_ids` u32 `[B, T]`, `T` a multiple of
    /// the block size; returns final-normed hidden states `[B, T, H]` (pass them, or the rows
    /// you need, to [`Sdar::logits`]). `commit[i]` new positions of row i become part of the
    /// cache (`0` = read-only, `T` = store all).
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        cache: &mut KvCache,
        commit: &[usize],
    ) -> anyhow::Result<Tensor> {
        self.probed_forward_hidden(input_ids, cache, commit, &mut Unprobed)
    }

    /// `(B, T)` of a cached forward's `input_ids`, after checking them, the cache and `commit`
    /// against each other and the model.
    fn check_forward(
        &self,
        input_ids: &Tensor,
        cache: &KvCache,
        commit: &[usize],
    ) -> anyhow::Result<(usize, usize)> {
        let (b, t) = input_ids
            .dims2()
            .context("input_ids must be a [batch, tokens] tensor")?;
        let bs = self.config.block_size;
        ensure!(
            t > 0 && t % bs == 0,
            "{t} tokens per row is not a positive multiple of the block size {bs}"
        );
        ensure!(
            cache.batch_size() == b && cache.keys.len() == self.layers.len(),
            "KV cache has {} rows and {} layers, the batch {b} rows and the model {} layers",
            cache.batch_size(),
            cache.keys.len(),
            self.layers.len()
        );
        ensure!(
            commit.len() == b,
            "commit has {} entries for {b} rows",
            commit.len()
        );
        for (row, &c) in commit.iter().enumerate() {
            ensure!(
                c <= t && c % bs == 0,
                "commit {c} of row {row} is not a multiple of {bs} in 0..={t}"
            );
        }
        cache.check_room(t)?;
        Ok((b, t))
    }

    /// [`Sdar::forward_hidden`] running each stage through `probe`.
    fn probed_forward_hidden(
        &self,
        input_ids: &Tensor,
        cache: &mut KvCache,
        commit: &[usize],
        probe: &mut impl Probe,
    ) -> anyhow::Result<Tensor> {
        let cfg = &self.config;
        let (b, t) = self.check_forward(input_ids, cache, commit)?;
        let bs = cfg.block_size;
        #[cfg(feature = "cuda")]
        if let Some(decode) = probe.stage(Stage::Setup, || {
            fused::FusedDecode::for_cache(self, cache, t)
        })? {
            let hidden = decode.forward_hidden(self, input_ids, cache, probe)?;
            cache.advance(commit);
            return Ok(hidden);
        }
        let device = self.device();
        let (write, rope, mask) = probe.stage(Stage::Setup, || -> anyhow::Result<_> {
            let write = cache.slot_write(t, cfg.num_key_value_heads, cfg.head_dim)?;
            let positions = match &write {
                SlotWrite::Uniform(len) => Tensor::arange(*len as u32, (len + t) as u32, device)?,
                SlotWrite::PerRow(_) => {
                    let pos: Vec<u32> = cache
                        .lens
                        .iter()
                        .flat_map(|&len| (len..len + t).map(|p| p as u32))
                        .collect();
                    Tensor::from_vec(pos, (b, t), device)?
                }
            };
            let rope = Rope::new(&self.inv_freq, &positions, self.dtype())?;
            let mask = masks::cached_block_mask(&cache.lens, t, bs, device)?;
            Ok((write, rope, mask))
        })?;
        let slots = cache.lens.iter().copied().max().unwrap_or(0) + t;
        let mut h = probe.stage(Stage::Embedding, || self.embed(input_ids))?;
        for (l, layer) in self.layers.iter().enumerate() {
            probe.enter_layer(l);
            let (q, k, v) = layer.qkv(cfg, &h, &rope, Kernels::Fused, probe)?;
            probe.stage(Stage::KvCacheWrite, || {
                for (store, new) in [(&cache.keys[l], &k), (&cache.values[l], &v)] {
                    match &write {
                        SlotWrite::Uniform(offset) => store.slice_set(new, 2, *offset)?,
                        SlotWrite::PerRow(index) => store.scatter_set(index, new, 2)?,
                    }
                }
                Result::Ok(())
            })?;
            let a = probe.stage(Stage::Attention, || {
                let keys = cache.keys[l].narrow(2, 0, slots)?;
                let values = cache.values[l].narrow(2, 0, slots)?;
                chunked_attention(
                    &q,
                    &keys,
                    &values,
                    mask.as_ref(),
                    inference_query_rows(b * cfg.num_attention_heads, slots),
                    Kernels::Fused,
                )
            })?;
            h = layer.finish(cfg, &h, &a, Kernels::Fused, probe)?;
        }
        cache.advance(commit);
        Ok(probe.stage(Stage::FinalNorm, || self.final_norm(&h, Kernels::Fused))?)
    }

    /// [`Sdar::forward_hidden`] followed by the lm_head on every position: logits `[B, T, V]`.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        cache: &mut KvCache,
        commit: &[usize],
    ) -> anyhow::Result<Tensor> {
        self.probed_forward(input_ids, cache, commit, &mut Unprobed)
    }

    /// [`Sdar::forward`] running each stage through `probe`.
    fn probed_forward(
        &self,
        input_ids: &Tensor,
        cache: &mut KvCache,
        commit: &[usize],
        probe: &mut impl Probe,
    ) -> anyhow::Result<Tensor> {
        let hidden = self.probed_forward_hidden(input_ids, cache, commit, probe)?;
        Ok(probe.stage(Stage::LmHead, || self.logits(&hidden))?)
    }

    /// Block-causal prefill (spec §3.2) of whole blocks into empty or partly filled rows,
    /// storing every token: logits `[B, T, V]`.
    pub fn prefill(&self, input_ids: &Tensor, cache: &mut KvCache) -> anyhow::Result<Tensor> {
        let t = input_ids.dim(D::Minus1)?;
        self.forward(input_ids, cache, &vec![t; cache.batch_size()])
    }

    /// One decoding forward of a block per row (spec §3.3) with per-row `store_kv`: logits
    /// `[B, block, V]`.
    pub fn block_forward(
        &self,
        input_ids: &Tensor,
        cache: &mut KvCache,
        store_kv: &[bool],
    ) -> anyhow::Result<Tensor> {
        let t = input_ids.dim(D::Minus1)?;
        let commit: Vec<usize> = store_kv.iter().map(|&s| if s { t } else { 0 }).collect();
        self.forward(input_ids, cache, &commit)
    }
}
