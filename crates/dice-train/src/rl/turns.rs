//! Refinement in RL (issue #28, as Kevin does it): with `rollout.turns` T > 1 each of a task's
//! samples is a trajectory of up to T turns. Turn 1 decodes the task's prompt; a turn whose
//! program does not earn the full reward (correct and not deceptive) is followed by another,
//! whose prompt is the conversation so far (the turn's prompt and answer) with the judge's
//! feedback on that answer as the user's next message ([`Score::feedback`], built from the
//! stored verdict by [`dice_eval::refinement_feedback`], which reveals none of the judge's
//! inputs, seeds or thresholds).
//!
//! Each turn's program keeps its own reward r_t (still strict, speedup shaping optional); its
//! return is G_t = r_t + γ·G_{t+1} over the turns after it ([`discounted_returns`]), so a turn
//! is credited for the fixes it leads to. The returns of every turn of a task's group are
//! z-scored together, and each turn's response is replayed (TraceRL) with its own prompt,
//! trace and advantage. With one turn this is the one-turn step exactly: the returns are the
//! rewards, the seeds and the judge's sample ids are those of the first turn.

use super::reward::Score;
use super::rollout::{sample_seed, PhaseTimes, Rolled};
use crate::dist::Collective;
use anyhow::{ensure, Context, Result};
use dice_model::SdarTokenizer;
use serde::Serialize;

/// The next turn's user message after a completion whose reward gave no verdict to quote
/// (the toy rewards).
pub const NO_REWARD_FEEDBACK: &str = "Your answer did not earn the reward. Try again.";

/// The end of the model's turn in the ChatML of the RL prompts.
const END_OF_TURN: &str = "<|im_end|>";

/// The seed of turn `turn` (0-based) of the completion in `slot` of `step`: the first turn's is
/// [`sample_seed`], the later turns' differ from it and from each other.
pub fn turn_seed(seed: u64, step: u64, slot: usize, turn: usize) -> u64 {
    sample_seed(seed, step, slot) ^ (turn as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93)
}

/// The return of each turn of a trajectory with `rewards`: G_t = r_t + `discount`·G_{t+1},
/// the last turn's its reward.
pub fn discounted_returns(rewards: &[f64], discount: f64) -> Vec<f64> {
    let mut returns = rewards.to_vec();
    for t in (0..returns.len().saturating_sub(1)).rev() {
        returns[t] += discount * returns[t + 1];
    }
    returns
}

/// Whether a completion earned the full reward: correct and not deceptive. Its trajectory
/// ends there (with speedup shaping too: a faster program is not asked for).
pub fn earned(score: &Score) -> bool {
    score.passed && !score.deceptive
}

/// One turn of a sample's trajectory: the prompt it decoded and its scored completion.
pub(crate) struct Turn {
    pub(crate) prompt: Vec<u32>,
    pub(crate) rolled: Rolled,
}

/// How a trajectory goes on after a turn that did not earn the reward.
pub struct Refinement<'a> {
    tokenizer: &'a SdarTokenizer,
    /// Where an answer ends: the end of the model's turn and the rollout's stop token.
    answer_ends: [u32; 2],
    /// Turns of a trajectory at most.
    turns: usize,
    /// The longest prompt the replay keeps: a turn with a longer one would not be learned from,
    /// so its trajectory ends before it.
    max_prompt_len: usize,
}

impl<'a> Refinement<'a> {
    pub fn new(
        tokenizer: &'a SdarTokenizer,
        stop: u32,
        turns: usize,
        max_prompt_len: usize,
    ) -> Result<Self> {
        let end_of_turn = tokenizer
            .inner()
            .token_to_id(END_OF_TURN)
            .with_context(|| format!("refinement needs {END_OF_TURN}: the tokenizer has none"))?;
        Ok(Self {
            tokenizer,
            answer_ends: [end_of_turn, stop],
            turns,
            max_prompt_len,
        })
    }

    /// The prompt of the turn after one that decoded `prompt` into `completion` with `score`:
    /// `prompt`, the answer (the completion up to its first end of turn or stop token), the
    /// end of the turn, the feedback as the user's message and the opening of the model's next
    /// turn (with the blank line the stage-2 prompt opens it with). `None` when the trajectory
    /// ends: the answer earned the reward, or the next prompt would be longer than the replay
    /// keeps.
    pub fn next_prompt(
        &self,
        prompt: &[u32],
        completion: &[u32],
        score: &Score,
    ) -> Result<Option<Vec<u32>>> {
        if earned(score) {
            return Ok(None);
        }
        let answer = completion
            .iter()
            .position(|id| self.answer_ends.contains(id))
            .map_or(completion, |end| &completion[..end]);
        let feedback = score.feedback.as_deref().unwrap_or(NO_REWARD_FEEDBACK);
        let message = self.tokenizer.encode(&format!(
            "{END_OF_TURN}\n<|im_start|>user\n{feedback}{END_OF_TURN}\n<|im_start|>assistant\n\n"
        ))?;
        let next = [prompt, answer, &message].concat();
        Ok((next.len() <= self.max_prompt_len).then_some(next))
    }
}

/// Rolls out the step's trajectories: every slot's `first_prompts` entry, then, turn after
/// turn, the next prompts `refinement` gives (none: one turn). `roll` decodes and scores one
/// turn's `(slot, prompt)`s (0-based turn, slots ascending) and returns the scored completions
/// in that order. Returns each slot's turns, and the phase times summed over the turns.
pub(crate) fn roll_out_trajectories(
    first_prompts: Vec<Vec<u32>>,
    refinement: Option<&Refinement>,
    mut roll: impl FnMut(usize, &[(usize, Vec<u32>)]) -> Result<(Vec<Rolled>, PhaseTimes)>,
) -> Result<(Vec<Vec<Turn>>, PhaseTimes)> {
    let turns = refinement.map_or(1, |r| r.turns);
    let mut trajectories: Vec<Vec<Turn>> = first_prompts.iter().map(|_| Vec::new()).collect();
    let mut prompts: Vec<(usize, Vec<u32>)> = first_prompts.into_iter().enumerate().collect();
    let mut times = PhaseTimes::default();
    for turn in 0..turns {
        if prompts.is_empty() {
            break;
        }
        let (rolled, turn_times) = roll(turn, &prompts)?;
        ensure!(
            rolled.len() == prompts.len(),
            "internal error: {} completions for {} prompts",
            rolled.len(),
            prompts.len()
        );
        times.rollout += turn_times.rollout;
        times.judge += turn_times.judge;
        times.idle += turn_times.idle;
        let mut next = Vec::new();
        for ((slot, prompt), rolled) in prompts.into_iter().zip(rolled) {
            if let Some(refinement) = refinement.filter(|_| turn + 1 < turns) {
                let completion = &rolled.completion.token_ids;
                if let Some(prompt) = refinement.next_prompt(&prompt, completion, &rolled.score)? {
                    next.push((slot, prompt));
                }
            }
            trajectories[slot].push(Turn { prompt, rolled });
        }
        prompts = next;
    }
    Ok((trajectories, times))
}

/// How refinement went in a step (`metrics.jsonl`, with trajectories of several turns).
#[derive(Debug, Clone, Serialize)]
pub struct TurnMetrics {
    /// Completions of each turn: every sample's first, then those whose trajectory went on.
    pub samples_by_turn: Vec<usize>,
    /// Mean reward of each turn's completions.
    pub reward_mean_by_turn: Vec<f64>,
    /// Mean over the trajectories of their best turn's reward.
    pub best_turn_reward_mean: f64,
    /// Share of the trajectories whose first turn did not earn the full reward and a later
    /// turn did.
    pub fixed_after_first_turn: f64,
}

/// The sums [`TurnMetrics`] are made of, over the rank's trajectories, then over the ranks.
pub(crate) struct TurnTotals {
    /// (completions, reward sum) per turn.
    by_turn: Vec<[f64; 2]>,
    trajectories: f64,
    best_reward_sum: f64,
    fixed: f64,
}

impl TurnTotals {
    pub(crate) fn new(turns: usize) -> Self {
        Self {
            by_turn: vec![[0.0; 2]; turns],
            trajectories: 0.0,
            best_reward_sum: 0.0,
            fixed: 0.0,
        }
    }

    /// Adds a task group's trajectories: their sums taken on their own, then added to the
    /// step's, so that ranks holding a group each sum as one rank holding them all
    /// ([`super::metrics::StepTotals`] does the same).
    pub(crate) fn add_group(&mut self, trajectories: &[Vec<Turn>]) {
        let mut group = Self::new(self.by_turn.len());
        for turns in trajectories {
            for (sums, turn) in group.by_turn.iter_mut().zip(turns) {
                sums[0] += 1.0;
                sums[1] += turn.rolled.score.reward;
            }
            group.trajectories += 1.0;
            group.best_reward_sum += turns
                .iter()
                .map(|t| t.rolled.score.reward)
                .fold(0.0, f64::max);
            let earned_at = turns.iter().position(|t| earned(&t.rolled.score));
            group.fixed += f64::from(u8::from(earned_at.is_some_and(|t| t > 0)));
        }
        for (sums, group) in self.by_turn.iter_mut().zip(&group.by_turn) {
            sums[0] += group[0];
            sums[1] += group[1];
        }
        self.trajectories += group.trajectories;
        self.best_reward_sum += group.best_reward_sum;
        self.fixed += group.fixed;
    }

    pub(crate) fn all_reduce(self, collective: &dyn Collective) -> Result<TurnMetrics> {
        let mut values: Vec<f64> = [self.trajectories, self.best_reward_sum, self.fixed]
            .into_iter()
            .chain(self.by_turn.iter().flatten().copied())
            .collect();
        collective.all_reduce_sum_f64(&mut values)?;
        let trajectories = values[0].max(1.0);
        let by_turn = values[3..].chunks(2);
        Ok(TurnMetrics {
            samples_by_turn: by_turn.clone().map(|s| s[0] as usize).collect(),
            reward_mean_by_turn: by_turn.map(|s| s[1] / s[0].max(1.0)).collect(),
            best_turn_reward_mean: values[1] / trajectories,
            fixed_after_first_turn: values[2] / trajectories,
        })
    }
}

/// The longest prompt the engine decodes, given the longest first prompt: with several turns,
/// any up to the replay's `max_prompt_len` (the trajectories end before longer ones).
pub(crate) fn longest_turn_prompt(
    turns: usize,
    longest_first: usize,
    max_prompt_len: usize,
) -> usize {
    if turns > 1 {
        longest_first.max(max_prompt_len)
    } else {
        longest_first
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn score(passed: bool, feedback: Option<&str>) -> Score {
        Score {
            reward: f64::from(u8::from(passed)),
            passed,
            deceptive: false,
            feedback: feedback.map(str::to_string),
        }
    }

    #[test]
    fn returns_discount_the_later_turns_rewards() {
        assert_eq!(
            discounted_returns(&[0.0, 0.0, 1.0], 0.4),
            [0.16000000000000003, 0.4, 1.0]
        );
        assert_eq!(discounted_returns(&[1.0], 0.4), [1.0]);
        assert_eq!(discounted_returns(&[0.5, 1.0], 0.0), [0.5, 1.0]);
        assert!(discounted_returns(&[], 0.4).is_empty());
    }

    #[test]
    fn the_first_turn_keeps_the_sample_seed() {
        assert_eq!(turn_seed(7, 3, 5, 0), sample_seed(7, 3, 5));
        assert_ne!(turn_seed(7, 3, 5, 1), sample_seed(7, 3, 5));
        assert_ne!(turn_seed(7, 3, 5, 1), turn_seed(7, 3, 5, 2));
    }

    #[test]
    fn the_next_prompt_holds_the_answer_and_the_feedback() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/sdar");
        let tokenizer = SdarTokenizer::from_dir(&dir).unwrap();
        let stop = tokenizer.inner().token_to_id("<|endoftext|>").unwrap();
        let refinement = Refinement::new(&tokenizer, stop, 2, 2000).unwrap();
        let prompt = tokenizer
            .encode("<|im_start|>user\nWrite relu.<|im_end|>\n<|im_start|>assistant\n\n")
            .unwrap();
        let answer = tokenizer.encode("```python\nx = 1\n```").unwrap();
        // The answer ends at the stop token; what the engine decoded after it is not said.
        let completion = [&answer[..], &[stop, 11, 12]].concat();
        let feedback = "The judge's verdict on your program: output mismatch.";
        let next = refinement
            .next_prompt(&prompt, &completion, &score(false, Some(feedback)))
            .unwrap()
            .unwrap();
        assert_eq!(next[..prompt.len()], prompt[..]);
        assert_eq!(next[prompt.len()..prompt.len() + answer.len()], answer[..]);
        let text = tokenizer.inner().decode(&next, false).unwrap();
        assert_eq!(
            text,
            format!(
                "<|im_start|>user\nWrite relu.<|im_end|>\n<|im_start|>assistant\n\n```python\n\
                 x = 1\n```<|im_end|>\n<|im_start|>user\n{feedback}<|im_end|>\n\
                 <|im_start|>assistant\n\n"
            )
        );
        // Without a verdict the next turn is told it earned nothing.
        let toy = refinement
            .next_prompt(&prompt, &answer, &score(false, None))
            .unwrap()
            .unwrap();
        let toy = tokenizer.inner().decode(&toy, false).unwrap();
        assert!(
            toy.contains(&format!("user\n{NO_REWARD_FEEDBACK}<|im_end|>")),
            "{toy}"
        );
        // An answer that earned the reward ends its trajectory, and so does a prompt the replay
        // would drop.
        assert_eq!(
            refinement
                .next_prompt(&prompt, &answer, &score(true, None))
                .unwrap(),
            None
        );
        let short = Refinement::new(&tokenizer, stop, 2, next.len() - 1).unwrap();
        let failed = score(false, Some(feedback));
        assert_eq!(
            short.next_prompt(&prompt, &completion, &failed).unwrap(),
            None
        );
    }
}
