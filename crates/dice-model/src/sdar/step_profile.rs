//! Where the time of one checkpointed training step goes: [`Sdar::profile_sft_step`] runs the
//! real step (the same code) with every phase timed on its own between two device
//! synchronizations; [`Sdar::overlap_sft_step`] runs it without synchronizing, marking each
//! phase on the device with CUDA events and on the host with the clock, to show where the
//! device waited for the host.
//!
//! [`Sdar::profile_sft_step`]: super::Sdar::profile_sft_step
//! [`Sdar::overlap_sft_step`]: super::Sdar::overlap_sft_step

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{sys::CUevent_flags, CudaEvent, CudaStream};
use candle_core::{Device, Result};
use serde::Serialize;
use std::cell::RefCell;
#[cfg(feature = "cuda")]
use std::sync::Arc;
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

/// One phase of [`StepOverlap`].
#[derive(Debug, Clone, Serialize)]
pub struct PhaseOverlap {
    pub phase: StepPhase,
    pub name: &'static str,
    pub runs: u64,
    /// Seconds on the device between the events recorded at its runs' starts and ends: its
    /// kernels, and whatever the device waited for the host inside them.
    pub device_seconds: f64,
    /// Seconds the host took to enqueue its runs.
    pub host_seconds: f64,
    /// The least, over its runs, of how far the device trailed the host when the host had
    /// enqueued the run: near zero, the device had caught up and waited for the host.
    pub least_lead_seconds: f64,
    /// Runs that ended with the device less than [`STARVED_LEAD_SECONDS`] behind the host.
    pub starved_runs: u64,
}

/// A lead under which the device is taken to have waited for the host (a launch's latency).
pub const STARVED_LEAD_SECONDS: f64 = 50e-6;

/// Result of [`super::Sdar::overlap_sft_step`]: every phase of [`StepPhase::ALL`] in order.
#[derive(Debug, Clone, Serialize)]
pub struct StepOverlap {
    pub phases: Vec<PhaseOverlap>,
    /// Seconds on the device from the step's start to the end of its last phase.
    pub device_seconds: f64,
    /// Seconds on the host from the step's start until it had enqueued its last phase.
    pub host_seconds: f64,
}

/// One run of a phase marked without synchronizing: host clock and device event at its start
/// and end.
#[cfg(feature = "cuda")]
struct Mark {
    phase: StepPhase,
    start: (Instant, CudaEvent),
    end: (Instant, CudaEvent),
}

/// How a [`PhaseTimer`] times: each phase between two synchronizations, or every phase marked
/// by events on the device's stream with the device never waited for.
enum Timing {
    Synchronized {
        seconds: [f64; StepPhase::ALL.len()],
        runs: [u64; StepPhase::ALL.len()],
    },
    #[cfg(feature = "cuda")]
    Overlapped {
        stream: Arc<CudaStream>,
        /// The step's start: the host clock and an event recorded right after a
        /// synchronization, so that both clocks start together.
        origin: (Instant, CudaEvent),
        marks: Vec<Mark>,
    },
}

/// Times the phases of one step.
pub(super) struct PhaseTimer {
    device: Device,
    timing: Timing,
}

impl PhaseTimer {
    /// Synchronizing the device before and after each phase.
    pub(super) fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
            timing: Timing::Synchronized {
                seconds: [0.0; StepPhase::ALL.len()],
                runs: [0; StepPhase::ALL.len()],
            },
        }
    }

    /// Marking each phase with events on `device`'s stream, never synchronizing; `None` off CUDA.
    pub(super) fn overlapped(device: &Device) -> Result<Option<Self>> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = device {
            let stream = dev.cuda_stream();
            device.synchronize()?;
            let origin = (Instant::now(), timing_event(&stream)?);
            return Ok(Some(Self {
                device: device.clone(),
                timing: Timing::Overlapped {
                    stream,
                    origin,
                    marks: Vec::new(),
                },
            }));
        }
        let _ = device;
        Ok(None)
    }

    /// The synchronized profile of the step that took `step_seconds`.
    // Without CUDA, Synchronized is the only timing.
    #[allow(irrefutable_let_patterns)]
    pub(super) fn finish(self, step_seconds: f64) -> Result<StepProfile> {
        let Timing::Synchronized { seconds, runs } = self.timing else {
            candle_core::bail!("internal error: an overlapped timer finished as a synchronized one")
        };
        Ok(StepProfile {
            phases: StepPhase::ALL
                .iter()
                .map(|&phase| PhaseTime {
                    phase,
                    name: phase.name(),
                    runs: runs[phase.index()],
                    seconds: seconds[phase.index()],
                })
                .collect(),
            step_seconds,
        })
    }

    /// The overlapped timeline of the step, once its work is done (waits for the device).
    pub(super) fn finish_overlapped(self) -> Result<StepOverlap> {
        #[cfg(feature = "cuda")]
        if let Timing::Overlapped { origin, marks, .. } = self.timing {
            let device_at = |event: &CudaEvent| -> Result<f64> {
                let ms = origin
                    .1
                    .elapsed_ms(event)
                    .map_err(candle_core::Error::wrap)?;
                Ok(f64::from(ms) / 1e3)
            };
            let host_at = |instant: &Instant| instant.duration_since(origin.0).as_secs_f64();
            let runs = marks
                .iter()
                .map(|mark| {
                    Ok(MarkedRun {
                        phase: mark.phase,
                        host: [host_at(&mark.start.0), host_at(&mark.end.0)],
                        device: [device_at(&mark.start.1)?, device_at(&mark.end.1)?],
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            return Ok(StepOverlap::of_runs(&runs));
        }
        candle_core::bail!("internal error: a synchronized timer finished as an overlapped one")
    }
}

/// One run of a phase in an overlapped step: when the host began and ended enqueuing it, and
/// when the device reached its start and end, in seconds from the step's start on each clock.
#[derive(Debug, Clone, Copy)]
struct MarkedRun {
    phase: StepPhase,
    host: [f64; 2],
    device: [f64; 2],
}

impl StepOverlap {
    /// The timeline of the marked runs, phase by phase. The device reaches a run's end no sooner
    /// than the host has enqueued it, so the lead (device end less host end) is never much below
    /// zero, and a lead near zero means the device had nothing left to run when the host got
    /// there: it was waiting.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn of_runs(runs: &[MarkedRun]) -> Self {
        let mut phases: Vec<PhaseOverlap> = StepPhase::ALL
            .iter()
            .map(|&phase| PhaseOverlap {
                phase,
                name: phase.name(),
                runs: 0,
                device_seconds: 0.0,
                host_seconds: 0.0,
                least_lead_seconds: f64::INFINITY,
                starved_runs: 0,
            })
            .collect();
        let (mut device_seconds, mut host_seconds) = (0f64, 0f64);
        for run in runs {
            let lead = run.device[1] - run.host[1];
            let phase = &mut phases[run.phase.index()];
            phase.runs += 1;
            phase.device_seconds += run.device[1] - run.device[0];
            phase.host_seconds += run.host[1] - run.host[0];
            phase.least_lead_seconds = phase.least_lead_seconds.min(lead);
            phase.starved_runs += u64::from(lead < STARVED_LEAD_SECONDS);
            device_seconds = device_seconds.max(run.device[1]);
            host_seconds = host_seconds.max(run.host[1]);
        }
        for phase in &mut phases {
            if phase.runs == 0 {
                phase.least_lead_seconds = 0.0;
            }
        }
        StepOverlap {
            phases,
            device_seconds,
            host_seconds,
        }
    }
}

/// An event with timing, recorded now on `stream`.
#[cfg(feature = "cuda")]
fn timing_event(stream: &CudaStream) -> Result<CudaEvent> {
    stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(candle_core::Error::wrap)
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
    #[cfg(feature = "cuda")]
    let stream = match &timer.borrow().timing {
        Timing::Overlapped { stream, .. } => Some(stream.clone()),
        Timing::Synchronized { .. } => None,
    };
    #[cfg(feature = "cuda")]
    if let Some(stream) = stream {
        let start = (Instant::now(), timing_event(&stream)?);
        let result = work()?;
        let end = (Instant::now(), timing_event(&stream)?);
        if let Timing::Overlapped { marks, .. } = &mut timer.borrow_mut().timing {
            marks.push(Mark { phase, start, end });
        }
        return Ok(result);
    }
    let device = timer.borrow().device.clone();
    sync(&device)?;
    let start = Instant::now();
    let result = work()?;
    sync(&device)?;
    // Without CUDA, Synchronized is the only timing.
    #[allow(irrefutable_let_patterns)]
    if let Timing::Synchronized { seconds, runs } = &mut timer.borrow_mut().timing {
        seconds[phase.index()] += start.elapsed().as_secs_f64();
        runs[phase.index()] += 1;
    }
    Ok(result)
}

fn sync(device: &Device) -> Result<()> {
    device.synchronize()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run whose end the device reached right after the host enqueued it is starved; one the
    /// device reached long after is not; phases sum their runs, and unmarked phases read zero.
    #[test]
    fn runs_the_device_reached_as_the_host_enqueued_them_count_as_starved() {
        let run = |phase, host: [f64; 2], device: [f64; 2]| MarkedRun {
            phase,
            host,
            device,
        };
        let overlap = StepOverlap::of_runs(&[
            // The host runs ahead: the attention ends on the device 20 ms after it was enqueued.
            run(StepPhase::ForwardAttention, [0.000, 0.001], [0.001, 0.021]),
            run(StepPhase::ForwardAttention, [0.001, 0.002], [0.021, 0.041]),
            // Many small launches: the device ends 10 µs after the host's last one.
            run(
                StepPhase::ProjectionsBackward,
                [0.050, 0.060],
                [0.045, 0.06001],
            ),
        ]);
        let phase = |p: StepPhase| &overlap.phases[p.index()];
        let attention = phase(StepPhase::ForwardAttention);
        assert_eq!(attention.runs, 2);
        assert!((attention.device_seconds - 0.040).abs() < 1e-12);
        assert!((attention.host_seconds - 0.002).abs() < 1e-12);
        assert!((attention.least_lead_seconds - 0.020).abs() < 1e-12);
        assert_eq!(attention.starved_runs, 0);
        let projections = phase(StepPhase::ProjectionsBackward);
        assert_eq!(projections.starved_runs, 1);
        assert!(projections.least_lead_seconds < STARVED_LEAD_SECONDS);
        let setup = phase(StepPhase::Setup);
        assert_eq!((setup.runs, setup.least_lead_seconds), (0, 0.0));
        assert!((overlap.device_seconds - 0.06001).abs() < 1e-12);
        assert!((overlap.host_seconds - 0.060).abs() < 1e-12);
    }
}
