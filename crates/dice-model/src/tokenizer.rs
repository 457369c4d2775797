//! The SDAR tokenizer (spec §5.1-§5.2): `tokenizer.json` when the checkpoint has one, else the
//! Qwen2 byte-level BPE pipeline assembled for the `tokenizers` crate from `vocab.json`,
//! `merges.txt` and `tokenizer_config.json` (NFC, the Qwen2 split regex, byte-level mapping,
//! BPE without unk/dropout/fallback, every added token with its id and special flag).

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// Qwen2 pre-tokenizer regex (spec §5.2 step 3).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub struct SdarTokenizer {
    inner: tokenizers::Tokenizer,
    mask_token_id: Option<u32>,
    eos_token_id: Option<u32>,
    pad_token_id: Option<u32>,
}

fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// Content of a token entry of tokenizer_config.json (a string or an AddedToken object).
fn token_content(v: &Value) -> Option<&str> {
    v.as_str()
        .or_else(|| v.get("content").and_then(Value::as_str))
}

/// The `tokenizers` JSON of the slow Qwen2 tokenizer.
fn qwen2_tokenizer_json(dir: &Path, config: &Value) -> Result<Value> {
    let vocab = read_json(&dir.join("vocab.json"))?;
    let merges_path = dir.join("merges.txt");
    let merges_text = std::fs::read_to_string(&merges_path)
        .with_context(|| format!("cannot read {}", merges_path.display()))?;
    let mut merges = Vec::new();
    for (n, line) in merges_text.lines().enumerate() {
        if line.starts_with("#version") || line.is_empty() {
            continue;
        }
        let Some((a, b)) = line.split_once(' ') else {
            bail!(
                "{} line {}: a merge must be two tokens separated by a space",
                merges_path.display(),
                n + 1
            );
        };
        merges.push(json!([a, b]));
    }

    // Tokens the slow tokenizer counts as special (`all_special_ids`): the named special tokens
    // and additional_special_tokens, on top of the per-token flags.
    let mut special_names: Vec<&str> = [
        "eos_token",
        "pad_token",
        "bos_token",
        "unk_token",
        "mask_token",
    ]
    .iter()
    .filter_map(|k| config.get(*k).and_then(token_content))
    .collect();
    if let Some(list) = config
        .get("additional_special_tokens")
        .and_then(Value::as_array)
    {
        special_names.extend(list.iter().filter_map(token_content));
    }
    let decoder = config
        .get("added_tokens_decoder")
        .and_then(Value::as_object)
        .context("tokenizer_config.json has no added_tokens_decoder")?;
    let mut added = BTreeMap::new();
    for (id, token) in decoder {
        let id: u32 = id
            .parse()
            .with_context(|| format!("added token id {id:?} is not a number"))?;
        let content =
            token_content(token).with_context(|| format!("added token {id} has no content"))?;
        let flag = |k: &str| token.get(k).and_then(Value::as_bool).unwrap_or(false);
        let special = flag("special") || special_names.contains(&content);
        added.insert(
            id,
            json!({"id": id, "content": content, "single_word": flag("single_word"), "lstrip": flag("lstrip"),
                   "rstrip": flag("rstrip"), "normalized": false, "special": special}),
        );
    }
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added.into_values().collect::<Vec<_>>(),
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": false},
            byte_level,
        ]},
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": merges},
    }))
}

impl SdarTokenizer {
    /// Loads the tokenizer of a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.exists() {
            read_json(&config_path)?
        } else {
            Value::Object(Map::new())
        };
        let fast = dir.join("tokenizer.json");
        let inner = if fast.exists() {
            tokenizers::Tokenizer::from_file(&fast)
                .map_err(|e| anyhow::anyhow!("cannot load {}: {e}", fast.display()))?
        } else {
            if !config_path.exists() {
                bail!("{} has neither tokenizer.json nor tokenizer_config.json + vocab.json + merges.txt", dir.display());
            }
            let spec = qwen2_tokenizer_json(dir, &config)?;
            spec.to_string()
                .parse::<tokenizers::Tokenizer>()
                .map_err(|e| {
                    anyhow::anyhow!("cannot build the tokenizer of {}: {e}", dir.display())
                })?
        };
        let id_of = |key: &str| {
            config
                .get(key)
                .and_then(token_content)
                .and_then(|t| inner.token_to_id(t))
        };
        let mask_token_id = id_of("mask_token");
        let eos_token_id = id_of("eos_token");
        let pad_token_id = id_of("pad_token");
        Ok(Self {
            inner,
            mask_token_id,
            eos_token_id,
            pad_token_id,
        })
    }

    /// Token ids of `text`, added tokens matched literally, nothing prepended or appended
    /// (`add_special_tokens=False`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow::anyhow!("cannot tokenize: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`; `skip_special_tokens` drops special tokens (eos, im_start, im_end, the
    /// mask token, ...) but keeps non-special added tokens such as `<think>`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let vocab = self.inner.get_vocab_size(true) as u32;
        if let Some(bad) = ids.iter().find(|&&id| id >= vocab) {
            bail!("token id {bad} is outside the tokenizer's vocabulary of {vocab} tokens");
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| anyhow::anyhow!("cannot decode token ids: {e}"))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Id of `mask_token` of tokenizer_config.json (`<|MASK|>`, 151669 for SDAR).
    pub fn mask_token_id(&self) -> Option<u32> {
        self.mask_token_id
    }

    /// Id of `eos_token` of tokenizer_config.json.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// Id of `pad_token` of tokenizer_config.json (`<|endoftext|>`, 151643 for SDAR).
    pub fn pad_token_id(&self) -> Option<u32> {
        self.pad_token_id
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
