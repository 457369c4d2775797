//! Where the time of one checkpointed training step goes: [`Sdar::profile_sft_step`] runs the
//! real step (the same code) with every phase timed on its own between two device
//! synchronizations.
//!
//! [`Sdar::profile_sft_step`]: super::Sdar::profile_sft_step

use candle_core::{Device, Result};
use serde::Serialize;
use std::cell::RefCell;
use std::time::Instant;

/// One phase of a checkpointed SFT step. The phases inside the layers run once per layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepPhase {
    /// Rotary tables, the attention masks or the fused attention's spans.
    Setup,
    /// Embedding, input norm, q/k/v projections, q/k norms and rotary of the forward.
    ForwardProjections,
    ForwardAttention,
    /// o_proj, the residuals, the post-attention norm and the MLP of the forward.
    ForwardMlp,
    /// Final norm, lm_head, log-softmax and loss over the scored rows, forward and backward.
    LossHead,
    /// The layer's q/k/v recomputed with autograd from its saved input.
    RecomputeProjections,
    /// o_proj and the MLP recomputed from the saved attention output and backpropagated.
    MlpBackward,
    AttentionBackward,
    /// Backpropagation through q/k/v, rotary, norms and the input norm, and the layer input's
    /// gradient summed.
    ProjectionsBackward,
    /// The embedding's gradient from the first layer's input gradient.
    EmbeddingGradient,
}

impl StepPhase {
    /// Every phase, in the order a step reaches them.
    pub const ALL: [StepPhase; 10] = [
        StepPhase::Setup,
        StepPhase::ForwardProjections,
        StepPhase::ForwardAttention,
        StepPhase::ForwardMlp,
        StepPhase::LossHead,
        StepPhase::RecomputeProjections,
        StepPhase::MlpBackward,
        StepPhase::AttentionBackward,
        StepPhase::ProjectionsBackward,
        StepPhase::EmbeddingGradient,
    ];

    /// The phase's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            StepPhase::Setup => "setup (rotary, masks or spans)",
            StepPhase::ForwardProjections => "forward: embedding, norm, q/k/v, rotary",
            StepPhase::ForwardAttention => "forward: attention",
            StepPhase::ForwardMlp => "forward: o_proj, norm, MLP",
            StepPhase::LossHead => "loss head: norm, lm_head, CE, backward",
            StepPhase::RecomputeProjections => "backward: q/k/v recomputed",
            StepPhase::MlpBackward => "backward: o_proj, norm, MLP (recomputed)",
            StepPhase::AttentionBackward => "backward: attention",
            StepPhase::ProjectionsBackward => "backward: q/k/v, rotary, norms",
            StepPhase::EmbeddingGradient => "backward: embedding gradient",
        }
    }

    fn index(self) -> usize {
        Self::ALL
            .iter()
            .position(|&p| p == self)
            .expect("every phase is in ALL")
    }
}

/// One phase of [`StepProfile`].
#[derive(Debug, Clone, Serialize)]
pub struct PhaseTime {
    pub phase: StepPhase,
    pub name: &'static str,
    /// Times the phase ran in the step (once per layer for the layers' phases).
    pub runs: u64,
    /// Seconds over all its runs, device work included.
    pub seconds: f64,
}

/// Result of [`super::Sdar::profile_sft_step`]: every phase of [`StepPhase::ALL`] in order.
#[derive(Debug, Clone, Serialize)]
pub struct StepProfile {
    pub phases: Vec<PhaseTime>,
    /// Wall seconds of the whole profiled step: the phases' sum plus what runs between them
    /// (gradient bookkeeping on the host).
    pub step_seconds: f64,
}

/// Times the phases of one step, synchronizing the device before and after each.
pub(super) struct PhaseTimer {
    device: Device,
    seconds: [f64; StepPhase::ALL.len()],
    runs: [u64; StepPhase::ALL.len()],
}

impl PhaseTimer {
    pub(super) fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
            seconds: [0.0; StepPhase::ALL.len()],
            runs: [0; StepPhase::ALL.len()],
        }
    }

    pub(super) fn finish(self, step_seconds: f64) -> StepProfile {
        StepProfile {
            phases: StepPhase::ALL
                .iter()
                .map(|&phase| PhaseTime {
                    phase,
                    name: phase.name(),
                    runs: self.runs[phase.index()],
                    seconds: self.seconds[phase.index()],
                })
                .collect(),
            step_seconds,
        }
    }
}

/// Runs `work` as `phase`, timed when `timer` is set.
pub(super) fn timed<R, E: From<candle_core::Error>>(
    timer: Option<&RefCell<PhaseTimer>>,
    phase: StepPhase,
    work: impl FnOnce() -> std::result::Result<R, E>,
) -> std::result::Result<R, E> {
    let Some(timer) = timer else {
        return work();
    };
    let device = timer.borrow().device.clone();
    sync(&device)?;
    let start = Instant::now();
    let result = work()?;
    sync(&device)?;
    let mut timer = timer.borrow_mut();
    timer.seconds[phase.index()] += start.elapsed().as_secs_f64();
    timer.runs[phase.index()] += 1;
    Ok(result)
}

fn sync(device: &Device) -> Result<()> {
    device.synchronize()
}
