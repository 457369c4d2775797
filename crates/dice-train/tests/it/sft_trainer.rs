//! The SFT trainer on the CPU in f32, on the formula golden's tiny model (hidden 64, the full
//! 151,936-token vocabulary) written into a temporary folder: it overfits 16 samples, its
//! checkpoints load as models with its in-memory logits, an interrupted run resumes to the
//! same weights, and its metrics and settings read back.

use crate::common::{fixture, formula_config, metrics, read, run_options, weights};
use candle_core::{DType, Device, Tensor};
use dice_model::init::InitWeights;
use dice_model::{Sdar, TwoStreamBatch};
use dice_train::dist::{SingleProcess, TcpGroup};
use dice_train::noise::Noiser;
use dice_train::run::settings::{SaveDType, Settings};
use dice_train::run::RunOptions;
use dice_train::schedule::ScheduleKind;
use dice_train::sft::{SftConfig, SftTrainer};
use std::path::{Path, PathBuf};

/// The formula golden's model folder, tokenizer files included.
fn tiny_model(dir: &Path) -> PathBuf {
    crate::common::tiny_model(dir, &formula_config(), InitWeights::Formula)
}

/// The 16 samples in rows of 128 tokens (4 rows), all of them every step.
fn settings(model: &Path, steps: u64, lr: f64) -> SftConfig {
    let mut config = SftConfig::default();
    config.model.path = Some(model.to_path_buf());
    config.data.files = vec![fixture("overfit.jsonl")];
    config.data.row_tokens = 128;
    config.training.max_steps = Some(steps);
    config.training.run.learning_rate = lr;
    config.training.lr_scheduler = ScheduleKind::ConstantWithWarmup;
    config.training.warmup_ratio = 0.0;
    config.training.per_device_train_batch_size = 4;
    config
}

/// A single-process trainer writing to `out`, resuming whatever run it finds there.
fn open_trainer(config: SftConfig, out: &Path) -> anyhow::Result<SftTrainer> {
    let options = run_options(out);
    SftTrainer::new(config, options, Box::new(SingleProcess))
}

fn run(config: SftConfig, out: &Path) -> SftTrainer {
    let mut trainer = open_trainer(config, out).unwrap();
    trainer.train().unwrap();
    trainer
}

/// The 16 samples have distinct prompts and one shared response: the tiny model learns it in
/// a few dozen steps on the CPU (16 distinct responses take it hundreds). The loss of the last
/// three steps falls below 5 % of the first step's.
#[test]
fn sixteen_samples_are_overfit() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let out = dir.path().join("run");
    run(settings(&model, 20, 1e-2), &out);
    let losses: Vec<f64> = metrics(&out)
        .iter()
        .filter_map(|m| m["loss"].as_f64())
        .collect();
    assert_eq!(losses.len(), 20);
    let first = losses[0];
    let last = losses[losses.len() - 3..].iter().sum::<f64>() / 3.0;
    assert!(last < 0.05 * first, "from {first} to {last}: {losses:?}");
}

/// Logits of the two-stream forward on a noised training row.
fn logits(model: &Sdar, config: &SftConfig) -> Tensor {
    let tokenizer = dice_model::SdarTokenizer::from_dir(config.model.tokenizer_dir()).unwrap();
    let encoder = dice_train::data::Qwen3Encoder::new(&tokenizer).unwrap();
    let datasets = dice_train::data::select_datasets(&config.data.files, None, &[]).unwrap();
    let data = dice_train::data::PackedDataset::build(&datasets, &encoder, &config.pack_options(4))
        .unwrap();
    let row = Noiser::new(1, model.config().mask_token_id).noise(data.row(0), 0, 0);
    let batch = TwoStreamBatch::new(&[row]).unwrap();
    model
        .logits(&model.two_stream_hidden(&batch).unwrap())
        .unwrap()
}

/// Two steps with a checkpoint and an evaluation of a validation file after each, f32 weights
/// in shards of at most 20 MB: the folders (checkpoint-1 kept as a model only once checkpoint-2
/// is complete), the metrics, the settings, the checkpoint's logits; then the same run stopped
/// after its first checkpoint, as a kill after it leaves it, and resumed. (One step after the
/// checkpoint resumes every part of the state a later step reads: the f32 weights, here the
/// f32 model's, the moments and their step count, the schedule, the data order and the
/// noise.)
#[test]
fn checkpoints_load_as_models_and_a_resumed_run_ends_with_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let out = dir.path().join("run");
    let mut config = settings(&model, 2, 1e-3);
    config.checkpoint.save_steps = 1;
    config.checkpoint.save_dtype = SaveDType::F32;
    config.checkpoint.max_shard_bytes = 20_000_000;
    config.data.val_files = vec![fixture("prompt_response.jsonl")];
    config.eval.eval_steps = 1;
    let trainer = run(config, &out);

    // Settings: config.toml holds the resolved settings and reads back as them.
    let written = SftConfig::read(&out.join("config.toml")).unwrap();
    assert_eq!(&written, trainer.run().config());
    assert_eq!(written.clone().resolve().unwrap(), written);

    // Metrics: a line per step with every field, an eval line after each.
    let lines = metrics(&out);
    let steps: Vec<&serde_json::Value> = lines.iter().filter(|l| l.get("loss").is_some()).collect();
    assert_eq!(steps.len(), 2);
    for (k, line) in steps.iter().enumerate() {
        assert_eq!(line["step"], k as u64 + 1);
        for field in ["loss", "lr", "grad_norm", "tokens_per_s", "tflops", "epoch"] {
            assert!(line[field].as_f64().unwrap().is_finite(), "{field}: {line}");
        }
        assert_eq!(line["tokens"], 4 * 128);
        assert!(line["mfu"].is_null(), "no peak is known on the CPU: {line}");
        assert!(line["memory"].as_u64().unwrap() > 0);
    }
    assert_eq!(steps[0]["lr"], 1e-3);
    let evals: Vec<u64> = lines
        .iter()
        .filter(|l| l["eval_loss"].as_f64().is_some_and(f64::is_finite))
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evals, [1, 2]);
    let html = std::fs::read_to_string(out.join("metrics.html")).unwrap();
    assert!(html.contains("<svg") && !html.contains("<script"));

    // Folders: checkpoint-1, checkpoint-2 and final, sharded, f32, with the base model's files.
    let final_dir = out.join("final");
    for folder in [
        out.join("checkpoint-1"),
        out.join("checkpoint-2"),
        final_dir.clone(),
    ] {
        let index: serde_json::Value =
            serde_json::from_slice(&read(&folder.join("model.safetensors.index.json"))).unwrap();
        let shards: std::collections::BTreeSet<&str> = index["weight_map"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(
            shards.into_iter().collect::<Vec<_>>(),
            [
                "model-00001-of-00003.safetensors",
                "model-00002-of-00003.safetensors",
                "model-00003-of-00003.safetensors"
            ]
        );
        let config: serde_json::Value =
            serde_json::from_slice(&read(&folder.join("config.json"))).unwrap();
        assert_eq!(config["torch_dtype"], "float32");
        assert_eq!(config["hidden_size"], 64);
        for file in [
            "vocab.json",
            "merges.txt",
            "tokenizer_config.json",
            "chat_template.jinja",
        ] {
            assert_eq!(read(&folder.join(file)), read(&model.join(file)), "{file}");
        }
        assert!(folder.join("trainer_state.json").is_file());
    }
    assert!(out.join("checkpoint-2/optimizer.safetensors").is_file());
    assert!(!out.join("checkpoint-1/optimizer.safetensors").exists());
    assert!(!final_dir.join("optimizer.safetensors").exists());
    let written: Vec<&str> = lines
        .iter()
        .filter_map(|l| l["checkpoint"].as_str())
        .collect();
    assert_eq!(written, ["checkpoint-1", "checkpoint-2", "final"]);

    // The final folder loads as a model with the trained model's logits, bit for bit.
    let loaded = Sdar::load(&final_dir, DType::F32, &Device::Cpu).unwrap();
    let (ours, theirs) = (
        logits(trainer.run().model(), trainer.run().config()),
        logits(&loaded, trainer.run().config()),
    );
    assert_eq!(
        ours.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        theirs.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
    let settings_again = trainer.run().config().clone();
    drop(trainer);

    // Resume: the same run stopped after checkpoint-1, then run again.
    let shard = |dir: &Path| read(&dir.join("model-00001-of-00003.safetensors"));
    let straight_weights: Vec<Vec<u8>> = (1..=3)
        .map(|k| read(&final_dir.join(format!("model-0000{k}-of-00003.safetensors"))))
        .collect();
    let straight_state = read(&out.join("checkpoint-2/optimizer.safetensors"));
    let out = dir.path().join("stopped");
    let final_dir = out.join("final");
    let options = RunOptions {
        stop_after: Some(1),
        ..run_options(&out)
    };
    let mut stopped =
        SftTrainer::new(settings_again.clone(), options, Box::new(SingleProcess)).unwrap();
    assert_eq!(stopped.train().unwrap().steps_run(), 1);
    drop(stopped);
    assert!(out.join("checkpoint-1/optimizer.safetensors").is_file());
    assert!(!final_dir.exists());
    let mut resumed = open_trainer(settings_again, &out).unwrap();
    assert_eq!(resumed.run().step(), 1);
    let summary = resumed.train().unwrap();
    assert_eq!(summary.steps_run(), 1);
    for (k, straight) in straight_weights.iter().enumerate() {
        let name = format!("model-0000{}-of-00003.safetensors", k + 1);
        assert!(read(&final_dir.join(&name)) == *straight, "{name} differs");
    }
    assert!(read(&out.join("checkpoint-2/optimizer.safetensors")) == straight_state);
    assert_ne!(shard(&out.join("checkpoint-1")), shard(&final_dir));
    let learned = |lines: &[serde_json::Value]| -> Vec<serde_json::Value> {
        lines
            .iter()
            .filter(|l| l.get("loss").is_some() || l.get("eval_loss").is_some())
            .map(|l| serde_json::json!([l["step"], l["loss"], l["eval_loss"]]))
            .collect()
    };
    assert_eq!(learned(&metrics(&out)), learned(&lines));

    // A finished run does nothing when run again; other settings are refused.
    let mut config = resumed.run().config().clone();
    drop(resumed);
    let mut done = open_trainer(config.clone(), &out).unwrap();
    assert_eq!(done.train().unwrap().steps_run(), 0);
    drop(done);
    config.training.run.learning_rate = 2e-3;
    let refused = open_trainer(config, &out).err().unwrap().to_string();
    assert!(
        refused
            .contains("was trained with training.learning_rate = 0.001, this run asks for 0.002"),
        "{refused}"
    );
}

/// Trains `config` with `world` ranks as threads joined through a TCP rendezvous on
/// localhost, all writing to `out` (rank 0 alone does); returns the f32 moment values each
/// rank's optimizer held.
fn run_ranks(world: usize, config: &SftConfig, out: &Path) -> Vec<usize> {
    run_ranks_until(world, config, out, None)
}

/// [`run_ranks`], stopped after step `stop_after` when it is set.
fn run_ranks_until(
    world: usize,
    config: &SftConfig,
    out: &Path,
    stop_after: Option<u64>,
) -> Vec<usize> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut listener = Some(listener);
    std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let group = match rank {
                    0 => Some(listener.take().unwrap()),
                    _ => None,
                };
                scope.spawn(move || {
                    let group = match group {
                        Some(listener) => TcpGroup::host(listener, world).unwrap(),
                        None => TcpGroup::join(addr, rank, world).unwrap(),
                    };
                    let options = RunOptions {
                        stop_after,
                        ..run_options(out)
                    };
                    let mut trainer =
                        SftTrainer::new(config.clone(), options, Box::new(group)).unwrap();
                    trainer.train().unwrap();
                    trainer.run().moment_elements()
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

fn step_lines(out: &Path) -> Vec<(f64, f64)> {
    metrics(out)
        .iter()
        .filter(|l| l.get("loss").is_some())
        .map(|l| {
            (
                l["loss"].as_f64().unwrap(),
                l["grad_norm"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// Two steps (the second one's update depends on the first one's state), f32 checkpoints: one
/// rank accumulating `micro_batches` micro-batches of `rows` rows.
fn parallel_settings(model: &Path, rows: usize, micro_batches: usize) -> SftConfig {
    let mut config = settings(model, 2, 1e-3);
    config.training.per_device_train_batch_size = rows;
    config.training.gradient_accumulation_steps = micro_batches;
    config.checkpoint.save_dtype = SaveDType::F32;
    config
}

/// Two ranks running one micro-batch of a row each give the losses, gradient norms and
/// weights of one rank accumulating both micro-batches, bit for bit: rank 0 adds rank 1's
/// gradients to its own as the accumulator adds the second micro-batch to the first. Rank 0
/// alone writes the output folder, and the run resumes only with 2 ranks.
#[test]
fn two_ranks_train_as_one_rank_accumulating_their_micro_batches() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    run(parallel_settings(&model, 1, 2), &one);
    run_ranks(2, &parallel_settings(&model, 1, 1), &two);
    assert_eq!(step_lines(&one).len(), 2);
    assert_eq!(step_lines(&one), step_lines(&two));
    assert_eq!(weights(&one.join("final")), weights(&two.join("final")));
    assert_eq!(
        read(&one.join("checkpoint-2/optimizer.safetensors")),
        read(&two.join("checkpoint-2/optimizer.safetensors"))
    );

    let refused = open_trainer(parallel_settings(&model, 1, 1), &two)
        .err()
        .unwrap();
    assert!(format!("{refused:#}").contains("world_size"), "{refused:#}");
}

/// With two micro-batches of one row per rank, the ranks' partial sums are regrouped:
/// (a + b) + (c + d) where one rank adds ((a + b) + c) + d. The losses and gradient norms agree
/// to 1e-6 (relative) over two steps, and the weights to 1e-5.
#[test]
fn two_ranks_with_accumulation_match_one_rank_up_to_the_order_of_the_sum() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    run(parallel_settings(&model, 1, 4), &one);
    run_ranks(2, &parallel_settings(&model, 1, 2), &two);
    let (lines1, lines2) = (step_lines(&one), step_lines(&two));
    assert_eq!(lines1.len(), 2);
    for ((loss1, norm1), (loss2, norm2)) in lines1.into_iter().zip(lines2) {
        assert!(
            (loss1 - loss2).abs() <= 1e-6 * loss1.abs(),
            "{loss1} {loss2}"
        );
        assert!((norm1 - norm2).abs() <= 1e-6 * norm1, "{norm1} {norm2}");
    }
    let (ours, theirs) = (weights(&one.join("final")), weights(&two.join("final")));
    assert_eq!(ours.len(), theirs.len());
    let (mut largest, mut differing, mut total) = (0f32, 0usize, 0usize);
    for (a, b) in ours.values().zip(theirs.values()) {
        for (x, y) in a.iter().zip(b) {
            largest = largest.max((x - y).abs());
            differing += usize::from(x != y);
            total += 1;
        }
    }
    eprintln!("{differing} of {total} weights differ, by at most {largest:e}");
    assert!(
        largest <= 1e-5,
        "{differing} of {total} weights differ, by at most {largest:e}"
    );
}

/// `world` ranks with the optimizer state sharded (ZeRO `stage`), one row each per step, train
/// as one rank accumulating `world` rows with the whole state: the same losses, gradient norms,
/// weights and gathered optimizer state, bit for bit, over two steps. Each rank holds the
/// moments of its 1/`world` share of the parameters only. Returns the sharded run's folder and
/// settings.
fn sharded_runs_match_one_rank(
    dir: &Path,
    world: usize,
    stage: u8,
    save_steps: u64,
) -> (PathBuf, SftConfig) {
    let model = tiny_model(dir);
    let (one, sharded) = (dir.join("one"), dir.join("sharded"));
    let mut config = parallel_settings(&model, 1, world);
    config.training.max_steps = Some(2);
    config.checkpoint.save_steps = save_steps;
    let mut trainer = open_trainer(config.clone(), &one).unwrap();
    trainer.train().unwrap();
    let whole = trainer.run().moment_elements();
    drop(trainer);
    config.training.gradient_accumulation_steps = 1;
    config.training.zero_stage = stage;
    let moments = run_ranks(world, &config, &sharded);

    assert_eq!(step_lines(&one).len(), 2);
    assert_eq!(step_lines(&one), step_lines(&sharded));
    assert_eq!(weights(&one.join("final")), weights(&sharded.join("final")));
    let state = "checkpoint-2/optimizer.safetensors";
    assert!(read(&one.join(state)) == read(&sharded.join(state)));
    assert_eq!(moments.iter().sum::<usize>(), whole);
    for held in &moments {
        assert!(held.abs_diff(whole / world) <= 2, "{moments:?} of {whole}");
    }
    (sharded, config)
}

#[test]
fn two_ranks_with_zero_2_train_as_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    sharded_runs_match_one_rank(dir.path(), 2, 2, 2);
}

/// Three ranks with ZeRO-1, then the same run stopped after its first checkpoint (as a kill -9
/// after it leaves it) and resumed with ZeRO-2: each rank reads its shard of the gathered state,
/// and the run ends with the same weights and state.
#[test]
fn three_ranks_with_zero_1_train_as_one_rank_and_resume_with_zero_2() {
    let dir = tempfile::tempdir().unwrap();
    let (sharded, mut config) = sharded_runs_match_one_rank(dir.path(), 3, 1, 1);
    let straight = weights(&sharded.join("final"));
    let state = read(&sharded.join("checkpoint-2/optimizer.safetensors"));
    let out = dir.path().join("stopped");
    run_ranks_until(3, &config, &out, Some(1));
    assert!(!out.join("final").exists());
    config.training.zero_stage = 2;
    run_ranks(3, &config, &out);
    assert_eq!(weights(&out.join("final")), straight);
    assert!(read(&out.join("checkpoint-2/optimizer.safetensors")) == state);
}
