//! Where a candidate's run-stage time went, stage by stage.

use crate::gate::{Access, SharedPass, StepHistory};
use std::time::Instant;

/// A stage or a wait for a pass this long is logged (info, target `dice_eval::stages`), so that a
/// batch that stops finishing samples shows what its samples were doing.
const SLOW_STAGE_S: f64 = 2.0;

/// Wall time of a candidate's stages, as the evaluator saw them, in seconds; time spent waiting
/// for an untimed pass is also summed apart (`pass wait`).
pub(crate) struct StageClock {
    started: Instant,
    last: Instant,
    stages: Vec<(String, f64)>,
    pass_wait_s: f64,
    /// How long the candidate's untimed steps held the device: long ones take turns with timers.
    history: StepHistory,
    /// What the log calls the candidate (its job folder's name).
    label: String,
}

impl StageClock {
    pub(crate) fn start() -> Self {
        let now = Instant::now();
        StageClock {
            started: now,
            last: now,
            stages: Vec::new(),
            pass_wait_s: 0.0,
            history: StepHistory::default(),
            label: String::new(),
        }
    }

    /// Names the candidate in the log's lines about its slow stages.
    pub(crate) fn set_label(&mut self, label: String) {
        self.label = label;
    }

    /// Counts the stages from now, as a clock started now with the same name.
    pub(crate) fn restart(&mut self) {
        let label = std::mem::take(&mut self.label);
        *self = StageClock::start();
        self.label = label;
    }

    /// A pass of `access` for one untimed step; the wait for it counts as `pass wait`.
    pub(crate) fn untimed<'a>(&mut self, access: &Access<'a>) -> Option<SharedPass<'a>> {
        let asked = Instant::now();
        let pass = access.untimed_step(&self.history);
        let waited = asked.elapsed().as_secs_f64();
        if waited >= SLOW_STAGE_S {
            let label = &self.label;
            tracing::info!(
                target: "dice_eval::stages",
                "{label}: waited {waited:.1} s for an untimed pass"
            );
        }
        self.pass_wait_s += waited;
        pass
    }

    pub(crate) fn into_stages(mut self) -> Vec<(String, f64)> {
        self.stages
            .push(("pass wait".to_string(), self.pass_wait_s));
        self.stages
    }

    /// Ends the stage `name`, which began when the previous one ended.
    pub(crate) fn lap(&mut self, name: &str) {
        let now = Instant::now();
        let took = (now - self.last).as_secs_f64();
        if took >= SLOW_STAGE_S {
            let label = &self.label;
            tracing::info!(target: "dice_eval::stages", "{label}: {name} took {took:.1} s");
        }
        self.stages.push((name.to_string(), took));
        self.last = now;
    }

    pub(crate) fn total_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }
}
