//! Training forwards: the two-stream SFT forward and loss (spec §3.1, §6.3-§6.4) as one autograd
//! graph, and the same loss and gradients with layer-wise activation checkpointing
//! ([`Sdar::sft_loss_and_grads`]); and the forward under an explicit attention mask that the
//! TraceRL replay needs ([`MaskedSequence`]: label log-probabilities, and any loss of them with
//! its gradients through the same checkpointed machinery).
//!
//! candle has no checkpointing and no way to seed `backward()` with an output gradient, so a
//! piece of the model is backpropagated on its own through the surrogate scalar
//! Σ ⟨output, upstream⟩ (detached upstream): its gradient with respect to the output is exactly
//! the upstream gradient, so `backward()` on it yields the vector-Jacobian product of the piece.
//! That composite path is the CPU's (and `DICE_FUSED_LAYER=0`'s); on CUDA (bf16, f16, and f32
//! through attention kernels without tensor cores) the checkpointed step runs the fused
//! attention and the hand-written layer and head of
//! [`fused_layer`] instead (no autograd but the loss closure's), keeping the forward activations
//! of as many layers as memory allows for an SFT step.

use super::stage::Unprobed;
use super::step_profile::{timed, PhaseTimer, StepOverlap, StepPhase, StepProfile};
use super::{
    attention_rows, chunked_attention, linear, rms_norm, row_chunks, DecoderLayer, Kernels, Rope,
    Sdar, QUERY_CHUNK,
};
use crate::masks::{self, KeySpans};
use crate::sft::TwoStreamBatch;
use anyhow::{ensure, Context};
use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var, D};
use fused_layer::LayerInput;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

mod fused_layer;
use crate::layer_ops::{accumulate, LayerOps};

/// Training always runs the composite ops autograd can differentiate.
const KERNELS: Kernels = Kernels::Differentiable;

/// A training loss and its gradients, from [`Sdar::sft_loss_and_grads`] and
/// [`Sdar::masked_loss_and_grads`].
#[derive(Debug, Clone)]
pub struct LossGradients {
    /// The loss.
    pub loss: f32,
    /// log π(label) of every scored row, in the order of the rows (f32): the selected noisy
    /// positions of an SFT batch, [`MaskedSequence::rows`] of a masked sequence.
    pub log_probs: Vec<f32>,
    /// d loss / d weight for every checkpoint tensor, keyed by its checkpoint name (the keys of
    /// [`crate::SdarConfig::tensor_shapes`] and of the `VarMap` of [`Sdar::load_trainable`]), in
    /// the dtype of that weight.
    pub grads: HashMap<String, Tensor>,
}

/// One token sequence under an explicit attention mask, with the rows whose label
/// log-probabilities a loss reads: the form of a TraceRL replay sample (spec bicrl §8.6, §9),
/// and of any training input whose visibility is not the two-stream SFT mask.
#[derive(Debug, Clone)]
pub struct MaskedSequence {
    /// Token ids, N of them.
    pub tokens: Vec<u32>,
    /// Rotary position of every token.
    pub positions: Vec<u32>,
    /// Additive f32 `[N, N]` mask on the model's device (0 = row may attend column, -inf = may
    /// not); every row must see at least one column. Needed unless `spans` are given and the
    /// model takes them ([`Sdar::trains_on_key_spans`]): an N² tensor a long sequence's caller
    /// need not build.
    pub mask: Option<Tensor>,
    /// The same visibility as key ranges ([`KeySpans::from_predicate`]), where every row's
    /// visible keys form at most two ranges: on CUDA (sm_80 and newer) attention then runs the
    /// fused kernels, and `mask` is not read.
    pub spans: Option<KeySpans>,
    /// Rows whose logits are scored, each against the label of the same index.
    pub rows: Vec<u32>,
    pub labels: Vec<u32>,
}

impl MaskedSequence {
    fn check(&self) -> anyhow::Result<()> {
        let n = self.tokens.len();
        ensure!(n > 0, "the masked sequence has no tokens");
        ensure!(
            self.positions.len() == n,
            "the masked sequence has {n} tokens but {} positions",
            self.positions.len()
        );
        ensure!(
            self.mask.is_some() || self.spans.is_some(),
            "the masked sequence has neither a mask nor key spans"
        );
        if let Some(mask) = &self.mask {
            ensure!(
                mask.dims() == [n, n] && mask.dtype() == DType::F32,
                "the mask of a {n}-token sequence must be an f32 [{n}, {n}] tensor, not {:?} {:?}",
                mask.dtype(),
                mask.dims()
            );
        }
        if let Some(spans) = &self.spans {
            ensure!(
                spans.tokens() == n,
                "the key spans of a {n}-token sequence cover {} queries",
                spans.tokens()
            );
        }
        ensure!(
            self.rows.len() == self.labels.len(),
            "the masked sequence scores {} rows with {} labels",
            self.rows.len(),
            self.labels.len()
        );
        ensure!(
            self.rows.iter().all(|&r| (r as usize) < n),
            "a scored row lies outside the {n}-token sequence"
        );
        Ok(())
    }
}

/// A stretch of a training sequence that attends only within itself.
struct Segment {
    start: usize,
    len: usize,
    /// Additive `[1, 1, 1, len, len]` mask (query axis at dim 3, as the chunked attention
    /// expects).
    mask: Tensor,
}

/// How the attention of a training forward runs.
enum AttentionPath {
    /// candle's differentiable ops, one query chunk of one segment at a time, under the
    /// segments' masks.
    Composite(Vec<Segment>),
    /// The fused kernels, over the whole sequence at once: no mask tensor, the log-sum-exp of
    /// the forward kept for the backward.
    #[cfg(feature = "cuda")]
    Fused(crate::kernels::TrainAttention),
}

#[cfg(feature = "cuda")]
impl AttentionPath {
    /// The fused kernels over `spans`, where the device and dtype have them.
    fn fused(model: &Sdar, spans: &KeySpans) -> anyhow::Result<Option<Self>> {
        let planned = crate::kernels::TrainAttention::plan(
            model.device(),
            model.dtype(),
            &model.config,
            spans,
        )?;
        Ok(planned.map(AttentionPath::Fused))
    }
}

/// What every layer of one training forward shares: rotary tables, how attention runs, the
/// fused layer's kernels where the layers take them ([`fused_layer`]; candle's composite ops
/// and autograd otherwise); and the phase timer of a profiled step.
struct Layout {
    rope: Rope,
    attention: AttentionPath,
    layer: Option<Box<dyn LayerOps>>,
    /// With the fused layer, how many layers (the first ones) keep their forward activations
    /// for the backward instead of recomputing them ([`fused_layer::layers_to_keep`]).
    keep_layers: usize,
    timer: Option<RefCell<PhaseTimer>>,
}

/// One layer's attention output, and what the fused backward needs of its forward.
struct AttentionOutput {
    /// `[1, T, Hq * Dh]`.
    out: Tensor,
    /// The fused forward's log-sum-exp, f32 `[Hq, T]`; `None` on the composite path (always,
    /// without the `cuda` feature).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    lse: Option<Tensor>,
}

/// What the checkpointed backward recomputes a layer from: its input and attention output.
struct SavedLayer {
    input: Tensor,
    attention: AttentionOutput,
    /// The fused layer's forward activations, kept when memory allows: the backward then
    /// recomputes nothing of the layer ([`fused_layer::KeptLayer`]).
    kept: Option<fused_layer::KeptLayer>,
}

impl Layout {
    /// An SFT batch: every sample is a segment of 2n positions [noisy ⧺ clean] under the
    /// two-stream mask of its length. With `fused`, attention takes the fused kernels where
    /// the device and dtype have them (they have no autograd: the checkpointed step and frozen
    /// forwards only).
    fn two_stream(model: &Sdar, batch: &TwoStreamBatch, fused: bool) -> anyhow::Result<Self> {
        let device = model.device();
        let positions = Tensor::new(batch.positions(), device)?;
        let rope = Rope::new(&model.inv_freq, &positions, model.dtype())?;
        #[cfg(feature = "cuda")]
        if fused {
            let spans = KeySpans::two_stream(batch.sample_lens(), model.config.block_size);
            if let Some(attention) = AttentionPath::fused(model, &spans)? {
                return Ok(Self {
                    rope,
                    attention,
                    layer: fused_layer::kernels(model)?,
                    keep_layers: 0,
                    timer: None,
                });
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = fused;
        let mut masks: HashMap<usize, Tensor> = HashMap::new();
        let mut segments = Vec::with_capacity(batch.sample_lens().len());
        let mut start = 0;
        for &n in batch.sample_lens() {
            let mask = match masks.get(&n) {
                Some(mask) => mask.clone(),
                None => {
                    let mask = masks::two_stream_mask(n, model.config.block_size, device)?
                        .reshape((1, 1, 1, 2 * n, 2 * n))?;
                    masks.insert(n, mask.clone());
                    mask
                }
            };
            segments.push(Segment {
                start,
                len: 2 * n,
                mask,
            });
            start += 2 * n;
        }
        Ok(Self {
            rope,
            attention: AttentionPath::Composite(segments),
            layer: None,
            keep_layers: 0,
            timer: None,
        })
    }

    /// The layout of a checkpointed SFT step ([`Layout::two_stream`] with the fused kernels),
    /// keeping the forward activations of as many layers as memory allows where the fused
    /// layer runs ([`fused_layer::layers_to_keep`]).
    fn sft_step(model: &Sdar, batch: &TwoStreamBatch, chunk_rows: usize) -> anyhow::Result<Self> {
        let mut layout = Self::two_stream(model, batch, true)?;
        if layout.layer.is_some() {
            layout.keep_layers =
                fused_layer::layers_to_keep(model, batch.tokens().len(), chunk_rows)?;
        }
        Ok(layout)
    }

    /// A masked sequence: one segment under its own mask, or the fused kernels over its key
    /// spans where it has them and the device and dtype have the kernels.
    fn masked(model: &Sdar, sequence: &MaskedSequence) -> anyhow::Result<Self> {
        let n = sequence.tokens.len();
        let positions = Tensor::new(sequence.positions.as_slice(), model.device())?;
        let rope = Rope::new(&model.inv_freq, &positions, model.dtype())?;
        #[cfg(feature = "cuda")]
        if let Some(spans) = &sequence.spans {
            if let Some(attention) = AttentionPath::fused(model, spans)? {
                return Ok(Self {
                    rope,
                    attention,
                    layer: fused_layer::kernels(model)?,
                    keep_layers: 0,
                    timer: None,
                });
            }
        }
        let mask = sequence.mask.as_ref().with_context(|| {
            format!(
                "this {n}-token masked sequence has key spans but no mask, and the model's \
                 attention here is the composite one (CPU, a GPU before sm_80, or \
                 DICE_FUSED_ATTENTION=0), which needs the mask: build it where \
                 Sdar::trains_on_key_spans is false"
            )
        })?;
        Ok(Self {
            rope,
            attention: AttentionPath::Composite(vec![Segment {
                start: 0,
                len: n,
                mask: mask.reshape((1, 1, 1, n, n))?,
            }]),
            layer: None,
            keep_layers: 0,
            timer: None,
        })
    }

    /// Runs `work` as `phase` of a profiled step (untimed otherwise).
    fn timed<R, E: From<candle_core::Error>>(
        &self,
        phase: StepPhase,
        work: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        timed(self.timer.as_ref(), phase, work)
    }

    /// Attention within every segment (on the composite path `rows` queries at a time): q
    /// `[1, Hq, T, Dh]`, k and v `[1, Hkv, T, Dh]`, output `[1, T, Hq * Dh]`.
    // Without the `cuda` feature the composite path is the only one.
    #[cfg_attr(not(feature = "cuda"), allow(clippy::infallible_destructuring_match))]
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rows: usize,
    ) -> Result<AttentionOutput> {
        let segments = match &self.attention {
            AttentionPath::Composite(segments) => segments,
            #[cfg(feature = "cuda")]
            AttentionPath::Fused(kernels) => {
                let (out, lse) = kernels.forward(q, k, v)?;
                return Ok(AttentionOutput {
                    out,
                    lse: Some(lse),
                });
            }
        };
        let outputs = segments
            .iter()
            .map(|segment| {
                let span = |x: &Tensor| x.narrow(2, segment.start, segment.len);
                chunked_attention(
                    &span(q)?,
                    &span(k)?,
                    &span(v)?,
                    Some(&segment.mask),
                    rows,
                    KERNELS,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(AttentionOutput {
            out: Tensor::cat(&outputs, 1)?,
            lse: None,
        })
    }

    /// Gradients of [`Layout::attention`] with respect to q, k and v for the output gradient
    /// `upstream`, given the forward's `output`. The composite path recomputes and
    /// backpropagates one query chunk of one segment at a time, summing the chunks'
    /// contributions in f32 and rounding once to the input dtype.
    #[cfg_attr(not(feature = "cuda"), allow(clippy::infallible_destructuring_match))]
    fn attention_backward(
        &self,
        [q, k, v]: [&Tensor; 3],
        output: &AttentionOutput,
        upstream: &Tensor,
        rows: usize,
    ) -> anyhow::Result<[Tensor; 3]> {
        // Only the fused backward reads the forward's output.
        #[cfg(not(feature = "cuda"))]
        let _ = output;
        let segments = match &self.attention {
            AttentionPath::Composite(segments) => segments,
            #[cfg(feature = "cuda")]
            AttentionPath::Fused(kernels) => {
                let lse = output
                    .lse
                    .as_ref()
                    .context("internal error: a fused attention forward keeps its log-sum-exp")?;
                return Ok(kernels.backward([q, k, v], &output.out, lse, upstream)?);
            }
        };
        let mut per_segment: [Vec<Tensor>; 3] = Default::default();
        for segment in segments {
            // Fresh leaves (copies), so that each backward stops at this segment's q, k and v.
            let leaf = |x: &Tensor| Var::from_tensor(&x.narrow(2, segment.start, segment.len)?);
            let leaves = [leaf(q)?, leaf(k)?, leaf(v)?];
            let [ql, kl, vl] = leaves.each_ref().map(Var::as_tensor);
            let mut sums: [Option<Tensor>; 3] = Default::default();
            for chunk in row_chunks(segment.len, rows) {
                let out = attention_rows(ql, kl, vl, Some(&segment.mask), chunk, KERNELS)?;
                let upstream = upstream.narrow(1, segment.start + chunk.0, chunk.1)?;
                let grads = pull_back(&[(&out, &upstream)])?;
                for (sum, leaf) in sums.iter_mut().zip(&leaves) {
                    accumulate(
                        sum,
                        grad_of(&grads, leaf.as_tensor(), "an attention input")?,
                    )?;
                }
            }
            for (parts, sum) in per_segment.iter_mut().zip(sums) {
                parts.push(sum.context("a segment spans at least one query chunk")?);
            }
        }
        let dtype = q.dtype();
        let [dq, dk, dv] = per_segment;
        Ok([
            Tensor::cat(&dq, 2)?.to_dtype(dtype)?,
            Tensor::cat(&dk, 2)?.to_dtype(dtype)?,
            Tensor::cat(&dv, 2)?.to_dtype(dtype)?,
        ])
    }

    /// One decoder layer on the sequence `h` `[1, T, H]` through candle's composite ops: its
    /// attention output and its output `[1, T, H]`.
    fn layer_forward(
        &self,
        model: &Sdar,
        layer: &DecoderLayer,
        h: &Tensor,
        rows: usize,
    ) -> Result<(AttentionOutput, Tensor)> {
        let (q, k, v) = self.timed(StepPhase::ForwardProjections, || {
            layer.qkv(&model.config, h, &self.rope, KERNELS, &mut Unprobed)
        })?;
        let attention = self.timed(StepPhase::ForwardAttention, || {
            self.attention(&q, &k, &v, rows)
        })?;
        let out = self.timed(StepPhase::ForwardMlp, || {
            layer.finish(&model.config, h, &attention.out, KERNELS, &mut Unprobed)
        })?;
        Ok((attention, out))
    }
}

/// Backpropagates the output gradients `upstream` through the graphs of `outputs` (pairs of
/// output and its gradient, same dtype) via the surrogate of the module docs.
fn pull_back(pairs: &[(&Tensor, &Tensor)]) -> Result<GradStore> {
    let mut surrogate: Option<Tensor> = None;
    for (output, upstream) in pairs {
        let term = (*output * upstream.detach())?.sum_all()?;
        surrogate = Some(match surrogate {
            Some(s) => (s + term)?,
            None => term,
        });
    }
    match surrogate {
        Some(s) => s.backward(),
        None => Ok(GradStore::default()),
    }
}

fn grad_of<'g>(grads: &'g GradStore, tensor: &Tensor, what: &str) -> anyhow::Result<&'g Tensor> {
    grads
        .get(tensor)
        .with_context(|| format!("internal error: backward reached no gradient for {what}"))
}

/// [`LayerOps::embedding_backward`] through candle: the rows' gradients added into f32 zeros by
/// `index_add` (position order), as the composite path and the fused layer's CPU tests take it.
pub(super) fn embedding_backward_by_index_add(
    tokens: &[u32],
    upstream: &Tensor,
    vocab: usize,
) -> Result<Tensor> {
    let hidden = upstream.dim(1)?;
    let tokens = Tensor::new(tokens, upstream.device())?;
    Tensor::zeros((vocab, hidden), DType::F32, upstream.device())?.index_add(
        &tokens,
        &upstream.to_dtype(DType::F32)?,
        0,
    )
}

/// An f32 gradient sum rounded to the dtype of `weight`; zeros when nothing contributed.
fn rounded(sum: Option<Tensor>, weight: &Tensor) -> Result<Tensor> {
    match sum {
        Some(s) => s.to_dtype(weight.dtype()),
        None => weight.zeros_like(),
    }
}

/// log π(label) per row, `[M]` in f32: logits `[M, V]` in the model dtype, log-softmax in f32.
fn label_log_probs(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?
        .gather(&labels.unsqueeze(1)?, 1)?
        .squeeze(1)
}

/// Σ CE / p over rows, from the rows' label log-probabilities.
fn weighted_nll_sum(log_probs: &Tensor, p: &Tensor) -> Result<Tensor> {
    (log_probs.neg()? / p)?.sum_all()
}

/// The rows a training loss reads, and the loss.
struct Head<'a> {
    /// Scored rows of the sequence, u32 `[M]`.
    rows: Tensor,
    /// The label of every scored row, u32 `[M]`.
    labels: Tensor,
    /// The f32 scalar loss of the scored rows `range` from their label log-probabilities
    /// `[range.len()]`. The loss must be a sum of per-row terms: the head evaluates it over
    /// consecutive ranges and adds the results.
    loss: &'a dyn Fn(&Tensor, Range<usize>) -> Result<Tensor>,
}

/// What the loss head gives back to the layer stack.
struct HeadGradients {
    loss: f32,
    log_probs: Vec<f32>,
    /// d loss / d (last hidden state), `[1, T, H]` in the model dtype.
    hidden: Tensor,
    norm: Option<Tensor>,
    lm_head: Option<Tensor>,
}

impl Sdar {
    /// The two-stream SFT forward (spec §3.1, §6.3) as one autograd graph: final-normed hidden
    /// states of the batch's selected noisy-stream positions, `[M, H]` in the batch's selection
    /// order. The graph keeps every layer's activations; [`Sdar::sft_loss_and_grads`] is the
    /// memory-bounded way to train.
    pub fn two_stream_hidden(&self, batch: &TwoStreamBatch) -> anyhow::Result<Tensor> {
        let device = self.device();
        let layout = Layout::two_stream(self, batch, false)?;
        let tokens = Tensor::new(batch.tokens(), device)?.unsqueeze(0)?;
        let mut h = self.embed(&tokens)?;
        for layer in &self.layers {
            h = layout.layer_forward(self, layer, &h, QUERY_CHUNK)?.1;
        }
        let select = Tensor::new(batch.selected(), device)?;
        let picked = h.squeeze(0)?.index_select(&select, 0)?;
        Ok(self.final_norm(&picked, KERNELS)?)
    }

    /// SFT loss of spec §6.4 on [`Sdar::two_stream_hidden`] output: Σ CE(logits, label) / p
    /// over the selected positions, divided by `batch.num_loss_tokens()` (labels != -100).
    /// Logits in the model dtype, log-softmax in f32; returns an f32 scalar.
    pub fn sft_loss(&self, hidden: &Tensor, batch: &TwoStreamBatch) -> anyhow::Result<Tensor> {
        let device = self.device();
        let labels = Tensor::new(batch.selected_labels(), device)?;
        let p = Tensor::new(batch.selected_p(), device)?;
        let sum = weighted_nll_sum(&label_log_probs(&self.logits(hidden)?, &labels)?, &p)?;
        Ok((sum / batch.num_loss_tokens().max(1) as f64)?)
    }

    /// The SFT loss of [`Sdar::sft_loss`] and its gradient for every checkpoint tensor, with
    /// layer-wise activation checkpointing; equal to `sft_loss(two_stream_hidden(batch))`
    /// followed by `backward()` up to rounding.
    ///
    /// Steps: (1) a forward through the layers without autograd that keeps, per layer, only
    /// its input and its attention output; (2) the loss head (final norm, gather of the masked
    /// noisy positions, lm_head, CE/p) `chunk_rows` selected positions at a time, each chunk
    /// with its own graph and backward, giving d loss / d h_L; (3) from the last layer to the
    /// first: the layer is recomputed from its saved input with autograd, the MLP half is
    /// backpropagated, then the attention one query chunk of one sample at a time (scores
    /// recomputed per chunk), then the q/k/v projections; the layer's weight gradients are
    /// kept, d loss / d input becomes the upstream of the layer below, and everything else of
    /// the layer is dropped; (4) the embedding gradient is the first layer's input gradient
    /// index-added into the rows of the tokens used.
    ///
    /// Memory, estimated for SDAR-1.7B in bf16 on one packed row of 4,096 tokens (T = 8,192
    /// positions with both streams) with 1,024-row chunks:
    /// - weights and gradients: 3.8 GiB each (gradients accumulate as layers finish);
    /// - saved activations: 2 × T × H × 2 B = 64 MiB per layer, 1.75 GiB for 28 layers, plus
    ///   the [2n, 2n] f32 mask of a sample (256 MiB);
    /// - one attention chunk: f32 scores of 16 heads × 1,024 queries × 8,192 keys × 4 B =
    ///   512 MiB per tensor; the graph keeps six of them (scores, scaled, masked, shifted,
    ///   exp, probabilities) and two bf16 halves, 3.5 GiB, and its backward adds a few more
    ///   (including candle's unused gradient for the mask): about 7 GiB at the peak;
    /// - the rest of one layer's recomputation (MLP [T, 6,144], norms in f32): about 1.5 GiB;
    /// - one head chunk: 1,024 × 151,936 f32 logits (594 MiB) a few times over, about
    ///   4.5 GiB, next to the f32 lm_head gradient sum (1.16 GiB); the f32 embedding gradient
    ///   sum (1.16 GiB, twice while it is index-added) exists only at the end.
    ///
    /// Expected peak about 18 GiB, reached in a layer's attention backward. The attention
    /// term grows with `chunk_rows` × sample length, the saved activations with layers × T;
    /// nothing holds all layers' attention or all positions' logits at once.
    ///
    /// Weights that are `Var`s ([`Sdar::load_trainable`]) are used in place; plain weights
    /// ([`Sdar::load`], [`Sdar::random`]) are copied into `Var`s one layer at a time while
    /// that layer is recomputed. Gradients come back in the weight dtype, as candle's
    /// `backward()` gives them; a gradient with several contributions (the lm_head over head
    /// chunks, embedding rows of repeated tokens, a tied embedding, q/k/v over query chunks,
    /// the two paths into a layer input) is summed in f32 and rounded once.
    ///
    /// `chunk_rows` (> 0; [`QUERY_CHUNK`] is the default choice) is the query-chunk and
    /// head-chunk length.
    pub fn sft_loss_and_grads(
        &self,
        batch: &TwoStreamBatch,
        chunk_rows: usize,
    ) -> anyhow::Result<LossGradients> {
        ensure!(
            !batch.tokens().is_empty(),
            "the SFT batch has no tokens: pass at least one non-empty packed row"
        );
        let layout = Layout::sft_step(self, batch, chunk_rows)?;
        self.sft_step_on(&layout, batch, chunk_rows)
    }

    /// The SFT loss head of `batch` and the checkpointed step on its `layout`.
    fn sft_step_on(
        &self,
        layout: &Layout,
        batch: &TwoStreamBatch,
        chunk_rows: usize,
    ) -> anyhow::Result<LossGradients> {
        let device = self.device();
        let p = Tensor::new(batch.selected_p(), device)?;
        let denom = batch.num_loss_tokens().max(1) as f64;
        let loss = |log_probs: &Tensor, range: Range<usize>| {
            weighted_nll_sum(log_probs, &p.narrow(0, range.start, range.len())?)? / denom
        };
        let head = Head {
            rows: Tensor::new(batch.selected(), device)?,
            labels: Tensor::new(batch.selected_labels(), device)?,
            loss: &loss,
        };
        self.checkpointed_loss_and_grads(layout, batch.tokens(), &head, chunk_rows)
    }

    /// [`Sdar::sft_loss_and_grads`] with every phase of the step ([`StepPhase`]) timed on its
    /// own between two device synchronizations: the same loss and gradients, and where the
    /// step's time goes.
    pub fn profile_sft_step(
        &self,
        batch: &TwoStreamBatch,
        chunk_rows: usize,
    ) -> anyhow::Result<(LossGradients, StepProfile)> {
        let start = Instant::now();
        let (step, timer) =
            self.timed_sft_step(batch, chunk_rows, PhaseTimer::new(self.device()))?;
        self.device().synchronize()?;
        let seconds = start.elapsed().as_secs_f64();
        Ok((step, timer.finish(seconds)?))
    }

    /// [`Sdar::sft_loss_and_grads`] with every phase marked on the device by CUDA events and on
    /// the host by the clock, never synchronizing (the step as it runs unprofiled): where the
    /// device waited for the host. `None` off CUDA, where there is no device to wait.
    pub fn overlap_sft_step(
        &self,
        batch: &TwoStreamBatch,
        chunk_rows: usize,
    ) -> anyhow::Result<Option<(LossGradients, StepOverlap)>> {
        let Some(timer) = PhaseTimer::overlapped(self.device())? else {
            return Ok(None);
        };
        let (step, timer) = self.timed_sft_step(batch, chunk_rows, timer)?;
        Ok(Some((step, timer.finish_overlapped()?)))
    }

    /// The SFT step with its phases, the layout's setup included, timed by `timer`.
    fn timed_sft_step(
        &self,
        batch: &TwoStreamBatch,
        chunk_rows: usize,
        timer: PhaseTimer,
    ) -> anyhow::Result<(LossGradients, PhaseTimer)> {
        ensure!(
            !batch.tokens().is_empty(),
            "the SFT batch has no tokens: pass at least one non-empty packed row"
        );
        let timer = RefCell::new(timer);
        let mut layout = timed(Some(&timer), StepPhase::Setup, || {
            Layout::sft_step(self, batch, chunk_rows)
        })?;
        layout.timer = Some(timer);
        let step = self.sft_step_on(&layout, batch, chunk_rows)?;
        let timer = layout
            .timer
            .take()
            .context("the timed layout keeps its timer")?;
        Ok((step, timer.into_inner()))
    }

    /// Whether a [`MaskedSequence`] with key spans trains here without its mask: on CUDA
    /// where the fused training attention is available (its kernels are built on first
    /// use). Elsewhere the composite attention reads the mask.
    pub fn trains_on_key_spans(&self) -> anyhow::Result<bool> {
        #[cfg(feature = "cuda")]
        return crate::kernels::TrainAttention::available(
            self.device(),
            self.dtype(),
            &self.config,
        );
        #[cfg(not(feature = "cuda"))]
        Ok(false)
    }

    /// log π(label) of every scored row of `sequence` (f32, in the order of its rows): the
    /// forward of [`Sdar::masked_loss_and_grads`] without autograd, giving the same values
    /// (TraceRL's old log-probabilities, spec bicrl §9.1). `chunk_rows` as there.
    pub fn masked_log_probs(
        &self,
        sequence: &MaskedSequence,
        chunk_rows: usize,
    ) -> anyhow::Result<Vec<f32>> {
        ensure!(chunk_rows > 0, "chunk_rows must be positive");
        sequence.check()?;
        let layout = Layout::masked(self, sequence)?;
        self.frozen_label_log_probs(
            &layout,
            &sequence.tokens,
            &sequence.rows,
            &sequence.labels,
            chunk_rows,
        )
    }

    /// The SFT loss of [`Sdar::sft_loss_and_grads`] without autograd (an evaluation loss):
    /// the same forward, `chunk_rows` (> 0) query rows and head rows at a time, keeping no
    /// activations; Σ −log π(label) / p over the selected positions, summed in f64, divided by
    /// `batch.num_loss_tokens()`.
    pub fn sft_loss_value(&self, batch: &TwoStreamBatch, chunk_rows: usize) -> anyhow::Result<f32> {
        ensure!(chunk_rows > 0, "chunk_rows must be positive");
        ensure!(
            !batch.tokens().is_empty(),
            "the SFT batch has no tokens: pass at least one non-empty packed row"
        );
        let layout = Layout::two_stream(self, batch, true)?;
        let log_probs = self.frozen_label_log_probs(
            &layout,
            batch.tokens(),
            batch.selected(),
            batch.selected_labels(),
            chunk_rows,
        )?;
        let sum: f64 = log_probs
            .iter()
            .zip(batch.selected_p())
            .map(|(&lp, &p)| -f64::from(lp) / f64::from(p))
            .sum();
        Ok((sum / batch.num_loss_tokens().max(1) as f64) as f32)
    }

    /// log π(label) of the scored `rows` of a forward without autograd (f32, in row order).
    fn frozen_label_log_probs(
        &self,
        layout: &Layout,
        tokens: &[u32],
        rows: &[u32],
        labels: &[u32],
        chunk_rows: usize,
    ) -> anyhow::Result<Vec<f32>> {
        let device = self.device();
        let last = self.frozen_forward(layout, tokens, chunk_rows, None)?;
        let picked = last
            .squeeze(0)?
            .index_select(&Tensor::new(rows, device)?, 0)?;
        let labels = Tensor::new(labels, device)?;
        if let Some(ops) = &layout.layer {
            // The fused head's arithmetic, so that these equal the log-probabilities of
            // `masked_loss_and_grads` (TraceRL's ratio is 1 before an update).
            return fused_layer::head_log_probs(ops.as_ref(), self, &picked, &labels, chunk_rows);
        }
        let (norm, lm_head) = (self.norm.detach(), self.lm_head.detach());
        let mut log_probs = Vec::with_capacity(rows.len());
        for (start, len) in row_chunks(rows.len(), chunk_rows) {
            let normed = rms_norm(
                &picked.narrow(0, start, len)?,
                &norm,
                self.config.rms_norm_eps,
                KERNELS,
            )?;
            let chunk =
                label_log_probs(&linear(&normed, &lm_head)?, &labels.narrow(0, start, len)?)?;
            log_probs.extend(chunk.to_vec1::<f32>()?);
        }
        Ok(log_probs)
    }

    /// A loss of the label log-probabilities of `sequence`'s scored rows, and its gradient for
    /// every checkpoint tensor, computed as [`Sdar::sft_loss_and_grads`] computes the SFT loss
    /// (same checkpointing, memory bounds and gradient conventions; the sequence is one
    /// segment under its own mask).
    ///
    /// `loss(log_probs, range)` gives the f32 scalar loss of the scored rows `range` from
    /// their label log-probabilities `[range.len()]` (f32, with autograd), in candle ops. The
    /// loss must be a sum of per-row terms: it is evaluated `chunk_rows` rows at a time and
    /// the results are added. The log-probabilities come back in
    /// [`LossGradients::log_probs`].
    pub fn masked_loss_and_grads(
        &self,
        sequence: &MaskedSequence,
        loss: impl Fn(&Tensor, Range<usize>) -> Result<Tensor>,
        chunk_rows: usize,
    ) -> anyhow::Result<LossGradients> {
        sequence.check()?;
        let device = self.device();
        let head = Head {
            rows: Tensor::new(sequence.rows.as_slice(), device)?,
            labels: Tensor::new(sequence.labels.as_slice(), device)?,
            loss: &loss,
        };
        let layout = Layout::masked(self, sequence)?;
        self.checkpointed_loss_and_grads(&layout, &sequence.tokens, &head, chunk_rows)
    }

    /// The layers without autograd: the last hidden state `[1, T, H]`. With `saved`, every
    /// layer's input and attention output are pushed onto it, what the checkpointed backward
    /// recomputes the layer from.
    fn frozen_forward(
        &self,
        layout: &Layout,
        tokens: &[u32],
        chunk_rows: usize,
        mut saved: Option<&mut Vec<SavedLayer>>,
    ) -> Result<Tensor> {
        let embedded = layout.timed(StepPhase::ForwardProjections, || {
            let tokens = Tensor::new(tokens, self.device())?;
            self.embed_tokens
                .detach()
                .index_select(&tokens, 0)?
                .unsqueeze(0)
        })?;
        let mut h = LayerInput::Rows(embedded);
        for (l, layer) in self.layers.iter().enumerate() {
            let frozen = layer.map(|t| Ok(t.detach()))?;
            let keep = saved.is_some() && l < layout.keep_layers;
            let (input, attention, out, kept) = match &layout.layer {
                Some(ops) => layout.fused_layer_forward(
                    ops.as_ref(),
                    &self.config,
                    &frozen,
                    h,
                    chunk_rows,
                    keep,
                )?,
                None => {
                    let input = h.rows()?;
                    let (attention, out) =
                        layout.layer_forward(self, &frozen, &input, chunk_rows)?;
                    (input, attention, LayerInput::Rows(out), None)
                }
            };
            h = out;
            if let Some(saved) = saved.as_deref_mut() {
                saved.push(SavedLayer {
                    input,
                    attention,
                    kept,
                });
            }
        }
        h.rows()
    }

    /// The checkpointed loss and gradients of [`Sdar::sft_loss_and_grads`] for any layout and
    /// loss head.
    fn checkpointed_loss_and_grads(
        &self,
        layout: &Layout,
        tokens: &[u32],
        head: &Head,
        chunk_rows: usize,
    ) -> anyhow::Result<LossGradients> {
        ensure!(chunk_rows > 0, "chunk_rows must be positive");
        let mut saved = Vec::with_capacity(self.layers.len());
        let h = self.frozen_forward(layout, tokens, chunk_rows, Some(&mut saved))?;
        let head = layout.timed(StepPhase::LossHead, || match &layout.layer {
            Some(ops) => fused_layer::head_backward(ops.as_ref(), self, &h, head, chunk_rows),
            None => self.head_backward(&h, head, chunk_rows),
        })?;
        drop(h);
        let mut grads = HashMap::new();
        grads.insert(
            "model.norm.weight".to_string(),
            rounded(head.norm, &self.norm)?,
        );
        let mut embed_sum = None;
        if self.config.tie_word_embeddings {
            embed_sum = head.lm_head;
        } else {
            grads.insert(
                "lm_head.weight".to_string(),
                rounded(head.lm_head, &self.lm_head)?,
            );
        }

        let mut upstream = head.hidden;
        for (l, layer) in self.layers.iter().enumerate().rev() {
            let mut saved_layer = saved
                .pop()
                .context("internal error: one saved input per layer")?;
            let (d_input, layer_grads) =
                self.layer_backward(layer, layout, &mut saved_layer, &upstream, chunk_rows)?;
            for (name, grad) in DecoderLayer::NAMES.iter().zip(layer_grads) {
                grads.insert(format!("model.layers.{l}.{name}"), grad);
            }
            upstream = d_input;
        }

        let embed_grad = layout.timed(StepPhase::EmbeddingGradient, || {
            let upstream = upstream.squeeze(0)?;
            let vocab = self.embed_tokens.dim(0)?;
            let rows = match &layout.layer {
                Some(ops) => ops.embedding_backward(tokens, &upstream, vocab)?,
                None => embedding_backward_by_index_add(tokens, &upstream, vocab)?,
            };
            accumulate(&mut embed_sum, &rows)?;
            drop(rows);
            rounded(embed_sum, &self.embed_tokens)
        })?;
        grads.insert("model.embed_tokens.weight".to_string(), embed_grad);
        Ok(LossGradients {
            loss: head.loss,
            log_probs: head.log_probs,
            grads,
        })
    }

    /// Loss head on the last hidden states `[1, T, H]` (no graph), `rows` scored rows at a
    /// time: the loss, the label log-probabilities, d loss / d hidden, and the f32 gradient
    /// sums of norm and lm_head.
    fn head_backward(
        &self,
        last: &Tensor,
        head: &Head,
        rows: usize,
    ) -> anyhow::Result<HeadGradients> {
        let device = self.device();
        let last = last.squeeze(0)?;
        let picked = last.index_select(&head.rows, 0)?;
        let norm = Var::from_tensor(&self.norm)?;
        let lm_head = Var::from_tensor(&self.lm_head)?;
        let mut loss = 0f32;
        let mut log_probs = Vec::with_capacity(head.rows.dim(0)?);
        let (mut norm_sum, mut lm_head_sum) = (None, None);
        let mut d_picked = Vec::new();
        for (start, len) in row_chunks(head.rows.dim(0)?, rows) {
            let x = Var::from_tensor(&picked.narrow(0, start, len)?)?;
            let normed = rms_norm(
                x.as_tensor(),
                norm.as_tensor(),
                self.config.rms_norm_eps,
                KERNELS,
            )?;
            let chunk_log_probs = label_log_probs(
                &linear(&normed, lm_head.as_tensor())?,
                &head.labels.narrow(0, start, len)?,
            )?;
            let chunk_loss = (head.loss)(&chunk_log_probs, start..start + len)?;
            loss += chunk_loss.to_scalar::<f32>()?;
            log_probs.extend(chunk_log_probs.to_vec1::<f32>()?);
            let grads = chunk_loss.backward()?;
            accumulate(
                &mut norm_sum,
                grad_of(&grads, norm.as_tensor(), "the final norm")?,
            )?;
            accumulate(
                &mut lm_head_sum,
                grad_of(&grads, lm_head.as_tensor(), "the lm_head")?,
            )?;
            d_picked.push(grad_of(&grads, x.as_tensor(), "the head input")?.to_dtype(DType::F32)?);
        }
        let mut hidden = Tensor::zeros(last.shape(), DType::F32, device)?;
        if !d_picked.is_empty() {
            hidden = hidden.index_add(&head.rows, &Tensor::cat(&d_picked, 0)?, 0)?;
        }
        Ok(HeadGradients {
            loss,
            log_probs,
            hidden: hidden.to_dtype(self.dtype())?.unsqueeze(0)?,
            norm: norm_sum,
            lm_head: lm_head_sum,
        })
    }

    /// Recomputes `layer` with autograd from its saved input `[1, T, H]` and attention output
    /// and backpropagates `upstream` (d loss / d output): d loss / d input, and the layer's
    /// weight gradients in the order of [`DecoderLayer::NAMES`].
    fn layer_backward(
        &self,
        layer: &DecoderLayer,
        layout: &Layout,
        saved: &mut SavedLayer,
        upstream: &Tensor,
        rows: usize,
    ) -> anyhow::Result<(Tensor, Vec<Tensor>)> {
        let cfg = &self.config;
        if let Some(ops) = &layout.layer {
            return layout.fused_layer_backward(ops.as_ref(), cfg, layer, saved, upstream, rows);
        }
        let weights = layer.map(|t| Ok(Var::from_tensor(t)?.into_inner()))?;
        let input = Var::from_tensor(&saved.input)?;
        let (q, k, v) = layout.timed(StepPhase::RecomputeProjections, || {
            weights.qkv(cfg, input.as_tensor(), &layout.rope, KERNELS, &mut Unprobed)
        })?;
        // The MLP half starts from the saved attention output, so the attention graph is never
        // built for the whole sequence at once.
        let attn = Var::from_tensor(&saved.attention.out)?;
        let mut late = layout.timed(StepPhase::MlpBackward, || {
            let out = weights.finish(
                cfg,
                input.as_tensor(),
                attn.as_tensor(),
                KERNELS,
                &mut Unprobed,
            )?;
            pull_back(&[(&out, upstream)])
        })?;
        let d_attn = grad_of(&late, attn.as_tensor(), "the attention output")?.clone();
        let [dq, dk, dv] = layout.timed(StepPhase::AttentionBackward, || {
            layout.attention_backward([&q, &k, &v], &saved.attention, &d_attn, rows)
        })?;
        drop(d_attn);
        let (mut early, d_input) =
            layout.timed(StepPhase::ProjectionsBackward, || -> anyhow::Result<_> {
                let early = pull_back(&[(&q, &dq), (&k, &dk), (&v, &dv)])?;
                let mut d_input = None;
                for grads in [&late, &early] {
                    accumulate(
                        &mut d_input,
                        grad_of(grads, input.as_tensor(), "a layer input")?,
                    )?;
                }
                Ok((early, d_input))
            })?;
        let weight_grads = weights
            .tensors()
            .into_iter()
            .zip(DecoderLayer::NAMES)
            .map(|(w, name)| {
                early
                    .remove(w)
                    .or_else(|| late.remove(w))
                    .with_context(|| format!("internal error: no gradient for {name}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok((rounded(d_input, input.as_tensor())?, weight_grads))
    }
}
