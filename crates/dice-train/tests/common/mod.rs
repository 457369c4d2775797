//! The SDAR tokenizer, this crate's fixture files and the formula golden's training cases.

#![allow(dead_code)]

use anyhow::Result;
use candle_core::{Device, Tensor};
use dice_model::golden::FormulaGolden;
use dice_model::init::{InitWeights, ModelInit};
use dice_model::SdarTokenizer;
use std::collections::HashMap;
use std::path::PathBuf;

/// The SDAR tokenizer of the workspace's `tests/data/sdar`.
pub(crate) fn tokenizer() -> SdarTokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/sdar");
    SdarTokenizer::from_dir(&dir).expect("the SDAR tokenizer loads")
}

/// A fixture file of `tests/data`.
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
        let dir =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/sdar/golden/formula");
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
