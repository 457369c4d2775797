//! What a run would train on, without loading the model: the tasks by level, the prompts'
//! token lengths (and how many the length limit drops), and the levels each step draws.

use super::config::RlConfig;
use super::task::{load_tasks, render_prompt, select_tasks};
use anyhow::Result;
use dice_model::SdarTokenizer;
use std::collections::BTreeMap;
use std::fmt::Write;

/// The dry-run report of `config` (resolved here), as text.
pub fn dry_run_report(config: RlConfig) -> Result<String> {
    let config = config.resolve()?;
    let stage = config.tasks.stage;
    let tasks = load_tasks(config.task_file(), stage)?;
    let tokenizer = SdarTokenizer::from_dir(config.model.tokenizer_dir())?;
    let lengths = tasks
        .iter()
        .map(|task| Ok(tokenizer.encode(&render_prompt(task, stage)?)?.len()))
        .collect::<Result<Vec<usize>>>()?;
    let mut levels: BTreeMap<u32, usize> = BTreeMap::new();
    for task in &tasks {
        *levels.entry(task.level).or_default() += 1;
    }
    let (rollout, training) = (&config.rollout, &config.training);
    let mut out = String::new();
    writeln!(
        out,
        "tasks: {} from {} (stage {}, {} order)",
        tasks.len(),
        config.task_file().display(),
        format!("{stage:?}").to_lowercase(),
        format!("{:?}", config.tasks.order).to_lowercase()
    )?;
    let by_level: Vec<String> = levels.iter().map(|(l, n)| format!("{l}: {n}")).collect();
    writeln!(out, "tasks per level: {}", by_level.join(", "))?;
    let longest = lengths.iter().max().copied().unwrap_or(0);
    let shortest = lengths.iter().min().copied().unwrap_or(0);
    let mean = lengths.iter().sum::<usize>() as f64 / lengths.len().max(1) as f64;
    let too_long = lengths
        .iter()
        .filter(|&&n| n > training.max_prompt_len)
        .count();
    writeln!(
        out,
        "prompt tokens: {shortest}–{longest}, mean {mean:.0}; {too_long} longer than max_prompt_len {} (their samples are not trained on)",
        training.max_prompt_len
    )?;
    writeln!(
        out,
        "each step: {} tasks × {} samples, up to {} tokens each; {} steps ({:.2} passes over the tasks)",
        rollout.tasks_per_step,
        rollout.samples_per_task,
        rollout.max_tokens,
        training.total_steps,
        (training.total_steps as usize * rollout.tasks_per_step) as f64 / tasks.len() as f64
    )?;
    writeln!(out, "levels drawn per step:")?;
    let mut previous = String::new();
    let mut first = 1;
    for step in 1..=training.total_steps + 1 {
        let drawn = if step > training.total_steps {
            String::new()
        } else {
            let mut counts: BTreeMap<u32, usize> = BTreeMap::new();
            for t in select_tasks(
                step,
                rollout.tasks_per_step,
                tasks.len(),
                config.tasks.order,
                training.run.seed,
            ) {
                *counts.entry(tasks[t].level).or_default() += 1;
            }
            let parts: Vec<String> = counts
                .iter()
                .map(|(l, n)| format!("{n} × level {l}"))
                .collect();
            parts.join(", ")
        };
        if step > 1 && drawn != previous {
            let steps = if first == step - 1 {
                format!("step {first}")
            } else {
                format!("steps {first}–{}", step - 1)
            };
            writeln!(out, "  {steps}: {previous}")?;
            first = step;
        }
        previous = drawn;
    }
    Ok(out)
}
