//! `metrics.html` of an RL run: the curves of `metrics.jsonl`, one chart per quantity, as a
//! self-contained page (inline SVG, no script), rewritten after every step.

use crate::metrics::{write_page, ChartSpec, Page, Quantity, CHECKPOINT_BYTES, CHECKPOINT_SECONDS};
use anyhow::Result;
use std::path::Path;

/// The RL page: what [`crate::rl::RlStepMetrics`] and the evaluation lines record.
const RL_PAGE: Page = Page {
    summary: &[
        ("reward_mean", "reward"),
        ("pass_rate", "pass rate"),
        ("deceptive_rate", "deceptive"),
        ("groups_kept", "groups kept"),
        ("kl", "kl"),
        ("clip_fraction", "clipped"),
        ("seconds_step", "seconds per step"),
    ],
    charts: &[
        ChartSpec::new(
            "reward",
            Quantity::Real("mean over completions"),
            &[("reward_mean", "reward mean")],
        ),
        ChartSpec::new(
            "reward per turn (refinement, turns counted from 0)",
            Quantity::Real("mean over the turn's completions"),
            &[
                ("reward_mean_by_turn.*", "turn *"),
                ("best_turn_reward_mean", "best turn of each trajectory"),
            ],
        ),
        ChartSpec::new(
            "completions per turn (refinement, turns counted from 0)",
            Quantity::Count("completions"),
            &[("samples_by_turn.*", "turn *")],
        ),
        ChartSpec::new(
            "trajectories fixed after the first turn",
            Quantity::Share("share of trajectories"),
            &[("fixed_after_first_turn", "fixed by a later turn")],
        ),
        ChartSpec::new(
            "pass and deceptive rates",
            Quantity::Share("share of completions"),
            &[
                ("pass_rate", "pass rate"),
                ("deceptive_rate", "deceptive rate"),
                ("eval_pass_rate", "held-out pass rate"),
                ("eval_deceptive_rate", "held-out deceptive rate"),
            ],
        ),
        ChartSpec::new(
            "pass rate per level",
            Quantity::Share("pass rate"),
            &[("pass_rate_by_level.*", "level *")],
        ),
        ChartSpec::new(
            "task groups per step",
            Quantity::Count("groups"),
            &[
                ("tasks", "tasks drawn"),
                ("groups_kept", "kept (with a learning signal)"),
            ],
        ),
        ChartSpec::new(
            "KL (k3, mean per replay sample)",
            Quantity::Amount("KL"),
            &[("kl", "kl")],
        ),
        ChartSpec::new(
            "clip fraction",
            Quantity::Share("tokens clipped"),
            &[("clip_fraction", "clipped tokens")],
        ),
        ChartSpec::new(
            "entropy (mean −log π_old of the decoded tokens)",
            Quantity::Amount("nats per token"),
            &[("entropy", "entropy")],
        ),
        ChartSpec::new(
            "policy loss",
            Quantity::Real("loss"),
            &[("loss", "policy loss")],
        ),
        ChartSpec::new(
            "gradient norm (before clipping)",
            Quantity::Amount("global norm"),
            &[("grad_norm", "gradient norm")],
        ),
        ChartSpec::new(
            "advantages",
            Quantity::Real("advantage"),
            &[
                ("advantage_mean", "mean"),
                ("advantage_std", "std"),
                ("advantage_abs_max", "|max|"),
            ],
        ),
        ChartSpec::new(
            "seconds per phase (rank 0)",
            Quantity::Amount("seconds"),
            &[
                ("seconds_rollout", "rollout"),
                ("seconds_judge", "judge (overlapping the rollout)"),
                ("seconds_idle", "idle (waiting for the judge)"),
                ("seconds_update", "update"),
                ("seconds_step", "step"),
            ],
        ),
        ChartSpec::new(
            "update seconds by part (rank 0)",
            Quantity::Amount("seconds"),
            &[
                ("seconds_update_parts.replay", "replay built"),
                ("seconds_update_parts.old_log_probs", "old log-probs"),
                ("seconds_update_parts.loss_and_grads", "loss and gradients"),
                ("seconds_update_parts.optimizer", "optimizer"),
            ],
        ),
        ChartSpec::new(
            "rollout seconds per rank",
            Quantity::Amount("seconds"),
            &[("seconds_per_rank.*.rollout", "rank *")],
        ),
        ChartSpec::new(
            "judge seconds per rank",
            Quantity::Amount("seconds"),
            &[("seconds_per_rank.*.judge", "rank *")],
        ),
        ChartSpec::new(
            "idle seconds per rank (waiting for the judge)",
            Quantity::Amount("seconds"),
            &[("seconds_per_rank.*.idle", "rank *")],
        ),
        ChartSpec::new(
            "update seconds per rank",
            Quantity::Amount("seconds"),
            &[("seconds_per_rank.*.update", "rank *")],
        ),
        ChartSpec::new(
            "rollout tokens per second",
            Quantity::Amount("tokens/s"),
            &[("rollout_tokens_per_s", "tokens/s")],
        ),
        ChartSpec::new(
            "tokens generated per step",
            Quantity::Count("tokens"),
            &[("tokens_generated", "tokens generated")],
        ),
        ChartSpec::new(
            "completions and replay samples per step",
            Quantity::Count("samples"),
            &[
                ("samples", "completions"),
                ("replay_samples", "replay samples"),
            ],
        ),
        ChartSpec::new(
            "loss tokens per step",
            Quantity::Count("tokens"),
            &[("loss_tokens", "tokens under the loss")],
        ),
        ChartSpec::new(
            "optimizer updates per step",
            Quantity::Count("updates"),
            &[("updates", "updates")],
        ),
        CHECKPOINT_SECONDS,
        CHECKPOINT_BYTES,
        ChartSpec::new(
            "held-out tasks",
            Quantity::Count("tasks"),
            &[("eval_tasks", "tasks evaluated")],
        ),
        ChartSpec::new(
            "held-out evaluation seconds",
            Quantity::Amount("seconds"),
            &[("eval_seconds", "wall seconds")],
        ),
    ],
};

/// Writes the curves of the RL run's `metrics` (its `metrics.jsonl`) to `html`.
pub fn write_html(metrics: &Path, html: &Path, title: &str) -> Result<()> {
    write_page(metrics, html, title, &RL_PAGE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::layout_misses;
    use crate::rl::metrics::{RankSeconds, RlEvalMetrics, RlStepMetrics, UpdateSeconds};
    use crate::rl::turns::TurnMetrics;
    use crate::run::checkpoint::CheckpointMetrics;

    /// The lines of a two-rank RL run: every field of its step, eval and checkpoint lines.
    fn lines() -> Vec<serde_json::Value> {
        let step = |step: u64, reward: f64| RlStepMetrics {
            step,
            tasks: 8,
            samples: 64,
            reward_mean: reward,
            pass_rate: reward,
            deceptive_rate: 0.0,
            pass_rate_by_level: [(1, reward), (2, 0.0)].into(),
            groups_kept: 5,
            learned: true,
            advantage_mean: 0.0,
            advantage_std: 1.0,
            advantage_abs_max: 1.5,
            replay_samples: 160,
            loss_tokens: 20_480,
            loss: Some(-0.1),
            kl: Some(1e-3),
            clip_fraction: Some(0.1),
            entropy: Some(2.0),
            grad_norm: Some(0.5),
            updates: 4,
            tokens_generated: 32_768,
            rollout_tokens_per_s: 100.0,
            seconds_rollout: 3.0,
            seconds_judge: 2.0,
            seconds_idle: 0.5,
            seconds_update: 1.0,
            seconds_update_parts: Some(UpdateSeconds {
                replay: 0.1,
                old_log_probs: 0.2,
                loss_and_grads: 0.6,
                optimizer: 0.1,
            }),
            seconds_step: 4.5,
            seconds_per_rank: vec![
                RankSeconds {
                    rollout: 3.0,
                    judge: 2.0,
                    idle: 0.5,
                    update: 1.0,
                };
                2
            ],
            // A run of two-turn trajectories from step 2 on: the refinement's keys too.
            turns: (step > 1).then(|| TurnMetrics {
                samples_by_turn: vec![64, 40],
                reward_mean_by_turn: vec![reward, reward / 2.0],
                best_turn_reward_mean: reward,
                fixed_after_first_turn: 0.1,
            }),
        };
        let eval = RlEvalMetrics {
            step: 2,
            eval_tasks: 3,
            eval_pass_rate: 0.25,
            eval_deceptive_rate: 0.0,
            eval_seconds: 12.0,
        };
        vec![
            serde_json::to_value(step(1, 0.25)).unwrap(),
            serde_json::to_value(step(2, 0.5)).unwrap(),
            serde_json::to_value(eval).unwrap(),
            serde_json::to_value(CheckpointMetrics {
                step: 1,
                checkpoint: "checkpoint-1".into(),
                checkpoint_bytes: 12 << 30,
                seconds_checkpoint: 0.4,
                seconds_checkpoint_write: 9.0,
                checkpoint_snapshot: crate::optim::SnapshotPlace::Device,
            })
            .unwrap(),
        ]
    }

    #[test]
    fn every_key_of_the_rl_lines_has_its_own_named_chart() {
        assert_eq!(layout_misses(&lines(), &RL_PAGE), Vec::<String>::new());
    }

    #[test]
    fn the_page_draws_every_quantity_and_level() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        let text: Vec<String> = lines().iter().map(ToString::to_string).collect();
        std::fs::write(&metrics, text.join("\n") + "\n").unwrap();
        let html = dir.path().join("metrics.html");
        write_html(&metrics, &html, "rl <run>").unwrap();
        let page = std::fs::read_to_string(&html).unwrap();
        assert!(page.contains("<title>rl &lt;run&gt;</title>"));
        assert!(
            page.contains(
                "<p>step 2 · reward 0.5 · pass rate 50.0% · deceptive 0.0% · groups kept 5 · \
                 kl 0.001 · clipped 10.0% · seconds per step 4.5</p>"
            ),
            "{page}"
        );
        for heading in [
            "reward",
            "pass and deceptive rates",
            "task groups per step",
            "KL",
            "clip fraction",
            "entropy",
            "seconds per phase",
            "rollout seconds per rank",
        ] {
            assert!(
                page.contains(&format!("<h2>{heading}")),
                "no {heading} chart"
            );
        }
        let chart = |heading: &str| {
            let from = page.split(&format!("<h2>{heading}</h2>")).nth(1).unwrap();
            from[..from.find("</figure>").unwrap()].to_string()
        };
        // Pass, deceptive, held-out pass and deceptive rate: four lines, four legend entries.
        let rates = chart("pass and deceptive rates");
        assert_eq!(rates.matches("<polyline").count(), 4);
        assert_eq!(rates.matches("<g class=\"legend\">").count(), 4);
        let levels = chart("pass rate per level");
        assert!(levels.contains(">level 1</text></g>") && levels.contains(">level 2</text></g>"));
        let ranks = chart("idle seconds per rank (waiting for the judge)");
        assert!(ranks.contains(">rank 0</text></g>") && ranks.contains(">rank 1</text></g>"));
        // Two steps: ticks 1 and 2, whole numbers.
        assert!(levels.contains("text-anchor=\"middle\">1</text>"));
        assert!(levels.contains("text-anchor=\"middle\">2</text>"));
        assert!(!levels.contains("text-anchor=\"middle\">1.5</text>"));
        assert!(!page.contains("no data yet") && !page.contains("<script"));
    }
}
