//! The SDAR tokenizer and this crate's fixture files.

#![allow(dead_code)]

use dice_model::SdarTokenizer;
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
