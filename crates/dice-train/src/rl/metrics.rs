//! What a BiC-RL run reports in `metrics.jsonl`: a line per RL step ([`RlStepMetrics`]) and per
//! evaluation ([`RlEvalMetrics`]), and the sums a step's line is made of ([`StepTotals`]).

use super::rollout::Rolled;
use super::turns::TurnMetrics;
use crate::dist::Collective;
use crate::run::StepLine;
use anyhow::Result;
use serde::Serialize;
use std::collections::BTreeMap;

/// Levels the per-level pass rates are summed over (0–7).
const LEVELS: usize = 8;

/// One RL step's line in `metrics.jsonl`.
#[derive(Debug, Clone, Serialize)]
pub struct RlStepMetrics {
    pub step: u64,
    pub tasks: usize,
    /// Completions rolled out.
    pub samples: usize,
    pub reward_mean: f64,
    /// Share of completions that compiled and were correct.
    pub pass_rate: f64,
    /// Share of completions the audit flagged as reward hacks.
    pub deceptive_rate: f64,
    /// Pass rate per task level, for the levels the step drew.
    pub pass_rate_by_level: BTreeMap<u32, f64>,
    /// Task groups with a learning signal (not all equally rewarded).
    pub groups_kept: usize,
    /// Whether the step updated the weights: false when every task group's completions were
    /// rewarded alike (no group kept), so that there was nothing to learn from.
    pub learned: bool,
    pub advantage_mean: f64,
    pub advantage_std: f64,
    pub advantage_abs_max: f64,
    pub replay_samples: usize,
    pub loss_tokens: usize,
    /// Mean loss over the step's updates; null, as the update's other numbers, when the step
    /// learned nothing.
    pub loss: Option<f64>,
    /// Mean k3 KL term over the replay samples.
    pub kl: Option<f64>,
    pub clip_fraction: Option<f64>,
    /// Mean −log π_old of the decoded tokens: the policy's entropy on what it decoded.
    pub entropy: Option<f64>,
    /// Gradient norm (before clipping) of the step's last update.
    pub grad_norm: Option<f64>,
    pub updates: usize,
    pub tokens_generated: u64,
    pub rollout_tokens_per_s: f64,
    pub seconds_rollout: f64,
    /// Time the judge spent judging (overlapping the rollout).
    pub seconds_judge: f64,
    /// Time from the last completion to the last verdict: the devices idle, waiting for it.
    pub seconds_idle: f64,
    pub seconds_update: f64,
    /// Where the update's seconds went (absent when the step learned nothing).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seconds_update_parts: Option<UpdateSeconds>,
    pub seconds_step: f64,
    /// Each rank's rollout, judge, idle and update seconds, in rank order (a rank is a GPU
    /// with --device cuda).
    pub seconds_per_rank: Vec<RankSeconds>,
    /// How refinement went, with trajectories of several turns (absent with one: the counts
    /// above are then over every turn's completions, the seconds over every turn's rollout).
    #[serde(flatten)]
    pub turns: Option<TurnMetrics>,
}

/// The parts of one step's update on this rank, each ended by the device's synchronisation
/// (the rest of `seconds_update` is making room for it: dropping a rollout engine).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct UpdateSeconds {
    /// The replay built from the traces (every replayed step's visibility), moments reset.
    pub replay: f64,
    /// log π_old of every replayed position: one forward over the replay, before any update.
    pub old_log_probs: f64,
    /// The policy loss's forwards and backwards over the replay, gradients summed.
    pub loss_and_grads: f64,
    /// Gradient norm, clipping and AdamW, with the ranks' all-reduce.
    pub optimizer: f64,
}

impl UpdateSeconds {
    /// One line: every part's seconds.
    pub fn summary(&self) -> String {
        format!(
            "replay {:.2} s, old log-probs {:.2} s, loss and gradients {:.2} s, optimizer {:.2} s",
            self.replay, self.old_log_probs, self.loss_and_grads, self.optimizer
        )
    }
}

/// One rank's share of a step's time.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RankSeconds {
    pub rollout: f64,
    pub judge: f64,
    pub idle: f64,
    pub update: f64,
}

/// An evaluation's line in `metrics.jsonl`.
#[derive(Debug, Clone, Serialize)]
pub struct RlEvalMetrics {
    pub step: u64,
    pub eval_tasks: usize,
    pub eval_pass_rate: f64,
    pub eval_deceptive_rate: f64,
    pub eval_seconds: f64,
}

impl StepLine for RlStepMetrics {
    fn describe(&self) -> String {
        let (reward, pass) = (self.reward_mean, self.pass_rate);
        match self.kl {
            Some(kl) => format!("reward {reward:.3} · pass {pass:.3} · kl {kl:.2e}"),
            None => format!("reward {reward:.3} · pass {pass:.3} · nothing learned"),
        }
    }

    fn note(&self) -> Option<String> {
        (!self.learned).then(|| {
            format!(
                "RL step {} learned nothing: the completions of every task group were rewarded \
                 alike (mean reward {:.3}), so no group was kept and the weights were not updated",
                self.step, self.reward_mean
            )
        })
    }
}

/// A step's rollout statistics, summed over the rank's groups, then over the ranks.
#[derive(Default)]
pub(crate) struct StepTotals {
    pub(crate) samples: f64,
    pub(crate) reward_sum: f64,
    pub(crate) passed: f64,
    pub(crate) deceptive: f64,
    pub(crate) tokens: f64,
    pub(crate) groups_kept: f64,
    /// Advantages of the kept groups (one per completion, of every turn).
    pub(crate) advantages: f64,
    pub(crate) advantage_sum: f64,
    pub(crate) advantage_sq_sum: f64,
    pub(crate) advantage_abs_max: f64,
    /// (samples, passed) per level.
    levels: [[f64; 2]; LEVELS],
}

/// A task group's sums are taken on their own, then added to the step's: the ranks' totals
/// add up to one rank's exactly when each holds one group (see [`super::trainer`]'s update).
impl StepTotals {
    /// Adds a task group's completions (of every turn, when trajectories have several).
    pub(crate) fn add_group<'a, I>(&mut self, level: usize, rolled: I)
    where
        I: IntoIterator<Item = &'a Rolled> + Clone,
    {
        let rolled = || rolled.clone().into_iter();
        let passed: f64 = rolled()
            .map(|r| f64::from(u8::from(r.score.passed && !r.score.deceptive)))
            .sum();
        let samples = rolled().count() as f64;
        self.samples += samples;
        self.reward_sum += rolled().map(|r| r.score.reward).sum::<f64>();
        self.passed += passed;
        self.deceptive += rolled()
            .map(|r| f64::from(u8::from(r.score.deceptive)))
            .sum::<f64>();
        self.tokens += rolled()
            .map(|r| r.completion.token_ids.len() as f64)
            .sum::<f64>();
        let bucket = &mut self.levels[level.min(LEVELS - 1)];
        bucket[0] += samples;
        bucket[1] += passed;
    }

    pub(crate) fn add_advantages(&mut self, advantages: &[f64]) {
        self.groups_kept += 1.0;
        self.advantages += advantages.len() as f64;
        self.advantage_sum += advantages.iter().sum::<f64>();
        self.advantage_sq_sum += advantages.iter().map(|a| a * a).sum::<f64>();
        self.advantage_abs_max = advantages
            .iter()
            .fold(self.advantage_abs_max, |max, a| max.max(a.abs()));
    }

    pub(crate) fn all_reduce(mut self, collective: &dyn Collective) -> Result<Self> {
        let mut values: Vec<f64> = [
            self.samples,
            self.reward_sum,
            self.passed,
            self.deceptive,
            self.tokens,
            self.groups_kept,
            self.advantages,
            self.advantage_sum,
            self.advantage_sq_sum,
        ]
        .into_iter()
        .chain(self.levels.iter().flatten().copied())
        .collect();
        collective.all_reduce_sum_f64(&mut values)?;
        let mut values = values.into_iter();
        let mut next = || values.next().expect("as many values as were summed");
        self.samples = next();
        self.reward_sum = next();
        self.passed = next();
        self.deceptive = next();
        self.tokens = next();
        self.groups_kept = next();
        self.advantages = next();
        self.advantage_sum = next();
        self.advantage_sq_sum = next();
        for bucket in &mut self.levels {
            *bucket = [next(), next()];
        }
        let world = collective.world_size();
        let mut max = vec![0.0; world];
        max[collective.rank()] = self.advantage_abs_max;
        collective.all_reduce_sum_f64(&mut max)?;
        self.advantage_abs_max = max.into_iter().fold(0.0, f64::max);
        Ok(self)
    }

    pub(crate) fn pass_rate_by_level(&self) -> BTreeMap<u32, f64> {
        self.levels
            .iter()
            .enumerate()
            .filter(|(_, [n, _])| *n > 0.0)
            .map(|(level, [n, passed])| (level as u32, passed / n))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::SingleProcess;
    use crate::rl::reward::Score;
    use dice_engine::Completion;

    #[test]
    fn step_totals_count_passes_per_level() {
        let rolled = |passed: bool| Rolled {
            completion: Completion {
                id: 0,
                token_ids: vec![1, 2],
                trace: vec![1, 1],
                finish_reason: dice_engine::FinishReason::Length,
                prompt_len: 3,
            },
            score: Score {
                reward: f64::from(u8::from(passed)),
                passed,
                deceptive: false,
                feedback: None,
            },
        };
        let mut totals = StepTotals::default();
        totals.add_group(1, &[rolled(true), rolled(false)]);
        totals.add_group(2, &[rolled(false), rolled(false)]);
        let totals = totals.all_reduce(&SingleProcess).unwrap();
        assert_eq!(
            (totals.samples, totals.passed, totals.tokens),
            (4.0, 1.0, 8.0)
        );
        assert_eq!(
            totals.pass_rate_by_level(),
            BTreeMap::from([(1, 0.5), (2, 0.0)])
        );
    }
}
