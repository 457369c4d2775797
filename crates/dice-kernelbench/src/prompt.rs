//! Prompts: KernelBench's one-shot end-to-end prompt (as DICE builds it) and DICE's
//! kernel-infilling prompt. Their fixed text lives in `templates/` (see ATTRIBUTION.md there)
//! and is reproduced byte for byte.

use crate::problem::Problem;
use crate::records::read_records;
use anyhow::{Context, Result};
use std::path::Path;

/// KernelBench's example architecture (`Model` returning `a + b`).
pub const EXAMPLE_ARCH_SRC: &str = include_str!("../templates/model_ex_add.py");
/// KernelBench's example answer (`ModelNew` with an inline element-wise-add CUDA kernel).
pub const EXAMPLE_NEW_ARCH_SRC: &str = include_str!("../templates/model_new_ex_add.py");

const ONE_SHOT_TEMPLATE: &str = include_str!("../templates/kernelbench_one_shot.txt");
const INFILLING_TEMPLATE: &str = include_str!("../templates/dice_infilling.txt");

/// The one-shot CUDA prompt of KernelBench v0.1 / DICE
/// (`prompt_generate_custom_cuda_from_prompt_template`) for a reference program: the user
/// message DICE sends as the single chat turn.
pub fn one_shot_prompt(ref_arch_src: &str) -> String {
    render(
        ONE_SHOT_TEMPLATE,
        &[
            ("example_arch_src", EXAMPLE_ARCH_SRC),
            ("example_new_arch_src", EXAMPLE_NEW_ARCH_SRC),
            ("ref_arch_src", ref_arch_src),
        ],
    )
}

/// [`one_shot_prompt`] for a problem.
pub fn problem_prompt(problem: &Problem) -> Result<String> {
    Ok(one_shot_prompt(problem.source_text()?))
}

/// One kernel-infilling task: a reference and the skeleton (prefix, suffix) of its CUDA
/// program; `middle` is the reference core, when the task file has it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InfillingTask {
    pub id: Option<u32>,
    pub pytorch_code: String,
    pub prefix: String,
    pub middle: Option<String>,
    pub suffix: String,
    /// `file#index` or `file:line`.
    pub origin: String,
}

/// Reads infilling tasks (DICE's `kernel_infilling_evaluation.json` format: a JSON array or
/// JSONL of objects with `pytorch_code`, `prefix`, `suffix`, optional `id` and `middle`).
pub fn load_infilling_tasks(path: &Path) -> Result<Vec<InfillingTask>> {
    read_records(path)?
        .into_iter()
        .map(|r| {
            Ok(InfillingTask {
                id: r.u32_field("id")?,
                pytorch_code: r.required_str("pytorch_code")?.to_string(),
                prefix: r.required_str("prefix")?.to_string(),
                middle: r.str_field("middle")?.map(str::to_string),
                suffix: r.required_str("suffix")?.to_string(),
                origin: r.origin,
            })
        })
        .collect::<Result<_>>()
        .with_context(|| format!("cannot read infilling tasks from {}", path.display()))
}

/// DICE's kernel-infilling prompt. Unlike [`one_shot_prompt`] this is the complete model
/// input, already in ChatML markup (`<|im_start|>user` … `<|im_start|>assistant\n`), exactly
/// as DICE feeds it; it must not go through a chat template again.
pub fn infilling_prompt(task: &InfillingTask) -> String {
    render(
        INFILLING_TEMPLATE,
        &[
            ("example_arch_src", EXAMPLE_ARCH_SRC),
            ("example_new_arch_src", EXAMPLE_NEW_ARCH_SRC),
            ("pytorch_code", &task.pytorch_code),
            ("prefix", &task.prefix),
            ("suffix", &task.suffix),
        ],
    )
}

/// The complete candidate program: the task's prefix, the generated core, its suffix.
/// (DICE's pairs satisfy `cuda_code == prefix + middle + suffix` exactly.)
pub fn assemble_infilled(task: &InfillingTask, core: &str) -> String {
    [task.prefix.as_str(), core, task.suffix.as_str()].concat()
}

/// Replaces `{name}` markers in one left-to-right pass; substituted values are never
/// re-scanned, so a problem containing `{prefix}` stays intact.
fn render(template: &str, values: &[(&str, &str)]) -> String {
    let mut out =
        String::with_capacity(template.len() + values.iter().map(|v| v.1.len()).sum::<usize>());
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let hit = values
            .iter()
            .find(|(name, _)| after.starts_with(name) && after[name.len()..].starts_with('}'));
        match hit {
            Some((name, value)) => {
                out.push_str(value);
                rest = &after[name.len() + 1..];
            }
            None => {
                out.push('{');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_is_single_pass() {
        let out = render("a{x}b{y}c{z}", &[("x", "{y}"), ("y", "Y")]);
        assert_eq!(out, "a{y}bYc{z}");
    }

    #[test]
    fn every_marker_is_used_once() {
        for (template, names) in [
            (
                ONE_SHOT_TEMPLATE,
                &["example_arch_src", "example_new_arch_src", "ref_arch_src"][..],
            ),
            (
                INFILLING_TEMPLATE,
                &[
                    "example_arch_src",
                    "example_new_arch_src",
                    "pytorch_code",
                    "prefix",
                    "suffix",
                ][..],
            ),
        ] {
            for name in names {
                assert_eq!(
                    template.matches(&format!("{{{name}}}")).count(),
                    1,
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn problem_text_with_markers_is_kept() {
        let src = "x = '{ref_arch_src}'";
        let prompt = one_shot_prompt(src);
        assert_eq!(prompt.matches(src).count(), 1);
    }

    #[test]
    fn assembly_concatenates_prefix_core_suffix() {
        let task = InfillingTask {
            id: None,
            pytorch_code: String::new(),
            prefix: "P\n".into(),
            middle: None,
            suffix: "\nS".into(),
            origin: "t".into(),
        };
        assert_eq!(assemble_infilled(&task, "core"), "P\ncore\nS");
    }
}
