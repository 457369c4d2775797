//! PyTorch→CUDA pairs (DICE's released format) as level-0 problems with one candidate each.

use crate::candidate::Candidate;
use crate::problem::{InvalidProblem, Problem};
use crate::records::read_records;
use crate::validate::validate_problem_source;
use anyhow::{bail, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Pairs are not KernelBench problems; they all live in this level.
pub const PAIRS_LEVEL: u32 = 0;

/// Problems and candidates read from a pairs file.
#[derive(Clone, Debug, Default)]
pub struct PairSet {
    /// Valid problems, sorted by id; named `pair_{id}`, `path` = the pairs file.
    pub problems: Vec<Problem>,
    /// Pairs whose `pytorch_code` is not a usable problem (their candidates are left out).
    pub invalid: Vec<InvalidProblem>,
    /// One candidate per valid problem (sample 0); `code` is `None` for an empty `cuda_code`.
    pub candidates: Vec<Candidate>,
}

/// Reads a JSON array or JSONL of objects with `pytorch_code` (the problem) and `cuda_code`
/// (the candidate). The problem id is the object's `id`, or its 0-based position when absent or
/// a string (the hashes `dice curate export` writes; the problem is then named by it).
pub fn load_pairs(path: &Path) -> Result<PairSet> {
    // Each pair's id as written and its problem id (`#N`), with the record that first used it.
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    let mut set = PairSet::default();
    for (position, record) in read_records(path)?.into_iter().enumerate() {
        let (id, label) = match record.fields.get("id") {
            // `dice curate export` names tasks by a content hash: the position numbers them.
            Some(Value::String(name)) => (u32::try_from(position)?, name.clone()),
            _ => {
                let id = match record.u32_field("id")? {
                    Some(id) => id,
                    None => u32::try_from(position)?,
                };
                (id, id.to_string())
            }
        };
        for key in [label.clone(), format!("#{id}")] {
            if let Some(first) = seen.insert(key, record.origin.clone()) {
                bail!(
                    "{}: pair id {label} is already used by {first}",
                    record.origin
                );
            }
        }
        let source = record.required_str("pytorch_code")?.as_bytes().to_vec();
        let cuda_code = record.required_str("cuda_code")?;
        if let Some(reason) = validate_problem_source(&source) {
            set.invalid.push(InvalidProblem {
                path: PathBuf::from(&record.origin),
                reason,
            });
            continue;
        }
        set.candidates.push(Candidate {
            level: PAIRS_LEVEL,
            problem_id: id,
            sample_id: 0,
            code: (!cuda_code.is_empty()).then(|| cuda_code.as_bytes().to_vec()),
            raw_answer: None,
            origin: record.origin,
        });
        set.problems.push(Problem {
            level: PAIRS_LEVEL,
            problem_id: id,
            name: format!("pair_{label}"),
            path: path.to_path_buf(),
            source,
        });
    }
    // The candidates keep the file's order, the order they are judged in: a file can put what it
    // wants judged together side by side (bench/eval/pairs_with_identity.py: each pair beside
    // its identity candidate, timed while the pairs' builds run).
    set.problems.sort_by_key(|p| p.problem_id);
    Ok(set)
}
