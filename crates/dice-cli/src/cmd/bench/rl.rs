//! `dice bench rl`: one RL step at a preset's full size with random weights, judging recorded
//! programs of known outcome ([`dice_train::rl::bench`]), pipelined and back to back.

use anyhow::{Context, Result};
use clap::Args;
use dice_model::SdarConfig;
use dice_report::targets::Targets;
use dice_train::rl::bench::{bench_rl, RlBench, StepPhases};
use dice_train::rl::RlConfig;
use dice_train::run::settings::ComputeDType;
use std::path::PathBuf;

pub(super) const AFTER_HELP: &str = "\
Runs one stage-2 RL step of --preset (its tasks per step, samples per task and token limit
unless the flags say otherwise) on a model of CONFIG's shapes with random weights, through the
trainer's own step: the policy decodes the step's requests in the engine, the strict judge
scores programs as they finish, and the TraceRL update learns from them. What is judged is not
what the policy decodes but, for each completion, a recorded program of the same task with a
known outcome, traded in as the decoding finishes: the task's correct program (`cuda_code` of
--tasks), the same with an #error after its first #include (does not build), with ModelNew's
output negated (wrong result) and the reference itself as ModelNew (a hack for the audit),
sample j of a group taking the (j mod 4)-th, so rewards are mixed and every group is kept;
each sample's source carries a comment of its own, so the judge builds every one. The policy
decodes exactly as many tokens as each recorded completion holds; its trace is one token per
denoising step, left to right.

The step runs twice in --out (a temporary folder by default), each with a judge and a build
cache of its own (or both with --build-cache), on the same tasks and weights:
pipelined (each completion judged as it finishes, as `dice train rl` runs) and back to back
(the judge given every completion once the rollout is done), the baseline. Prints each run's
seconds of rollout (decoding), judging (the judging thread's busy time), idle (from the end of
the rollout to the last verdict), update and the whole step, the speedup of the pipelined step
and its GPU idle share (idle over the step: the trainer's device waits for the judge then).

Example (H200):
  dice bench rl --config tests/data/sdar/configs/sdar-1.7b.json --device cuda --judge-device cuda";

#[derive(Args)]
pub(crate) struct RlBenchArgs {
    /// A model config.json (e.g. tests/data/sdar/configs/sdar-1.7b.json); weights are random.
    #[arg(long)]
    pub config: PathBuf,
    /// The RL preset whose step is measured.
    #[arg(long, default_value = "dice-1.7b-stage2")]
    pub preset: String,
    /// Task file whose tasks have `pytorch_code` and their correct program `cuda_code`.
    #[arg(
        long,
        default_value = "tests/data/dice/kernel_infilling_evaluation.json"
    )]
    pub tasks: PathBuf,
    /// The tokenizer folder.
    #[arg(long, default_value = "tests/data/sdar")]
    pub tokenizer: PathBuf,
    /// Tasks per step [default: the preset's].
    #[arg(long)]
    pub tasks_per_step: Option<usize>,
    /// Completions per task [default: the preset's].
    #[arg(long)]
    pub samples_per_task: Option<usize>,
    /// The most tokens of a completion [default: the preset's]; every recorded one must fit.
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Where the model decodes and trains (cuda needs a binary built with `--features cuda`).
    #[arg(long, value_enum, default_value_t = dice_eval::Device::Cpu)]
    pub device: dice_eval::Device,
    /// Compute dtype [default: f32 on the CPU, bf16 on CUDA].
    #[arg(long, value_enum)]
    pub dtype: Option<ComputeDType>,
    /// Where candidates are judged [default: --device].
    #[arg(long, value_enum)]
    pub judge_device: Option<dice_eval::Device>,
    /// The Python with torch and ninja the judge's workers run [default: `DICE_PYTHON`, else
    /// the project's .dice/venv, else python3].
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// The folder for the random-weight model and both runs [default: a temporary folder,
    /// removed after].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// One build cache for both runs [default: one of each run's own under --out, so both
    /// build every program as a real step does]. A warm or shared cache spares the builds and
    /// judging then takes less than a real step's: for measuring the rollout and the update.
    #[arg(long)]
    pub build_cache: Option<PathBuf>,
    /// Also write the result as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub(super) fn run(args: RlBenchArgs) -> Result<()> {
    let model = SdarConfig::from_path(&args.config)?;
    let mut config = RlConfig::preset(&args.preset)?;
    config.model.tokenizer = Some(args.tokenizer.clone());
    config.tasks.file = Some(args.tasks.clone());
    let rollout = &mut config.rollout;
    rollout.tasks_per_step = args.tasks_per_step.unwrap_or(rollout.tasks_per_step);
    rollout.samples_per_task = args.samples_per_task.unwrap_or(rollout.samples_per_task);
    rollout.max_tokens = args.max_tokens.unwrap_or(rollout.max_tokens);
    config.training.run.device = args.device;
    config.training.run.dtype = args.dtype;
    config.reward.judge_device = args.judge_device;
    config.reward.python.clone_from(&args.python);
    let temporary;
    let work = match &args.out {
        Some(out) => out.clone(),
        None => {
            temporary = tempfile::tempdir().context("cannot make a temporary folder")?;
            temporary.path().to_path_buf()
        }
    };
    let bench = bench_rl(
        config,
        &model,
        &work,
        args.build_cache.as_deref(),
        |name, phases| eprintln!("{name} step done: {}", phases.summary()),
    )?;
    print_rl_bench(&bench, &args);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&bench)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

fn print_rl_bench(b: &RlBench, args: &RlBenchArgs) {
    println!(
        "dice bench rl: {} of {}, {} tasks x {} samples, {} tokens decoded; judge on {}",
        args.preset,
        args.config.display(),
        b.tasks,
        b.samples / b.tasks.max(1),
        b.tokens,
        args.judge_device.unwrap_or(args.device),
    );
    println!(
        "rewards: mean {:.3}, pass rate {:.3}, deceptive {:.3}; {} groups kept; update {} ({} replay samples)",
        b.reward_mean,
        b.pass_rate,
        b.deceptive_rate,
        b.groups_kept,
        if b.learned { "ran" } else { "skipped" },
        b.replay_samples,
    );
    println!();
    println!("| recorded program | samples | passed | deceptive | mean reward |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for o in &b.outcomes {
        println!(
            "| {:?} | {} | {} | {} | {:.2} |",
            o.variant,
            o.samples,
            o.passed,
            o.deceptive,
            o.reward_sum / o.samples.max(1) as f64
        );
    }
    println!();
    println!("| step | rollout s | judge s | idle s | update s | step s |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for (name, p) in [
        ("pipelined", &b.pipelined),
        ("back to back", &b.back_to_back),
    ] {
        let StepPhases {
            rollout,
            judge,
            idle,
            update,
            step,
            ..
        } = p;
        println!("| {name} | {rollout:.2} | {judge:.2} | {idle:.2} | {update:.2} | {step:.2} |");
    }
    println!();
    println!(
        "pipelined speedup {:.2}x; GPU idle share {:.1}% (idle / step: the trainer's device waiting for the judge)",
        b.speedup,
        100.0 * b.gpu_idle_share
    );
    for target in Targets::get().measured_by("bench rl") {
        println!(
            "target {}: speedup >= {}x ({})",
            target.name, target.target, target.target_why
        );
    }
}
