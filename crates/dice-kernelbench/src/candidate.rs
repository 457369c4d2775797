//! Candidate kernels: KernelBench run folders (`level_L_problem_ID_sample_S_kernel.py`)
//! and JSONL files of code or raw model answers ([`CandidateRecord`] lines).

use crate::extract::extract_first_code;
use crate::records::{read_jsonl_file, Record};
use anyhow::{bail, Context, Result};
use regex::Regex;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

static KERNEL_FILE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^level_(\d+)_problem_(\d+)_sample_(\d+)_kernel\.py$").expect("valid regex")
});

/// One candidate program for one (level, problem, sample).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub level: u32,
    pub problem_id: u32,
    pub sample_id: u32,
    /// The program's bytes; `None` when no code could be extracted from the raw answer.
    pub code: Option<Vec<u8>>,
    /// The model's answer the code was extracted from, when the input was a raw answer.
    pub raw_answer: Option<String>,
    /// Where it came from: a file path, or `file:line` for JSONL.
    pub origin: String,
}

impl Candidate {
    pub fn key(&self) -> (u32, u32, u32) {
        (self.level, self.problem_id, self.sample_id)
    }
}

/// One line of a candidates JSONL file: what `dice generate` appends (a raw answer with its
/// token ids, trace and finish reason) and what [`load_candidates`] reads (code or a raw
/// answer).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CandidateRecord {
    pub level: u32,
    pub problem_id: u32,
    pub sample_id: u32,
    #[serde(flatten)]
    pub body: CandidateBody,
    /// The generated token ids, when the model's side reported them.
    pub token_ids: Option<Vec<u32>>,
    /// For each generated token, the denoising step that unmasked it.
    pub trace: Option<Vec<u32>>,
    /// `stop` or `length`, when the model's side reported it.
    pub finish_reason: Option<String>,
}

/// What a candidate line holds: the field `code` or the field `completion`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CandidateBody {
    /// The program itself.
    Code(String),
    /// A model's raw answer; the program is its first code block.
    Completion(String),
}

impl CandidateRecord {
    pub fn key(&self) -> (u32, u32, u32) {
        (self.level, self.problem_id, self.sample_id)
    }

    fn from_fields(record: &Record) -> Result<Self> {
        let level = record.required_u32("level")?;
        let problem_id = record.required_u32("problem_id")?;
        let sample_id = record.required_u32("sample_id")?;
        let body = match (record.str_field("code")?, record.str_field("completion")?) {
            (Some(code), None) => CandidateBody::Code(code.to_string()),
            (None, Some(answer)) => CandidateBody::Completion(answer.to_string()),
            (Some(_), Some(_)) => bail!(
                "{}: has both `code` and `completion`; give one of them",
                record.origin
            ),
            (None, None) => bail!(
                "{}: missing `code` (a program) or `completion` (a raw model answer)",
                record.origin
            ),
        };
        Ok(CandidateRecord {
            level,
            problem_id,
            sample_id,
            body,
            token_ids: record.u32_list("token_ids")?,
            trace: record.u32_list("trace")?,
            finish_reason: record.str_field("finish_reason")?.map(str::to_string),
        })
    }
}

/// The lines of a candidates JSONL file (as `dice generate` writes them).
pub fn read_candidate_records(path: &Path) -> Result<Vec<CandidateRecord>> {
    read_jsonl_file(path)?
        .iter()
        .map(CandidateRecord::from_fields)
        .collect()
}

/// Loads candidates from files and folders, sorted by (level, problem, sample).
///
/// * a file named `level_{L}_problem_{ID}_sample_{S}_kernel.py` (KernelBench run layout);
/// * a folder: its files with that name pattern (none at all is an error); its other Python files
///   are listed in a warning and not evaluated;
/// * a `.jsonl` file: lines `{level, problem_id, sample_id, code}` or
///   `{level, problem_id, sample_id, completion}` (a raw answer, extracted with
///   [`extract_first_code`]).
///
/// The same (level, problem, sample) twice is an error naming both origins.
pub fn load_candidates(paths: &[PathBuf]) -> Result<Vec<Candidate>> {
    let mut by_key: BTreeMap<(u32, u32, u32), Candidate> = BTreeMap::new();
    for path in paths {
        for candidate in load_path(path)? {
            if let Some(first) = by_key.get(&candidate.key()) {
                let (l, p, s) = candidate.key();
                bail!(
                    "level {l} problem {p} sample {s} is given twice: {} and {}",
                    first.origin,
                    candidate.origin
                );
            }
            by_key.insert(candidate.key(), candidate);
        }
    }
    Ok(by_key.into_values().collect())
}

fn load_path(path: &Path) -> Result<Vec<Candidate>> {
    if path.is_dir() {
        return load_folder(path);
    }
    if !path.exists() {
        bail!("candidate path `{}` does not exist", path.display());
    }
    if let Some(key) = kernel_file_key(path) {
        return Ok(vec![read_kernel_file(path, key)?]);
    }
    if path.extension().is_some_and(|e| e == "jsonl") {
        return load_jsonl(path);
    }
    bail!(
        "`{}` is neither a `level_L_problem_ID_sample_S_kernel.py` file, a folder of them, \
         nor a `.jsonl` file of candidates",
        path.display()
    )
}

fn load_folder(dir: &Path) -> Result<Vec<Candidate>> {
    let mut candidates = Vec::new();
    let mut misnamed = Vec::new();
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?;
    for entry in entries {
        let path = entry
            .with_context(|| format!("cannot list {}", dir.display()))?
            .path();
        match kernel_file_key(&path).filter(|_| path.is_file()) {
            Some(key) => candidates.push(read_kernel_file(&path, key)?),
            None if path.extension().is_some_and(|e| e == "py") && path.is_file() => {
                misnamed.push(
                    path.file_name()
                        .unwrap_or_default()
                        .to_string_lossy()
                        .into_owned(),
                );
            }
            None => tracing::debug!("ignoring {} (not a candidate kernel file)", path.display()),
        }
    }
    misnamed.sort();
    if candidates.is_empty() {
        let beside = if misnamed.is_empty() {
            String::new()
        } else {
            format!(" ({})", misnamed_files(&misnamed))
        };
        bail!(
            "folder `{}` holds no `level_L_problem_ID_sample_S_kernel.py` files{beside}",
            dir.display()
        );
    }
    if !misnamed.is_empty() {
        tracing::warn!(
            "{}: {} (not evaluated)",
            dir.display(),
            misnamed_files(&misnamed)
        );
    }
    Ok(candidates)
}

/// How many Python files of a candidate folder do not follow the name pattern, and the first
/// few (sorted) names.
fn misnamed_files(names: &[String]) -> String {
    const SHOWN: usize = 3;
    let mut shown = names[..names.len().min(SHOWN)].join(", ");
    if names.len() > SHOWN {
        shown.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    let (count, verb) = match names.len() {
        1 => ("1 Python file".to_string(), "does"),
        n => (format!("{n} Python files"), "do"),
    };
    format!(
        "{count} {verb} not follow the candidate name pattern \
         `level_L_problem_ID_sample_S_kernel.py`: {shown}"
    )
}

fn kernel_file_key(path: &Path) -> Option<(u32, u32, u32)> {
    let name = path.file_name()?.to_str()?;
    let caps = KERNEL_FILE.captures(name)?;
    let num = |i: usize| caps[i].parse::<u32>().ok();
    Some((num(1)?, num(2)?, num(3)?))
}

fn read_kernel_file(
    path: &Path,
    (level, problem_id, sample_id): (u32, u32, u32),
) -> Result<Candidate> {
    let code = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(Candidate {
        level,
        problem_id,
        sample_id,
        code: Some(code),
        raw_answer: None,
        origin: path.display().to_string(),
    })
}

fn load_jsonl(path: &Path) -> Result<Vec<Candidate>> {
    read_jsonl_file(path)?
        .into_iter()
        .map(|record| {
            let line = CandidateRecord::from_fields(&record)?;
            let (code, raw_answer) = match line.body {
                CandidateBody::Code(code) => (Some(code.into_bytes()), None),
                CandidateBody::Completion(answer) => (
                    extract_first_code(&answer).map(String::into_bytes),
                    Some(answer),
                ),
            };
            Ok(Candidate {
                level: line.level,
                problem_id: line.problem_id,
                sample_id: line.sample_id,
                code,
                raw_answer,
                origin: record.origin,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Python files of a candidate folder that do not follow the pattern are counted and the
    /// first few named; a folder of only such files says so in its error.
    #[test]
    fn misnamed_candidate_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str| std::fs::write(dir.path().join(name), "x = 1\n").unwrap();
        for name in ["level_1_problem_2_sample_0.py", "kernel.py"] {
            write(name);
        }
        std::fs::write(dir.path().join("notes.txt"), "").unwrap();
        let err = load_folder(dir.path()).unwrap_err().to_string();
        assert!(
            err.ends_with(
                "holds no `level_L_problem_ID_sample_S_kernel.py` files (2 Python files do not \
                 follow the candidate name pattern `level_L_problem_ID_sample_S_kernel.py`: \
                 kernel.py, level_1_problem_2_sample_0.py)"
            ),
            "{err}"
        );

        write("level_1_problem_2_sample_1_kernel.py");
        for name in ["a.py", "b.py"] {
            write(name);
        }
        let loaded = load_folder(dir.path()).unwrap();
        assert_eq!(loaded.len(), 1);
        let names: Vec<String> = ["a.py", "b.py", "kernel.py", "level_1_problem_2_sample_0.py"]
            .map(String::from)
            .to_vec();
        assert!(misnamed_files(&names).ends_with(": a.py, b.py, kernel.py and 1 more"));
        assert!(misnamed_files(&names[..1]).starts_with("1 Python file does not follow"));
    }

    #[test]
    fn a_written_record_reads_back_as_itself() {
        let record = CandidateRecord {
            level: 1,
            problem_id: 19,
            sample_id: 2,
            body: CandidateBody::Completion("```python\nx = 1\n```".into()),
            token_ids: Some(vec![8, 9]),
            trace: Some(vec![1, 1]),
            finish_reason: Some("length".into()),
        };
        let line = serde_json::to_string(&record).unwrap();
        assert!(
            line.starts_with(r#"{"level":1,"problem_id":19,"sample_id":2,"completion":"#),
            "{line}"
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("candidates.jsonl");
        std::fs::write(&path, format!("{line}\n")).unwrap();
        assert_eq!(read_candidate_records(&path).unwrap(), vec![record]);
    }
}
