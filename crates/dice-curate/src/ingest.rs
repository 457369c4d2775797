//! `ingest`: pairs from the formats they come in, normalised, given content ids and freed of
//! exact and near duplicates.
//!
//! Inputs, told apart per record (JSON array or JSONL files) or by being a folder:
//! * DICE / KernelBench-style pairs: `pytorch_code` and `cuda_code` (an empty or missing
//!   `cuda_code` makes a problem-only record, as in DICE's end-to-end RL tasks); `level` is kept
//!   as the record's label;
//! * LlamaFactory SFT records, alpaca (`instruction` + `input` → `output`, or `prompt` →
//!   `response`) or sharegpt (`conversations` of `from`/`value`, or `messages` of
//!   `role`/`content`): the program is the response's first fenced block (KernelBench's
//!   extraction), the problem the last fenced block of the prompt that defines `class Model`;
//! * folders of `.py` files: a file defining `class ModelNew` is a kernel, its problem the file
//!   beside it that defines `class Model` with the longest name its own name starts with
//!   (`19_ReLU.py` for `19_ReLU_new.py`); a problem without kernels is a problem-only record.

use crate::dedup::{shingles, token_hash, tokens, NearDuplicates};
use crate::run::{write_jsonl, RunDir};
use anyhow::{Context, Result};
use dice_kernelbench::{extract_first_code, read_records, validate_problem_source, Record};
use regex::Regex;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

/// One PyTorch reference and its kernel program (none for a problem-only record), normalised.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pair {
    /// The first 16 hex digits of the SHA-256 of the normalised reference and kernel.
    pub id: String,
    pub pytorch_code: String,
    pub cuda_code: Option<String>,
    /// Where it was read: `file#index`, `file:line` or a kernel file's path.
    pub origin: String,
    /// The source's difficulty label (`level`), when it has one.
    pub label: Option<String>,
}

/// A record ingest left out, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DroppedRecord {
    pub origin: String,
    /// Its id when it got that far.
    pub id: Option<String>,
    /// `exact duplicate`, `near duplicate`, or why no pair could be read from it.
    pub reason: String,
    /// The kept pair it duplicates, and their similarity (1 for exact duplicates).
    pub duplicate_of: Option<String>,
    pub similarity: Option<f64>,
}

/// What ingest did, as `RUN/ingest.json` holds it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IngestSummary {
    /// Records read, per input format.
    pub read: BTreeMap<String, usize>,
    pub rejected: usize,
    pub exact_duplicates: usize,
    pub near_duplicates: usize,
    pub kept: usize,
    /// Kept records without a kernel.
    pub problem_only: usize,
    /// The near-duplicate threshold (Jaccard similarity of token shingles).
    pub threshold: f64,
    /// Kept pairs with duplicates: the kept id and its dropped duplicates.
    pub clusters: Vec<Cluster>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    pub kept: String,
    /// `(origin, similarity)` of each duplicate dropped in its favour.
    pub duplicates: Vec<(String, f64)>,
}

/// A record read from an input, before deduplication.
struct Raw {
    origin: String,
    format: &'static str,
    read: Result<(String, Option<String>), String>,
    label: Option<String>,
}

/// Reads `inputs`, keeps the first of every group of duplicates, and writes the run folder's
/// `pairs.jsonl`, `ingest-dropped.jsonl` and `ingest.json` (anew: ingesting the same inputs
/// again gives the same files).
pub fn ingest(run: &RunDir, inputs: &[PathBuf], threshold: f64) -> Result<IngestSummary> {
    run.create()?;
    let mut raws = Vec::new();
    for input in inputs {
        if input.is_dir() {
            raws.extend(read_folder(input)?);
        } else {
            raws.extend(read_records(input)?.iter().map(read_record));
        }
    }
    let mut summary = IngestSummary {
        threshold,
        ..IngestSummary::default()
    };
    let mut pairs: Vec<Pair> = Vec::new();
    let mut dropped = Vec::new();
    let mut exact: HashMap<String, usize> = HashMap::new();
    let mut near = NearDuplicates::default();
    let mut clusters: BTreeMap<usize, Vec<(String, f64)>> = BTreeMap::new();
    for raw in raws {
        *summary.read.entry(raw.format.to_string()).or_default() += 1;
        let (pytorch_code, cuda_code) = match raw.read {
            Ok(read) => read,
            Err(reason) => {
                summary.rejected += 1;
                dropped.push(DroppedRecord {
                    origin: raw.origin,
                    id: None,
                    reason,
                    duplicate_of: None,
                    similarity: None,
                });
                continue;
            }
        };
        let pair = Pair {
            id: content_id(&pytorch_code, cuda_code.as_deref()),
            pytorch_code,
            cuda_code,
            origin: raw.origin,
            label: raw.label,
        };
        let code = format!(
            "{}\n{}",
            pair.pytorch_code,
            pair.cuda_code.as_deref().unwrap_or("")
        );
        let tokens = tokens(&code);
        let hash = token_hash(&tokens);
        // `near` keeps exactly the pairs kept here, in the same order, so its indices are
        // indices into `pairs`.
        let duplicate = match exact.get(&hash) {
            Some(&kept) => {
                summary.exact_duplicates += 1;
                Some(("exact duplicate", kept, 1.0))
            }
            None => near
                .offer(shingles(&tokens), threshold)
                .map(|(kept, similarity)| {
                    summary.near_duplicates += 1;
                    ("near duplicate", kept, similarity)
                }),
        };
        if let Some((reason, kept, similarity)) = duplicate {
            clusters
                .entry(kept)
                .or_default()
                .push((pair.origin.clone(), similarity));
            dropped.push(DroppedRecord {
                origin: pair.origin,
                id: Some(pair.id),
                reason: reason.to_string(),
                duplicate_of: Some(pairs[kept].id.clone()),
                similarity: Some(similarity),
            });
            continue;
        }
        exact.insert(hash, pairs.len());
        pairs.push(pair);
    }
    summary.kept = pairs.len();
    summary.problem_only = pairs.iter().filter(|p| p.cuda_code.is_none()).count();
    summary.clusters = clusters
        .into_iter()
        .map(|(kept, duplicates)| Cluster {
            kept: pairs[kept].id.clone(),
            duplicates,
        })
        .collect();
    write_jsonl(&run.pairs(), &pairs)?;
    write_jsonl(&run.ingest_dropped(), &dropped)?;
    crate::run::write_json(&run.ingest_summary(), &summary)?;
    Ok(summary)
}

/// The stable id of a pair: its normalised content's hash.
pub(crate) fn content_id(pytorch_code: &str, cuda_code: Option<&str>) -> String {
    let mut hasher = Sha256::new();
    hasher.update(pytorch_code.as_bytes());
    hasher.update([0]);
    hasher.update(cuda_code.unwrap_or("").as_bytes());
    hex::encode(hasher.finalize())[..16].to_string()
}

/// Line ends as `\n`, no trailing white space on a line, no blank lines at either end, one
/// final newline.
pub fn normalize(code: &str) -> String {
    let lines: Vec<&str> = code.lines().map(str::trim_end).collect();
    let first = lines.iter().position(|l| !l.is_empty());
    let last = lines.iter().rposition(|l| !l.is_empty());
    match (first, last) {
        (Some(first), Some(last)) => lines[first..=last].join("\n") + "\n",
        _ => String::new(),
    }
}

static CLASS_MODEL: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?m)^class\s+Model\b").expect("valid regex"));
static CLASS_MODEL_NEW: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?m)^class\s+ModelNew\b").expect("valid regex"));
static FENCED: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?s)```[ \t]*[A-Za-z0-9_+-]*[ \t]*\n(.*?)```").expect("valid regex")
});

/// The reference and kernel of a problem and program, both normalised and checked.
fn checked(problem: &str, kernel: Option<&str>) -> Result<(String, Option<String>), String> {
    let problem = normalize(problem);
    if let Some(why) = validate_problem_source(problem.as_bytes()) {
        return Err(format!(
            "the PyTorch reference is not a usable problem: {why}"
        ));
    }
    let kernel = kernel.map(normalize).filter(|k| !k.is_empty());
    if let Some(kernel) = &kernel {
        if !CLASS_MODEL_NEW.is_match(kernel) {
            return Err("the kernel program defines no `class ModelNew`".into());
        }
    }
    Ok((problem, kernel))
}

fn read_record(record: &Record) -> Raw {
    let fields = &record.fields;
    let text = |key: &str| fields.get(key).and_then(Value::as_str);
    let label = match fields.get("level") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => None,
    };
    let (format, read) = if let Some(problem) = text("pytorch_code") {
        ("pairs", checked(problem, text("cuda_code")))
    } else if let (Some(prompt), Some(response)) = (
        text("instruction").or(text("prompt")),
        text("output").or(text("response")),
    ) {
        let prompt = format!("{prompt}\n{}", text("input").unwrap_or(""));
        ("alpaca", from_chat(&prompt, response))
    } else if let Some(turns) = fields
        .get("conversations")
        .or(fields.get("messages"))
        .and_then(Value::as_array)
    {
        ("sharegpt", from_turns(turns))
    } else {
        (
            "unknown",
            Err("no pytorch_code, alpaca or sharegpt fields".to_string()),
        )
    };
    Raw {
        origin: record.origin.clone(),
        format,
        read,
        label,
    }
}

/// A sharegpt conversation: the user turns are the prompt, the last assistant turn the response.
fn from_turns(turns: &[Value]) -> Result<(String, Option<String>), String> {
    let mut prompt = String::new();
    let mut response = None;
    for turn in turns {
        let role = turn
            .get("from")
            .or(turn.get("role"))
            .and_then(Value::as_str);
        let content = turn
            .get("value")
            .or(turn.get("content"))
            .and_then(Value::as_str)
            .unwrap_or("");
        match role {
            Some("human" | "user") => {
                prompt.push_str(content);
                prompt.push('\n');
            }
            Some("gpt" | "assistant") => response = Some(content),
            _ => {}
        }
    }
    from_chat(&prompt, response.ok_or("no assistant turn")?)
}

fn from_chat(prompt: &str, response: &str) -> Result<(String, Option<String>), String> {
    let problem = FENCED
        .captures_iter(prompt)
        .filter_map(|c| c.get(1))
        .map(|m| m.as_str())
        .filter(|block| CLASS_MODEL.is_match(block) && !CLASS_MODEL_NEW.is_match(block))
        .last()
        .ok_or("the prompt holds no fenced PyTorch reference (`class Model`)")?;
    let program = extract_first_code(response).ok_or("the response holds no fenced program")?;
    checked(problem, Some(&program))
}

/// Kernel files and their problems in a folder tree (module docs: the pairing rule).
fn read_folder(root: &Path) -> Result<Vec<Raw>> {
    let mut files = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("cannot list {}", dir.display()))?
        {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "py") {
                files.push(path);
            }
        }
    }
    files.sort();
    let mut problems: BTreeMap<PathBuf, String> = BTreeMap::new();
    let mut kernels: Vec<(PathBuf, String)> = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {} as UTF-8 text", path.display()))?;
        if CLASS_MODEL_NEW.is_match(&text) {
            kernels.push((path, text));
        } else if CLASS_MODEL.is_match(&text) {
            problems.insert(path, text);
        }
    }
    let mut with_kernels = std::collections::BTreeSet::new();
    let mut raws = Vec::new();
    for (path, kernel) in kernels {
        let problem = problems
            .keys()
            .filter(|p| p.parent() == path.parent() && stem(&path).starts_with(stem(p)))
            .max_by_key(|p| stem(p).len());
        let read = match problem {
            Some(p) => {
                with_kernels.insert(p.clone());
                checked(&problems[p], Some(&kernel))
            }
            None => Err(
                "no problem file beside the kernel (`class Model`, a prefix of its name)".into(),
            ),
        };
        raws.push(Raw {
            origin: path.display().to_string(),
            format: "folder",
            read,
            label: None,
        });
    }
    for (path, problem) in &problems {
        if !with_kernels.contains(path) {
            raws.push(Raw {
                origin: path.display().to_string(),
                format: "folder",
                read: checked(problem, None),
                label: None,
            });
        }
    }
    Ok(raws)
}

fn stem(path: &Path) -> &str {
    path.file_stem().and_then(|s| s.to_str()).unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalising_keeps_code_and_drops_layout_noise() {
        assert_eq!(normalize("\r\n\nx = 1  \r\n\n  y\t\n\n"), "x = 1\n\n  y\n");
        assert_eq!(normalize(" \n"), "");
    }

    #[test]
    fn the_problem_is_the_last_reference_block_of_the_prompt() {
        let prompt = "Example:\n```python\nclass Model:\n    a = 1\n```\nnew:\n```\nclass ModelNew:\n    pass\n```\n\
You are given:\n```\nimport torch\nclass Model(torch.nn.Module):\n    pass\ndef get_inputs():\n    return []\ndef get_init_inputs():\n    return []\n```";
        let response = "Here:\n```python\nclass ModelNew:\n    pass\n```";
        let (problem, kernel) = from_chat(prompt, response).unwrap();
        assert!(problem.starts_with("import torch\n"));
        assert_eq!(kernel.as_deref(), Some("class ModelNew:\n    pass\n"));
        assert!(from_chat(prompt, "no code").is_err());
        assert!(from_chat("no reference", response).is_err());
    }
}
