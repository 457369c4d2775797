//! `dice prompt`: the exact prompt a model receives for a KernelBench problem or an
//! infilling task.

use anyhow::{bail, Context, Result};
use clap::Args;
use dice_kernelbench::prompt::{infilling_prompt, load_infilling_tasks, problem_prompt};
use dice_kernelbench::KernelBench;
use dice_model::chat::ChatMessage;
use dice_model::ChatTemplate;
use std::io::Write;
use std::path::PathBuf;

/// Shown after the flags by `dice prompt --help`.
const PROMPT_MANUAL: &str = "\
Prints a prompt exactly as the model receives it (no trailing newline is added).

End-to-end (default): KernelBench's one-shot CUDA prompt for one problem, as DICE builds it
(KernelBench v0.1 prompt_generate_custom_cuda_from_prompt_template, byte for byte). With --chat
it is wrapped as one user message by the model's chat template, with the generation prompt.

Infilling (--infill): DICE's kernel-infilling prompt for one task of a tasks file; it is already
in chat markup, as DICE feeds it.

Examples:
  dice prompt --kernelbench KernelBench/ --level 1 --problem 19
  dice prompt --kernelbench KernelBench/ --level 2 --problem 17 --chat --model SDAR-8B-Chat/
  dice prompt --infill --tasks kernel_infilling_evaluation.json --index 7";

#[derive(Debug, Args)]
#[command(after_help = PROMPT_MANUAL)]
pub(crate) struct PromptArgs {
    /// The KernelBench problem folder (holding level1/ … level4/). End-to-end prompts only.
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with = "infill",
        required_unless_present = "infill"
    )]
    pub kernelbench: Option<PathBuf>,
    /// Level of the problem (1–4). Example: --level 1
    #[arg(long, value_name = "L", requires = "kernelbench")]
    pub level: Option<u32>,
    /// Problem id within the level: the number before the first `_` of its file name.
    /// Example: --problem 19 (for level1/19_ReLU.py)
    #[arg(long, value_name = "ID", requires = "kernelbench")]
    pub problem: Option<u32>,
    /// Wrap the end-to-end prompt as a single user message with the chat template of the
    /// model given by --model (and the generation prompt), as DICE's local models receive it.
    #[arg(long, requires = "model", conflicts_with = "infill")]
    pub chat: bool,
    /// Model folder whose chat template --chat uses (chat_template.jinja, or the
    /// chat_template of tokenizer_config.json).
    #[arg(long, value_name = "DIR", requires = "chat")]
    pub model: Option<PathBuf>,
    /// Print the kernel-infilling prompt of a task from --tasks instead.
    #[arg(long, requires_all = ["tasks", "index"])]
    pub infill: bool,
    /// Infilling tasks: a JSON array or JSONL of objects with `pytorch_code`, `prefix`,
    /// `suffix` (DICE's kernel_infilling_evaluation.json format).
    #[arg(long, value_name = "FILE", requires = "infill")]
    pub tasks: Option<PathBuf>,
    /// 0-based position of the task in --tasks. Example: --index 0
    #[arg(long, value_name = "I", requires = "infill")]
    pub index: Option<usize>,
}

pub(crate) fn run(args: PromptArgs) -> Result<()> {
    let prompt = if args.infill {
        infill(&args)?
    } else {
        end_to_end(&args)?
    };
    let mut out = std::io::stdout().lock();
    out.write_all(prompt.as_bytes())?;
    out.flush()?;
    Ok(())
}

fn end_to_end(args: &PromptArgs) -> Result<String> {
    let (Some(dir), Some(level), Some(id)) = (&args.kernelbench, args.level, args.problem) else {
        bail!("an end-to-end prompt needs --kernelbench DIR --level L --problem ID");
    };
    let problem = KernelBench::open(dir)?.problem(level, id)?;
    let user = problem_prompt(&problem)?;
    match (&args.model, args.chat) {
        (Some(model), true) => ChatTemplate::from_dir(model)?
            .render(
                &[ChatMessage::new("user", &user)],
                true,
                &serde_json::Value::Null,
            )
            .with_context(|| format!("cannot render the chat template of {}", model.display())),
        _ => Ok(user),
    }
}

fn infill(args: &PromptArgs) -> Result<String> {
    let (Some(path), Some(index)) = (&args.tasks, args.index) else {
        bail!("an infilling prompt needs --tasks FILE --index I");
    };
    let tasks = load_infilling_tasks(path)?;
    let Some(task) = tasks.get(index) else {
        bail!(
            "{} has {} tasks; --index must be 0–{}",
            path.display(),
            tasks.len(),
            tasks.len().saturating_sub(1)
        );
    };
    Ok(infilling_prompt(task))
}
