//! KernelBench problems: the `levelL/ID_Name.py` tree, enumerated and validated.

use crate::validate::validate_problem_source;
use anyhow::{bail, Context, Result};
use std::fs;
use std::path::{Path, PathBuf};

/// Level 4 problems wrap Hugging Face models fetched with `from_pretrained` at import time.
const NETWORK_LEVEL: u32 = 4;

/// One reference program: a module defining `Model`, `get_inputs` and `get_init_inputs`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub level: u32,
    /// The 1-based KernelBench id (the integer before the first `_` of the file name).
    pub problem_id: u32,
    /// The file stem, e.g. `1_Square_matrix_multiplication_` (`pair_{id}` for pairs).
    pub name: String,
    pub path: PathBuf,
    /// The file's bytes, untouched (no newline translation, no trimming).
    pub source: Vec<u8>,
}

impl Problem {
    /// Whether running the reference needs network access (Hugging Face downloads):
    /// every level-4 problem, and any other problem that calls `from_pretrained`.
    pub fn needs_network(&self) -> bool {
        self.level == NETWORK_LEVEL || contains(&self.source, b"from_pretrained")
    }

    /// The source as text; problems that passed validation are always UTF-8.
    pub fn source_text(&self) -> Result<&str> {
        std::str::from_utf8(&self.source)
            .with_context(|| format!("{} is not valid UTF-8", self.path.display()))
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// A file that looks like a problem but cannot be used, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidProblem {
    /// The file; for a pair, its position in the pairs file (`file#index` or `file:line`).
    pub path: PathBuf,
    pub reason: String,
}

/// The outcome of reading problem files: the usable problems (sorted by level, then id)
/// and the files that were rejected. A rejected file never hides the others.
#[derive(Clone, Debug, Default)]
pub struct ProblemScan {
    pub problems: Vec<Problem>,
    pub invalid: Vec<InvalidProblem>,
}

/// A KernelBench problem tree: a folder holding `level1/`, `level2/`, … with `ID_Name.py` files.
#[derive(Clone, Debug)]
pub struct KernelBench {
    root: PathBuf,
}

impl KernelBench {
    /// Opens the folder holding `level1/` … `level4/`. A repository clone's root is accepted
    /// too, when its `KernelBench/` subfolder holds the levels.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            bail!(
                "KernelBench folder `{}` does not exist; pass the `KernelBench/` folder of a \
                 KernelBench clone (the one holding level1/ … level4/)",
                dir.display()
            );
        }
        for root in [dir.to_path_buf(), dir.join("KernelBench")] {
            if !level_folders(&root)?.is_empty() {
                return Ok(KernelBench { root });
            }
        }
        bail!(
            "`{}` holds no level folders (level1/, level2/, …); pass the `KernelBench/` folder \
             of a KernelBench clone",
            dir.display()
        )
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The levels present, ascending.
    pub fn levels(&self) -> Result<Vec<u32>> {
        Ok(level_folders(&self.root)?
            .into_iter()
            .map(|(level, _)| level)
            .collect())
    }

    /// Every problem of every level (`None`) or of one level.
    pub fn scan(&self, level: Option<u32>) -> Result<ProblemScan> {
        let levels = match level {
            Some(l) => vec![l],
            None => self.levels()?,
        };
        let mut all = ProblemScan::default();
        for level in levels {
            let scan = self.scan_level(level)?;
            all.problems.extend(scan.problems);
            all.invalid.extend(scan.invalid);
        }
        Ok(all)
    }

    /// The problems of one level, sorted by id.
    pub fn scan_level(&self, level: u32) -> Result<ProblemScan> {
        let dir = self.root.join(format!("level{level}"));
        if !dir.is_dir() {
            let present: Vec<String> = self.levels()?.iter().map(u32::to_string).collect();
            bail!(
                "`{}` does not exist; levels in this tree: {}",
                dir.display(),
                present.join(", ")
            );
        }
        let mut files: Vec<PathBuf> = fs::read_dir(&dir)
            .with_context(|| format!("cannot list {}", dir.display()))?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<_>>()
            .with_context(|| format!("cannot list {}", dir.display()))?;
        files.retain(|p| p.is_file() && p.extension().is_some_and(|e| e == "py"));
        files.sort();

        let mut scan = ProblemScan::default();
        for path in files {
            match read_problem(level, &path)? {
                Err(reason) => scan.invalid.push(InvalidProblem { path, reason }),
                Ok(problem) => match scan
                    .problems
                    .iter()
                    .find(|p| p.problem_id == problem.problem_id)
                {
                    Some(first) => scan.invalid.push(InvalidProblem {
                        reason: format!(
                            "problem id {} is already used by {}",
                            problem.problem_id,
                            first.path.display()
                        ),
                        path,
                    }),
                    None => scan.problems.push(problem),
                },
            }
        }
        scan.problems.sort_by_key(|p| p.problem_id);
        Ok(scan)
    }

    /// One problem by level and id; an invalid file for that id is an error carrying its reason.
    pub fn problem(&self, level: u32, problem_id: u32) -> Result<Problem> {
        let scan = self.scan_level(level)?;
        if let Some(p) = scan
            .problems
            .into_iter()
            .find(|p| p.problem_id == problem_id)
        {
            return Ok(p);
        }
        let prefix = format!("{problem_id}_");
        if let Some(bad) = scan.invalid.iter().find(|bad| {
            bad.path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
        }) {
            bail!(
                "level {level} problem {problem_id} ({}) is invalid: {}",
                bad.path.display(),
                bad.reason
            );
        }
        bail!(
            "level {level} has no problem {problem_id} in {}",
            self.root.display()
        )
    }
}

/// `(level, folder)` for every `level{N}` subfolder, ascending by N.
fn level_folders(root: &Path) -> Result<Vec<(u32, PathBuf)>> {
    if !root.is_dir() {
        return Ok(Vec::new());
    }
    let mut levels = Vec::new();
    for entry in fs::read_dir(root).with_context(|| format!("cannot list {}", root.display()))? {
        let path = entry
            .with_context(|| format!("cannot list {}", root.display()))?
            .path();
        let level = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("level"))
            .and_then(|n| n.parse::<u32>().ok());
        if let (Some(level), true) = (level, path.is_dir()) {
            levels.push((level, path));
        }
    }
    levels.sort();
    Ok(levels)
}

/// Reads one file; the inner `Err` is why the file is not a usable problem.
fn read_problem(level: u32, path: &Path) -> Result<std::result::Result<Problem, String>> {
    let Some((problem_id, name)) = parse_file_name(path) else {
        return Ok(Err(
            "file name is not `ID_Name.py` (ID = the problem number); skipped".to_string(),
        ));
    };
    let source = fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    if let Some(reason) = validate_problem_source(&source) {
        return Ok(Err(reason));
    }
    Ok(Ok(Problem {
        level,
        problem_id,
        name,
        path: path.to_path_buf(),
        source,
    }))
}

/// `(id, stem)` of `{id}_{Name}.py`.
fn parse_file_name(path: &Path) -> Option<(u32, String)> {
    let stem = path.file_stem()?.to_str()?;
    let (id, rest) = stem.split_once('_')?;
    if id.is_empty() || rest.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((id.parse().ok()?, stem.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_follow_kernelbench() {
        let id = |n: &str| parse_file_name(Path::new(n)).map(|(id, _)| id);
        assert_eq!(id("12_Matmul_with_diagonal_matrices_.py"), Some(12));
        assert_eq!(id("1_EleutherAI-gpt-neo-2p7B_bs32_seq256.py"), Some(1));
        assert_eq!(id("test.py"), None);
        assert_eq!(id("x1_A.py"), None);
        assert_eq!(id("7_.py"), None);
    }

    #[test]
    fn network_need_follows_level_and_source() {
        let p = |level, src: &str| Problem {
            level,
            problem_id: 1,
            name: "1_x".into(),
            path: "1_x.py".into(),
            source: src.as_bytes().to_vec(),
        };
        assert!(p(4, "").needs_network());
        assert!(!p(1, "import torch").needs_network());
        assert!(p(0, "AutoModel.from_pretrained(name)").needs_network());
    }
}
