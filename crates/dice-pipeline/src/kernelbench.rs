//! A model on KernelBench in one run folder: candidates generated (`candidates.jsonl`), judged
//! (`dice.db`) and reported (`report.md`, `report.html`, `report.json`). Every stage resumes: a
//! candidate already generated is not generated again, a sample already judged is not judged
//! again, and the report is written anew from the store.

use crate::candidates::{generate_candidates, CandidateRun, Progress, CANDIDATES_FILE};
use anyhow::{bail, ensure, Context, Result};
use dice_engine::{DecodeParams, Generator};
use dice_eval::{Batch, EvalConfig, EvalProblem, EvalSample, Judge, StaticAudit, Store, Summary};
use dice_kernelbench::{load_candidates, KernelBench};
use dice_report::{render_comparison, ComparedRun, Comparison, Format};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The run folder's store of verdicts.
pub const STORE_FILE: &str = "dice.db";
/// What generated the run's candidates: the model and the decoding parameters.
pub const GENERATION_FILE: &str = "generation.json";
/// The reports the run writes, in the paper's layout.
pub const REPORT_FILES: [(&str, Format); 3] = [
    ("report.md", Format::Md),
    ("report.html", Format::Html),
    ("report.json", Format::Json),
];

/// One model on chosen KernelBench levels, `samples` candidates per problem, in one run folder.
#[derive(Clone, Debug)]
pub struct KernelBenchRun {
    tree: KernelBench,
    /// The run folder (created when missing).
    pub dir: PathBuf,
    pub levels: Vec<u32>,
    /// The problem ids to answer on every level (all valid problems of a level when `None`);
    /// an id a level has no valid problem for is an error. Problems the tree rejects are left
    /// out (`dice problems list` names them).
    pub problems: Option<BTreeSet<u32>>,
    /// Candidates per problem; sample `s` decodes with [`DecodeParams::for_sample`]`(s)`.
    pub samples: u32,
    /// What the report calls the model; a run resumed with another model is refused.
    pub model: String,
    /// Start the run folder over: its candidates, verdicts and reports are removed first.
    pub force: bool,
    /// How candidates are judged: [`KernelBenchRun::new`] sets its store (`RUN/dice.db`) and
    /// problem source (the tree); the rest (device, trials, tolerances, strict…) is the
    /// caller's.
    pub judging: EvalConfig,
}

/// What a run reports as it goes, for a progress display.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Generation of one level's candidates (`Planned(0)`: the run folder holds them all).
    Generating { level: u32, progress: Progress },
    /// The judge starts on this many candidates; those judged before are skipped.
    Judging { candidates: usize },
}

/// What a finished run did and found.
pub struct Finished {
    /// The judge's account of this invocation (what it judged, what was judged before).
    pub judged: Summary,
    /// The run in the paper's layout, as the reports show it.
    pub report: Comparison,
    /// The reports written, as [`REPORT_FILES`] names them.
    pub report_files: Vec<PathBuf>,
}

impl KernelBenchRun {
    /// A run of every valid problem of `levels` of the KernelBench tree at `kernelbench`, one
    /// sample each, into the run folder `dir`, judged with [`EvalConfig`]'s defaults.
    pub fn new(kernelbench: &Path, dir: PathBuf, levels: Vec<u32>, model: String) -> Result<Self> {
        let tree = KernelBench::open(kernelbench)?;
        let judging = EvalConfig::new(
            dir.join(STORE_FILE),
            format!("kernelbench:{}", tree.root().display()),
        );
        Ok(KernelBenchRun {
            tree,
            dir,
            levels,
            problems: None,
            samples: 1,
            model,
            force: false,
            judging,
        })
    }

    /// Generates the candidates the run folder lacks with `generator` and `params`, judges
    /// those not judged yet, and writes the reports.
    pub fn run(
        &self,
        generator: &Generator,
        params: &DecodeParams,
        mut progress: impl FnMut(Event),
    ) -> Result<Finished> {
        ensure!(!self.levels.is_empty(), "no KernelBench level chosen");
        ensure!(self.samples > 0, "samples per problem must be at least 1");
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("cannot create the run folder {}", self.dir.display()))?;
        if self.force {
            self.start_over()?;
        }
        self.record_generation(params)?;
        let levels: BTreeSet<u32> = self.levels.iter().copied().collect();
        for &level in &levels {
            let candidates = CandidateRun {
                kernelbench: self.tree.root().to_path_buf(),
                level,
                problems: self.problems.clone(),
                samples: self.samples,
                run: self.dir.clone(),
            };
            generate_candidates(generator, params, &candidates, |p| {
                progress(Event::Generating { level, progress: p });
            })?;
        }
        let judged = self.judge(&levels, &mut progress)?;
        let (report, report_files) = self.write_reports()?;
        Ok(Finished {
            judged,
            report,
            report_files,
        })
    }

    fn start_over(&self) -> Result<()> {
        let files = [CANDIDATES_FILE, GENERATION_FILE]
            .into_iter()
            .chain(REPORT_FILES.iter().map(|(name, _)| *name))
            .map(|name| self.dir.join(name))
            .chain([self.judging.db.clone()]);
        for path in files {
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(e).with_context(|| format!("cannot remove {}", path.display()))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Records the model and decoding parameters, or checks them against those recorded: the
    /// candidates of one run come from one model decoding one way.
    fn record_generation(&self, params: &DecodeParams) -> Result<()> {
        let path = self.dir.join(GENERATION_FILE);
        let generation = json!({ "model": self.model, "decoding": params });
        if path.exists() {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            let recorded: Value = serde_json::from_str(&text).with_context(|| {
                format!("{} is not JSON; remove it or use --force", path.display())
            })?;
            let changed = changes(&recorded, &generation);
            if !changed.is_empty() {
                bail!(
                    "{} holds candidates generated with other settings ({}); run with the ones it \
                     was started with, use --force to start it over, or choose another --run folder",
                    self.dir.display(),
                    changed.join(", ")
                );
            }
            return Ok(());
        }
        std::fs::write(&path, serde_json::to_string_pretty(&generation)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))
    }

    /// Judges the run's candidates of the chosen levels, problems and samples.
    fn judge(&self, levels: &BTreeSet<u32>, progress: &mut impl FnMut(Event)) -> Result<Summary> {
        let mut problems = Vec::new();
        for &level in levels {
            let scan = self.tree.scan_level(level)?;
            problems.extend(scan.problems.into_iter().filter(|p| {
                self.problems
                    .as_ref()
                    .is_none_or(|w| w.contains(&p.problem_id))
            }));
        }
        let keys: BTreeSet<(u32, u32)> = problems.iter().map(|p| (p.level, p.problem_id)).collect();
        let samples: Vec<EvalSample> = load_candidates(&[self.dir.join(CANDIDATES_FILE)])?
            .into_iter()
            .filter(|c| keys.contains(&(c.level, c.problem_id)) && c.sample_id < self.samples)
            .map(EvalSample::from)
            .collect();
        progress(Event::Judging {
            candidates: samples.len(),
        });
        let batch = Batch::new(
            problems.into_iter().map(EvalProblem::from).collect(),
            samples,
        )?;
        let audit = Arc::new(StaticAudit {
            strict: self.judging.strict,
        });
        let mut judge = Judge::start(self.judging.clone(), Some(audit))?;
        let summary = judge.evaluate(batch)?;
        judge.shutdown();
        Ok(summary)
    }

    fn write_reports(&self) -> Result<(Comparison, Vec<PathBuf>)> {
        let store = Store::open(&self.judging.db)?;
        let run = ComparedRun::read(&self.model, &store, false)?
            .context("the run's store holds no run after judging")?;
        let report = Comparison { runs: vec![run] };
        let mut written = Vec::new();
        for (name, format) in REPORT_FILES {
            let path = self.dir.join(name);
            std::fs::write(&path, render_comparison(&report, format)?)
                .with_context(|| format!("cannot write {}", path.display()))?;
            written.push(path);
        }
        Ok((report, written))
    }
}

/// The names of what differs between two generation records: `model`, or a decoding parameter.
fn changes(recorded: &Value, now: &Value) -> Vec<String> {
    let mut changed = Vec::new();
    if recorded["model"] != now["model"] {
        changed.push("model".to_string());
    }
    let empty = serde_json::Map::new();
    let (old, new) = (
        recorded["decoding"].as_object().unwrap_or(&empty),
        now["decoding"].as_object().unwrap_or(&empty),
    );
    let names: BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    changed.extend(
        names
            .into_iter()
            .filter(|name| old.get(*name) != new.get(*name))
            .cloned(),
    );
    changed
}
