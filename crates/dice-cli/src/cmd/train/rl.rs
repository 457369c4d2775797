//! `dice train rl`: BiC-RL. The flags map onto `dice_train::rl`'s settings and trainer.

use super::{set, RunArgs};
use anyhow::Result;
use clap::Args;
use dice_train::rl::config::GridName;
use dice_train::rl::{dry_run_report, RewardToken, RlConfig, RlTrainer, Stage, TaskOrder};
use std::path::PathBuf;

/// The preset without --preset or --config.
const DEFAULT_PRESET: &str = "dice-8b-stage1";

pub(crate) const MANUAL: &str = "\
What a step does (spec bicrl §15). The step's tasks are drawn from --tasks in file order with
wrap-around (--order shuffled: a seeded permutation per pass), each prompt is rendered for the
stage (infill: DICE's kernel-infilling prompt with the task's prefix/suffix scaffold; e2e:
KernelBench's one-shot prompt in the reference's ChatML wrapping; a task's own `prompt` field
wins), and every prompt is decoded --samples-per-task times by the engine with the trainer's
current weights (in memory, never through the disk): block 4, at most 4 passes per block,
low_confidence_dynamic at 0.9, temperature 1.0, up to --max-tokens tokens, each token's
denoising pass recorded. Each completion goes to the judge as soon as it finishes, while the
others still decode. Infilling candidates are the task's prefix + the generated core + its
suffix; end-to-end candidates are the answer's first code block. The judge runs the evaluator in
strict mode: reward 1 for a program that compiles, matches the reference (atol = rtol 1e-2) and
is not flagged as a reward hack, else 0 (--speedup-shaping: a correct program earns its speedup,
capped). Rewards are z-scored within each task's group; groups whose rewards are all equal are
dropped (when every group is, the step learns nothing and a warning says so). The traces are replayed round by round (TraceRL) on the block grid they were sampled
on (--grid reference: the reference trainer's, spec bicrl §16.3), old log-probabilities come
from the step's starting weights, and AdamW (lr 1e-6, betas 0.9/0.999, eps 1e-8, no weight
decay; moments reset every step as the reference's fresh optimizer, --keep-moments to keep
them) takes one step per 256 replay samples on the PPO-clip loss (eps 0.2) with the k3 KL
penalty (beta 0.01), gradients scaled by 1/32 as the reference's DeepSpeed does and clipped to
norm 1.0.

Refinement (--turns N, stage 2, as Kevin does): a sample whose program is not correct, or is
deceptive, gets another turn, its prompt the conversation so far with the judge's feedback on
the verdict (what the verdict says, never the judge's inputs, seeds or thresholds) as the next
user message, up to N turns or until the prompt would pass the replay's longest; each turn's
return is its reward plus --turn-discount (0.4) times the next turn's return, the returns of
all the turns of a task's group are z-scored together, and every turn's response is replayed.
metrics.jsonl then adds samples_by_turn, reward_mean_by_turn, best_turn_reward_mean and
fixed_after_first_turn.

Settings. --preset picks DICE's configuration (spec bicrl §2, §13):
  dice-8b-stage1    --stage infill, 20 steps, prompts up to 2000 tokens, engines of 32
                    sequences (evaluation 32): the default
  dice-8b-stage2    --stage e2e, 100 steps, prompts up to 1500 tokens, engines of 48
                    (evaluation 4)
  dice-4b-stage1/2  as 8B, but stage-2 engines of 20
  dice-1.7b-stage1/2  as 4B, but stage-1 evaluation engines of 16
Every preset: 64 tasks x 16 samples per step, up to 4096 tokens, the sampling, loss and
optimizer above, a checkpoint kept and an evaluation every 10 steps. A --stage other than the
preset's takes the other stage's preset of the same size (no --preset: 8B). --config F reads a
TOML file instead (sections [model] [tasks] [rollout] [reward] [training] [optimizer]
[checkpoint] [eval], the keys of OUT/config.toml); flags override either. Every run writes its
resolved settings to OUT/config.toml. --reward-token ID replaces the judge by a toy reward, 1
for a completion holding that token id, else 0: it checks the loop, the ranks and a deployment
without compiling anything; --reward-token census lets a census of the first step's completions
pick the token (the one closest to half of them hold), so that random weights learn too.

Task files: a JSON array or JSON Lines of objects with `pytorch_code`, and for --stage infill
`prefix` and `suffix`; `level` (number or string) is kept for the per-level pass rates. DICE's
end_to_end_kernel_generation_4000.json and kernel_infilling_*.json read as they are.

Output folder.
  checkpoint-STEP/  after every step, written in the background while the next step runs (a
                    step ending while the write before it is still running skips its own,
                    unless --save-steps keeps it or it is the last): the newest is resumable
                    (f32 masters, no AdamW moments: the presets reset them every step), older
                    ones are kept every --save-steps steps as models only (disk use: see
                    --save-steps)
  final/            the finished model (a Hugging Face folder, as dice train sft writes)
  config.toml       the run's settings
  judge.db          the judge's verdicts of every candidate (rank R > 0: judge-rankR.db)
  metrics.jsonl     one JSON object per RL step: step, tasks, samples, reward_mean, pass_rate,
                    deceptive_rate, pass_rate_by_level, groups_kept, learned (false when no
                    group was kept: the step learned nothing, and loss, kl, clip_fraction,
                    entropy and grad_norm are null), advantage_mean/std/abs_max,
                    replay_samples, loss_tokens, loss, kl, clip_fraction, entropy, grad_norm,
                    updates, tokens_generated, rollout_tokens_per_s, seconds_rollout,
                    seconds_judge, seconds_idle (last completion to last verdict),
                    seconds_update, seconds_update_parts (replay, old_log_probs,
                    loss_and_grads, optimizer; absent when nothing was learned),
                    seconds_step (rank 0's), seconds_per_rank (each rank's rollout, judge,
                    idle, update); per checkpoint once written: checkpoint,
                    checkpoint_bytes, seconds_checkpoint (the training waited),
                    seconds_checkpoint_write (the background write), checkpoint_snapshot
                    (device or host: where the state was copied), or checkpoint and
                    checkpoint_skipped for a step's checkpoint not saved because the one
                    before it was still being written (never one kept by --save-steps, nor
                    the last step's); and per evaluation
                    (--eval-tasks, every --eval-steps steps: one greedy static sample per task)
                    eval_tasks, eval_pass_rate, eval_deceptive_rate, eval_seconds
  metrics.html      the curves of metrics.jsonl (inline SVG), redrawn after every step
Resuming: run the same command again; a killed run continues after its last completed step.
A progress bar shows the step, reward, pass rate and KL (where stderr is not a terminal, a plain
line at the first step, every 30 s and at the last); RUST_LOG=info logs every step.

Several ranks. --nproc-per-node N starts N ranks on this machine, as dice train sft does;
torchrun, Slurm or Kubernetes start them through RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT. Each rank (LOCAL_RANK's GPU with --device cuda) takes a contiguous share of the
step's tasks, rolls them out with its own engine, judges them and replays them; the loss
normaliser is the largest over the ranks, and update u of the step sums the gradients of the
u-th share of every rank's replay samples. Sums are taken task group by task group and added in
task order, so ranks holding one task group each take exactly the step of one rank holding
them all (tested bit for bit on the CPU); with several groups per rank the order of the sum
differs, and each rank pads its replay samples to its own longest prompt and response, which
can change the last bits. Rank 0 alone writes checkpoints, final/, config.toml and the metrics
(give every rank the same --out on a shared file system); a run resumes with the same number
of ranks. CUDA ranks talk through NCCL as dice train sft's do (not yet run on a GPU).

--dry-run reads the tasks, renders and tokenizes every prompt and prints the tasks per level,
the prompt lengths and the levels each step draws, without loading the weights.

Examples:
  dice train rl --model sft-8b/ --tasks kernel_infilling_992.json --stage infill --out runs/s1 \\
      --device cuda
  dice train rl --model runs/s1/final/ --tasks end_to_end_kernel_generation_4000.json \\
      --stage e2e --preset dice-8b-stage2 --out runs/s2 --device cuda
  dice train rl --model sft-8b/ --tasks end_to_end_kernel_generation_4000.json --stage e2e \\
      --preset dice-8b-stage2 --out runs/s2 --dry-run
A tiny model on the CPU, two ranks, the toy reward (a minute; the path, not the learning):
  dice model init --config tests/data/sdar/golden/formula/config.json --weights random \\
      --seed 1 --tokenizer tests/data/sdar --out tiny/
  dice train rl --model tiny/ --tasks tests/data/dice/end_to_end_kernel_generation_4000.json \\
      --stage e2e --preset dice-1.7b-stage2 --tasks-per-step 2 --samples-per-task 4 \\
      --max-tokens 16 --max-steps 2 --reward-token 16 --out runs/tiny-rl --nproc-per-node 2";

#[derive(Args, Debug)]
pub(crate) struct RlArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Task file (JSON array or JSON Lines).
    #[arg(long, value_name = "FILE")]
    pub tasks: Option<PathBuf>,
    /// What is rewarded [default: the preset's].
    #[arg(long, value_enum)]
    pub stage: Option<Stage>,
    /// DICE's settings for a model size and stage: dice-8b-stage1, dice-8b-stage2,
    /// dice-4b-stage1, dice-4b-stage2, dice-1.7b-stage1 or dice-1.7b-stage2 (below: what each
    /// sets) [default: dice-8b-stage1].
    #[arg(long, value_name = "NAME", conflicts_with = "config")]
    pub preset: Option<String>,
    /// Where candidates are judged [default: the training device].
    #[arg(long, value_enum)]
    pub judge_device: Option<dice_eval::Device>,
    /// The Python (with torch and ninja) the judge's workers run [default: DICE_PYTHON, else
    /// .dice/venv, else python3].
    #[arg(long, value_name = "PATH")]
    pub python: Option<PathBuf>,
    /// The order tasks are drawn in [default: sequential].
    #[arg(long, value_enum)]
    pub order: Option<TaskOrder>,
    /// Tasks per step [default: 64].
    #[arg(long, value_name = "N")]
    pub tasks_per_step: Option<usize>,
    /// Completions per task (the group advantages are standardised in) [default: 16].
    #[arg(long, value_name = "N")]
    pub samples_per_task: Option<usize>,
    /// Longest completion, in tokens [default: 4096].
    #[arg(long, value_name = "N")]
    pub max_tokens: Option<usize>,
    /// Sequences each engine decodes at once [default: the preset's].
    #[arg(long, value_name = "N")]
    pub max_active: Option<usize>,
    /// Turns of each sample's trajectory (--stage e2e): a sample whose program does not earn
    /// the reward is decoded again with the judge's feedback on it, up to N turns [default: 1].
    #[arg(long, value_name = "N")]
    pub turns: Option<usize>,
    /// γ of the trajectories' returns: a turn earns its reward plus γ times the next turn's
    /// return [default: 0.4, Kevin's].
    #[arg(long, value_name = "G")]
    pub turn_discount: Option<f64>,
    /// Keep AdamW's moments from one RL step to the next (the reference resets them).
    #[arg(long)]
    pub keep_moments: bool,
    /// The block grid traces are replayed on [default: rollout].
    #[arg(long, value_enum)]
    pub grid: Option<GridName>,
    /// Reward a correct program its measured speedup (capped at 4) instead of 1.
    #[arg(long)]
    pub speedup_shaping: bool,
    /// Reward 1 for a completion holding this token id, else 0, instead of judging its
    /// program: a verifiable toy reward to check the loop, the ranks and a deployment without
    /// the evaluator. `census` picks the token that the share of the first step's completions
    /// closest to half holds (one rank only; the choice goes to OUT/reward_token.json and a
    /// resumed run keeps it): a reward an untrained model earns sometimes, whatever its weights.
    #[arg(long, value_name = "ID|census")]
    pub reward_token: Option<RewardToken>,
    /// Held-out task file, evaluated every --eval-steps steps and at the end.
    #[arg(long, value_name = "FILE")]
    pub eval_tasks: Option<PathBuf>,
}

pub(crate) fn run(a: RlArgs) -> Result<()> {
    let train = RlTrainer::train_with_configured_reward;
    a.run
        .start(settings(&a)?, dry_run_report, RlTrainer::new, train)
}

/// The preset or settings file with the flags on top.
fn settings(a: &RlArgs) -> Result<RlConfig> {
    let preset = a.preset.as_deref().unwrap_or(DEFAULT_PRESET);
    let mut c = a.run.settings_or(|| RlConfig::preset(preset))?;
    if let Some(stage) = a.stage {
        if stage != c.tasks.stage && a.run.config.is_none() {
            // The stage's own preset of the same size: stage 2 runs 100 steps, not 20.
            let other = match stage {
                Stage::Infill => preset.replace("stage2", "stage1"),
                Stage::E2e => preset.replace("stage1", "stage2"),
            };
            c = RlConfig::preset(&other)?;
        }
        c.tasks.stage = stage;
    }
    a.run.apply(
        &mut c.model,
        &mut c.training.run,
        &mut c.checkpoint,
        &mut c.eval.eval_steps,
    );
    if a.tasks.is_some() {
        c.tasks.file.clone_from(&a.tasks);
    }
    set(&mut c.tasks.order, &a.order);
    set(&mut c.rollout.tasks_per_step, &a.tasks_per_step);
    set(&mut c.rollout.samples_per_task, &a.samples_per_task);
    set(&mut c.rollout.max_tokens, &a.max_tokens);
    set(&mut c.rollout.max_active, &a.max_active);
    set(&mut c.rollout.turns, &a.turns);
    set(&mut c.reward.turn_discount, &a.turn_discount);
    let t = &mut c.training;
    set(&mut t.total_steps, &a.run.max_steps);
    if a.keep_moments {
        t.reset_moments = false;
    }
    set(&mut t.grid, &a.grid);
    if a.judge_device.is_some() {
        c.reward.judge_device = a.judge_device;
    }
    if a.python.is_some() {
        c.reward.python.clone_from(&a.python);
    }
    if a.speedup_shaping {
        c.reward.speedup_shaping = true;
    }
    if a.reward_token.is_some() {
        c.reward.contains_token = a.reward_token;
    }
    if a.eval_tasks.is_some() {
        c.eval.file.clone_from(&a.eval_tasks);
    }
    Ok(c)
}
