//! KernelBench candidates for `dice eval`: answers to the one-shot prompt of every valid
//! problem of a level (or of those asked for), appended to `RUN/candidates.jsonl` one line at a
//! time as they finish, so that an interrupted run resumes where it stopped.

use anyhow::{ensure, Context, Result};
use dice_engine::{DecodeParams, Generator, Job, PromptStyle};
use dice_kernelbench::prompt::problem_prompt;
use dice_kernelbench::{read_candidate_records, CandidateBody, CandidateRecord, KernelBench};
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The file of a run folder that candidates are appended to.
pub const CANDIDATES_FILE: &str = "candidates.jsonl";
/// The run folder's store of verdicts, beside its candidates.
pub const STORE_FILE: &str = "dice.db";

/// Which candidates to generate, and where they go.
#[derive(Clone, Debug)]
pub struct CandidateRun {
    /// The KernelBench folder.
    pub kernelbench: PathBuf,
    pub level: u32,
    /// The problems to answer (every valid problem of the level when `None`); an id the level
    /// has no valid problem for is an error.
    pub problems: Option<BTreeSet<u32>>,
    /// Samples per problem: sample `s` decodes with [`DecodeParams::for_sample`]`(s)`.
    pub samples: u32,
    /// The run folder (created when missing); candidates it holds already are skipped.
    pub run: PathBuf,
}

/// What candidate generation reports as it goes, for a progress display.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// The candidates still to generate (none: the run folder holds them all).
    Planned(usize),
    /// One more candidate was appended.
    Stored,
}

/// Generates the candidates of `run` that its run folder does not hold yet.
pub fn generate_candidates(
    generator: &Generator,
    params: &DecodeParams,
    run: &CandidateRun,
    progress: impl FnMut(Progress),
) -> Result<()> {
    let jobs = kernelbench_jobs(run)?;
    append_answers(generator, params, &run.run, jobs, progress)
}

/// Answers the jobs whose candidates the folder `dir` (created when missing) does not hold yet,
/// appending each answer to its candidates file as it finishes.
pub(crate) fn append_answers(
    generator: &Generator,
    params: &DecodeParams,
    dir: &Path,
    jobs: Vec<Job<CandidateKey>>,
    mut progress: impl FnMut(Progress),
) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the run folder {}", dir.display()))?;
    let path = dir.join(CANDIDATES_FILE);
    let done = stored_keys(&path)?;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    let jobs: Vec<_> = jobs
        .into_iter()
        .filter(|job| !done.contains(&job.key))
        .collect();
    progress(Progress::Planned(jobs.len()));
    if jobs.is_empty() {
        return Ok(());
    }
    generator.run(
        params,
        PromptStyle::Chat,
        jobs,
        |(level, problem_id, sample_id), answer| {
            let record = CandidateRecord {
                level,
                problem_id,
                sample_id,
                body: CandidateBody::Completion(answer.text),
                token_ids: answer.token_ids,
                trace: answer.trace,
                finish_reason: answer.finish_reason,
            };
            writeln!(file, "{}", serde_json::to_string(&record)?)
                .and_then(|()| file.flush())
                .with_context(|| format!("cannot append to {}", path.display()))?;
            progress(Progress::Stored);
            Ok(())
        },
    )
}

pub(crate) type CandidateKey = (u32, u32, u32);

/// Every (problem, sample) of `run`, keyed as [`CandidateRecord::key`].
fn kernelbench_jobs(run: &CandidateRun) -> Result<Vec<Job<CandidateKey>>> {
    let bench = KernelBench::open(&run.kernelbench)?;
    let scan = bench.scan_level(run.level)?;
    let wanted = |id: u32| run.problems.as_ref().is_none_or(|w| w.contains(&id));
    let mut found = BTreeSet::new();
    let mut jobs = Vec::new();
    for problem in scan.problems.iter().filter(|p| wanted(p.problem_id)) {
        found.insert(problem.problem_id);
        let text = problem_prompt(problem)?;
        jobs.extend((0..run.samples).map(|sample_id| Job {
            key: (run.level, problem.problem_id, sample_id),
            history: Vec::new(),
            text: text.clone(),
            sample: sample_id as usize,
        }));
    }
    if let Some(wanted) = &run.problems {
        let missing: Vec<String> = wanted.difference(&found).map(u32::to_string).collect();
        ensure!(
            missing.is_empty(),
            "level {} has no valid problem {}",
            run.level,
            missing.join(", ")
        );
    }
    Ok(jobs)
}

/// The keys of the candidates in `path` (an absent file has none).
fn stored_keys(path: &Path) -> Result<BTreeSet<CandidateKey>> {
    Ok(stored_candidates(path)?
        .iter()
        .map(CandidateRecord::key)
        .collect())
}

/// The candidates in `path` (an absent file has none).
pub(crate) fn stored_candidates(path: &Path) -> Result<Vec<CandidateRecord>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    read_candidate_records(path).with_context(|| {
        format!(
            "cannot resume from {}; fix or remove the line named here",
            path.display()
        )
    })
}
