//! Text in and out of the engine for a model folder: chat-template prompts, default stop ids,
//! and completion text as DICE's evaluation produces it (spec §4.6, §5).

use anyhow::{Context, Result};
use dice_model::chat::ChatMessage;
use dice_model::{ChatTemplate, SdarTokenizer};
use serde_json::Value;
use std::path::Path;

/// DICE's evaluation deletes this literal from the decoded text (spec §4.6).
const MASK_TEXT: &str = "<|MASK|>";

pub struct TextCodec {
    tokenizer: SdarTokenizer,
    template: ChatTemplate,
    tokenizer_vocab: u32,
}

impl TextCodec {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tokenizer = SdarTokenizer::from_dir(dir)?;
        let template = ChatTemplate::from_dir(dir)?;
        let tokenizer_vocab = tokenizer.inner().get_vocab_size(true) as u32;
        Ok(TextCodec {
            tokenizer,
            template,
            tokenizer_vocab,
        })
    }

    pub fn tokenizer(&self) -> &SdarTokenizer {
        &self.tokenizer
    }

    /// The chat-template rendering of `messages` with the generation prompt (no system
    /// message is added, thinking left to the template's default), tokenized.
    pub fn chat_prompt_ids(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let text = self.template.render(messages, true, &Value::Null)?;
        self.tokenizer.encode(&text)
    }

    /// A prompt used as is (no template).
    pub fn raw_prompt_ids(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode(text)
    }

    /// Generated ids to text: special tokens skipped, `<|MASK|>` removed. Ids past the
    /// tokenizer's vocabulary (unused embedding rows the model can still emit) have no text.
    pub fn completion_text(&self, ids: &[u32]) -> Result<String> {
        let known: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&id| id < self.tokenizer_vocab)
            .collect();
        Ok(self.tokenizer.decode(&known, true)?.replace(MASK_TEXT, ""))
    }
}

/// The `eos_token_id` of the folder's `generation_config.json` (an id or a list of ids), else
/// of its `config.json`; none when neither names one.
pub fn default_stop_ids(dir: &Path) -> Result<Vec<u32>> {
    for file in ["generation_config.json", "config.json"] {
        let path = dir.join(file);
        if !path.exists() {
            continue;
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let json: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        let ids: Vec<u32> = match json.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().into_iter().map(|n| n as u32).collect(),
            Some(Value::Array(list)) => list
                .iter()
                .filter_map(Value::as_u64)
                .map(|n| n as u32)
                .collect(),
            _ => Vec::new(),
        };
        if !ids.is_empty() {
            return Ok(ids);
        }
    }
    Ok(Vec::new())
}
