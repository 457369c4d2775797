//! The hand-written training layer: a decoder layer's forward and backward as GEMMs (candle's
//! matmul; on CUDA cuBLAS in bf16/f16 with f32 accumulation) between fused element-wise steps
//! ([`LayerOps`]; on CUDA the kernels of `crate::kernels::TrainLayer`), with the layout's
//! attention (on CUDA the fused training attention) in the middle. No autograd graph, no
//! surrogate products, no per-layer copies of the weights into `Var`s: the backward is written
//! out, and each weight's gradient is one GEMM over the whole sequence.
//!
//! q/k/v and gate/up run as one GEMM each over the concatenated weights (so the input
//! gradient of each group is one GEMM too, summing its parts in f32); the layer keeps the
//! composite forward's roundings (normed, projected and gated values in the model dtype), so
//! its gradients are those of the forward it computes. The loss head is written out the same
//! way: the final norm, the lm_head GEMM, a log-softmax that gives each row's log-sum-exp and
//! label log-probability, and the logits' gradient (written over the logits on CUDA).
//!
//! The step is checked against the composite one on the CPU with a candle implementation of
//! [`LayerOps`] (the unit tests below), the kernels against direct references through the CUDA
//! emulation (tests/it/train_layer_emulated.rs), and the whole on the GPU by tests/it/cuda.rs.

use super::{row_chunks, AttentionOutput, Head, HeadGradients, Layout, SavedLayer, StepPhase};
use crate::layer_ops::{accumulate, LayerOps};
use crate::sdar::DecoderLayer;
use crate::{Sdar, SdarConfig};
use candle_core::{DType, Result, Tensor, Var};

/// The fused layer's kernels for `model`'s device and dtype where they exist (CUDA, not with
/// `DICE_FUSED_LAYER=0`); `None` keeps candle's composite layer and autograd.
#[cfg(feature = "cuda")]
pub(super) fn kernels(model: &Sdar) -> anyhow::Result<Option<Box<dyn LayerOps>>> {
    let planned = crate::kernels::TrainLayer::plan(model.device(), model.dtype(), &model.config)?;
    Ok(planned.map(|ops| Box::new(ops) as Box<dyn LayerOps>))
}

/// A layer's weights as the fused layer multiplies by them: q/k/v and gate/up stacked.
struct Stacked<'a> {
    layer: &'a DecoderLayer,
    qkv: Tensor,
    gate_up: Tensor,
}

impl<'a> Stacked<'a> {
    /// The stacked weights of `layer`: copies of its q/k/v and gate/up weights, unless the
    /// layer holds them concatenated already.
    fn new(layer: &'a DecoderLayer) -> Result<Self> {
        let (qkv, gate_up) = match &layer.concatenated {
            Some(c) => (c.qkv.clone(), c.gate_up.clone()),
            None => (
                Tensor::cat(&[&layer.q_proj, &layer.k_proj, &layer.v_proj], 0)?,
                Tensor::cat(&[&layer.gate_proj, &layer.up_proj], 0)?,
            ),
        };
        Ok(Self {
            layer,
            qkv,
            gate_up,
        })
    }

    /// `layer`'s stacked weights as a forward kept them ([`KeptLayer`]), or stacked anew.
    fn kept_or_new(layer: &'a DecoderLayer, kept: Option<&KeptWeights>) -> Result<Self> {
        match kept {
            Some(KeptWeights { qkv, gate_up }) => Ok(Self {
                layer,
                qkv: qkv.clone(),
                gate_up: gate_up.clone(),
            }),
            None => Self::new(layer),
        }
    }

    /// The stacked weights alone, detached (no product with them records a graph), to be
    /// kept from a forward to its backward.
    fn keep(&self) -> KeptWeights {
        KeptWeights {
            qkv: self.qkv.detach(),
            gate_up: self.gate_up.detach(),
        }
    }
}

/// A layer's stacked weights kept from its forward to its backward: the weights do not change
/// between the two, and stacking them again copied 5 tensors a layer (half of the 7.7 ms of
/// copies in a 1.7B step on an H100: bench/notes/train-h200.md, session 30).
struct KeptWeights {
    qkv: Tensor,
    gate_up: Tensor,
}

/// `x` `[T, in]` times `w` `[out, in]` transposed: `[T, out]`.
fn times_transposed(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.matmul(&w.t()?)
}

/// The attention half's forward activations of one layer, 2-d `[T, …]`.
struct QkvForward {
    normed: Tensor,
    rstd: Tensor,
    qkv: Tensor,
    heads: [Tensor; 3],
    q_rstd: Tensor,
    k_rstd: Tensor,
}

/// The MLP half's forward activations of one layer.
struct MlpForward {
    after_attention: Tensor,
    normed: Tensor,
    rstd: Tensor,
    gate_up: Tensor,
    gated: Tensor,
}

/// A fused layer's input: its rows `[1, T, H]`, or the previous layer's residual and MLP output
/// `[T, H]` not yet added (the add is fused into this layer's input norm, `add_rms_norm`,
/// instead of a pass of its own over both and the sum).
pub(super) enum LayerInput {
    Rows(Tensor),
    Sum(Tensor, Tensor),
}

impl LayerInput {
    /// The input rows `[1, T, H]` (a `Sum` added).
    pub(super) fn rows(self) -> Result<Tensor> {
        match self {
            LayerInput::Rows(h) => Ok(h),
            LayerInput::Sum(a, b) => (a + b)?.unsqueeze(0),
        }
    }
}

/// The layer's input rows `[T, H]` (a `Sum` added by the norm's kernel), the input norm's
/// output and its reciprocal RMS.
fn input_norm(
    ops: &dyn LayerOps,
    cfg: &SdarConfig,
    w: &Stacked,
    input: LayerInput,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (weight, eps) = (&w.layer.input_layernorm, cfg.rms_norm_eps);
    match input {
        LayerInput::Rows(h) => {
            let h = h.squeeze(0)?;
            let (normed, rstd) = ops.rms_norm(&h, weight, eps)?;
            Ok((h, normed, rstd))
        }
        LayerInput::Sum(a, b) => ops.add_rms_norm(&a, &b, weight, eps),
    }
}

/// The q/k/v GEMM of the input norm's output `normed` (`rstd` its reciprocal RMS), head norms
/// and RoPE: q, k, v in head-major order.
fn qkv(
    ops: &dyn LayerOps,
    cfg: &SdarConfig,
    w: &Stacked,
    rope: [&Tensor; 2],
    (normed, rstd): (Tensor, Tensor),
) -> Result<QkvForward> {
    let eps = cfg.rms_norm_eps;
    let qkv = times_transposed(&normed, &w.qkv)?;
    let (q_dim, kv_dim) = (cfg.q_dim(), cfg.kv_dim());
    let (q, q_rstd) = ops.heads_forward(
        &qkv.narrow(1, 0, q_dim)?,
        Some((&w.layer.q_norm, rope)),
        cfg.num_attention_heads,
        eps,
    )?;
    let (k, k_rstd) = ops.heads_forward(
        &qkv.narrow(1, q_dim, kv_dim)?,
        Some((&w.layer.k_norm, rope)),
        cfg.num_key_value_heads,
        eps,
    )?;
    let (v, _) = ops.heads_forward(
        &qkv.narrow(1, q_dim + kv_dim, kv_dim)?,
        None,
        cfg.num_key_value_heads,
        eps,
    )?;
    let missing = || candle_core::Error::Msg("a head norm keeps its rstd".into());
    Ok(QkvForward {
        normed,
        rstd,
        qkv,
        heads: [q, k, v],
        q_rstd: q_rstd.ok_or_else(missing)?,
        k_rstd: k_rstd.ok_or_else(missing)?,
    })
}

/// o_proj and the residual, post-attention norm, gate/up GEMM and SwiGLU (the down GEMM and
/// its residual are the caller's: the backward needs only what comes before them).
fn mlp(
    ops: &dyn LayerOps,
    cfg: &SdarConfig,
    w: &Stacked,
    h: &Tensor,
    attention: &Tensor,
) -> Result<MlpForward> {
    let o = times_transposed(attention, &w.layer.o_proj)?;
    let (after_attention, normed, rstd) =
        ops.add_rms_norm(h, &o, &w.layer.post_attention_layernorm, cfg.rms_norm_eps)?;
    let gate_up = times_transposed(&normed, &w.gate_up)?;
    let gated = ops.swiglu(&gate_up)?;
    Ok(MlpForward {
        after_attention,
        normed,
        rstd,
        gate_up,
        gated,
    })
}

/// The loss head's forward over a chunk of scored rows.
struct HeadChunk {
    normed: Tensor,
    rstd: Tensor,
    logits: Tensor,
    lse: Tensor,
    log_probs: Tensor,
}

/// Final norm, lm_head GEMM and label log-softmax of the scored rows `x` `[rows, H]`.
fn head_chunk(ops: &dyn LayerOps, model: &Sdar, x: &Tensor, labels: &Tensor) -> Result<HeadChunk> {
    let (normed, rstd) = ops.rms_norm(x, &model.norm.detach(), model.config.rms_norm_eps)?;
    let logits = times_transposed(&normed, &model.lm_head.detach())?;
    let (lse, log_probs) = ops.label_log_softmax(&logits, labels)?;
    Ok(HeadChunk {
        normed,
        rstd,
        logits,
        lse,
        log_probs,
    })
}

/// log π(label) of the scored rows `picked` `[M, H]` (f32, in row order), `rows` at a time: the
/// forward of [`head_backward`], the same arithmetic.
pub(super) fn head_log_probs(
    ops: &dyn LayerOps,
    model: &Sdar,
    picked: &Tensor,
    labels: &Tensor,
    rows: usize,
) -> anyhow::Result<Vec<f32>> {
    let scored = picked.dim(0)?;
    let mut log_probs = Vec::new();
    for (start, len) in row_chunks(scored, rows) {
        let chunk = head_chunk(
            ops,
            model,
            &picked.narrow(0, start, len)?,
            &labels.narrow(0, start, len)?,
        )?;
        log_probs.push(chunk.log_probs);
    }
    Ok(read_once(&[], &log_probs)?.1)
}

/// The chunks' losses (0-dim f32, summed in order in f32) and log-probabilities (in order),
/// read from the device in one synchronisation at the end of the head rather than one per
/// chunk.
fn read_once(losses: &[Tensor], log_probs: &[Tensor]) -> Result<(f32, Vec<f32>)> {
    let mut parts = Vec::with_capacity(2);
    if !losses.is_empty() {
        parts.push(Tensor::stack(losses, 0)?);
    }
    if !log_probs.is_empty() {
        parts.push(Tensor::cat(log_probs, 0)?);
    }
    if parts.is_empty() {
        return Ok((0.0, Vec::new()));
    }
    let mut values = Tensor::cat(&parts, 0)?.to_vec1::<f32>()?;
    let rest = values.split_off(losses.len());
    Ok((values.into_iter().fold(0f32, |sum, x| sum + x), rest))
}

/// The loss head on the last hidden states `[1, T, H]` (what [`Sdar`]'s composite head computes
/// through autograd), `rows` scored rows at a time: the loss and its gradients. The loss
/// closure runs through autograd on its chunk's log-probabilities alone.
pub(super) fn head_backward(
    ops: &dyn LayerOps,
    model: &Sdar,
    last: &Tensor,
    head: &Head,
    rows: usize,
) -> anyhow::Result<HeadGradients> {
    let last = last.squeeze(0)?;
    let picked = last.index_select(&head.rows, 0)?;
    let (norm, lm_head) = (model.norm.detach(), model.lm_head.detach());
    let scored = head.rows.dim(0)?;
    let (mut losses, mut log_probs) = (Vec::new(), Vec::new());
    let (mut norm_sum, mut lm_head_sum) = (None, None);
    let mut d_picked = Vec::new();
    for (start, len) in row_chunks(scored, rows) {
        let x = picked.narrow(0, start, len)?;
        let labels = head.labels.narrow(0, start, len)?;
        let HeadChunk {
            normed,
            rstd,
            logits,
            lse,
            log_probs: chunk_log_probs,
        } = head_chunk(ops, model, &x, &labels)?;
        let leaf = Var::from_tensor(&chunk_log_probs)?;
        let chunk_loss = (head.loss)(leaf.as_tensor(), start..start + len)?;
        losses.push(chunk_loss.detach());
        log_probs.push(chunk_log_probs);
        let d_log_probs = match chunk_loss.backward()?.get(leaf.as_tensor()) {
            Some(grad) => grad.clone(),
            // A loss that does not read these rows.
            None => leaf.as_tensor().zeros_like()?,
        };
        let d_logits = ops.label_log_softmax_backward(logits, &labels, &lse, &d_log_probs)?;
        ops.accumulate_at_b(&mut lm_head_sum, &d_logits, &normed)?;
        let d_normed = d_logits.matmul(&lm_head)?;
        drop(d_logits);
        let (d_x, d_norm) = ops.rms_norm_backward(&x, &norm, &rstd, &d_normed, None)?;
        accumulate(&mut norm_sum, &d_norm)?;
        d_picked.push(d_x.to_dtype(DType::F32)?);
    }
    let mut hidden = Tensor::zeros(last.shape(), DType::F32, last.device())?;
    if !d_picked.is_empty() {
        hidden = hidden.index_add(&head.rows, &Tensor::cat(&d_picked, 0)?, 0)?;
    }
    let (loss, log_probs) = read_once(&losses, &log_probs)?;
    Ok(HeadGradients {
        loss,
        log_probs,
        hidden: hidden.to_dtype(model.dtype())?.unsqueeze(0)?,
        norm: norm_sum,
        lm_head: lm_head_sum,
    })
}

/// A layer's forward activations kept for its backward, which then recomputes nothing: every
/// GEMM output and what the element-wise steps between them made, and the stacked weights.
pub(super) struct KeptLayer {
    qkv: QkvForward,
    mlp: MlpForward,
    weights: KeptWeights,
}

/// Device memory a backward needs besides the kept activations, as a share of the device: a
/// margin for the allocator and for what the estimate of [`layers_to_keep`] leaves out.
const KEEP_MARGIN: f64 = 0.1;

/// How many layers of an SFT step over `tokens` positions keep their forward activations
/// ([`KeptLayer`]), from the device memory free now: as many as fit beside what the backward
/// needs at its start (every weight's gradient, the loss head's logits and f32 sums, two
/// layers' worth of backward temporaries, a margin of [`KEEP_MARGIN`]). Keeping a layer saves
/// its recomputation: the q/k/v, o_proj and gate/up GEMMs again, a quarter of the step's GEMM
/// work. None on the CPU (no measure of free memory) or with `DICE_RECOMPUTE=all`.
pub(super) fn layers_to_keep(
    model: &Sdar,
    tokens: usize,
    chunk_rows: usize,
) -> anyhow::Result<usize> {
    if std::env::var("DICE_RECOMPUTE").is_ok_and(|v| v == "all") {
        return Ok(0);
    }
    let Some((free, total)) = crate::memory::free_and_total(model.device())? else {
        return Ok(0);
    };
    let cfg = &model.config;
    let bytes = model.dtype().size_in_bytes();
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let qkv_width = cfg.q_dim() + 2 * cfg.kv_dim();
    // normed, qkv, the heads, after_attention, normed again, gate_up, gated; the stacked
    // weights.
    let per_layer = (tokens * (3 * h + 2 * qkv_width + 3 * i) + (qkv_width + 2 * i) * h) * bytes;
    let head = chunk_rows * cfg.vocab_size * (2 * bytes + 4) + 2 * cfg.vocab_size * h * 4;
    let reserve = model.num_parameters() * bytes
        + head
        + 2 * per_layer
        + (KEEP_MARGIN * total as f64) as usize;
    let room = (free as usize).saturating_sub(reserve);
    Ok((room / per_layer.max(1)).min(model.layers.len()))
}

impl Layout {
    /// One decoder layer through the fused layer: its input rows `[1, T, H]` (which the
    /// backward starts from), its attention output, its output (the residual and the MLP's
    /// output, added by the next layer's input norm or [`LayerInput::rows`]), and with `keep`
    /// its activations for the backward.
    pub(super) fn fused_layer_forward(
        &self,
        ops: &dyn LayerOps,
        cfg: &SdarConfig,
        layer: &DecoderLayer,
        input: LayerInput,
        rows: usize,
        keep: bool,
    ) -> Result<(Tensor, AttentionOutput, LayerInput, Option<KeptLayer>)> {
        let rope = [&self.rope.cos, &self.rope.sin];
        let (w, h, qkv) = self.timed(StepPhase::ForwardProjections, || {
            let w = Stacked::new(layer)?;
            let (h, normed, rstd) = input_norm(ops, cfg, &w, input)?;
            let qkv = qkv(ops, cfg, &w, rope, (normed, rstd))?;
            Ok::<_, candle_core::Error>((w, h, qkv))
        })?;
        let [q, k, v] = &qkv.heads;
        let attention = self.timed(StepPhase::ForwardAttention, || {
            self.attention(q, k, v, rows)
        })?;
        let (next, mlp) = self.timed(StepPhase::ForwardMlp, || {
            let mlp = mlp(ops, cfg, &w, &h, &attention.out.squeeze(0)?)?;
            let down = times_transposed(&mlp.gated, &layer.down_proj)?;
            let next = LayerInput::Sum(mlp.after_attention.clone(), down);
            Ok::<_, candle_core::Error>((next, mlp))
        })?;
        let kept = keep.then(|| KeptLayer {
            qkv,
            mlp,
            weights: w.keep(),
        });
        Ok((h.unsqueeze(0)?, attention, next, kept))
    }

    /// [`Sdar`]'s checkpointed layer backward through the fused layer: the layer recomputed
    /// from its saved input, then its gradients written out. d loss / d input `[1, T, H]` and
    /// the weights' gradients in the order of [`DecoderLayer::NAMES`].
    pub(super) fn fused_layer_backward(
        &self,
        ops: &dyn LayerOps,
        cfg: &SdarConfig,
        layer: &DecoderLayer,
        saved: &mut SavedLayer,
        upstream: &Tensor,
        rows: usize,
    ) -> anyhow::Result<(Tensor, Vec<Tensor>)> {
        // Detached, so that no product with a `Var` weight records a graph that would keep
        // this layer's activations alive beside its gradients.
        let layer = &layer.map(|t| Ok(t.detach()))?;
        let rope = [&self.rope.cos, &self.rope.sin];
        let h = saved.input.squeeze(0)?;
        let d_out = upstream.squeeze(0)?;
        let attention = saved.attention.out.squeeze(0)?;
        let (w, qkv, mlp) = self.timed(StepPhase::RecomputeProjections, || {
            let kept = saved.kept.take();
            let w = Stacked::kept_or_new(layer, kept.as_ref().map(|kept| &kept.weights))?;
            let (qkv, mlp) = match kept {
                Some(KeptLayer { qkv, mlp, .. }) => (qkv, mlp),
                None => {
                    let normed = ops.rms_norm(&h, &layer.input_layernorm, cfg.rms_norm_eps)?;
                    let qkv = qkv(ops, cfg, &w, rope, normed)?;
                    let mlp = mlp(ops, cfg, &w, &h, &attention)?;
                    (qkv, mlp)
                }
            };
            Ok::<_, candle_core::Error>((w, qkv, mlp))
        })?;
        let inter = cfg.intermediate_size;
        let (d_after_attention, d_attention, mlp_grads) =
            self.timed(StepPhase::MlpBackward, || {
                let d_gated = d_out.matmul(&layer.down_proj)?;
                let d_down = d_out.t()?.matmul(&mlp.gated)?;
                drop(mlp.gated);
                let d_gate_up = ops.swiglu_backward(&mlp.gate_up, &d_gated)?;
                drop(d_gated);
                let d_stacked = d_gate_up.t()?.matmul(&mlp.normed)?;
                let d_normed = d_gate_up.matmul(&w.gate_up)?;
                drop(d_gate_up);
                let (d_after_attention, d_post_norm) = ops.rms_norm_backward(
                    &mlp.after_attention,
                    &layer.post_attention_layernorm,
                    &mlp.rstd,
                    &d_normed,
                    Some(&d_out),
                )?;
                let d_attention = d_after_attention.matmul(&layer.o_proj)?;
                let d_o = d_after_attention.t()?.matmul(&attention)?;
                Ok::<_, candle_core::Error>((
                    d_after_attention,
                    d_attention,
                    [
                        d_o,
                        d_post_norm,
                        d_stacked.narrow(0, 0, inter)?,
                        d_stacked.narrow(0, inter, inter)?,
                        d_down,
                    ],
                ))
            })?;
        let [dq, dk, dv] = self.timed(StepPhase::AttentionBackward, || {
            let [q, k, v] = &qkv.heads;
            self.attention_backward(
                [q, k, v],
                &saved.attention,
                &d_attention.unsqueeze(0)?,
                rows,
            )
        })?;
        drop(d_attention);
        let (d_input, early_grads) = self.timed(StepPhase::ProjectionsBackward, || {
            let (q_dim, kv_dim) = (cfg.q_dim(), cfg.kv_dim());
            let columns = |start: usize, len: usize| qkv.qkv.narrow(1, start, len);
            // The three heads' gradients go straight into their columns of one buffer, which
            // they fill.
            let d_qkv = ops.heads_gradient_rows(&qkv.qkv)?;
            let d_q_norm = ops.heads_backward(
                &dq,
                &columns(0, q_dim)?,
                Some((&layer.q_norm, &qkv.q_rstd, rope)),
                &d_qkv,
                0,
            )?;
            let d_k_norm = ops.heads_backward(
                &dk,
                &columns(q_dim, kv_dim)?,
                Some((&layer.k_norm, &qkv.k_rstd, rope)),
                &d_qkv,
                q_dim,
            )?;
            ops.heads_backward(
                &dv,
                &columns(q_dim + kv_dim, kv_dim)?,
                None,
                &d_qkv,
                q_dim + kv_dim,
            )?;
            let d_stacked = d_qkv.t()?.matmul(&qkv.normed)?;
            let d_normed = d_qkv.matmul(&w.qkv)?;
            drop(d_qkv);
            let (d_input, d_input_norm) = ops.rms_norm_backward(
                &h,
                &layer.input_layernorm,
                &qkv.rstd,
                &d_normed,
                Some(&d_after_attention),
            )?;
            let missing =
                || anyhow::anyhow!("internal error: a head norm's backward gives its gradient");
            Ok::<_, anyhow::Error>((
                d_input,
                [
                    d_input_norm,
                    d_stacked.narrow(0, 0, q_dim)?,
                    d_stacked.narrow(0, q_dim, kv_dim)?,
                    d_stacked.narrow(0, q_dim + kv_dim, kv_dim)?,
                    d_q_norm.ok_or_else(missing)?,
                    d_k_norm.ok_or_else(missing)?,
                ],
            ))
        })?;
        let [d_input_norm, d_q, d_k, d_v, d_q_norm, d_k_norm] = early_grads;
        let [d_o, d_post_norm, d_gate, d_up, d_down] = mlp_grads;
        let dtype = layer.input_layernorm.dtype();
        let grads = [
            d_input_norm,
            d_q,
            d_k,
            d_v,
            d_q_norm,
            d_k_norm,
            d_o,
            d_post_norm,
            d_gate,
            d_up,
            d_down,
        ]
        .into_iter()
        .map(|g| g.to_dtype(dtype))
        .collect::<Result<Vec<_>>>()?;
        Ok((d_input.unsqueeze(0)?, grads))
    }
}

#[cfg(test)]
mod tests {
    //! The written-out step against candle's composite step and autograd, on the CPU in f32:
    //! [`CandleOps`] computes the element-wise steps with candle ops (the kernels' maths, which
    //! the CUDA emulation checks on their own), so what is checked here is everything around
    //! them: the GEMMs and their transposes, the stacked weights, the residual paths, the head,
    //! the order of the gradients.
    use super::*;
    use crate::masks::{additive_mask, block_causal_allowed, KeySpans};
    use crate::sft::{PackedRow, TwoStreamBatch};
    use crate::{LossGradients, MaskedSequence};
    use candle_core::{Device, D};

    struct CandleOps;

    fn f32(x: &Tensor) -> Result<Tensor> {
        x.to_dtype(DType::F32)
    }

    /// Rotate-half RoPE of `x` `[T, heads, Dh]` by the angles of cos, sin `[T, Dh / 2]`; with
    /// `inverse`, the rotation back (RoPE's transpose).
    fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> Result<Tensor> {
        let full = |t: &Tensor| Tensor::cat(&[t, t], 1)?.unsqueeze(1);
        let half = x.dim(D::Minus1)? / 2;
        let (x1, x2) = (x.narrow(2, 0, half)?, x.narrow(2, half, half)?);
        let turned = if inverse {
            Tensor::cat(&[&x2, &x1.neg()?], 2)?
        } else {
            Tensor::cat(&[&x2.neg()?, &x1], 2)?
        };
        x.broadcast_mul(&full(&f32(cos)?)?)? + turned.broadcast_mul(&full(&f32(sin)?)?)?
    }

    impl LayerOps for CandleOps {
        fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
            let x32 = f32(x)?;
            let rstd = (x32.sqr()?.mean_keepdim(1)? + eps)?.sqrt()?.recip()?;
            let y = x32.broadcast_mul(&rstd)?.broadcast_mul(&f32(w)?)?;
            Ok((y.to_dtype(x.dtype())?, rstd.squeeze(1)?))
        }

        fn add_rms_norm(
            &self,
            a: &Tensor,
            b: &Tensor,
            w: &Tensor,
            eps: f64,
        ) -> Result<(Tensor, Tensor, Tensor)> {
            let sum = (a + b)?;
            let (y, rstd) = self.rms_norm(&sum, w, eps)?;
            Ok((sum, y, rstd))
        }

        fn rms_norm_backward(
            &self,
            x: &Tensor,
            w: &Tensor,
            rstd: &Tensor,
            dy: &Tensor,
            d_residual: Option<&Tensor>,
        ) -> Result<(Tensor, Tensor)> {
            let (x32, dy32, r) = (f32(x)?, f32(dy)?, rstd.unsqueeze(1)?);
            let g = dy32.broadcast_mul(&f32(w)?)?;
            let n = x.dim(1)? as f64;
            let coef = ((&g * &x32)?.sum_keepdim(1)? * r.powf(3.0)?)?.affine(1.0 / n, 0.0)?;
            let mut dx = (g.broadcast_mul(&r)? - x32.broadcast_mul(&coef)?)?;
            if let Some(d) = d_residual {
                dx = (dx + f32(d)?)?;
            }
            let dw = (dy32 * x32.broadcast_mul(&r)?)?.sum(0)?;
            Ok((dx.to_dtype(x.dtype())?, dw))
        }

        fn heads_forward(
            &self,
            src: &Tensor,
            norm: Option<(&Tensor, [&Tensor; 2])>,
            heads: usize,
            eps: f64,
        ) -> Result<(Tensor, Option<Tensor>)> {
            let (t, width) = src.dims2()?;
            let dh = width / heads;
            let x = src.contiguous()?.reshape((t, heads, dh))?;
            let (y, rstd) = match norm {
                None => (x, None),
                Some((w, [cos, sin])) => {
                    let (y, rstd) = self.rms_norm(&x.reshape((t * heads, dh))?, w, eps)?;
                    let y = rotate(&f32(&y.reshape((t, heads, dh))?)?, cos, sin, false)?;
                    (y.to_dtype(src.dtype())?, Some(rstd))
                }
            };
            Ok((y.transpose(0, 1)?.contiguous()?.unsqueeze(0)?, rstd))
        }

        fn heads_backward(
            &self,
            d_heads: &Tensor,
            src: &Tensor,
            norm: Option<(&Tensor, &Tensor, [&Tensor; 2])>,
            d_rows: &Tensor,
            column: usize,
        ) -> Result<Option<Tensor>> {
            let (t, width) = src.dims2()?;
            let (_, heads, _, dh) = d_heads.dims4()?;
            let d = d_heads.squeeze(0)?.transpose(0, 1)?.contiguous()?;
            let (dx, dw) = match norm {
                None => (d.reshape((t, width))?, None),
                Some((w, rstd, [cos, sin])) => {
                    let d_normed = rotate(&f32(&d)?, cos, sin, true)?.reshape((t * heads, dh))?;
                    let x = src.contiguous()?.reshape((t * heads, dh))?;
                    let (dx, dw) = self.rms_norm_backward(&x, w, rstd, &d_normed, None)?;
                    (dx.reshape((t, width))?, Some(dw))
                }
            };
            d_rows.slice_set(&dx, 1, column)?;
            Ok(dw)
        }

        fn swiglu(&self, gate_up: &Tensor) -> Result<Tensor> {
            let inter = gate_up.dim(1)? / 2;
            let gate = f32(&gate_up.narrow(1, 0, inter)?)?.silu()?;
            gate.to_dtype(gate_up.dtype())? * gate_up.narrow(1, inter, inter)?
        }

        fn swiglu_backward(&self, gate_up: &Tensor, d_act: &Tensor) -> Result<Tensor> {
            let inter = gate_up.dim(1)? / 2;
            let g = f32(&gate_up.narrow(1, 0, inter)?)?;
            let u = f32(&gate_up.narrow(1, inter, inter)?)?;
            let da = f32(d_act)?;
            let sigmoid = (g.neg()?.exp()? + 1.0)?.recip()?;
            let slope = ((&g * (1.0 - &sigmoid)?)? + 1.0)?;
            let d_gate = (&da * &u)?.mul(&sigmoid)?.mul(&slope)?;
            let d_up = (da * g * sigmoid)?;
            Tensor::cat(&[d_gate, d_up], 1)?.to_dtype(gate_up.dtype())
        }

        fn label_log_softmax(&self, logits: &Tensor, labels: &Tensor) -> Result<(Tensor, Tensor)> {
            let l = f32(logits)?;
            let top = l.max_keepdim(1)?;
            let lse = (l.broadcast_sub(&top)?.exp()?.sum_keepdim(1)?.log()? + top)?;
            let log_prob = l.gather(&labels.unsqueeze(1)?, 1)?.sub(&lse)?;
            Ok((lse.squeeze(1)?, log_prob.squeeze(1)?))
        }

        fn label_log_softmax_backward(
            &self,
            logits: Tensor,
            labels: &Tensor,
            lse: &Tensor,
            d_log_prob: &Tensor,
        ) -> Result<Tensor> {
            let vocab = logits.dim(1)? as u32;
            let p = f32(&logits)?.broadcast_sub(&lse.unsqueeze(1)?)?.exp()?;
            let columns = Tensor::arange(0, vocab, logits.device())?.unsqueeze(0)?;
            let onehot = labels
                .unsqueeze(1)?
                .broadcast_eq(&columns)?
                .to_dtype(DType::F32)?;
            (onehot - p)?
                .broadcast_mul(&d_log_prob.unsqueeze(1)?)?
                .to_dtype(logits.dtype())
        }

        fn embedding_backward(
            &self,
            tokens: &[u32],
            upstream: &Tensor,
            vocab: usize,
        ) -> Result<Tensor> {
            super::super::embedding_backward_by_index_add(tokens, upstream, vocab)
        }
    }

    fn tiny_model() -> Sdar {
        let config: SdarConfig = serde_json::from_value(serde_json::json!({
            "model_type": "sdar", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "rope_theta": 1e4, "block_size": 4, "mask_token_id": 96, "initializer_range": 0.3
        }))
        .unwrap();
        Sdar::random(&config, DType::F32, &Device::Cpu).unwrap()
    }

    /// A packed row of `n` tokens whose positions from 3 on are scored, every third noised.
    fn row(n: usize, seed: u32) -> PackedRow {
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 13 + seed) % 90).collect();
        let noised: Vec<usize> = (3..n).filter(|i| i % 3 == 0).collect();
        PackedRow {
            noisy_ids: (0..n)
                .map(|i| if noised.contains(&i) { 96 } else { ids[i] })
                .collect(),
            labels: (0..n)
                .map(|i| if i > 2 { ids[i] as i64 } else { -100 })
                .collect(),
            input_ids: ids,
            position_ids: (0..n as u32).collect(),
            p_mask: vec![0.5; noised.len()],
            masked_positions: noised,
        }
    }

    fn assert_same(fused: &LossGradients, composite: &LossGradients) {
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-4 * b.abs().max(1.0);
        assert!(
            close(fused.loss, composite.loss),
            "loss {} vs {}",
            fused.loss,
            composite.loss
        );
        assert_eq!(fused.log_probs.len(), composite.log_probs.len());
        for (a, b) in fused.log_probs.iter().zip(&composite.log_probs) {
            assert!(close(*a, *b), "log-probability {a} vs {b}");
        }
        assert_eq!(fused.grads.len(), composite.grads.len());
        for (name, want) in &composite.grads {
            let got = &fused.grads[name];
            assert_eq!(got.dims(), want.dims(), "{name}");
            let error = (got - want).unwrap().abs().unwrap().max_all().unwrap();
            let scale = want.abs().unwrap().max_all().unwrap();
            let (error, scale) = (
                error.to_scalar::<f32>().unwrap(),
                scale.to_scalar::<f32>().unwrap(),
            );
            assert!(scale > 0.0, "{name}: a zero gradient checks nothing");
            assert!(
                error <= 1e-4 * scale,
                "{name}: max error {error} against max {scale}"
            );
        }
    }

    #[test]
    fn the_written_out_sft_step_matches_autograd() {
        let model = tiny_model();
        // Two samples packed, head and query chunks of 8 rows (several per sample).
        let batch = TwoStreamBatch::new(&[row(21, 1), row(10, 5)]).unwrap();
        let composite = Layout::two_stream(&model, &batch, false).unwrap();
        let want = model.sft_step_on(&composite, &batch, 8).unwrap();
        let mut fused = Layout::two_stream(&model, &batch, false).unwrap();
        fused.layer = Some(Box::new(CandleOps));
        let got = model.sft_step_on(&fused, &batch, 8).unwrap();
        assert_same(&got, &want);
    }

    /// Layers that keep their forward activations give the gradients of layers that recompute
    /// them, bit for bit.
    #[test]
    fn kept_activations_give_the_recomputed_gradients() {
        let model = tiny_model();
        let batch = TwoStreamBatch::new(&[row(21, 1), row(10, 5)]).unwrap();
        let step = |keep_layers: usize| {
            let mut layout = Layout::two_stream(&model, &batch, false).unwrap();
            layout.layer = Some(Box::new(CandleOps));
            layout.keep_layers = keep_layers;
            model.sft_step_on(&layout, &batch, 8).unwrap()
        };
        let (recomputed, one_kept, all_kept) = (step(0), step(1), step(2));
        for kept in [&one_kept, &all_kept] {
            assert_eq!(kept.loss.to_bits(), recomputed.loss.to_bits());
            for (name, want) in &recomputed.grads {
                let (got, want) = (kept.grads[name].flatten_all(), want.flatten_all());
                let (got, want) = (
                    got.unwrap().to_vec1::<f32>(),
                    want.unwrap().to_vec1::<f32>(),
                );
                assert_eq!(got.unwrap(), want.unwrap(), "{name}");
            }
        }
    }

    #[test]
    fn the_written_out_masked_step_matches_autograd() {
        let model = tiny_model();
        let n = 23;
        let visible = |q: usize, k: usize| (k >= 3 && block_causal_allowed(q, k, 4)) || k == q;
        let sequence = MaskedSequence {
            tokens: (0..n as u32).map(|i| (i * 7 + 3) % 90).collect(),
            positions: (0..n as u32).collect(),
            mask: Some(additive_mask(n, n, visible, &Device::Cpu).unwrap()),
            spans: KeySpans::from_predicate(n, visible),
            rows: (4..n as u32).step_by(2).collect(),
            labels: (4..n as u32).step_by(2).map(|i| (i * 11) % 90).collect(),
        };
        // A loss that weighs rows differently, so that d loss / d log p differs per row.
        let loss = |log_probs: &Tensor, range: std::ops::Range<usize>| {
            let weights: Vec<f32> = range.map(|i| 1.0 + i as f32 / 4.0).collect();
            let weights = Tensor::new(weights.as_slice(), log_probs.device())?;
            (log_probs * weights)?.neg()?.sum_all()
        };
        let head = Head {
            rows: Tensor::new(sequence.rows.as_slice(), &Device::Cpu).unwrap(),
            labels: Tensor::new(sequence.labels.as_slice(), &Device::Cpu).unwrap(),
            loss: &loss,
        };
        let composite = Layout::masked(&model, &sequence).unwrap();
        let want = model
            .checkpointed_loss_and_grads(&composite, &sequence.tokens, &head, 8)
            .unwrap();
        let mut fused = Layout::masked(&model, &sequence).unwrap();
        fused.layer = Some(Box::new(CandleOps));
        let got = model
            .checkpointed_loss_and_grads(&fused, &sequence.tokens, &head, 8)
            .unwrap();
        assert_same(&got, &want);
        // TraceRL's old log-probabilities (the forward alone) are the step's own, bit for bit.
        let old = model
            .frozen_label_log_probs(
                &fused,
                &sequence.tokens,
                &sequence.rows,
                &sequence.labels,
                8,
            )
            .unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&old), bits(&got.log_probs));
    }
}
