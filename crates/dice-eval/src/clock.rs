//! Where a candidate's run-stage time went, stage by stage.

use crate::gate::{Access, SharedPass};
use std::time::Instant;

/// Wall time of a candidate's stages, as the evaluator saw them, in seconds; time spent waiting
/// for an untimed pass is also summed apart (`pass wait`).
pub(crate) struct StageClock {
    started: Instant,
    last: Instant,
    stages: Vec<(String, f64)>,
    pass_wait_s: f64,
}

impl StageClock {
    pub(crate) fn start() -> Self {
        let now = Instant::now();
        StageClock {
            started: now,
            last: now,
            stages: Vec::new(),
            pass_wait_s: 0.0,
        }
    }

    /// A pass of `access` for one untimed step; the wait for it counts as `pass wait`.
    pub(crate) fn untimed<'a>(&mut self, access: &Access<'a>) -> Option<SharedPass<'a>> {
        let asked = Instant::now();
        let pass = access.untimed();
        self.pass_wait_s += asked.elapsed().as_secs_f64();
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
        self.stages
            .push((name.to_string(), (now - self.last).as_secs_f64()));
        self.last = now;
    }

    pub(crate) fn total_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }
}
