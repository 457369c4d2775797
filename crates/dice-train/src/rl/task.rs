//! RL tasks (spec bicrl §3, §4, §12): the task files, which tasks a step draws, the prompt
//! each stage renders, and the candidate program a completion becomes.
//!
//! A task file is a JSON array or JSON Lines of objects with `pytorch_code` (the reference
//! program), and for infilling `prefix` and `suffix` (the scaffold); `level` (a number or a
//! string such as DICE's `"2"`) is kept when present, and a `prompt` is the model input as it
//! is, in place of the stage's rendered prompt. DICE's
//! `end_to_end_kernel_generation_4000.json`, `kernel_infilling_*.json` and the files
//! `dice curate export` writes all read as they are.

use anyhow::{bail, Context, Result};
use dice_kernelbench::prompt::InfillingTask;
use dice_kernelbench::prompt::{assemble_infilled, infilling_prompt, one_shot_prompt};
use dice_kernelbench::{extract_first_code, read_records, Record};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// What the policy is rewarded for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// Stage 1: fill the core of a kernel into a fixed prefix/suffix scaffold.
    Infill,
    /// Stage 2: write the whole program from the one-shot prompt.
    E2e,
}

/// One task: a reference program and, for infilling, its scaffold.
#[derive(Debug, Clone, PartialEq)]
pub struct RlTask {
    /// Position in the task file.
    pub index: usize,
    /// The task's level (0 when the file has none): the curriculum's coarse difficulty.
    pub level: u32,
    pub pytorch_code: String,
    /// `(prefix, suffix)` of the infilling scaffold.
    pub scaffold: Option<(String, String)>,
    /// The task file's own prompt, used instead of the stage's.
    pub prompt: Option<String>,
    /// `file#index` or `file:line`.
    pub origin: String,
}

/// Reads a task file for `stage`; infilling needs every task's `prefix` and `suffix`.
pub fn load_tasks(path: &Path, stage: Stage) -> Result<Vec<RlTask>> {
    let tasks = read_records(path)?
        .into_iter()
        .enumerate()
        .map(|(index, record)| task(index, &record, stage))
        .collect::<Result<Vec<_>>>()
        .with_context(|| format!("cannot read RL tasks from {}", path.display()))?;
    if tasks.is_empty() {
        bail!("{} holds no tasks", path.display());
    }
    Ok(tasks)
}

fn task(index: usize, record: &Record, stage: Stage) -> Result<RlTask> {
    let level = match record.fields.get("level") {
        None | Some(serde_json::Value::Null) => 0,
        Some(serde_json::Value::String(s)) => s
            .trim()
            .parse()
            .with_context(|| format!("{}: `level` must be a number, got {s:?}", record.origin))?,
        Some(_) => record.u32_field("level")?.unwrap_or(0),
    };
    let scaffold = match stage {
        Stage::Infill => Some((
            record.required_str("prefix")?.to_string(),
            record.required_str("suffix")?.to_string(),
        )),
        Stage::E2e => None,
    };
    Ok(RlTask {
        index,
        level,
        pytorch_code: record.required_str("pytorch_code")?.to_string(),
        scaffold,
        prompt: record.str_field("prompt")?.map(str::to_string),
        origin: record.origin.clone(),
    })
}

/// The order tasks are drawn in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum TaskOrder {
    /// File order with wrap-around (DICE's `sequential_select`): the file's order is the
    /// curriculum.
    #[default]
    Sequential,
    /// A seeded permutation of the file per pass over it.
    Shuffled,
}

/// The task indices of RL step `step` (1-based) drawing `per_step` of `len` tasks: step e takes
/// positions `(e−1)·per_step …` of the order, wrapping around (spec bicrl §3).
pub fn select_tasks(
    step: u64,
    per_step: usize,
    len: usize,
    order: TaskOrder,
    seed: u64,
) -> Vec<usize> {
    let start = (step - 1) as usize * per_step;
    (start..start + per_step)
        .map(|k| match order {
            TaskOrder::Sequential => k % len,
            TaskOrder::Shuffled => pass_order(seed, (k / len) as u64, len)[k % len],
        })
        .collect()
}

/// The permutation of pass `pass` over `len` tasks (Fisher-Yates on a generator of the seed
/// and the pass).
fn pass_order(seed: u64, pass: u64, len: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ pass.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    for i in (1..len).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    order
}

/// The prompt text of `task` for `stage`, a complete model input in ChatML (no chat template
/// goes over it; the tokenizer adds no BOS). Stage 1 is DICE's infilling prompt; stage 2 is
/// KernelBench's one-shot prompt as the reference's rollout wraps it (spec bicrl §4b): the
/// user turn opens it, and its instruction ends `… NO testing code! <|im_end|>\n<|im_start|>
/// assistant\n\n`, one newline more than stage 1. A task's own `prompt` comes as it is.
pub fn render_prompt(task: &RlTask, stage: Stage) -> Result<String> {
    if let Some(prompt) = &task.prompt {
        return Ok(prompt.clone());
    }
    match (stage, &task.scaffold) {
        (Stage::Infill, Some(_)) => Ok(infilling_prompt(&infilling_task(task))),
        (Stage::Infill, None) => bail!(
            "{}: an infilling task needs a prefix and a suffix",
            task.origin
        ),
        (Stage::E2e, _) => {
            let user = one_shot_prompt(&task.pytorch_code);
            let body = user.strip_suffix('\n').unwrap_or(&user);
            let body = body.strip_suffix('\n').unwrap_or(body);
            Ok(format!(
                "<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n\n"
            ))
        }
    }
}

fn infilling_task(task: &RlTask) -> InfillingTask {
    let (prefix, suffix) = task.scaffold.clone().unwrap_or_default();
    InfillingTask {
        id: None,
        pytorch_code: task.pytorch_code.clone(),
        prefix,
        middle: None,
        suffix,
        origin: task.origin.clone(),
    }
}

/// The candidate program of a completion, or `None` when there is none (no code block in an
/// end-to-end answer).
///
/// Stage 2 takes the first fenced block, as the reference does. Stage 1 always assembles
/// prefix + core + suffix, so the scaffold the task fixes is the program that runs whatever the
/// model wrote: the core is the first fenced block with the prefix and suffix taken off when the
/// model repeated them (the prompt asks for the whole architecture), or the completion itself
/// when it has no block (the model filled the gap directly), without surrounding whitespace.
pub fn candidate_program(task: &RlTask, stage: Stage, completion: &str) -> Option<String> {
    match (stage, &task.scaffold) {
        (Stage::Infill, Some((prefix, suffix))) => {
            let block = extract_first_code(completion).unwrap_or_else(|| completion.to_string());
            let core = block.trim();
            let core = core.strip_prefix(prefix.trim()).unwrap_or(core);
            let core = core.strip_suffix(suffix.trim()).unwrap_or(core);
            Some(assemble_infilled(&infilling_task(task), core.trim()))
        }
        _ => extract_first_code(completion),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e2e(code: &str) -> RlTask {
        RlTask {
            index: 0,
            level: 1,
            pytorch_code: code.to_string(),
            scaffold: None,
            prompt: None,
            origin: "t#0".into(),
        }
    }

    #[test]
    fn sequential_selection_wraps_around() {
        assert_eq!(select_tasks(1, 3, 5, TaskOrder::Sequential, 0), [0, 1, 2]);
        assert_eq!(select_tasks(2, 3, 5, TaskOrder::Sequential, 0), [3, 4, 0]);
        // DICE's stage 1: step 16 of 64 over 992 tasks covers 960..991 then 0..31.
        let step16 = select_tasks(16, 64, 992, TaskOrder::Sequential, 0);
        assert_eq!(
            (step16[0], step16[31], step16[32], step16[63]),
            (960, 991, 0, 31)
        );
    }

    #[test]
    fn shuffled_selection_visits_every_task_once_per_pass() {
        let mut pass: Vec<usize> = (1..=4)
            .flat_map(|step| select_tasks(step, 3, 12, TaskOrder::Shuffled, 7))
            .collect();
        assert_ne!(pass, (0..12).collect::<Vec<_>>());
        pass.sort_unstable();
        assert_eq!(pass, (0..12).collect::<Vec<_>>());
    }

    #[test]
    fn the_end_to_end_prompt_is_one_user_turn_ending_in_two_newlines() {
        let prompt = render_prompt(&e2e("class Model: pass\n"), Stage::E2e).unwrap();
        assert!(prompt.starts_with("<|im_start|>user\nYou write custom CUDA kernels"));
        assert!(prompt.ends_with("NO testing code! <|im_end|>\n<|im_start|>assistant\n\n"));
        assert_eq!(prompt.matches("class Model: pass").count(), 1);
    }

    #[test]
    fn infilling_candidates_keep_the_scaffold() {
        let task = RlTask {
            scaffold: Some(("import torch\n".into(), "\nclass ModelNew: pass\n".into())),
            ..e2e("")
        };
        let whole = "```python\nimport torch\nsource = 1\nclass ModelNew: pass\n```";
        let expected = "import torch\nsource = 1\nclass ModelNew: pass\n";
        assert_eq!(
            candidate_program(&task, Stage::Infill, whole).unwrap(),
            expected
        );
        assert_eq!(
            candidate_program(&task, Stage::Infill, "source = 1").unwrap(),
            expected
        );
        assert_eq!(candidate_program(&e2e(""), Stage::E2e, "no code"), None);
        assert_eq!(
            candidate_program(&e2e(""), Stage::E2e, "```python\nx = 1\n```").unwrap(),
            "x = 1"
        );
    }
}
