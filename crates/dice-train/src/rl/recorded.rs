//! Recorded completions for `dice bench rl` ([`super::bench`]): programs of known outcome made
//! from each task's correct program ([`Variant`]), tokenized as answers, with a trace their
//! replay can use ([`synthetic_trace`]), handed to the judge in place of what the policy decodes
//! ([`RecordedCompletions`]). Below the trainer, whose step takes them as its rollout's source.

use super::rollout::{roll_out, Finished};
use super::task::RlTask;
use anyhow::{bail, ensure, Context, Result};
use candle_nn::VarBuilder;
use dice_engine::{Completion, DecodeParams, Engine, Request, SdarDecoder};
use dice_kernelbench::read_records;
use dice_model::SdarTokenizer;
use serde::Serialize;
use std::path::Path;
use std::sync::Arc;

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
    /// torch with no kernel, which the strict judge rejects before running it.
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
                "# dice bench rl: sample {sample}\n{}\n\n\nclass ModelNew(Model):\n    pass\n",
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
        // Marked by sample too, so that no two samples are one program judged once.
        let hack = program(Variant::Hack);
        let (first, rest) = hack.split_once('\n').unwrap();
        assert!(first.starts_with("# dice bench rl: sample "), "{first}");
        assert!(
            rest.starts_with(REFERENCE) && rest.ends_with("class ModelNew(Model):\n    pass\n")
        );
        assert_ne!(Variant::Hack.program(REFERENCE, CORRECT, 4).unwrap(), hack);
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
