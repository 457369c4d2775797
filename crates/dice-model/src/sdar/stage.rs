//! The stages of a cached forward, and the hook through which the forward runs each of them:
//! the real forward runs them as they are ([`Unprobed`]); the profiler ([`super::profile`])
//! runs the very same code with a probe that times every stage on its own.

use serde::Serialize;

/// One piece of the cached forward. Stages inside a decoder layer run once or more per layer
/// (e.g. three projections for q, k and v); the others once per forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Slot placement, positions, rotary cos/sin tables and the attention mask.
    Setup,
    Embedding,
    InputNorm,
    /// The q, k and v projections (three matmuls).
    QkvProjection,
    QkNorm,
    /// The `[B, T, heads, Dh]` to `[B, heads, T, Dh]` copies of q, k and v.
    HeadTranspose,
    Rotary,
    KvCacheWrite,
    /// The fused CUDA kernel doing q/k norms, rotary, the head transposes and the KV-cache write
    /// in one pass (the fused decoding forward's replacement of the four stages before it).
    QkNormRotaryCacheWrite,
    /// Attention over the cache: scores, softmax and the weighted sum of values.
    Attention,
    OProjection,
    /// The residual adds after attention and after the MLP.
    Residual,
    PostAttentionNorm,
    /// The gate and up projections (two matmuls).
    GateUpProjection,
    /// SiLU of the gate (in f32) times up.
    SiluMul,
    DownProjection,
    /// The fused CUDA kernel adding a residual and normalising the sum for what follows (the
    /// post-attention norm, the next layer's input norm or the final norm).
    ResidualNorm,
    FinalNorm,
    LmHead,
}

impl Stage {
    /// Every stage, in the order the forward first reaches them.
    pub const ALL: [Stage; 19] = [
        Stage::Setup,
        Stage::Embedding,
        Stage::InputNorm,
        Stage::QkvProjection,
        Stage::QkNorm,
        Stage::HeadTranspose,
        Stage::Rotary,
        Stage::KvCacheWrite,
        Stage::QkNormRotaryCacheWrite,
        Stage::Attention,
        Stage::OProjection,
        Stage::Residual,
        Stage::PostAttentionNorm,
        Stage::GateUpProjection,
        Stage::SiluMul,
        Stage::DownProjection,
        Stage::ResidualNorm,
        Stage::FinalNorm,
        Stage::LmHead,
    ];

    /// Whether the stage runs inside every decoder layer.
    pub fn in_layer(self) -> bool {
        !matches!(
            self,
            Stage::Setup | Stage::Embedding | Stage::FinalNorm | Stage::LmHead
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Stage::Setup => "setup (positions, rotary tables, mask)",
            Stage::Embedding => "embedding",
            Stage::InputNorm => "input RMSNorm",
            Stage::QkvProjection => "q/k/v projections",
            Stage::QkNorm => "q/k norms",
            Stage::HeadTranspose => "q/k/v head transposes",
            Stage::Rotary => "rotary",
            Stage::KvCacheWrite => "KV-cache write",
            Stage::QkNormRotaryCacheWrite => "q/k norms + rotary + KV-cache write (fused)",
            Stage::Attention => "attention over the cache",
            Stage::OProjection => "o_proj",
            Stage::Residual => "residual adds",
            Stage::PostAttentionNorm => "post-attention RMSNorm",
            Stage::GateUpProjection => "gate/up projections",
            Stage::SiluMul => "SiLU * up",
            Stage::DownProjection => "down projection",
            Stage::ResidualNorm => "residual add + RMSNorm (fused)",
            Stage::FinalNorm => "final norm",
            Stage::LmHead => "lm_head",
        }
    }
}

/// How a forward runs its stages.
pub(crate) trait Probe {
    /// Called before the stages of decoder layer `layer` run.
    fn enter_layer(&mut self, layer: usize);

    /// Runs the ops of one stage and returns their result.
    fn stage<T, E: From<candle_core::Error>>(
        &mut self,
        stage: Stage,
        ops: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E>;
}

/// Runs every stage as it is: the forward of inference and training.
pub(crate) struct Unprobed;

impl Probe for Unprobed {
    fn enter_layer(&mut self, _layer: usize) {}

    #[inline(always)]
    fn stage<T, E: From<candle_core::Error>>(
        &mut self,
        _stage: Stage,
        ops: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        ops()
    }
}
