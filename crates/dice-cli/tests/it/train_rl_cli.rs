//! `dice train rl --dry-run` on DICE's released task files (tests/data/dice) with the SDAR
//! tokenizer of tests/data/sdar: the tasks per level, the prompt lengths and the curriculum.

use dice_test_support::test_data;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn dry_run(args: &[&str]) -> Output {
    let data = test_data();
    let tokenizer = data.join("sdar");
    crate::common::dice(
        &[
            &[
                "train",
                "rl",
                "--model",
                crate::common::path_arg(&tokenizer),
                "--dry-run",
            ],
            args,
        ]
        .concat(),
    )
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "dice failed: {}",
        crate::common::stderr(out)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn the_end_to_end_file_reads_with_the_reference_curriculum() {
    let tasks = test_data().join("dice/end_to_end_kernel_generation_4000.json");
    let text = stdout(&dry_run(&[
        "--tasks",
        crate::common::path_arg(&tasks),
        "--stage",
        "e2e",
    ]));
    assert!(text.contains("tasks: 4000 from"), "{text}");
    assert!(
        text.contains("tasks per level: 0: 1, 1: 590, 2: 3407, 3: 2"),
        "{text}"
    );
    assert!(
        text.contains("100 steps (1.60 passes over the tasks)"),
        "{text}"
    );
    // Spec bicrl §3: step 10 draws 15 level-1 and 49 level-2 tasks, steps 11–62 level 2 only.
    assert!(
        text.contains("step 10: 15 × level 1, 49 × level 2"),
        "{text}"
    );
    assert!(text.contains("steps 11–62: 64 × level 2"), "{text}");
}

#[test]
fn the_infilling_file_reads_with_its_scaffolds() {
    let tasks = test_data().join("dice/kernel_infilling_evaluation.json");
    let text = stdout(&dry_run(&[
        "--tasks",
        crate::common::path_arg(&tasks),
        "--stage",
        "infill",
    ]));
    assert!(text.contains("tasks: 99 from"), "{text}");
    assert!(text.contains("0 longer than max_prompt_len 2000"), "{text}");
    assert!(text.contains("20 steps"), "{text}");

    let e2e = test_data().join("dice/end_to_end_kernel_generation_4000.json");
    let out = dry_run(&[
        "--tasks",
        crate::common::path_arg(&e2e),
        "--stage",
        "infill",
    ]);
    assert!(!out.status.success());
    assert!(
        crate::common::stderr(&out).contains("missing `prefix`"),
        "{}",
        crate::common::stderr(&out)
    );
}

/// The formula golden's model shapes with random weights drawn wide (σ 0.35), as the trainer's
/// tests make it: the untrained model has favourite tokens, so a toy reward has something to
/// tell apart.
fn tiny_policy(dir: &Path) -> PathBuf {
    let data = test_data();
    let mut config =
        dice_model::SdarConfig::from_path(&data.join("sdar/golden/formula/config.json")).unwrap();
    config.initializer_range = 0.35;
    let model = dir.join("tiny");
    let tokenizer = data.join("sdar");
    dice_model::init::ModelInit {
        tokenizer: Some(&tokenizer),
        ..dice_model::init::ModelInit::new(
            &config,
            dice_model::init::InitWeights::Random { seed: 1 },
        )
    }
    .write(&model)
    .unwrap();
    model
}

/// Two end-to-end tasks with the same short prompt: every replay sample of the step has the
/// same padded length on one rank and on two.
fn two_tasks(dir: &Path) -> PathBuf {
    let prompt = "<|im_start|>user\nWrite a kernel.<|im_end|>\n<|im_start|>assistant\n";
    let tasks = serde_json::json!([
        {"idx": 0, "level": "1", "pytorch_code": "x.relu()", "prompt": prompt},
        {"idx": 1, "level": "2", "pytorch_code": "x * 2", "prompt": prompt},
    ]);
    let path = dir.join("tasks.json");
    std::fs::write(&path, tasks.to_string()).unwrap();
    path
}

/// A token that 5 of the untrained tiny policy's 8 first-step completions hold (counted as
/// dice-train's tests/rl_trainer.rs counts them): a task group gets rewards that differ, so
/// the first step updates the weights.
const REWARDED_TOKEN: &str = "93943";

/// `dice train rl` for 2 steps of the toy reward: 2 tasks × 4 samples of 8 tokens.
fn toy_run(model: &Path, tasks: &Path, out: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dice"))
        .args(["train", "rl", "--model"])
        .arg(model)
        .arg("--tasks")
        .arg(tasks)
        .arg("--out")
        .arg(out)
        .args([
            "--preset",
            "dice-1.7b-stage2",
            "--tasks-per-step",
            "2",
            "--samples-per-task",
            "4",
            "--max-tokens",
            "8",
            "--lr",
            "1e-2",
            "--max-steps",
            "2",
            "--device",
            "cpu",
            "--reward-token",
            REWARDED_TOKEN,
        ])
        .args(extra)
        .env_remove("WORLD_SIZE")
        .env_remove("MASTER_PORT")
        .output()
        .unwrap()
}

/// The step and evaluation lines of `metrics.jsonl` (its checkpoint lines aside).
fn metrics(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .filter(|line| line.get("checkpoint").is_none())
        .collect()
}

/// Every field of a step's line but the clock's.
fn without_times(line: &serde_json::Value) -> serde_json::Value {
    let mut line = line.clone();
    line.as_object_mut()
        .unwrap()
        .retain(|key, _| !key.starts_with("seconds_") && key != "rollout_tokens_per_s");
    line
}

/// `--nproc-per-node 2` starts two ranks, one task group each; they roll out, reward and
/// update as one rank does with both groups: the same metrics (the clock's aside) and the same
/// bytes of the f32 masters and moments after the last step. Rank 0 alone writes the output
/// folder.
#[test]
fn two_ranks_take_the_steps_of_one() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_policy(dir.path());
    let tasks = two_tasks(dir.path());
    let alone = dir.path().join("alone");
    let out = toy_run(&model, &tasks, &alone, &[]);
    assert!(
        out.status.success(),
        "one rank: {}",
        crate::common::stderr(&out)
    );
    let ranks = dir.path().join("ranks");
    let out = toy_run(&model, &tasks, &ranks, &["--nproc-per-node", "2"]);
    assert!(
        out.status.success(),
        "two ranks: {}",
        crate::common::stderr(&out)
    );

    let (one, two) = (metrics(&alone), metrics(&ranks));
    assert_eq!(one.len(), 2);
    assert!(
        one[0]["groups_kept"].as_u64().unwrap() >= 1 && one[0]["grad_norm"].as_f64().unwrap() > 0.0,
        "the first step has no learning signal: {}",
        one[0]
    );
    assert_eq!(
        one.iter().map(without_times).collect::<Vec<_>>(),
        two.iter().map(without_times).collect::<Vec<_>>()
    );
    for file in [
        "checkpoint-2/optimizer.safetensors",
        "final/model-00001-of-00001.safetensors",
    ] {
        let bytes = |run: &Path| std::fs::read(run.join(file)).unwrap();
        assert!(bytes(&alone) == bytes(&ranks), "{file} differs");
    }
    let mut written: Vec<String> = std::fs::read_dir(&ranks)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    written.sort();
    assert_eq!(
        written,
        [
            "checkpoint-2",
            "config.toml",
            "final",
            "metrics.html",
            "metrics.jsonl"
        ]
    );
    let seconds = &two[1]["seconds_per_rank"];
    assert_eq!(seconds.as_array().map(Vec::len), Some(2), "{seconds}");
    let page = std::fs::read_to_string(ranks.join("metrics.html")).unwrap();
    assert!(page.contains("<h2>pass rate per level"), "{page}");
}

/// Refinement over two ranks: with `--turns 2` the second turns (their prompts the conversation
/// with the toy reward's feedback) are rolled out, rewarded and replayed on the rank of their
/// task group, and the ranks still take the steps of one: the same metrics, the turns' included,
/// and the same final weights.
#[test]
fn two_ranks_refine_as_one() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_policy(dir.path());
    let tasks = two_tasks(dir.path());
    let turns = ["--stage", "e2e", "--turns", "2", "--turn-discount", "0.4"];
    let alone = dir.path().join("alone");
    let out = toy_run(&model, &tasks, &alone, &turns);
    assert!(
        out.status.success(),
        "one rank: {}",
        crate::common::stderr(&out)
    );
    let ranks = dir.path().join("ranks");
    let out = toy_run(
        &model,
        &tasks,
        &ranks,
        &[&turns[..], &["--nproc-per-node", "2"]].concat(),
    );
    assert!(
        out.status.success(),
        "two ranks: {}",
        crate::common::stderr(&out)
    );

    let (one, two) = (metrics(&alone), metrics(&ranks));
    let by_turn = one[0]["samples_by_turn"].as_array().unwrap();
    assert_eq!(by_turn[0], 8, "{}", one[0]);
    assert!(
        by_turn[1].as_u64().unwrap() > 0,
        "no second turn: {}",
        one[0]
    );
    assert_eq!(
        one.iter().map(without_times).collect::<Vec<_>>(),
        two.iter().map(without_times).collect::<Vec<_>>()
    );
    let weights = |run: &Path| std::fs::read(run.join("final/model-00001-of-00001.safetensors"));
    assert!(weights(&alone).unwrap() == weights(&ranks).unwrap());
    let config = std::fs::read_to_string(alone.join("config.toml")).unwrap();
    assert!(
        config.contains("turns = 2") && config.contains("turn_discount = 0.4"),
        "{config}"
    );
}

#[test]
fn help_is_a_manual() {
    let text = stdout(&crate::common::dice(&["train", "rl", "--help"]));
    for needle in [
        "What a step does",
        "dice-1.7b-stage2",
        "--nproc-per-node <N>",
        "Several ranks.",
        "--reward-token <ID|census>",
        "--turns <N>",
        "--turn-discount <G>",
        "metrics.html",
        "seconds_per_rank",
        "seconds_update_parts",
        "Examples:",
        "dice model init --config tests/data/sdar/golden/formula/config.json",
    ] {
        assert!(text.contains(needle), "no {needle:?} in:\n{text}");
    }
    // Disk use and checkpoint timing, as the help's wrapped lines read joined.
    let joined = text.split_whitespace().collect::<Vec<_>>().join(" ");
    for needle in [
        "no AdamW moments: the presets reset them",
        "seconds_checkpoint_write",
    ] {
        assert!(joined.contains(needle), "no {needle:?} in:\n{text}");
    }
}
