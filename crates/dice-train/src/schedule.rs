//! Learning-rate schedules as Hugging Face transformers defines them
//! (`get_constant_schedule_with_warmup`, `get_cosine_schedule_with_warmup` with
//! `num_cycles = 0.5`): a pure function of the number of optimizer steps taken.
//!
//! The reference (spec §6.5) trains with `constant_with_warmup` and a warmup ratio of 0.03.
//! Like transformers' `LambdaLR`, the factor of step 0 applies to the first update, so a run
//! with warmup starts with a learning rate of exactly 0.

use serde::{Deserialize, Serialize};

/// The shape of the schedule after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// The peak learning rate until the end (the reference's).
    ConstantWithWarmup,
    /// Half a cosine period from the peak down to 0 at the last step.
    Cosine,
}

/// A learning-rate schedule over a run of `total_steps` optimizer steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub kind: ScheduleKind,
    pub peak_lr: f64,
    /// Steps of linear warmup from 0 to `peak_lr`.
    pub warmup_steps: u64,
    pub total_steps: u64,
}

impl LrSchedule {
    /// A schedule whose warmup is `warmup_ratio` of the run, rounded up as transformers'
    /// `TrainingArguments.get_warmup_steps` does (`ceil(total_steps · warmup_ratio)`).
    pub fn with_warmup_ratio(
        kind: ScheduleKind,
        peak_lr: f64,
        warmup_ratio: f64,
        total_steps: u64,
    ) -> Self {
        Self {
            kind,
            peak_lr,
            warmup_steps: (total_steps as f64 * warmup_ratio).ceil() as u64,
            total_steps,
        }
    }

    /// The multiplier of `peak_lr` for the update that follows `step` completed optimizer
    /// steps (transformers' `lr_lambda(step)`, computed in f64 in the same order).
    pub fn factor(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return step as f64 / self.warmup_steps.max(1) as f64;
        }
        match self.kind {
            ScheduleKind::ConstantWithWarmup => 1.0,
            ScheduleKind::Cosine => {
                const NUM_CYCLES: f64 = 0.5;
                let decay_steps = self.total_steps.saturating_sub(self.warmup_steps).max(1);
                let progress = (step - self.warmup_steps) as f64 / decay_steps as f64;
                let cosine = (std::f64::consts::PI * NUM_CYCLES * 2.0 * progress).cos();
                (0.5 * (1.0 + cosine)).max(0.0)
            }
        }
    }

    /// The learning rate of the update that follows `step` completed optimizer steps.
    pub fn lr(&self, step: u64) -> f64 {
        self.peak_lr * self.factor(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_close(got: f64, want: f64) {
        assert!(
            (got - want).abs() <= 1e-15 * want.abs().max(1e-300),
            "{got} != {want}"
        );
    }

    #[test]
    fn warmup_steps_round_up_like_transformers() {
        let schedule = |ratio, total| {
            LrSchedule::with_warmup_ratio(ScheduleKind::ConstantWithWarmup, 1e-5, ratio, total)
                .warmup_steps
        };
        assert_eq!(schedule(0.03, 1000), 30);
        assert_eq!(schedule(0.03, 1001), 31);
        assert_eq!(schedule(0.03, 10), 1);
        assert_eq!(schedule(0.0, 10), 0);
    }

    #[test]
    fn constant_with_warmup_matches_the_hf_formula() {
        let s = LrSchedule {
            kind: ScheduleKind::ConstantWithWarmup,
            peak_lr: 1e-5,
            warmup_steps: 4,
            total_steps: 100,
        };
        // step / max(1, warmup) below the warmup, then 1.
        let want = [0.0, 0.25, 0.5, 0.75, 1.0, 1.0];
        for (step, &factor) in want.iter().enumerate() {
            assert_eq!(s.factor(step as u64), factor, "step {step}");
        }
        assert_eq!(s.lr(0), 0.0);
        assert_close(s.lr(1), 2.5e-6);
        assert_eq!(s.lr(99), 1e-5);
        assert_eq!(s.lr(1000), 1e-5);
    }

    #[test]
    fn no_warmup_starts_at_the_peak() {
        let s = LrSchedule {
            kind: ScheduleKind::ConstantWithWarmup,
            peak_lr: 2e-5,
            warmup_steps: 0,
            total_steps: 10,
        };
        assert_eq!(s.lr(0), 2e-5);
    }

    #[test]
    fn cosine_matches_the_hf_formula() {
        let s = LrSchedule {
            kind: ScheduleKind::Cosine,
            peak_lr: 1e-3,
            warmup_steps: 2,
            total_steps: 10,
        };
        // Warmup: 0, 1/2. Then progress p = (step - 2) / 8 and 0.5 · (1 + cos(π p)).
        assert_eq!(s.factor(0), 0.0);
        assert_eq!(s.factor(1), 0.5);
        assert_eq!(s.factor(2), 1.0);
        // p = 1/8: 0.5 · (1 + cos(π/8)) = 0.5 + 0.25·√(2 + √2).
        assert_close(s.factor(3), 0.5 + 0.25 * (2.0 + 2f64.sqrt()).sqrt());
        // p = 1/4: 0.5 · (1 + √2/2).
        assert_close(s.factor(4), 0.5 + 0.25 * 2f64.sqrt());
        // p = 1/2: cos(π/2) is 6.1e-17 in f64, not 0.
        assert_close(s.factor(6), 0.5);
        // p = 3/4: 0.5 · (1 − √2/2).
        assert_close(s.factor(8), 0.5 - 0.25 * 2f64.sqrt());
        // p = 1: the end of the half period; past it the factor rises again (transformers
        // does not clamp the progress).
        assert!(s.factor(10) < 1e-16);
        assert_close(
            s.factor(11),
            0.5 * (1.0 + (std::f64::consts::PI * 9.0 / 8.0).cos()),
        );
        assert_close(s.lr(4), 1e-3 * (0.5 + 0.25 * 2f64.sqrt()));
    }

    #[test]
    fn cosine_shorter_than_its_warmup_divides_by_one() {
        let s = LrSchedule {
            kind: ScheduleKind::Cosine,
            peak_lr: 1.0,
            warmup_steps: 5,
            total_steps: 3,
        };
        assert_eq!(s.factor(4), 0.8);
        // max(1, total − warmup) = 1: progress 0 at step 5, 1 at step 6.
        assert_eq!(s.factor(5), 1.0);
        assert!(s.factor(6) < 1e-16);
    }

    #[test]
    fn kinds_serialize_as_transformers_names_them() {
        assert_eq!(
            serde_json::to_string(&ScheduleKind::ConstantWithWarmup).unwrap(),
            r#""constant_with_warmup""#
        );
        assert_eq!(
            serde_json::to_string(&ScheduleKind::Cosine).unwrap(),
            r#""cosine""#
        );
    }
}
