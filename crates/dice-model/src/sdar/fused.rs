//! The cached forward on CUDA (a decoding block, or a prefill) with dice's own kernels
//! ([`crate::kernels`]): per layer three q/k/v matmuls (one over stacked weights after
//! [`Sdar::concatenate_projections`], and likewise for gate/up), one kernel for q/k norms + rotary +
//! head transposes + KV-cache write, the fused block attention, the o_proj matmul, one kernel
//! for residual add + RMSNorm, the gate and up matmuls, one SiLU × up kernel, the down matmul,
//! and one more residual add + RMSNorm (the next layer's input norm, or the final norm): 12
//! launches per layer where candle's ops take about 60.
//!
//! Positions come from the rows' lengths in a device tensor, never from kernel arguments or
//! uploads inside the forward, so the same launches can be captured once in a CUDA graph and
//! replayed at every later position ([`super::graph`]).
//!
//! Numerics are those of the candle path (the kernels round where candle's ops round); only
//! the order of floating-point sums inside the attention and the norms differs.

use super::stage::{Probe, Stage};
use super::{linear, rms_norm, Kernels, KvCache, Sdar};
use crate::kernels::{decode_ops, BlockAttention};
use candle_core::{Device, Result, Tensor};

/// One fused forward's setup: the rows' lengths on the device and the attention's
/// launch geometry, shared by every layer.
pub(crate) struct FusedDecode {
    attention: BlockAttention,
}

impl FusedDecode {
    /// The fused forward of `tokens` new tokens per row of `cache`, with row lengths `lens`
    /// (u32 `[B]` on the device) and at most `max_keys` keys per row, or `None` where the
    /// kernels do not apply (not CUDA, an unsupported dtype or head dim, kernels that failed to
    /// build, `DICE_FUSED_ATTENTION=0`).
    pub(crate) fn plan(
        model: &Sdar,
        lens: &Tensor,
        max_keys: usize,
        tokens: usize,
    ) -> anyhow::Result<Option<Self>> {
        let Device::Cuda(dev) = model.device() else {
            return Ok(None);
        };
        let cfg = model.config();
        if !decode_ops::available(dev, model.dtype(), cfg.head_dim) {
            return Ok(None);
        }
        let attention =
            BlockAttention::plan(model.device(), model.dtype(), cfg, lens, max_keys, tokens)?;
        Ok(attention.map(|attention| Self { attention }))
    }

    /// The fused forward for the lengths `cache` holds now (uploaded here).
    pub(crate) fn for_cache(
        model: &Sdar,
        cache: &KvCache,
        tokens: usize,
    ) -> anyhow::Result<Option<Self>> {
        if !model.device().is_cuda() {
            return Ok(None);
        }
        let max_keys = cache.lens.iter().copied().max().unwrap_or(0) + tokens;
        Self::plan(model, &cache.device_lens()?, max_keys, tokens)
    }

    /// Final-normed hidden states `[B, T, H]` of `input_ids` `[B, T]`; writes the new tokens'
    /// K/V into slots `lens[i]..lens[i] + T` of every row and changes nothing else (the caller
    /// advances the lengths).
    pub(crate) fn forward_hidden(
        &self,
        model: &Sdar,
        input_ids: &Tensor,
        cache: &KvCache,
        probe: &mut impl Probe,
    ) -> Result<Tensor> {
        let cfg = model.config();
        let eps = cfg.rms_norm_eps;
        let mut h = probe.stage(Stage::Embedding, || model.embed(input_ids))?;
        // The input norm of every layer but the first comes with the residual add before it.
        let mut normed_input = None;
        let lens = self.attention.lens();
        for (l, layer) in model.layers.iter().enumerate() {
            probe.enter_layer(l);
            let x = match normed_input.take() {
                Some(x) => x,
                None => probe.stage(Stage::InputNorm, || {
                    rms_norm(&h, &layer.input_layernorm, eps, Kernels::Fused)
                })?,
            };
            // [B, T, heads * D] each: three matmuls, or one over the layer's concatenated
            // weights whose output q, k and v are narrows of (the kernel takes their spacing).
            let (q, k, v) = probe.stage(Stage::QkvProjection, || match &layer.concatenated {
                Some(c) => {
                    let qkv = linear(&x, &c.qkv)?;
                    let (q_width, kv_width) = (cfg.q_dim(), cfg.kv_dim());
                    Result::Ok((
                        qkv.narrow(2, 0, q_width)?,
                        qkv.narrow(2, q_width, kv_width)?,
                        qkv.narrow(2, q_width + kv_width, kv_width)?,
                    ))
                }
                None => Ok((
                    linear(&x, &layer.q_proj)?,
                    linear(&x, &layer.k_proj)?,
                    linear(&x, &layer.v_proj)?,
                )),
            })?;
            let (keys, values) = (&cache.keys[l], &cache.values[l]);
            let q = probe.stage(Stage::QkNormRotaryCacheWrite, || {
                decode_ops::qk_norm_rope_cache(
                    &q,
                    &k,
                    &v,
                    &layer.q_norm,
                    &layer.k_norm,
                    &model.inv_freq,
                    lens,
                    eps,
                    keys,
                    values,
                )
            })?;
            let a = probe.stage(Stage::Attention, || self.attention.attend(&q, keys, values))?;
            let o = probe.stage(Stage::OProjection, || linear(&a, &layer.o_proj))?;
            let (sum, normed) = probe.stage(Stage::ResidualNorm, || {
                decode_ops::add_rms_norm(&h, &o, &layer.post_attention_layernorm, eps)
            })?;
            let (gate, up) =
                probe.stage(Stage::GateUpProjection, || match &layer.concatenated {
                    Some(c) => {
                        let gate_up = linear(&normed, &c.gate_up)?;
                        let width = cfg.intermediate_size;
                        Result::Ok((
                            gate_up.narrow(2, 0, width)?,
                            gate_up.narrow(2, width, width)?,
                        ))
                    }
                    None => Ok((
                        linear(&normed, &layer.gate_proj)?,
                        linear(&normed, &layer.up_proj)?,
                    )),
                })?;
            let gated = probe.stage(Stage::SiluMul, || decode_ops::silu_mul(&gate, &up))?;
            let m = probe.stage(Stage::DownProjection, || linear(&gated, &layer.down_proj))?;
            let next_norm = match model.layers.get(l + 1) {
                Some(next) => &next.input_layernorm,
                None => &model.norm,
            };
            let (sum, normed) = probe.stage(Stage::ResidualNorm, || {
                decode_ops::add_rms_norm(&sum, &m, next_norm, eps)
            })?;
            h = sum;
            normed_input = Some(normed);
        }
        match normed_input {
            Some(x) => Ok(x),
            None => probe.stage(Stage::FinalNorm, || model.final_norm(&h, Kernels::Fused)),
        }
    }
}
