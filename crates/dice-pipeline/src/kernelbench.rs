//! A model on KernelBench in one run folder: candidates generated (`candidates.jsonl`), judged
//! (`dice.db`) and reported (`report.md`, `report.html`, `report.json`); with several turns,
//! each sample answered again after the judge's feedback (turns.rs). Every stage resumes: a
//! candidate already generated is not generated again, a sample already judged is not judged
//! again, and the report is written anew from the stores.

use crate::candidates::{
    append_answers, generate_candidates, CandidateRun, Progress, CANDIDATES_FILE, STORE_FILE,
};
use crate::turns::{read_compared_run, turn_dir, Conversations};
use anyhow::{bail, ensure, Context, Result};
use dice_engine::{DecodeParams, Generator};
use dice_eval::{Batch, EvalConfig, EvalProblem, EvalSample, Judge, StaticAudit, Summary};
use dice_kernelbench::prompt::problem_prompt;
use dice_kernelbench::{load_candidates, KernelBench, Problem};
use dice_report::{render_comparison, Comparison, Format};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
    /// Turns of each sample's conversation: after a turn, a sample that has not reached
    /// `target_speedup` gets its verdict in words and answers again (1: answer once).
    pub turns: u32,
    /// A sample stops once it is correct, not deceptive and more than this many times as fast
    /// as the baseline.
    pub target_speedup: f64,
    /// How candidates are judged: [`KernelBenchRun::new`] sets its store (`RUN/dice.db`) and
    /// problem source (the tree); the rest (device, trials, tolerances, strict…) is the
    /// caller's.
    pub judging: EvalConfig,
}

/// What a run reports as it goes, for a progress display.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Generation of one level's candidates of a turn (`Planned(0)`: the run folder holds them
    /// all).
    Generating {
        turn: u32,
        level: u32,
        progress: Progress,
    },
    /// The judge starts on this many candidates of a turn; those judged before are skipped.
    Judging { turn: u32, candidates: usize },
    /// No sample goes on to this turn: each reached the target speedup, or got no verdict (its
    /// problem's reference failed).
    AllStopped { turn: u32 },
}

/// One turn judged.
pub struct JudgedTurn {
    pub turn: u32,
    /// The turn's store.
    pub store: PathBuf,
    /// The judge's account of this invocation (what it judged, what was judged before).
    pub judged: Summary,
}

/// What a finished run did and found.
pub struct Finished {
    /// Each turn judged, in order (one without several turns).
    pub turns: Vec<JudgedTurn>,
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
            turns: 1,
            target_speedup: 1.0,
            judging,
        })
    }

    /// Generates the candidates the run folder lacks with `generator` and `params`, judges
    /// those not judged yet, turn after turn, and writes the reports.
    pub fn run(
        &self,
        generator: &Generator,
        params: &DecodeParams,
        mut progress: impl FnMut(Event),
    ) -> Result<Finished> {
        ensure!(!self.levels.is_empty(), "no KernelBench level chosen");
        ensure!(self.samples > 0, "samples per problem must be at least 1");
        ensure!(self.turns > 0, "turns must be at least 1");
        ensure!(
            self.target_speedup.is_finite() && self.target_speedup >= 0.0,
            "the target speedup must be a number of at least 0, not {}",
            self.target_speedup
        );
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("cannot create the run folder {}", self.dir.display()))?;
        if self.force {
            self.start_over()?;
        }
        self.record_generation(params)?;
        let levels: BTreeSet<u32> = self.levels.iter().copied().collect();
        let problems = self.chosen_problems(&levels)?;
        let mut turns = Vec::new();
        for &level in &levels {
            let candidates = CandidateRun {
                kernelbench: self.tree.root().to_path_buf(),
                level,
                problems: self.problems.clone(),
                samples: self.samples,
                run: self.dir.clone(),
            };
            generate_candidates(generator, params, &candidates, |p| {
                progress(Event::Generating {
                    turn: 1,
                    level,
                    progress: p,
                });
            })?;
        }
        turns.push(self.judge(1, &problems, &mut progress)?);
        for turn in 2..=self.turns {
            if !self.refine(turn, generator, params, &problems, &mut progress)? {
                progress(Event::AllStopped { turn });
                break;
            }
            turns.push(self.judge(turn, &problems, &mut progress)?);
        }
        let (report, report_files) = self.write_reports()?;
        Ok(Finished {
            turns,
            report,
            report_files,
        })
    }

    /// The problems of `levels` the run answers.
    fn chosen_problems(&self, levels: &BTreeSet<u32>) -> Result<Vec<Problem>> {
        let mut problems = Vec::new();
        for &level in levels {
            let scan = self.tree.scan_level(level)?;
            problems.extend(scan.problems.into_iter().filter(|p| {
                self.problems
                    .as_ref()
                    .is_none_or(|w| w.contains(&p.problem_id))
            }));
        }
        Ok(problems)
    }

    /// Generates the answers of `turn` (≥ 2) the turn's folder lacks: each sample that has not
    /// reached the target, asked again with its conversation so far. False when no sample goes
    /// on.
    fn refine(
        &self,
        turn: u32,
        generator: &Generator,
        params: &DecodeParams,
        problems: &[Problem],
        progress: &mut impl FnMut(Event),
    ) -> Result<bool> {
        let keys: BTreeSet<(u32, u32)> = problems.iter().map(|p| (p.level, p.problem_id)).collect();
        let wanted = |(level, problem_id, sample_id): (u32, u32, u32)| {
            keys.contains(&(level, problem_id)) && sample_id < self.samples
        };
        let conversations = Conversations::read(&self.dir, turn - 1, self.target_speedup, wanted)?;
        if conversations.is_empty() {
            return Ok(false);
        }
        let dir = turn_dir(&self.dir, turn);
        conversations.write_feedback(&dir)?;
        let levels: BTreeSet<u32> = problems.iter().map(|p| p.level).collect();
        for level in levels {
            let prompts = problems
                .iter()
                .filter(|p| p.level == level)
                .map(|p| Ok((p.problem_id, problem_prompt(p)?)))
                .collect::<Result<BTreeMap<u32, String>>>()?;
            let jobs = conversations.jobs(level, &prompts)?;
            append_answers(generator, params, &dir, jobs, |p| {
                progress(Event::Generating {
                    turn,
                    level,
                    progress: p,
                });
            })?;
        }
        Ok(true)
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
        for turn in 2.. {
            let dir = turn_dir(&self.dir, turn);
            if !dir.exists() {
                break;
            }
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("cannot remove {}", dir.display()))?;
        }
        Ok(())
    }

    /// Records the model and decoding parameters (and with several turns, the target speedup),
    /// or checks them against those recorded: the candidates of one run come from one model
    /// decoding one way, and its turns from one target. A run of one turn may go on with more.
    fn record_generation(&self, params: &DecodeParams) -> Result<()> {
        let path = self.dir.join(GENERATION_FILE);
        let mut generation = json!({ "model": self.model, "decoding": params });
        if self.turns > 1 {
            generation[TARGET_SPEEDUP] = json!(self.target_speedup);
        }
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
            if recorded.get(TARGET_SPEEDUP) == generation.get(TARGET_SPEEDUP)
                || generation.get(TARGET_SPEEDUP).is_none()
            {
                return Ok(());
            }
        }
        std::fs::write(&path, serde_json::to_string_pretty(&generation)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))
    }

    /// Judges the candidates of `turn` of the chosen problems and samples into the turn's store.
    fn judge(
        &self,
        turn: u32,
        problems: &[Problem],
        progress: &mut impl FnMut(Event),
    ) -> Result<JudgedTurn> {
        let dir = turn_dir(&self.dir, turn);
        let keys: BTreeSet<(u32, u32)> = problems.iter().map(|p| (p.level, p.problem_id)).collect();
        let samples: Vec<EvalSample> = load_candidates(&[dir.join(CANDIDATES_FILE)])?
            .into_iter()
            .filter(|c| keys.contains(&(c.level, c.problem_id)) && c.sample_id < self.samples)
            .map(EvalSample::from)
            .collect();
        progress(Event::Judging {
            turn,
            candidates: samples.len(),
        });
        // Turn 1 records every problem of the run (the report's denominators); later turns only
        // those still answered, so no other reference is run again.
        let answered: BTreeSet<(u32, u32)> =
            samples.iter().map(|s| (s.level, s.problem_id)).collect();
        let problems = problems
            .iter()
            .filter(|p| turn == 1 || answered.contains(&(p.level, p.problem_id)))
            .cloned()
            .map(EvalProblem::from)
            .collect();
        let batch = Batch::new(problems, samples)?;
        let audit = Arc::new(StaticAudit {
            strict: self.judging.strict,
        });
        let mut judging = self.judging.clone();
        if turn > 1 {
            judging.db = dir.join(STORE_FILE);
        }
        let store = judging.db.clone();
        let mut judge = Judge::start(judging, Some(audit))?;
        let judged = judge.evaluate(batch)?;
        judge.shutdown();
        Ok(JudgedTurn {
            turn,
            store,
            judged,
        })
    }

    fn write_reports(&self) -> Result<(Comparison, Vec<PathBuf>)> {
        let run = read_compared_run(&self.dir, &self.model, false)?
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

/// The field of the generation record that holds the target speedup of a run of several turns.
const TARGET_SPEEDUP: &str = "target_speedup";

/// The names of what differs between two generation records: `model`, or a decoding parameter.
fn changes(recorded: &Value, now: &Value) -> Vec<String> {
    let mut changed = Vec::new();
    if recorded["model"] != now["model"] {
        changed.push("model".to_string());
    }
    if let (Some(old), Some(new)) = (recorded.get(TARGET_SPEEDUP), now.get(TARGET_SPEEDUP)) {
        if old != new {
            changed.push("target speedup".to_string());
        }
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
