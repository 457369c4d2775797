//! BiC-RL, TraceRL as DICE runs it (spec bicrl): the loop ([`trainer`]) and its parts — the
//! tasks and their prompts ([`task`]), rollouts with the engine ([`rollout`]), rewards
//! ([`reward`]), group-relative advantages, the replay of every response's decoding trace into
//! training samples on the rollout's block grid or the reference trainer's, old
//! log-probabilities, and the clipped policy loss with its k3 KL penalty and gradients; the
//! settings and presets ([`config`]); refinement over several turns ([`turns`]); [`bench`]
//! measures a step that judges recorded programs.
//!
//! One RL step's update, given the rollouts and their rewards:
//!
//! 1. [`advantage::group_advantages`] per task; the responses of the kept groups become
//!    [`TraceRecord`]s (prompt, response and trace as the engine returns them);
//! 2. [`Replay::build`] turns them into samples;
//! 3. [`old_log_probs`] before any update;
//! 4. [`policy_loss_and_grads`] over consecutive groups of samples, one optimizer step each.

pub mod advantage;
pub mod bench;
pub mod config;
pub mod dry_run;
pub mod loss;
pub mod metrics;
pub mod recorded;
pub mod replay;
pub mod report;
pub mod reward;
pub mod rollout;
pub mod task;
pub mod trainer;
pub mod turns;

pub use config::{RewardToken, RlConfig};
pub use dry_run::dry_run_report;
pub use loss::{
    old_log_probs, pack_tokens, policy_loss_and_grad_sums, policy_loss_and_grads, PolicyLoss,
    PolicyLossSettings, SampleLoss,
};
pub use metrics::{RankSeconds, RlEvalMetrics, RlStepMetrics};
pub use replay::{BlockGrid, Replay, ReplaySample, ReplaySettings, ReplayedRecord, TraceRecord};
pub use reward::{Candidate, CensusToken, ContainsToken, JudgeReward, Reward, Score, TokenCensus};
pub use task::{load_tasks, RlTask, Stage, TaskOrder};
pub use trainer::RlTrainer;
