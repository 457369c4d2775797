//! The run folder every stage of `dice curate` reads and writes. Stages write whole files under
//! a temporary name and rename them, so an interrupted stage leaves the previous file or none;
//! `verify` appends one line per judged pair and skips the pairs it finds there.

use anyhow::{Context, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A curate run folder.
#[derive(Clone, Debug)]
pub struct RunDir {
    pub dir: PathBuf,
}

impl RunDir {
    pub fn new(dir: impl Into<PathBuf>) -> RunDir {
        RunDir { dir: dir.into() }
    }

    pub fn create(&self) -> Result<()> {
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("cannot create the run folder {}", self.dir.display()))
    }

    /// The pairs ingest kept.
    pub fn pairs(&self) -> PathBuf {
        self.dir.join("pairs.jsonl")
    }

    /// The records ingest left out (duplicates, unreadable records) and why.
    pub fn ingest_dropped(&self) -> PathBuf {
        self.dir.join("ingest-dropped.jsonl")
    }

    pub fn ingest_summary(&self) -> PathBuf {
        self.dir.join("ingest.json")
    }

    /// One line per judged pair: the verdict, the speedup and its interval, kept or why not.
    pub fn verified(&self) -> PathBuf {
        self.dir.join("verified.jsonl")
    }

    /// Verify's counts and speedups.
    pub fn verify_summary(&self) -> PathBuf {
        self.dir.join("verify.json")
    }

    /// What verify decided for each pair, with a clear error when verify has not run.
    pub fn read_verified(&self) -> Result<Vec<crate::VerifiedPair>> {
        let path = self.verified();
        if !path.exists() {
            anyhow::bail!(
                "{} holds no verified.jsonl: run `dice curate verify --run {}` first",
                self.dir.display(),
                self.dir.display()
            );
        }
        read_jsonl(&path)
    }

    /// The evaluator's store of the judged pairs.
    pub fn judge_store(&self) -> PathBuf {
        self.dir.join("dice.db")
    }

    /// The problems diversify drew from the catalogue.
    pub fn diversify_problems(&self) -> PathBuf {
        self.dir.join("diversify-problems.jsonl")
    }

    /// Every answer of diversify's generator, appended as it arrives.
    pub fn diversify_answers(&self) -> PathBuf {
        self.dir.join("diversify-answers.jsonl")
    }

    /// The evaluator's store of diversify's attempts judged at `precision`.
    pub fn diversify_store(&self, precision: dice_eval::Precision) -> PathBuf {
        self.dir
            .join(format!("diversify-{}.db", precision.as_str()))
    }

    /// One line per judged attempt: the verdict, the speedup and its interval, kept or why not.
    pub fn diversify_attempts(&self) -> PathBuf {
        self.dir.join("diversify-attempts.jsonl")
    }

    /// The pairs diversify kept, which export adds to those verify kept.
    pub fn diversify_pairs(&self) -> PathBuf {
        self.dir.join("diversify-pairs.jsonl")
    }

    /// Diversify's counts.
    pub fn diversify_summary(&self) -> PathBuf {
        self.dir.join("diversify.json")
    }

    /// The endpoint's difficulty ratings, appended as they arrive (never asked again).
    pub fn difficulty_answers(&self) -> PathBuf {
        self.dir.join("difficulty-answers.jsonl")
    }

    /// The levels export gave the RL tasks: the method, the histogram, each task's measure.
    pub fn difficulty_summary(&self) -> PathBuf {
        self.dir.join("difficulty.json")
    }

    /// Reads the pairs ingest kept, with a clear error when ingest has not run.
    pub fn read_pairs(&self) -> Result<Vec<crate::Pair>> {
        let path = self.pairs();
        if !path.exists() {
            anyhow::bail!(
                "{} holds no pairs.jsonl: run `dice curate ingest --run {}` first",
                self.dir.display(),
                self.dir.display()
            );
        }
        read_jsonl(&path)
    }
}

/// Writes one JSON object per line, atomically (a temporary file renamed over `path`).
pub(crate) fn write_jsonl<T: Serialize>(path: &Path, items: &[T]) -> Result<()> {
    write_atomically(path, |file| {
        for item in items {
            serde_json::to_writer(&mut *file, item)?;
            file.write_all(b"\n")?;
        }
        Ok(())
    })
}

pub(crate) fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    write_atomically(path, |file| {
        serde_json::to_writer_pretty(&mut *file, value)?;
        file.write_all(b"\n")?;
        Ok(())
    })
}

pub(crate) fn write_atomically(
    path: &Path,
    fill: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> Result<()>,
) -> Result<()> {
    let partial = path.with_extension("partial");
    let file = std::fs::File::create(&partial)
        .with_context(|| format!("cannot create {}", partial.display()))?;
    let mut writer = std::io::BufWriter::new(file);
    fill(&mut writer).with_context(|| format!("cannot write {}", partial.display()))?;
    writer
        .into_inner()
        .map_err(std::io::IntoInnerError::into_error)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot write {}", partial.display()))?;
    std::fs::rename(&partial, path)
        .with_context(|| format!("cannot rename {} to {}", partial.display(), path.display()))
}

/// Every line of a JSONL file; a torn last line (an interrupted append) is ignored.
pub(crate) fn read_jsonl<T: DeserializeOwned>(path: &Path) -> Result<Vec<T>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let complete = if text.ends_with('\n') {
        lines.len()
    } else {
        lines.len().saturating_sub(1)
    };
    lines[..complete]
        .iter()
        .enumerate()
        .map(|(i, line)| {
            serde_json::from_str(line)
                .with_context(|| format!("{}:{}: not a record of this run", path.display(), i + 1))
        })
        .collect()
}
