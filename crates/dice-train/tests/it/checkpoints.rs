//! A run's checkpoints on their own, written by the background writer from optimizer
//! snapshots of a narrow model: which folders are kept and what each holds, a state without
//! masters or moments restoring the exact f32 weights, a write that fails leaving the
//! checkpoint before it, and the disk guard's refusal.

use crate::common::{formula_config, tiny_model};
use candle_core::{DType, Device, Tensor, Var};
use dice_model::init::InitWeights;
use dice_model::SdarConfig;
use dice_train::optim::{AdamW, AdamWConfig};
use dice_train::run::checkpoint::{
    checkpoint_name, newest_resumable, CheckpointMetrics, CheckpointSave, CheckpointWriter,
    Checkpointer, TrainerState, OPTIMIZER_STATE, TRAINER_STATE,
};
use dice_train::run::settings::{CheckpointConfig, ModelConfig, SaveDType};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The formula golden's model narrowed to hidden 8 (a checkpoint of a few dozen MB).
fn narrow_config() -> SdarConfig {
    SdarConfig {
        hidden_size: 8,
        intermediate_size: 16,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 4,
        ..formula_config()
    }
}

/// An optimizer over weights of `config`'s shapes, in `dtype`, every value of a weight
/// `1 + k/7` for the weight's index k plus 1/3 (not representable in bf16: the f32 masters
/// differ from the weights).
fn optimizer(config: &SdarConfig, dtype: DType) -> AdamW {
    let weights = config
        .tensor_shapes()
        .into_iter()
        .enumerate()
        .map(|(k, (name, shape))| {
            let value = 1.0 + k as f64 / 7.0 + 1.0 / 3.0;
            let master = Tensor::full(value as f32, shape, &Device::Cpu).unwrap();
            (
                name,
                Var::from_tensor(&master.to_dtype(dtype).unwrap()).unwrap(),
            )
        })
        .collect::<Vec<_>>();
    AdamW::new(weights, AdamWConfig::default()).unwrap()
}

/// A checkpointer of the narrow model (its folder in `dir`) writing to `dir/run`.
fn checkpointer(dir: &Path, settings: &CheckpointConfig) -> (Checkpointer, PathBuf) {
    let config = narrow_config();
    let model = ModelConfig {
        path: Some(tiny_model(dir, &config, InitWeights::Random { seed: 1 })),
        tokenizer: None,
    };
    let out = dir.join("run");
    std::fs::create_dir_all(&out).unwrap();
    (Checkpointer::new(&out, &model, &config, settings), out)
}

/// The resumable checkpoint of `step`: the optimizer's state, with its moments.
fn save(optimizer: &AdamW, step: u64) -> CheckpointSave {
    CheckpointSave {
        name: checkpoint_name(step),
        snapshot: optimizer.snapshot(true).unwrap(),
        state: TrainerState {
            step,
            total_steps: 100,
            epoch: 0.0,
            data_fingerprint: "data".into(),
            resume_key: serde_json::json!({}),
        },
        resumable: true,
    }
}

/// Saves `step` through `writer` and waits for it: its line.
fn save_and_wait(writer: &mut CheckpointWriter, optimizer: &AdamW, step: u64) -> CheckpointMetrics {
    writer.start(save(optimizer, step), Instant::now()).unwrap();
    writer.wait().unwrap().expect("a write was in flight")
}

/// The names in `out`, sorted.
fn listing(out: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn bytes_of(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

/// Saves after each of 7 steps with save_steps 3: the newest checkpoint is kept resumable,
/// checkpoint-3 and checkpoint-6 as models only, every other is removed; with a limit of 2, the
/// newest two. Each write's line gives the bytes of its complete folder.
#[test]
fn the_newest_checkpoint_is_resumable_and_every_save_steps_th_is_kept_as_a_model() {
    for (limit, expected) in [
        (None, vec!["checkpoint-3", "checkpoint-6", "checkpoint-7"]),
        (Some(2), vec!["checkpoint-6", "checkpoint-7"]),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let settings = CheckpointConfig {
            save_steps: 3,
            save_total_limit: limit,
            ..CheckpointConfig::default()
        };
        let (checkpointer, out) = checkpointer(dir.path(), &settings);
        let mut writer = CheckpointWriter::new(checkpointer);
        let optimizer = optimizer(&narrow_config(), DType::F32);
        for step in 1..=7 {
            let line = save_and_wait(&mut writer, &optimizer, step);
            assert_eq!(
                (line.step, line.checkpoint.as_str()),
                (step, &*checkpoint_name(step))
            );
            let folder = out.join(checkpoint_name(step));
            assert_eq!(line.checkpoint_bytes, bytes_of(&folder));
            assert!(line.seconds_checkpoint >= 0.0 && line.seconds_checkpoint_write > 0.0);
        }
        assert_eq!(listing(&out), expected, "limit {limit:?}");
        for name in &expected {
            let folder = out.join(name);
            assert!(folder.join(TRAINER_STATE).is_file() && folder.join("config.json").is_file());
            assert!(folder.join("model-00001-of-00001.safetensors").is_file());
            assert_eq!(
                folder.join(OPTIMIZER_STATE).is_file(),
                *name == "checkpoint-7",
                "{name}: only the newest checkpoint keeps the resume state"
            );
        }
        assert_eq!(
            newest_resumable(&out).unwrap(),
            Some(out.join("checkpoint-7"))
        );
    }
}

/// A checkpoint saved in f32 without moments (a run that resets them every step) holds only the
/// step in its optimizer state: the f32 model is the masters. Restored into bf16 weights, the
/// optimizer has the exact f32 masters back and a fresh AdamW's moments and step count.
#[test]
fn a_state_without_masters_or_moments_restores_the_f32_weights_of_the_model_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let settings = CheckpointConfig {
        save_dtype: SaveDType::F32,
        ..CheckpointConfig::default()
    };
    let (checkpointer, out) = checkpointer(dir.path(), &settings);
    let config = narrow_config();
    let mut saved = optimizer(&config, DType::BF16);
    let grads: HashMap<String, Tensor> = config
        .tensor_shapes()
        .into_iter()
        .map(|(name, shape)| (name, Tensor::full(0.5f32, shape, &Device::Cpu).unwrap()))
        .collect();
    saved.step(&grads, 1e-3, None).unwrap();
    let mut writer = CheckpointWriter::new(checkpointer);
    let save = CheckpointSave {
        snapshot: saved.snapshot(false).unwrap(),
        ..save(&saved, 1)
    };
    writer.start(save, Instant::now()).unwrap();
    writer.wait().unwrap();
    let state = out.join("checkpoint-1").join(OPTIMIZER_STATE);
    let stored = candle_core::safetensors::load(&state, &Device::Cpu).unwrap();
    assert_eq!(stored.keys().collect::<Vec<_>>(), ["step"]);

    let mut restored = optimizer(&config, DType::BF16);
    restored.load_state(&state).unwrap();
    assert_eq!(restored.steps(), 0, "a fresh AdamW's step count");
    let masters = |optimizer: &AdamW| -> Vec<Vec<f32>> {
        let snapshot = optimizer.snapshot(false).unwrap();
        snapshot
            .masters()
            .map(|(_, t)| t.flatten_all().unwrap().to_vec1().unwrap())
            .collect()
    };
    assert_eq!(masters(&restored), masters(&saved));
    assert_ne!(
        masters(&restored),
        masters(&optimizer(&config, DType::BF16))
    );
}

/// A write that fails halfway (the base model's config.json gone after the weights were
/// written) is an error of the wait for it, and leaves the checkpoint before it complete and
/// resumable; the folder it was writing never appears under its name, and what was written of
/// it is removed.
#[test]
fn a_failed_write_is_an_error_and_leaves_the_checkpoint_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let (checkpointer, out) = checkpointer(dir.path(), &CheckpointConfig::default());
    let mut writer = CheckpointWriter::new(checkpointer);
    let optimizer = optimizer(&narrow_config(), DType::F32);
    save_and_wait(&mut writer, &optimizer, 1);
    let before = std::fs::read(out.join("checkpoint-1").join(OPTIMIZER_STATE)).unwrap();

    std::fs::remove_file(dir.path().join("tiny/config.json")).unwrap();
    writer.start(save(&optimizer, 2), Instant::now()).unwrap();
    let error = format!("{:#}", writer.wait().unwrap_err());
    assert!(
        error.starts_with("cannot write checkpoint-2") && error.contains("config.json"),
        "{error}"
    );
    assert_eq!(
        listing(&out),
        ["checkpoint-1"],
        "the part written of checkpoint-2 is removed"
    );
    assert_eq!(
        newest_resumable(&out).unwrap(),
        Some(out.join("checkpoint-1"))
    );
    assert!(std::fs::read(out.join("checkpoint-1").join(OPTIMIZER_STATE)).unwrap() == before);
}

/// When the output folder's file system has less room than a checkpoint needs, the save fails
/// at once with one line that says what is needed, what is free and what to do; nothing is
/// written or removed.
#[test]
fn the_disk_guard_refuses_a_checkpoint_that_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let (checkpointer, out) = checkpointer(dir.path(), &CheckpointConfig::default());
    let mut writer = CheckpointWriter::new(checkpointer.clone());
    let optimizer = optimizer(&narrow_config(), DType::F32);
    save_and_wait(&mut writer, &optimizer, 1);
    let before = listing(&out);

    let needed = checkpointer.expected_bytes(&save(&optimizer, 2));
    // bf16 model, f32 masters and both moments, and the small files' allowance.
    assert_eq!(
        needed,
        14 * narrow_config().num_parameters() as u64 + (64 << 20)
    );
    let mut guarded = CheckpointWriter::new(checkpointer.with_free_bytes(|_| Ok(1_000_000)));
    let error = guarded
        .start(save(&optimizer, 2), Instant::now())
        .unwrap_err()
        .to_string();
    assert!(!error.contains('\n'), "{error}");
    for part in [
        "no room for checkpoint-2".to_string(),
        format!("needs {needed} bytes"),
        format!("{} has 1000000 bytes (0.0 GB) free", out.display()),
        "--save-total-limit".to_string(),
        "another --out".to_string(),
    ] {
        assert!(error.contains(&part), "no {part:?} in: {error}");
    }
    assert!(guarded.wait().unwrap().is_none(), "nothing was started");
    assert_eq!(listing(&out), before);
}
