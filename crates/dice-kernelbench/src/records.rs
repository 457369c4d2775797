//! Reading JSON object records from a JSON array file or a JSONL file, each with its origin.

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};
use std::path::Path;

/// One object of a records file, with `file:line` (JSONL) or `file#index` (JSON array).
pub struct Record {
    pub origin: String,
    pub fields: Map<String, Value>,
}

impl Record {
    pub fn u32_field(&self, key: &str) -> Result<Option<u32>> {
        match self.fields.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
                Some(n) => Ok(Some(n)),
                None => bail!(
                    "{}: `{key}` must be a non-negative integer, got {v}",
                    self.origin
                ),
            },
        }
    }

    pub(crate) fn u32_list(&self, key: &str) -> Result<Option<Vec<u32>>> {
        let list = match self.fields.get(key) {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect(),
            Some(_) => None,
        };
        list.map(Some).with_context(|| {
            format!(
                "{}: `{key}` must be a list of non-negative integers",
                self.origin
            )
        })
    }

    pub(crate) fn required_u32(&self, key: &str) -> Result<u32> {
        self.u32_field(key)?
            .with_context(|| format!("{}: missing `{key}`", self.origin))
    }

    pub fn str_field(&self, key: &str) -> Result<Option<&str>> {
        match self.fields.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => bail!(
                "{}: `{key}` must be a string, got {}",
                self.origin,
                json_type(v)
            ),
        }
    }

    pub fn required_str(&self, key: &str) -> Result<&str> {
        self.str_field(key)?
            .with_context(|| format!("{}: missing `{key}`", self.origin))
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Reads `path` as a JSON array of objects when its first non-blank character is `[`,
/// otherwise as JSONL (one object per non-blank line).
pub fn read_records(path: &Path) -> Result<Vec<Record>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read {} as UTF-8 text", path.display()))?;
    if text.trim_start().starts_with('[') {
        read_array(path, &text)
    } else {
        read_jsonl(path, &text)
    }
}

/// Reads `path` as JSONL only.
pub(crate) fn read_jsonl_file(path: &Path) -> Result<Vec<Record>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read {} as UTF-8 text", path.display()))?;
    read_jsonl(path, &text)
}

fn read_array(path: &Path, text: &str) -> Result<Vec<Record>> {
    let values: Vec<Value> = serde_json::from_str(text)
        .with_context(|| format!("{} is not a valid JSON array", path.display()))?;
    values
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let origin = format!("{}#{i}", path.display());
            into_record(origin, v)
        })
        .collect()
}

fn read_jsonl(path: &Path, text: &str) -> Result<Vec<Record>> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            let origin = format!("{}:{}", path.display(), i + 1);
            let value: Value = serde_json::from_str(line)
                .map_err(|e| anyhow::anyhow!("{origin}: not valid JSON ({e})"))?;
            into_record(origin, value)
        })
        .collect()
}

fn into_record(origin: String, value: Value) -> Result<Record> {
    match value {
        Value::Object(fields) => Ok(Record { origin, fields }),
        other => bail!(
            "{origin}: expected a JSON object, got {}",
            json_type(&other)
        ),
    }
}
