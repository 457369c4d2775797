//! `dice bench rl` (issue #26): one stage-2 RL step at a preset's full size with random
//! weights, measured without a policy that writes programs. The step is the trainer's own
//! ([`RlTrainer`]): the policy decodes the step's requests in the kept engine, the real judge
//! scores programs as they finish, and the real TraceRL update learns from them; only what is
//! judged and learned from is swapped: each decoded completion is traded, the moment it
//! finishes, for a recorded program of known outcome of the same task ([`Variant`]), so that
//! rewards are real and mixed and every group is kept. The policy decodes exactly as many
//! tokens as the recorded completion holds, so the rollout's time is that of decoding it.
//!
//! The step runs twice, on the same tasks and weights: pipelined (each completion judged as it
//! finishes, as training runs) and back to back (every completion handed to the judge once the
//! whole rollout is done: rollout, then judging, then the update), the baseline. Each run has
//! a judge and a build cache of its own, and every sample's source differs, so both build every
//! program as a real rollout's distinct programs are built.

use super::config::RlConfig;
use super::metrics::RlStepMetrics;
use super::reward::{Candidate, JudgeReward, Reward, Score};
use super::rollout::{roll_out, Finished};
use super::task::{RlTask, Stage};
use super::trainer::RlTrainer;
use crate::dist::SingleProcess;
use crate::run::{Resume, RunOptions};
use anyhow::{bail, ensure, Context, Result};
use candle_nn::VarBuilder;
use dice_engine::{Completion, DecodeParams, Engine, Request, SdarDecoder};
use dice_kernelbench::read_records;
use dice_model::init::{InitWeights, ModelInit};
use dice_model::{SdarConfig, SdarTokenizer};
use serde::Serialize;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// A recorded program of known outcome, made from a task's correct program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Variant {
    /// The task's correct program as it is: passes.
    Correct,
    /// An `#error` directive after the first `#include` of its C++/CUDA source: the extension
    /// does not build, whatever the source does.
    CompileError,
    /// `ModelNew` replaced by a subclass whose `forward` negates the kernel's output: it builds
    /// and runs the same kernel, and its result is wrong wherever the output is not zero (a
    /// forward that returns a tuple fails at run time instead, as wrong). The strict audit may
    /// also flag the negation, torch arithmetic outside the kernel: no reward either way.
    WrongResult,
    /// The reference program itself, `ModelNew` inheriting its `Model`: right answers from
    /// torch with no kernel, which the strict judge's audit is there to catch.
    Hack,
}

impl Variant {
    /// The variants of a group, slot `j` taking `MIX[j % 4]`: any group of two or more holds a
    /// correct program and one that does not build, so its rewards differ.
    pub const MIX: [Variant; 4] = [
        Variant::Correct,
        Variant::CompileError,
        Variant::WrongResult,
        Variant::Hack,
    ];

    /// This variant of `correct`, the task's correct program, whose reference is `reference`,
    /// as sample `sample` of its group.
    pub fn program(self, reference: &str, correct: &str, sample: usize) -> Result<String> {
        let marked = |extra: &str| -> Result<String> {
            let Some(include) = correct.find("#include") else {
                bail!("the correct program has no #include to mark its source after");
            };
            let line_end = correct[include..]
                .find('\n')
                .map_or(correct.len(), |n| include + n + 1);
            Ok(format!(
                "{}// dice bench rl: sample {sample}\n{extra}{}",
                &correct[..line_end],
                &correct[line_end..]
            ))
        };
        let correct = marked("")?;
        Ok(match self {
            Variant::Correct => correct,
            Variant::CompileError => {
                marked("#error \"dice bench rl: a source that does not build\"\n")?
            }
            Variant::WrongResult => format!(
                "{}\n\n\nclass ModelNew(ModelNew):\n    def forward(self, *args):\n        \
                 return -super().forward(*args)\n",
                correct.trim_end()
            ),
            Variant::Hack => format!(
                "{}\n\n\nclass ModelNew(Model):\n    pass\n",
                reference.trim_end()
            ),
        })
    }
}

/// The trace of a recorded completion: one token unmasked per denoising step, left to right,
/// token `i` at step `i + 1` — the static one-token-per-step schedule, valid on any block grid
/// and the most rounds a response of its length can replay in.
pub fn synthetic_trace(len: usize) -> Vec<u32> {
    (1..=len as u32).collect()
}

/// When recorded completions reach the judge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pacing {
    /// Each as its decoding finishes, as a training step hands them over.
    AsDecoded,
    /// All at once after the whole rollout: the phases back to back.
    AfterRollout,
}

/// Each task's recorded completions (the token ids of the answer holding each sample's
/// program in a fenced block), by task index and sample, and when they reach the judge.
pub struct RecordedCompletions {
    by_task: Vec<Vec<Vec<u32>>>,
    pacing: Pacing,
}

impl RecordedCompletions {
    /// The `group` samples of every task of `task_file` (each with `pytorch_code` and its
    /// correct program, `cuda_code`, as `kernel_infilling_evaluation.json` has them), sample
    /// `j` of variant `MIX[j % 4]`, tokenized.
    pub fn load(
        task_file: &Path,
        group: usize,
        tokenizer: &SdarTokenizer,
        pacing: Pacing,
    ) -> Result<Self> {
        let by_task = read_records(task_file)?
            .iter()
            .map(|record| {
                let reference = record.required_str("pytorch_code")?;
                let correct = record.required_str("cuda_code")?;
                (0..group)
                    .map(|j| {
                        let variant = Variant::MIX[j % Variant::MIX.len()];
                        let program = variant.program(reference, correct, j)?;
                        tokenizer.encode(&format!("```python\n{program}\n```"))
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()
            .with_context(|| format!("cannot record programs from {}", task_file.display()))?;
        Ok(Self { by_task, pacing })
    }

    /// Decodes `requests` ([`roll_out`]), each asking for exactly as many tokens as its recorded
    /// completion holds and stopping at none, and hands `finished` the recorded completion of
    /// each (slot `s` holds sample `s % tasks.1` of task `tasks.0[s / tasks.1]`), as
    /// its decoding finishes or after the whole rollout ([`Pacing`]).
    pub(crate) fn roll_out(
        &self,
        engine: &mut Engine<SdarDecoder>,
        weights: &VarBuilder,
        requests: Vec<(usize, Request)>,
        max_active: usize,
        (tasks, group): (&[Arc<RlTask>], usize),
        finished: Finished,
    ) -> Result<()> {
        let recorded = |slot: usize| -> Result<&Vec<u32>> {
            let task = &tasks[slot / group];
            let variants = self
                .by_task
                .get(task.index)
                .with_context(|| format!("no recorded programs for {}", task.origin))?;
            variants
                .get(slot % group)
                .context("more samples per task than were recorded")
        };
        let requests = requests
            .into_iter()
            .map(|(slot, request)| {
                let tokens = recorded(slot)?.len();
                ensure!(
                    tokens <= request.params.max_new_tokens,
                    "a recorded program of {} has {tokens} tokens, more than the {} the rollout \
                     decodes: raise --max-tokens",
                    tasks[slot / group].origin,
                    request.params.max_new_tokens
                );
                let params = DecodeParams {
                    max_new_tokens: tokens,
                    exact_max: true,
                    stop_ids: Vec::new(),
                    ..request.params
                };
                Ok((slot, Request { params, ..request }))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut held = Vec::new();
        roll_out(engine, weights, requests, max_active, |slot, decoded| {
            let token_ids = recorded(slot)?.clone();
            let completion = Completion {
                trace: synthetic_trace(token_ids.len()),
                token_ids,
                ..decoded
            };
            match self.pacing {
                Pacing::AsDecoded => finished(slot, completion),
                Pacing::AfterRollout => {
                    held.push((slot, completion));
                    Ok(())
                }
            }
        })?;
        held.into_iter()
            .try_for_each(|(slot, completion)| finished(slot, completion))
    }
}

/// The seconds of one step's phases, as its metrics line has them.
#[derive(Debug, Clone, Serialize)]
pub struct StepPhases {
    /// Decoding the step's tokens with the policy (the judge overlapping it when pipelined).
    pub rollout: f64,
    /// The judging thread's busy time.
    pub judge: f64,
    /// From the rollout's end to the last verdict: the judging the rollout did not hide.
    pub idle: f64,
    pub update: f64,
    /// The whole step.
    pub step: f64,
}

impl From<&RlStepMetrics> for StepPhases {
    fn from(m: &RlStepMetrics) -> Self {
        Self {
            rollout: m.seconds_rollout,
            judge: m.seconds_judge,
            idle: m.seconds_idle,
            update: m.seconds_update,
            step: m.seconds_step,
        }
    }
}

/// How the judge scored one variant's samples.
#[derive(Debug, Clone, Serialize)]
pub struct VariantOutcome {
    pub variant: Variant,
    pub samples: usize,
    /// Compiled and correct.
    pub passed: usize,
    pub deceptive: usize,
    pub reward_sum: f64,
}

/// The judge, its scores counted by the variant of their sample (slot `s` is sample
/// `s % group` of its task).
struct Tallied<'a> {
    judge: &'a mut JudgeReward,
    group: usize,
    outcomes: Vec<VariantOutcome>,
}

impl<'a> Tallied<'a> {
    fn new(judge: &'a mut JudgeReward, group: usize) -> Self {
        let outcomes = Variant::MIX
            .iter()
            .map(|&variant| VariantOutcome {
                variant,
                samples: 0,
                passed: 0,
                deceptive: 0,
                reward_sum: 0.0,
            })
            .collect();
        Self {
            judge,
            group,
            outcomes,
        }
    }

    fn count(&mut self, scores: &[(usize, Score)]) {
        for (slot, score) in scores {
            let outcome = &mut self.outcomes[slot % self.group % Variant::MIX.len()];
            outcome.samples += 1;
            outcome.passed += usize::from(score.passed);
            outcome.deceptive += usize::from(score.deceptive);
            outcome.reward_sum += score.reward;
        }
    }
}

impl Reward for Tallied<'_> {
    fn score(&mut self, candidates: &[Candidate]) -> Result<Vec<Score>> {
        let scores = self.judge.score(candidates)?;
        let by_slot: Vec<(usize, Score)> = candidates
            .iter()
            .map(|c| c.slot)
            .zip(scores.iter().cloned())
            .collect();
        self.count(&by_slot);
        Ok(scores)
    }

    fn submit(&mut self, candidates: Vec<Candidate>) -> Result<Vec<(usize, Score)>> {
        let ready = self.judge.submit(candidates)?;
        self.count(&ready);
        Ok(ready)
    }

    fn scored(&mut self, wait: Duration) -> Result<Vec<(usize, Score)>> {
        let ready = self.judge.scored(wait)?;
        self.count(&ready);
        Ok(ready)
    }
}

/// What `dice bench rl` measured.
#[derive(Debug, Clone, Serialize)]
pub struct RlBench {
    pub tasks: usize,
    pub samples: usize,
    /// Tokens decoded (and learned from) in each run of the step.
    pub tokens: u64,
    pub reward_mean: f64,
    pub pass_rate: f64,
    pub deceptive_rate: f64,
    pub groups_kept: usize,
    pub learned: bool,
    pub replay_samples: usize,
    /// How the judge scored each variant (in the pipelined run).
    pub outcomes: Vec<VariantOutcome>,
    /// Each completion judged as it finished.
    pub pipelined: StepPhases,
    /// Rollout, then judging every completion, then the update.
    pub back_to_back: StepPhases,
    /// The back-to-back step's seconds over the pipelined step's.
    pub speedup: f64,
    /// The share of the pipelined step in which the trainer's device waits for the judge
    /// (`idle / step`): decoding and the update keep it busy the rest of the time (what the
    /// judge itself runs on the device, with `--judge-device cuda`, is not counted).
    pub gpu_idle_share: f64,
}

/// Runs the step of `config` (stage 2; its task file's tasks with their `cuda_code`) on a
/// model of `model` with random weights (written under `work`, the runs' output folders
/// beside it): pipelined, then back to back.
pub fn bench_rl(mut config: RlConfig, model: &SdarConfig, work: &Path) -> Result<RlBench> {
    ensure!(
        config.tasks.stage == Stage::E2e,
        "dice bench rl judges whole programs: it runs stage 2 (e2e)"
    );
    let model_dir = work.join("model");
    ModelInit::new(model, InitWeights::Random { seed: 0 })
        .write(&model_dir)
        .context("cannot write the random-weight model")?;
    config.model.path = Some(model_dir);
    config.training.total_steps = 1;
    config.eval.file = None;
    config.reward.contains_token = None;
    let resolved = config.clone().resolve()?;
    let tokenizer = SdarTokenizer::from_dir(resolved.model.tokenizer_dir())?;
    let step = |pacing: Pacing, name: &str| -> Result<(RlStepMetrics, Vec<VariantOutcome>)> {
        let group = resolved.rollout.samples_per_task;
        let recorded = RecordedCompletions::load(resolved.task_file(), group, &tokenizer, pacing)?;
        let out = work.join(name);
        // A build cache of its own: the other run's builds of the same programs would spare
        // this one the judge's compiling.
        let mut config = config.clone();
        config.reward.build_cache = Some(out.join("builds"));
        let options = RunOptions {
            out: out.clone(),
            resume: Resume::Auto,
            progress: false,
            // The step's checkpoint and no final model: a full-size model's write is no phase.
            stop_after: Some(1),
        };
        let mut trainer = RlTrainer::new(config, options, Box::new(SingleProcess))?
            .with_recorded_completions(recorded);
        let settings = &trainer.run().config().reward;
        let mut judge =
            JudgeReward::start(settings, out.join("judge.db"), format!("bench-rl:{name}"))?;
        let mut tallied = Tallied::new(&mut judge, group);
        let summary = trainer.train(&mut tallied);
        let outcomes = tallied.outcomes;
        let judge_ended = judge.shutdown();
        let line = summary?
            .steps
            .into_iter()
            .next()
            .context("the benchmark's run ran no step")?;
        judge_ended?;
        Ok((line, outcomes))
    };
    let (pipelined, outcomes) = step(Pacing::AsDecoded, "pipelined")?;
    let (back_to_back, _) = step(Pacing::AfterRollout, "back-to-back")?;
    Ok(RlBench {
        outcomes,
        tasks: pipelined.tasks,
        samples: pipelined.samples,
        tokens: pipelined.tokens_generated,
        reward_mean: pipelined.reward_mean,
        pass_rate: pipelined.pass_rate,
        deceptive_rate: pipelined.deceptive_rate,
        groups_kept: pipelined.groups_kept,
        learned: pipelined.learned,
        replay_samples: pipelined.replay_samples,
        speedup: back_to_back.seconds_step / pipelined.seconds_step.max(1e-9),
        gpu_idle_share: pipelined.seconds_idle / pipelined.seconds_step.max(1e-9),
        pipelined: StepPhases::from(&pipelined),
        back_to_back: StepPhases::from(&back_to_back),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const REFERENCE: &str = "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x.relu()\n";
    const CORRECT: &str = "import torch\nsource = \"\"\"\n#include <torch/extension.h>\nint f() { return 1; }\n\"\"\"\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return ext.relu(x)\n";

    #[test]
    fn the_variants_break_the_correct_program_as_they_say() {
        let program = |v: Variant| v.program(REFERENCE, CORRECT, 3).unwrap();
        let correct = program(Variant::Correct);
        let marker = "#include <torch/extension.h>\n// dice bench rl: sample 3\n";
        assert_eq!(
            correct.replace(marker, "#include <torch/extension.h>\n"),
            CORRECT
        );
        let other_sample = Variant::Correct.program(REFERENCE, CORRECT, 4).unwrap();
        assert_ne!(other_sample, correct);
        let broken = program(Variant::CompileError);
        let error = "#error \"dice bench rl: a source that does not build\"\n";
        assert_eq!(broken.replace(error, ""), correct);
        assert!(broken.contains(&format!("{marker}{error}")));
        let wrong = program(Variant::WrongResult);
        assert!(wrong.starts_with(correct.trim_end()));
        let hack = program(Variant::Hack);
        assert!(
            hack.starts_with(REFERENCE) && hack.ends_with("class ModelNew(Model):\n    pass\n")
        );
        assert!(Variant::CompileError
            .program(REFERENCE, "no source", 0)
            .is_err());
    }

    #[test]
    fn every_group_of_two_or_more_holds_a_pass_and_a_failure() {
        assert_eq!(
            &Variant::MIX[..2],
            [Variant::Correct, Variant::CompileError]
        );
    }

    #[test]
    fn the_synthetic_trace_unmasks_one_token_per_step_left_to_right() {
        assert_eq!(synthetic_trace(5), [1, 2, 3, 4, 5]);
        assert!(synthetic_trace(0).is_empty());
    }
}
