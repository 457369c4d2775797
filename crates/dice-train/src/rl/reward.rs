//! Rewards (spec bicrl §6): what a rollout's completions are worth. [`JudgeReward`] judges
//! their programs with the evaluator (strict: 1 for a program that compiles, is correct and is
//! not flagged deceptive, else 0; speedup shaping on request); [`ContainsToken`] is a verifiable
//! toy reward for tests of the loop, [`CensusToken`] the same with a token a census of the first
//! step's completions picks.

use super::config::RewardConfig;
use super::task::RlTask;
use anyhow::{bail, ensure, Context, Result};
use dice_eval::store::{SampleKey, Verdict};
use dice_eval::{
    refinement_feedback, Batch, EvalConfig, EvalProblem, EvalSample, Evaluated, Evaluator,
    SampleOutcome, StaticAudit,
};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// One finished completion to reward.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// Position of the completion in its step (task-major: task slot × group size + sample).
    pub slot: usize,
    pub task: Arc<RlTask>,
    /// A number unique to this completion over the run (the evaluator's sample id).
    pub sample_id: u32,
    pub token_ids: Vec<u32>,
    /// The program to judge, `None` when the completion has none.
    pub program: Option<String>,
}

/// What a completion earned.
#[derive(Debug, Clone, PartialEq)]
pub struct Score {
    pub reward: f64,
    /// Compiled and correct.
    pub passed: bool,
    /// Flagged as a reward hack by the audit.
    pub deceptive: bool,
    /// What the verdict tells the model, as the next turn's user message of a refinement
    /// ([`dice_eval::refinement_feedback`]: it reveals none of the judge's inputs, seeds or
    /// thresholds); `None` from a reward without a verdict (the toy rewards, a task whose
    /// reference failed), whose next turn is told only that it earned nothing.
    pub feedback: Option<String>,
}

/// Scores completions; called from the judging thread with whatever completions have finished
/// since its last call, so it sees them as they come.
pub trait Reward: Send {
    /// One score per candidate, in order.
    fn score(&mut self, candidates: &[Candidate]) -> Result<Vec<Score>>;

    /// Takes candidates and returns the scores ready now, by slot; the others come from
    /// [`Reward::scored`]. A reward that judges in the background (the evaluator) returns at
    /// once, so completions that finish meanwhile are judged beside these; by default they are
    /// scored before it returns.
    fn submit(&mut self, candidates: Vec<Candidate>) -> Result<Vec<(usize, Score)>> {
        let scores = self.score(&candidates)?;
        ensure!(
            scores.len() == candidates.len(),
            "the reward scored {} of {} completions",
            scores.len(),
            candidates.len()
        );
        Ok(candidates.iter().map(|c| c.slot).zip(scores).collect())
    }

    /// Scores of submitted candidates that became ready, by slot, waiting at most `wait` for
    /// the first of them; none when every submitted candidate has its score.
    fn scored(&mut self, wait: Duration) -> Result<Vec<(usize, Score)>> {
        let _ = wait;
        Ok(Vec::new())
    }
}

/// Reward 1 when the completion holds a given token, else 0: a reward the tiny test models can
/// learn, to check that the loop moves the policy towards reward.
#[derive(Debug, Clone, Copy)]
pub struct ContainsToken(pub u32);

impl Reward for ContainsToken {
    fn score(&mut self, candidates: &[Candidate]) -> Result<Vec<Score>> {
        Ok(candidates
            .iter()
            .map(|c| {
                let passed = c.token_ids.contains(&self.0);
                Score {
                    reward: f64::from(u8::from(passed)),
                    passed,
                    deceptive: false,
                    feedback: None,
                }
            })
            .collect())
    }
}

/// Per token, the completions holding it (each counted once, however often it holds it).
#[derive(Debug, Default, Clone)]
pub struct TokenCensus {
    pub holding: HashMap<u32, usize>,
    pub completions: usize,
}

impl TokenCensus {
    pub fn count(&mut self, token_ids: &[u32]) {
        let mut ids = token_ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        for id in ids {
            *self.holding.entry(id).or_default() += 1;
        }
        self.completions += 1;
    }

    /// The token held by the number of completions closest to half of them (some but not all:
    /// none when every token is held by all or by one alike), the smaller id among equals;
    /// with the completions holding it.
    pub fn balanced(&self) -> Option<(u32, usize)> {
        let half = self.completions as f64 / 2.0;
        self.holding
            .iter()
            .filter(|&(_, &n)| n < self.completions)
            .map(|(&id, &n)| (id, n))
            .min_by(|a, b| {
                let off = |n: usize| (n as f64 - half).abs();
                off(a.1).total_cmp(&off(b.1)).then(a.0.cmp(&b.0))
            })
    }
}

/// [`ContainsToken`] with the token a census of the run's first step picks
/// ([`TokenCensus::balanced`]): the first step's completions are held until all `first_step`
/// of them are in, then scored with it. The choice is written to `record` (JSON: the token, the
/// completions holding it, the census's most held tokens), and a run that finds the file there
/// (a resumed run) keeps its token.
pub struct CensusToken {
    first_step: usize,
    record: PathBuf,
    census: TokenCensus,
    held: Vec<Candidate>,
    chosen: Option<ContainsToken>,
}

impl CensusToken {
    pub fn new(first_step: usize, record: PathBuf) -> Result<Self> {
        let chosen = match std::fs::read_to_string(&record) {
            Ok(text) => {
                let value: serde_json::Value = serde_json::from_str(&text)
                    .with_context(|| format!("cannot read {}", record.display()))?;
                let token = value["token"]
                    .as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .with_context(|| format!("{} names no token", record.display()))?;
                Some(ContainsToken(token))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", record.display())),
        };
        Ok(Self {
            first_step,
            record,
            census: TokenCensus::default(),
            held: Vec::new(),
            chosen,
        })
    }

    /// The census's choice, recorded; the error says what the completions were like.
    fn choose(&mut self) -> Result<ContainsToken> {
        let (token, holding) = self.census.balanced().with_context(|| {
            format!(
                "the census of the first step's {} completions found no token that some but                  not all of them hold: give a token id to --reward-token instead",
                self.census.completions
            )
        })?;
        let mut most: Vec<(usize, u32)> =
            self.census.holding.iter().map(|(&t, &n)| (n, t)).collect();
        most.sort_unstable_by(|a, b| b.cmp(a));
        most.truncate(20);
        let record = serde_json::json!({
            "token": token,
            "holding": holding,
            "completions": self.census.completions,
            "most_held": most.iter().map(|&(n, t)| serde_json::json!({"token": t, "holding": n})).collect::<Vec<_>>(),
        });
        std::fs::write(&self.record, format!("{record:#}\n"))
            .with_context(|| format!("cannot write {}", self.record.display()))?;
        tracing::info!(
            "the toy reward's token is {token}: {holding} of the first step's {} completions \
             hold it (census in {})",
            self.census.completions,
            self.record.display()
        );
        Ok(ContainsToken(token))
    }
}

impl Reward for CensusToken {
    fn score(&mut self, candidates: &[Candidate]) -> Result<Vec<Score>> {
        let mut scores: HashMap<usize, Score> =
            self.submit(candidates.to_vec())?.into_iter().collect();
        candidates
            .iter()
            .map(|c| {
                scores.remove(&c.slot).with_context(|| {
                    format!(
                        "the census holds completions until the first step's {} are in",
                        self.first_step
                    )
                })
            })
            .collect()
    }

    fn submit(&mut self, candidates: Vec<Candidate>) -> Result<Vec<(usize, Score)>> {
        if let Some(mut token) = self.chosen {
            return token.submit(candidates);
        }
        for c in &candidates {
            self.census.count(&c.token_ids);
        }
        self.held.extend(candidates);
        if self.held.len() < self.first_step {
            return Ok(Vec::new());
        }
        let mut token = self.choose()?;
        self.chosen = Some(token);
        token.submit(std::mem::take(&mut self.held))
    }
}

/// The evaluator as the reward: candidates are judged in strict mode (the static and run-time
/// reward-hack checks count against them) into the store `db` by one [`Evaluator`] for the whole
/// run, whose fork servers, build cache and problems' reference processes stay warm from one
/// call to the next. Submitted candidates join those being judged; scores come back as each
/// program's verdict is stored.
pub struct JudgeReward {
    evaluator: Evaluator,
    speedup_cap: Option<f64>,
    /// The slot of each candidate submitted and not scored yet, by its evaluator sample key.
    slots: HashMap<SampleKey, usize>,
}

impl JudgeReward {
    /// Starts the judge on `settings.judge_device` (the CPU when unset: resolved settings set it).
    pub fn start(settings: &RewardConfig, db: PathBuf, source: String) -> Result<Self> {
        let mut cfg = EvalConfig::new(db, source);
        cfg.set_device(settings.judge_device.unwrap_or_default());
        cfg.strict = true;
        cfg.correctness_trials = settings.correctness_trials;
        cfg.atol = settings.tolerance;
        cfg.rtol = settings.tolerance;
        cfg.timeout = Duration::from_secs(settings.timeout_s);
        // Resumed steps are judged again rather than read back: their samples are redrawn.
        cfg.force = true;
        if !settings.speedup_shaping {
            cfg.perf_trials = 0;
        }
        cfg.python.clone_from(&settings.python);
        if let Some(dir) = &settings.build_cache {
            cfg.build_cache.clone_from(dir);
        }
        let audit = Arc::new(StaticAudit { strict: true });
        let evaluator = Evaluator::start(cfg, Some(audit)).context("cannot start the judge")?;
        Ok(Self {
            evaluator,
            speedup_cap: settings.speedup_shaping.then_some(settings.speedup_cap),
            slots: HashMap::new(),
        })
    }

    /// Ends the judge's fork servers, once its run's timeline is stored.
    pub fn shutdown(self) -> Result<()> {
        self.evaluator.finish().map(drop)
    }
}

impl JudgeReward {
    /// The score of a sample the evaluator is done with, by its candidate's slot.
    fn score_of(&mut self, evaluated: Evaluated) -> Result<(usize, Score)> {
        let (level, problem_id, sample_id) = evaluated.sample;
        let slot = self.slots.remove(&evaluated.sample).with_context(|| {
            format!("the judge returned level {level} task {problem_id} sample {sample_id}, not submitted")
        })?;
        let record = match evaluated.outcome {
            SampleOutcome::Judged(record) => record,
            // Its task's reference failed: nothing to be right about.
            SampleOutcome::ReferenceFailed(_) => {
                let score = Score {
                    reward: 0.0,
                    passed: false,
                    deceptive: false,
                    feedback: None,
                };
                return Ok((slot, score));
            }
            SampleOutcome::AlreadyStored | SampleOutcome::JudgedElsewhere => bail!(
                "level {level} task {problem_id} sample {sample_id} was judged by another \
                 process on the judge's store: give each trainer a store of its own"
            ),
        };
        let passed = record.verdict == Verdict::Correct;
        let earned = passed && !record.deceptive;
        let reward = match (earned, self.speedup_cap) {
            (false, _) => 0.0,
            (true, None) => 1.0,
            (true, Some(cap)) => record.speedup.unwrap_or(1.0).min(cap),
        };
        let score = Score {
            reward,
            passed,
            deceptive: record.deceptive,
            feedback: Some(refinement_feedback(&record, None)),
        };
        Ok((slot, score))
    }
}

impl Reward for JudgeReward {
    fn score(&mut self, candidates: &[Candidate]) -> Result<Vec<Score>> {
        let mut ready: HashMap<usize, Score> =
            self.submit(candidates.to_vec())?.into_iter().collect();
        while let Some(evaluated) = self.evaluator.next()? {
            let (slot, score) = self.score_of(evaluated)?;
            ready.insert(slot, score);
        }
        candidates
            .iter()
            .map(|c| {
                ready
                    .remove(&c.slot)
                    .context("the judge did not score a completion")
            })
            .collect()
    }

    fn submit(&mut self, candidates: Vec<Candidate>) -> Result<Vec<(usize, Score)>> {
        let mut problems: Vec<EvalProblem> = Vec::new();
        let mut samples = Vec::with_capacity(candidates.len());
        for c in candidates {
            let (level, problem_id) = problem_key(&c.task);
            if !problems
                .iter()
                .any(|p| (p.level, p.problem_id) == (level, problem_id))
            {
                problems.push(EvalProblem {
                    level,
                    problem_id,
                    name: format!("task_{}", c.task.index),
                    source: c.task.pytorch_code.clone().into_bytes(),
                    defect: None,
                });
            }
            self.slots.insert((level, problem_id, c.sample_id), c.slot);
            samples.push(EvalSample {
                level,
                problem_id,
                sample_id: c.sample_id,
                code: c.program.map(String::into_bytes),
                origin: format!("{} sample {}", c.task.origin, c.sample_id),
            });
        }
        self.evaluator.submit(Batch::new(problems, samples)?)?;
        Ok(Vec::new())
    }

    fn scored(&mut self, wait: Duration) -> Result<Vec<(usize, Score)>> {
        let mut ready = Vec::new();
        let mut next = self.evaluator.next_timeout(wait)?;
        while let Some(evaluated) = next {
            ready.push(self.score_of(evaluated)?);
            next = self.evaluator.next_timeout(Duration::ZERO)?;
        }
        Ok(ready)
    }
}

/// The evaluator's problem key of a task: its level, and its position in the task file.
fn problem_key(task: &RlTask) -> (u32, u32) {
    (task.level, task.index as u32)
}

#[cfg(test)]
mod tests {
    use super::TokenCensus;

    #[test]
    fn the_census_picks_the_token_held_closest_to_half_never_one_all_hold() {
        let mut census = TokenCensus::default();
        for completion in [&[1, 2, 3, 3][..], &[1, 2], &[1, 4], &[1, 2, 5]] {
            census.count(completion);
        }
        // 1 is in all four (no signal), 2 in three, 3/4/5 in one: 3 repeated counts once.
        assert_eq!(census.holding[&3], 1);
        assert_eq!(census.balanced(), Some((2, 3)));
        census.count(&[3, 4]);
        // Of five, 2 (3) and 3, 4 (2 each) are equally far from 2.5: the smaller id.
        assert_eq!(census.balanced(), Some((2, 3)));
        let mut alike = TokenCensus::default();
        alike.count(&[7]);
        alike.count(&[7]);
        assert_eq!(alike.balanced(), None);
    }
}
