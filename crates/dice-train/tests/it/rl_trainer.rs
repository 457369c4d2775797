//! The BiC-RL loop on the CPU in f32, on a tiny model (the formula golden's two layers and full
//! 151,936-token vocabulary, narrowed to hidden 16): it learns a verifiable toy reward, says so
//! when a step learns nothing, its output folder holds the metrics, settings and checkpoints
//! (without AdamW's moments, which the presets reset every step), a killed run resumes after
//! its last step, from such a checkpoint to the bytes of an uninterrupted run, and the engine
//! kept from one rollout to the next decodes updated weights as a new one would.

use crate::common::{formula_config, metrics, read, run_options, weights};
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use dice_engine::{DecodeParams, Engine, EngineConfig, Request, SdarDecoder};
use dice_model::init::InitWeights;
use dice_model::{Sdar, SdarConfig};
use dice_train::dist::SingleProcess;
use dice_train::rl::config::RolloutConfig;
use dice_train::rl::rollout::{self, rollout_params, sample_seed};
use dice_train::rl::{
    Candidate, ContainsToken, JudgeReward, Reward, RlConfig, RlStepMetrics, RlTrainer, Score,
    Stage, TokenCensus,
};
use dice_train::run::settings::Settings;
use dice_train::run::{StepLine, TrainSummary};
use std::path::{Path, PathBuf};

/// The formula golden's model narrowed to hidden 16 (the loop's checks need no width, and every
/// step writes the weights and the optimizer state of the whole vocabulary's embedding and head:
/// a quarter of the bytes), with random weights, tokenizer files included. The matrices are
/// drawn wide (σ 1.2, not 0.02; the logits spread as σ·√hidden) so that the untrained model has
/// favourite tokens: with near-uniform logits no token recurs across completions, and there is
/// nothing to reward.
fn tiny_model(dir: &Path) -> PathBuf {
    crate::common::tiny_model(dir, &tiny_config(), InitWeights::Random { seed: 1 })
}

/// The config of [`tiny_model`].
fn tiny_config() -> SdarConfig {
    SdarConfig {
        hidden_size: 16,
        intermediate_size: 32,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 8,
        initializer_range: 1.2,
        ..formula_config()
    }
}

/// Two end-to-end tasks with short prompts of their own (the one-shot prompt's 900 tokens would
/// make every replayed sample 30 times longer).
fn task_file(dir: &Path) -> PathBuf {
    let path = dir.join("tasks.json");
    let tasks = serde_json::json!([
        {"idx": 0, "level": "1", "pytorch_code": "x.relu()", "prompt": "<|im_start|>user\nWrite relu.<|im_end|>\n<|im_start|>assistant\n"},
        {"idx": 1, "level": "2", "pytorch_code": "x * 2", "prompt": "<|im_start|>user\nDouble it.<|im_end|>\n<|im_start|>assistant\n"},
    ]);
    std::fs::write(&path, tasks.to_string()).unwrap();
    path
}

fn settings(model: &Path, tasks: &Path, steps: u64) -> RlConfig {
    let mut config = RlConfig::preset("dice-1.7b-stage2").unwrap();
    config.model.path = Some(model.to_path_buf());
    config.tasks.file = Some(tasks.to_path_buf());
    config.tasks.stage = Stage::E2e;
    config.rollout.tasks_per_step = 2;
    config.rollout.samples_per_task = 4;
    config.rollout.max_tokens = 8;
    config.training.total_steps = steps;
    config.training.run.learning_rate = 1e-2;
    config.training.samples_per_update = 64;
    config.checkpoint.save_steps = 5;
    config
}

fn open(config: RlConfig, out: &Path) -> anyhow::Result<RlTrainer> {
    let options = run_options(out);
    RlTrainer::new(config, options, Box::new(SingleProcess))
}

/// Rewards nothing and counts, per token, the completions holding it.
#[derive(Default)]
struct Counting(TokenCensus);

impl Reward for Counting {
    fn score(&mut self, candidates: &[Candidate]) -> anyhow::Result<Vec<Score>> {
        for c in candidates {
            self.0.count(&c.token_ids);
        }
        Ok(candidates
            .iter()
            .map(|_| Score {
                reward: 0.0,
                passed: false,
                deceptive: false,
                feedback: None,
            })
            .collect())
    }
}

/// A token that 2 to 5 of the untrained model's 8 completions of the first step hold (a
/// census run in `out`): rewarding it gives the groups a learning signal.
fn rewarded_token(model: &Path, tasks: &Path, out: &Path) -> u32 {
    let mut census = Counting::default();
    open(settings(model, tasks, 1), out)
        .unwrap()
        .train(&mut census)
        .unwrap();
    let mut counts: Vec<(usize, u32)> = census.0.holding.iter().map(|(&id, &n)| (n, id)).collect();
    counts.sort_unstable();
    eprintln!(
        "token census (completions holding each): {:?}",
        &counts[counts.len().saturating_sub(12)..]
    );
    let &(_, token) = counts
        .iter()
        .rev()
        .find(|(n, _)| (2..=5).contains(n))
        .expect("some token is held by 2-5 of the 8 completions");
    token
}

/// 20 steps of 2 tasks × 4 samples of 8 tokens, rewarded for holding the token that a census of
/// the untrained model's first step picks (`--reward-token census`: held by the share of its 8
/// completions closest to half): the mean reward of the last steps is well above the first
/// steps'. Once every completion earns the reward the groups carry no signal and the steps skip
/// the update.
#[test]
fn twenty_steps_learn_a_toy_reward() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let tasks = task_file(dir.path());

    let out = dir.path().join("run");
    let mut config = settings(&model, &tasks, 20);
    config.reward.contains_token = Some("census".parse().unwrap());
    let summary = open(config, &out)
        .unwrap()
        .train_with_configured_reward()
        .unwrap();
    let census: serde_json::Value =
        serde_json::from_slice(&read(&out.join("reward_token.json"))).unwrap();
    eprintln!("census: {census}");
    let holding = census["holding"].as_u64().unwrap();
    assert!((1..8).contains(&holding), "{census}");
    assert_eq!(
        summary.steps[0].reward_mean,
        holding as f64 / 8.0,
        "{census}"
    );
    let rewards: Vec<f64> = summary.steps.iter().map(|s| s.reward_mean).collect();
    eprintln!("reward per step: {rewards:?}");
    let first: f64 = rewards[..3].iter().sum::<f64>() / 3.0;
    let last: f64 = rewards[17..].iter().sum::<f64>() / 3.0;
    assert!(
        last >= first + 0.3 && last >= 0.7,
        "mean reward of the first three steps {first:.3}, of the last three {last:.3}: {rewards:?}"
    );
}

/// Refinement: the same toy reward over 30 steps of two-turn trajectories (a sample whose first
/// completion lacks the token is decoded again, its prompt the conversation with the toy
/// feedback; each turn replayed with its discounted return's advantage). The first step took
/// second turns exactly for the first turn's failures, and the first turn's mean reward of the
/// last steps is well above the first steps' (on the way it dips while the second turns, whose
/// longer prompt favours the token, earn most of the reward, then climbs to 1 by step 20: 30
/// steps, not the one-turn test's 20, leave room for that).
#[test]
fn two_turn_trajectories_learn_a_toy_reward() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let tasks = task_file(dir.path());

    let out = dir.path().join("run");
    let mut config = settings(&model, &tasks, 30);
    config.reward.contains_token = Some("census".parse().unwrap());
    config.rollout.turns = 2;
    config.reward.turn_discount = 0.4;
    // The engine is sized for prompts up to the replay's longest: keep it small on the CPU.
    config.training.max_prompt_len = 256;
    let summary = open(config, &out)
        .unwrap()
        .train_with_configured_reward()
        .unwrap();
    let turns: Vec<_> = summary
        .steps
        .iter()
        .map(|s| s.turns.clone().expect("two-turn steps report their turns"))
        .collect();
    let first = &turns[0];
    let failed_first = (8.0 * (1.0 - first.reward_mean_by_turn[0])).round() as usize;
    assert_eq!(first.samples_by_turn, [8, failed_first], "{first:?}");
    assert_eq!(summary.steps[0].samples, 8 + failed_first);
    let rewards: Vec<f64> = turns.iter().map(|t| t.reward_mean_by_turn[0]).collect();
    eprintln!("first-turn reward per step: {rewards:?}");
    eprintln!("turns per step: {turns:?}");
    let first: f64 = rewards[..3].iter().sum::<f64>() / 3.0;
    let last: f64 = rewards[27..].iter().sum::<f64>() / 3.0;
    assert!(
        last >= first + 0.3 && last >= 0.7,
        "first-turn mean reward of the first three steps {first:.3}, of the last three \
         {last:.3}: {rewards:?}"
    );
    let line = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert!(line
        .lines()
        .next()
        .unwrap()
        .contains("\"reward_mean_by_turn\""));
}

/// An infilling task around the examples' correct C++ ReLU (examples/candidates.jsonl, problem
/// 1 sample 0): whatever core the model writes lands in a Python string after the program, so
/// every candidate compiles (the examples' cached extension) and is correct.
fn relu_infilling_task(dir: &Path) -> PathBuf {
    let examples = dice_test_support::examples_dir();
    let reference = std::fs::read_to_string(examples.join("kernelbench/level1/1_ReLU.py")).unwrap();
    let program = std::fs::read_to_string(examples.join("candidates.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .find(|c| c["problem_id"] == 1 && c["sample_id"] == 0)
        .and_then(|c| c["code"].as_str().map(str::to_string))
        .unwrap();
    let path = dir.join("infill.json");
    let tasks = serde_json::json!([{
        "id": 1,
        "pytorch_code": reference,
        "prefix": format!("{program}\nr\"\"\"\n"),
        "suffix": "\n\"\"\"\n",
        "prompt": "<|im_start|>user\nFill in the kernel.<|im_end|>\n<|im_start|>assistant\n",
    }]);
    std::fs::write(&path, tasks.to_string()).unwrap();
    path
}

/// One stage-1 step end to end with the evaluator judging CPU C++ candidates: rollout, infilled
/// programs, strict judging into OUT/judge.db, rewards, the step's metrics and checkpoint, and
/// the greedy evaluation of the held-out tasks after it.
#[test]
fn a_step_is_judged_by_the_evaluator() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let tasks = relu_infilling_task(dir.path());
    let mut config = settings(&model, &tasks, 1);
    config.tasks.stage = Stage::Infill;
    config.rollout.tasks_per_step = 1;
    config.rollout.samples_per_task = 2;
    config.rollout.max_tokens = 4;
    config.reward.timeout_s = 120;
    config.eval.file = Some(tasks.clone());
    config.eval.max_tokens = 4;
    let out = dir.path().join("run");
    let mut trainer = open(config, &out).unwrap();
    let mut reward = JudgeReward::start(
        &trainer.run().config().reward,
        out.join("judge.db"),
        "rl test".into(),
    )
    .unwrap();
    let summary = trainer.train(&mut reward).unwrap();
    reward.shutdown().unwrap();
    let step = &summary.steps[0];
    assert_eq!((step.tasks, step.samples), (1, 2));
    assert_eq!(step.pass_rate, 1.0, "{step:?}");
    assert_eq!((step.reward_mean, step.deceptive_rate), (1.0, 0.0));
    assert_eq!(step.groups_kept, 0, "an all-correct group has no signal");
    assert_eq!(step.pass_rate_by_level.get(&0), Some(&1.0));
    let lines = metrics(&out);
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert_eq!(lines[1]["eval_tasks"], 1);
    // The checkpoints' lines, logged once their background writes were complete.
    assert_eq!(
        (&lines[2]["checkpoint"], &lines[3]["checkpoint"]),
        (&"checkpoint-1".into(), &"final".into())
    );
    assert_eq!(lines[1]["eval_pass_rate"], 1.0);
    assert!(out.join("judge.db").is_file());
    assert!(out.join("checkpoint-1/trainer_state.json").is_file());
    assert!(out.join("final/config.json").is_file());
}

/// The tiny model and the two tasks in `dir`, and a run of `steps` steps in `dir/run` that
/// rewards nothing (the token census): the model, the task file and the run's summary.
fn unrewarded_run(dir: &Path, steps: u64) -> (PathBuf, PathBuf, TrainSummary<RlStepMetrics>) {
    let model = tiny_model(dir);
    let tasks = task_file(dir);
    let summary = open(settings(&model, &tasks, steps), &dir.join("run"))
        .unwrap()
        .train(&mut Counting::default())
        .unwrap();
    (model, tasks, summary)
}

/// A run stopped after step 2 continues with step 3 from checkpoint-2 (kept as the newest even
/// though 2 is not a multiple of save_steps 5, then replaced by checkpoint-3); metrics.jsonl
/// holds each step once, and config.toml reads back as the run's settings.
#[test]
fn a_run_continues_after_its_last_completed_step() {
    let dir = tempfile::tempdir().unwrap();
    let (model, tasks, first) = unrewarded_run(dir.path(), 2);
    let out = dir.path().join("run");
    assert_eq!(first.steps_run(), 2);
    assert!(out.join("checkpoint-2").is_dir() && !out.join("checkpoint-1").exists());

    let mut resumed = open(settings(&model, &tasks, 3), &out).unwrap();
    assert_eq!(resumed.run().step(), 2);
    let second = resumed.train(&mut Counting::default()).unwrap();
    assert_eq!(second.steps.iter().map(|s| s.step).collect::<Vec<_>>(), [3]);
    assert!(out.join("checkpoint-3").is_dir() && !out.join("checkpoint-2").exists());
    let steps: Vec<u64> = metrics(&out)
        .iter()
        .filter(|l| l.get("reward_mean").is_some())
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3]);
    let written = RlConfig::read(&out.join("config.toml")).unwrap();
    assert_eq!(written.training.total_steps, 3);
    assert_eq!(written.rollout.samples_per_task, 4);
}

/// A step's checkpoint is not saved while the one before it is still being written (its line
/// in metrics.jsonl says so), unless it is the last step's, which waits: the write of
/// checkpoint-1 is held here by making the base model's config.json a named pipe that the test
/// fills only once step 2's checkpoint was skipped. The run ends with the same folders as
/// without the skip.
#[test]
fn a_step_checkpoint_is_skipped_while_the_one_before_is_still_written() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let tasks = task_file(dir.path());
    let out = dir.path().join("run");
    let mut trainer = open(settings(&model, &tasks, 3), &out).unwrap();
    let config = model.join("config.json");
    let text = std::fs::read(&config).unwrap();
    let pipe = dir.path().join("config.pipe");
    let made = std::process::Command::new("mkfifo").arg(&pipe).status();
    assert!(made.unwrap().success(), "mkfifo failed");
    std::fs::rename(&pipe, &config).unwrap();
    let log = out.join("metrics.jsonl");
    let release = std::thread::spawn(move || {
        // Waits (a minute at most: a run that never skips must not hang the suite) for step
        // 2's line saying its checkpoint was skipped, then opens the pipe (the writer of
        // checkpoint-1 is reading it), puts the file back for the later writes and fills the
        // pipe.
        let started = std::time::Instant::now();
        while !std::fs::read_to_string(&log).is_ok_and(|t| t.contains("checkpoint_skipped"))
            && started.elapsed().as_secs() < 60
        {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let mut pipe = std::fs::OpenOptions::new()
            .write(true)
            .open(&config)
            .unwrap();
        let file = config.with_extension("regular");
        std::fs::write(&file, &text).unwrap();
        std::fs::rename(&file, &config).unwrap();
        pipe.write_all(&text).unwrap();
    });
    let summary = trainer.train(&mut Counting::default()).unwrap();
    release.join().unwrap();
    assert_eq!(summary.steps_run(), 3);
    let lines = metrics(&out);
    let skipped: Vec<_> = lines
        .iter()
        .filter(|l| l.get("checkpoint_skipped").is_some())
        .map(|l| {
            (
                l["step"].as_u64().unwrap(),
                l["checkpoint"].as_str().unwrap(),
                l["checkpoint_skipped"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        skipped,
        [(2, "checkpoint-2", "checkpoint-1 was still being written")]
    );
    let written: Vec<_> = lines
        .iter()
        .filter(|l| l.get("checkpoint_bytes").is_some())
        .map(|l| l["checkpoint"].as_str().unwrap())
        .collect();
    assert_eq!(written, ["checkpoint-1", "checkpoint-3", "final"]);
    assert!(out.join("checkpoint-3/optimizer.safetensors").is_file());
    assert!(!out.join("checkpoint-1").exists() && !out.join("checkpoint-2").exists());
}

/// A step whose completions are rewarded alike in every task group has no group with a
/// learning signal: its line says that it learned nothing (`learned` false, the update's
/// numbers null, a warning's words), and it takes no optimizer step, so the weights stay the
/// start model's.
#[test]
fn a_step_whose_groups_are_all_rewarded_alike_learns_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _, summary) = unrewarded_run(dir.path(), 1);
    let out = dir.path().join("run");
    let step = &summary.steps[0];
    assert!(!step.learned, "{step:?}");
    assert_eq!(
        (step.groups_kept, step.updates, step.replay_samples),
        (0, 0, 0)
    );
    assert_eq!((step.loss, step.kl, step.grad_norm), (None, None, None));
    assert!(
        step.describe().ends_with("nothing learned"),
        "{}",
        step.describe()
    );
    let note = step.note().expect("a step that learned nothing says so");
    assert!(note.starts_with("RL step 1 learned nothing"), "{note}");
    let line = &metrics(&out)[0];
    assert_eq!(line["learned"], false, "{line}");
    assert!(
        line["loss"].is_null() && line["grad_norm"].is_null(),
        "{line}"
    );
    let state = candle_core::safetensors::load(
        out.join("checkpoint-1/optimizer.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(
        state["step"].to_scalar::<i64>().unwrap(),
        0,
        "an AdamW step was taken"
    );
    assert_eq!(weights(&out.join("final")), weights(&model));
}

/// The presets reset AdamW's moments before every step's update, so their checkpoints keep none:
/// the optimizer state holds the step and the f32 masters only. A run that learns for 2 steps
/// and is run again for a third from checkpoint-2 ends with the bytes of a run of 3 steps: the
/// final model and checkpoint-3's state. Each output folder then holds the newest checkpoint
/// alone (save_steps 5), complete as its line in metrics.jsonl counted it: the background
/// writes ended with the run.
#[test]
fn a_run_resumed_from_a_checkpoint_without_moments_ends_as_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let tasks = task_file(dir.path());
    let token = rewarded_token(&model, &tasks, &dir.path().join("census"));
    let train = |out: &Path, steps: u64| {
        open(settings(&model, &tasks, steps), out)
            .unwrap()
            .train(&mut ContainsToken(token))
            .unwrap()
    };
    let straight = dir.path().join("straight");
    let summary = train(&straight, 3);
    assert!(
        summary.steps.iter().any(|s| s.learned),
        "{:?}",
        summary.steps
    );
    let resumed = dir.path().join("resumed");
    train(&resumed, 2);
    let state = candle_core::safetensors::load(
        resumed.join("checkpoint-2/optimizer.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    assert!(state
        .keys()
        .all(|k| k == "step" || k.starts_with("master.")));
    assert_eq!(state.len(), 1 + weights(&model).len());
    assert_eq!(train(&resumed, 3).steps_run(), 1);

    for file in [
        "final/model-00001-of-00001.safetensors",
        "checkpoint-3/optimizer.safetensors",
    ] {
        assert!(
            read(&straight.join(file)) == read(&resumed.join(file)),
            "{file} differs"
        );
    }
    for out in [&straight, &resumed] {
        let mut names: Vec<String> = std::fs::read_dir(out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "checkpoint-3",
                "config.toml",
                "final",
                "metrics.html",
                "metrics.jsonl"
            ]
        );
        for line in metrics(out)
            .iter()
            .filter(|l| l.get("checkpoint").is_some())
        {
            let folder = out.join(line["checkpoint"].as_str().unwrap());
            if folder.exists() {
                let bytes: u64 = std::fs::read_dir(&folder)
                    .unwrap()
                    .map(|e| e.unwrap().metadata().unwrap().len())
                    .sum();
                assert_eq!(line["checkpoint_bytes"], bytes, "{line}");
            }
        }
    }
}

/// A decoder of the tiny model over `weights` with its q/k/v and gate/up projections stacked,
/// as the decoder stacks them on CUDA (on the CPU it does not): the weights it holds copies of.
fn stacked_decoder(weights: &VarBuilder) -> SdarDecoder {
    let config = SdarConfig {
        block_size: 4,
        ..tiny_config()
    };
    let mut model = Sdar::new(&config, weights.clone()).unwrap();
    model.concatenate_projections().unwrap();
    SdarDecoder::new(model).unwrap()
}

/// The tokens and traces of `completions` by slot.
type Decoded = Vec<(Vec<u32>, Vec<u32>)>;

/// Rolls out `requests` in `engine` ([`rollout::roll_out`], two at a time).
fn roll_out(
    engine: &mut Engine<SdarDecoder>,
    weights: &VarBuilder,
    requests: &[(usize, Request)],
) -> Decoded {
    let mut decoded = vec![(Vec::new(), Vec::new()); requests.len()];
    rollout::roll_out(engine, weights, requests.to_vec(), 2, |slot, c| {
        decoded[slot] = (c.token_ids, c.trace);
        Ok(())
    })
    .unwrap();
    decoded
}

/// The trainer keeps one engine (decoder, KV cache, CUDA graphs) for the whole run, its
/// decoder's own copies of the weights refreshed before each rollout: after the weights
/// change (set in place, as the optimizer sets them), a rollout through the kept engine decodes
/// exactly what a new decoder and engine over the new weights decode, seed for seed, with the
/// projections stacked as on CUDA. Without the refresh the stacks would still hold the old
/// projections, and the decoding differs; rolling out two at a time in an engine of three slots
/// decodes what an engine of two slots given every request at once decodes.
#[test]
fn a_kept_engine_decodes_updated_weights_as_a_new_engine() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let (_, vars) =
        Sdar::load_trainable(&tiny_model(dir.path()), DType::F32, &Device::Cpu).unwrap();
    let weights = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let rollout = RolloutConfig {
        max_tokens: 12,
        ..RolloutConfig::default()
    };
    let params = rollout_params(&rollout, Vec::new());
    let requests: Vec<(usize, Request)> = (0..5)
        .map(|slot| {
            let prompt = (0..3 + 2 * slot as u32).map(|i| 100 + 37 * i).collect();
            let params = DecodeParams {
                seed: sample_seed(7, 1, slot),
                ..params.clone()
            };
            (slot, Request { prompt, params })
        })
        .collect();
    let engine_of = |max_batch| EngineConfig {
        max_batch,
        max_seq_len: 32,
        ..EngineConfig::default()
    };
    let mut kept = Engine::new(stacked_decoder(&weights), engine_of(3)).unwrap();
    let mut stale = Engine::new(stacked_decoder(&weights), engine_of(3)).unwrap();
    let before = roll_out(&mut kept, &weights, &requests);

    // New values for every weight, in place.
    let (_, updated) = Sdar::load_trainable(
        &crate::common::tiny_model(
            &dir.path().join("updated"),
            &config,
            InitWeights::Random { seed: 2 },
        ),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    for (name, var) in vars.data().lock().unwrap().iter() {
        var.set(updated.data().lock().unwrap()[name].as_tensor())
            .unwrap();
    }
    let after = roll_out(&mut kept, &weights, &requests);
    let mut new = Engine::new(stacked_decoder(&weights), engine_of(3)).unwrap();
    assert_eq!(after, roll_out(&mut new, &weights, &requests));
    assert_ne!(after, before, "the new weights decode as the old ones did");

    let unrefreshed: Decoded = stale
        .generate(requests.iter().map(|(_, r)| r.clone()).collect())
        .unwrap()
        .into_iter()
        .map(|c| (c.token_ids, c.trace))
        .collect();
    assert_ne!(
        unrefreshed, after,
        "the stacked projections were never copies"
    );

    let mut all_at_once = Engine::new(stacked_decoder(&weights), engine_of(2)).unwrap();
    let at_once: Decoded = all_at_once
        .generate(requests.iter().map(|(_, r)| r.clone()).collect())
        .unwrap()
        .into_iter()
        .map(|c| (c.token_ids, c.trace))
        .collect();
    assert_eq!(at_once, after);
}
