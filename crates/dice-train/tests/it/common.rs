//! What the tests share: the SDAR tokenizer, this crate's fixture files, the formula golden's
//! config and training cases, tiny model folders and what a run leaves in its output folder.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use dice_model::golden::FormulaGolden;
use dice_model::init::{InitWeights, ModelInit};
use dice_model::{SdarConfig, SdarTokenizer};
use dice_train::run::{Resume, RunOptions};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The repository's SDAR tokenizer and chat template (`tests/data/sdar`).
pub(crate) fn sdar_dir() -> PathBuf {
    dice_test_support::test_data().join("sdar")
}

/// The SDAR tokenizer of the workspace's `tests/data/sdar`.
pub(crate) fn tokenizer() -> SdarTokenizer {
    SdarTokenizer::from_dir(&sdar_dir()).expect("the SDAR tokenizer loads")
}

/// A fixture file of this crate's `tests/data`.
pub(crate) fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

pub(crate) const IM_START: u32 = 151644;
pub(crate) const IM_END: u32 = 151645;
pub(crate) const PAD: u32 = 151643;
pub(crate) const NEWLINE: u32 = 198;
pub(crate) const USER: u32 = 872;
pub(crate) const ASSISTANT: u32 = 77091;
/// `<think>\n\n</think>\n\n`.
pub(crate) const EMPTY_THOUGHT: [u32; 4] = [151667, 271, 151668, 271];
/// Single capital letters are single tokens: 'X' = 55.
pub(crate) const X: u32 = 55;
pub(crate) const Y: u32 = 56;
pub(crate) const Z: u32 = 57;

/// `<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n` around content ids.
pub(crate) fn user_turn(content: &[u32]) -> Vec<u32> {
    let mut ids = vec![IM_START, USER, NEWLINE];
    ids.extend_from_slice(content);
    ids.extend([IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE]);
    ids
}

/// `{content}<|im_end|>\n` around content ids.
pub(crate) fn assistant_turn(content: &[u32]) -> Vec<u32> {
    let mut ids = content.to_vec();
    ids.extend([IM_END, NEWLINE]);
    ids
}

/// The formula golden's folder (tests/data/sdar/golden/formula).
fn formula_dir() -> PathBuf {
    sdar_dir().join("golden/formula")
}

/// The formula golden's model config: hidden 64, two layers, the full 151,936-token vocabulary.
pub(crate) fn formula_config() -> SdarConfig {
    SdarConfig::from_path(&formula_dir().join("config.json")).expect("the formula config reads")
}

/// A model folder `dir/tiny` of `config` with `weights`, the SDAR tokenizer files included.
pub(crate) fn tiny_model(dir: &Path, config: &SdarConfig, weights: InitWeights) -> PathBuf {
    let model = dir.join("tiny");
    let tokenizer = sdar_dir();
    ModelInit {
        tokenizer: Some(&tokenizer),
        ..ModelInit::new(config, weights)
    }
    .write(&model)
    .expect("the tiny model writes");
    model
}

/// Every weight of the model folder `dir`, by name, as f32.
pub(crate) fn weights(dir: &Path) -> BTreeMap<String, Vec<f32>> {
    let mut weights = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            for (name, tensor) in candle_core::safetensors::load(&path, &Device::Cpu).unwrap() {
                let values = tensor.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                weights.insert(name, values.to_vec1().unwrap());
            }
        }
    }
    assert!(!weights.is_empty(), "no weights in {}", dir.display());
    weights
}

/// A run writing to `out` without a progress bar, resuming whatever run it finds there.
pub(crate) fn run_options(out: &Path) -> RunOptions {
    RunOptions {
        out: out.to_path_buf(),
        resume: Resume::Auto,
        progress: false,
        stop_after: None,
    }
}

/// The lines of a run's `metrics.jsonl`.
pub(crate) fn metrics(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The bytes of a file, or a panic naming it.
pub(crate) fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The formula golden (tests/data/sdar/golden/formula) as its training cases read it: the
/// cases, a checkpoint of the formula weights in a temporary folder, and the tensors torch
/// computed (`expected_train.safetensors`).
pub(crate) struct TrainingGolden {
    pub(crate) golden: FormulaGolden,
    pub(crate) model_dir: tempfile::TempDir,
    pub(crate) expected: HashMap<String, Tensor>,
}

impl TrainingGolden {
    pub(crate) fn open() -> Result<Self> {
        let dir = formula_dir();
        let golden = FormulaGolden::open(&dir)?;
        let model_dir = tempfile::tempdir()?;
        ModelInit::new(golden.config(), InitWeights::Formula).write(model_dir.path())?;
        let expected =
            candle_core::safetensors::load(dir.join("expected_train.safetensors"), &Device::Cpu)?;
        Ok(Self {
            golden,
            model_dir,
            expected,
        })
    }
}
