//! `diversify`: problems drawn from the [`catalogue`](crate::catalogue) of LLM building blocks,
//! kernels for them asked of a generator, each attempt judged as `verify` judges a pair (strict,
//! kept when correct, not deceptive and faster than the threshold with confidence), up to a
//! number of attempts per problem, stopping at the first kept one.
//!
//! Attempts go in rounds: round k asks for attempt k of every problem without a kept attempt,
//! then judges them through one long-lived [`Evaluator`] per store, so the fork servers, build
//! cache and the run slots' references stay warm from round to round. The run folder keeps every step, so an interrupted run continues where it
//! stopped and a finished one does nothing again:
//! * `diversify-problems.jsonl`: the drawn problems (a rerun with other draw settings is refused);
//! * `diversify-answers.jsonl`: each generator answer, appended as it arrives (never asked again);
//! * `diversify-fp32.db` (`-fp16`, `-bf16`): the evaluator's stores, one per precision, since a
//!   problem is judged at its own dtype; they skip what they have judged;
//! * `diversify-attempts.jsonl`, `diversify-pairs.jsonl`, `diversify.json`: every attempt with
//!   its verdict and why it was dropped, the kept pairs (which `export` adds to verify's), and
//!   the counts; written anew from the stores after each round.

use crate::catalogue::{draw, CatalogueProblem, Component, Scale};
use crate::ingest::{content_id, normalize};
use crate::run::{read_jsonl, write_json, write_jsonl, RunDir};
use crate::verify::{category, decide};
use crate::{Pair, VerifiedPair};
use anyhow::{bail, Result};
use dice_eval::{
    Batch, EvalConfig, EvalProblem, EvalSample, Evaluator, Precision, SampleRecord, StaticAudit,
    Store,
};
use dice_kernelbench::extract_first_code;
use dice_kernelbench::prompt::one_shot_prompt;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

/// The paper asked for kernels up to five times per problem.
pub const DEFAULT_ATTEMPTS: u32 = 5;

/// The evaluator's level for diversify's problems.
const DIVERSIFY_LEVEL: u32 = 0;

#[derive(Clone, Debug)]
pub struct DiversifyOptions {
    pub components: Vec<Component>,
    pub scale: Scale,
    /// Problems drawn per component.
    pub variants: u32,
    pub seed: u64,
    /// Attempts per problem, at most.
    pub attempts: u32,
    pub min_speedup: f64,
    /// Judge each problem at KernelBench HEAD's tolerance for its dtype (fp32 1e-4, fp16 and
    /// bf16 1e-2) instead of the judging settings' atol and rtol.
    pub kernelbench_tolerance: bool,
}

/// One request for a kernel: KernelBench's one-shot prompt of a problem.
#[derive(Clone, Debug)]
pub struct KernelPrompt {
    pub text: String,
    /// Which attempt at its problem this is (0 first): a sampling generator seeds by it.
    pub attempt: u32,
}

/// What writes the kernels: a model on this machine or an endpoint.
pub trait KernelWriter {
    /// Answers every prompt once, handing each answer's text to `store` with the prompt's index
    /// as it finishes. The first error, of generation or of `store`, ends the call.
    fn write(
        &self,
        prompts: Vec<KernelPrompt>,
        store: &mut dyn FnMut(usize, String) -> Result<()>,
    ) -> Result<()>;
}

/// One generator answer, as `diversify-answers.jsonl` holds it.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Answer {
    problem: String,
    attempt: u32,
    text: String,
}

/// One judged attempt, as `diversify-attempts.jsonl` holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    /// The problem's name.
    pub problem: String,
    pub attempt: u32,
    /// `id` is the pair's content id (as ingest gives it) of the problem and the program.
    #[serde(flatten)]
    pub outcome: VerifiedPair,
}

/// What diversify found, as `diversify.json` holds it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DiversifySummary {
    pub min_speedup: f64,
    pub problems: usize,
    /// Attempts judged.
    pub attempts: usize,
    /// Problems with a kept attempt.
    pub kept: usize,
    /// Dropped attempts per reason category, as verify counts them.
    pub dropped: BTreeMap<String, usize>,
    pub speedups_kept: Vec<f64>,
}

/// What a caller hears while diversify runs (the judging shows the evaluator's own progress).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// A round asks the generator for this many kernels.
    Asking {
        attempt: u32,
        prompts: usize,
    },
    Answered,
}

/// Draws the problems, asks `writer` for kernels and judges them with `judging` (its device,
/// trials and tolerances are the caller's, unless `options.kernelbench_tolerance`; its store,
/// precision, source and strictness are set here) until each problem has a kept attempt or
/// `options.attempts`.
pub fn diversify(
    run: &RunDir,
    options: &DiversifyOptions,
    judging: &EvalConfig,
    writer: &dyn KernelWriter,
    progress: &mut dyn FnMut(Progress),
) -> Result<DiversifySummary> {
    if options.attempts == 0 || options.variants == 0 || options.components.is_empty() {
        bail!("diversify needs at least one component, one variant and one attempt");
    }
    run.create()?;
    let problems = problems_of_run(run, options)?;
    let settings = StoreSettings {
        judging,
        kernelbench_tolerance: options.kernelbench_tolerance,
        source: format!("dice curate diversify {}", problems_digest(&problems)),
    };
    let index: HashMap<&str, usize> = problems
        .iter()
        .enumerate()
        .map(|(i, p)| (p.name.as_str(), i))
        .collect();
    let mut answers: HashMap<(usize, u32), String> = HashMap::new();
    if run.diversify_answers().exists() {
        for answer in read_jsonl::<Answer>(&run.diversify_answers())? {
            if let Some(&i) = index.get(answer.problem.as_str()) {
                answers.insert((i, answer.attempt), answer.text);
            }
        }
    }
    let mut judged = Judged::default();
    // One evaluator per store, started by the first round that judges in it and kept for the
    // next rounds, so that its fork servers, build cache and references stay warm.
    let mut evaluators: HashMap<PathBuf, Evaluator> = HashMap::new();
    for attempt in 0..options.attempts {
        let open: Vec<usize> = (0..problems.len())
            .filter(|&i| !judged.closed(i, options.min_speedup))
            .collect();
        if open.is_empty() {
            break;
        }
        let asked: Vec<usize> = open
            .iter()
            .copied()
            .filter(|&i| !answers.contains_key(&(i, attempt)))
            .collect();
        if !asked.is_empty() {
            progress(Progress::Asking {
                attempt,
                prompts: asked.len(),
            });
            let prompts = asked
                .iter()
                .map(|&i| KernelPrompt {
                    text: one_shot_prompt(&problems[i].source),
                    attempt,
                })
                .collect();
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(run.diversify_answers())?;
            writer.write(prompts, &mut |k, text| {
                let i = asked[k];
                let answer = Answer {
                    problem: problems[i].name.clone(),
                    attempt,
                    text,
                };
                // One write per line, so that an interruption tears at most the last line.
                let mut line = serde_json::to_vec(&answer)?;
                line.push(b'\n');
                file.write_all(&line)?;
                answers.insert((i, attempt), answer.text);
                progress(Progress::Answered);
                Ok(())
            })?;
        }
        let programs: Vec<(usize, Option<String>)> = open
            .iter()
            .map(|&i| {
                (
                    i,
                    extract_first_code(&answers[&(i, attempt)]).map(|p| normalize(&p)),
                )
            })
            .collect();
        judge_round(
            run,
            &settings,
            &problems,
            attempt,
            &programs,
            &mut evaluators,
            &mut judged,
        )?;
    }
    for evaluator in evaluators.into_values() {
        evaluator.finish()?;
    }
    write_outcomes(run, options, &problems, &answers, &judged)
}

/// The drawn problems, written to the run folder the first time; a rerun with settings that
/// draw others is refused.
fn problems_of_run(run: &RunDir, options: &DiversifyOptions) -> Result<Vec<CatalogueProblem>> {
    let drawn = draw(
        &options.components,
        options.scale,
        options.variants,
        options.seed,
    );
    let path = run.diversify_problems();
    if path.exists() {
        let stored: Vec<CatalogueProblem> = read_jsonl(&path)?;
        if stored != drawn {
            bail!(
                "{} holds problems drawn with other settings (--components, --scale, --variants, --seed): give them as before, or use another run folder",
                run.dir.display()
            );
        }
    } else {
        write_jsonl(&path, &drawn)?;
    }
    Ok(drawn)
}

/// The stores' records of the run's attempts, and the problems whose reference failed.
#[derive(Default)]
struct Judged {
    records: HashMap<(usize, u32), SampleRecord>,
    reference_errors: HashMap<usize, String>,
}

impl Judged {
    /// Whether problem `i` needs no more attempts: one was kept, or its reference failed.
    fn closed(&self, i: usize, min_speedup: f64) -> bool {
        self.reference_errors.contains_key(&i)
            || self
                .records
                .iter()
                .any(|(&(p, _), r)| p == i && decide("", r, min_speedup).kept)
    }

    fn read(&mut self, store: &Store) -> Result<()> {
        for record in store.samples()? {
            self.records
                .insert((record.problem_id as usize, record.sample_id), record);
        }
        for problem in store.problems()? {
            if let Some(error) = problem.reference_error {
                self.reference_errors
                    .insert(problem.problem_id as usize, error);
            }
        }
        Ok(())
    }
}

/// Judges attempt `attempt` of the problems in `programs`, each in the store of its precision
/// through that store's evaluator in `evaluators` (started here the first time); a store that
/// holds every one of them already is only read.
fn judge_round(
    run: &RunDir,
    settings: &StoreSettings<'_>,
    problems: &[CatalogueProblem],
    attempt: u32,
    programs: &[(usize, Option<String>)],
    evaluators: &mut HashMap<PathBuf, Evaluator>,
    judged: &mut Judged,
) -> Result<()> {
    let mut by_precision: BTreeMap<&str, Vec<&(usize, Option<String>)>> = BTreeMap::new();
    for program in programs {
        by_precision
            .entry(problems[program.0].precision.as_str())
            .or_default()
            .push(program);
    }
    for group in by_precision.into_values() {
        let precision = problems[group[0].0].precision();
        let db = run.diversify_store(precision);
        let stored = db.exists() && {
            let mut known = Judged::default();
            known.read(&Store::open(&db)?)?;
            group.iter().all(|(i, _)| {
                known.records.contains_key(&(*i, attempt)) || known.reference_errors.contains_key(i)
            })
        };
        if !stored || settings.judging.force {
            let evaluator = match evaluators.entry(db.clone()) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => {
                    let config = settings.config(db.clone(), precision);
                    let audit = Arc::new(StaticAudit { strict: true });
                    e.insert(Evaluator::start(config, Some(audit))?)
                }
            };
            let eval_problems = group
                .iter()
                .map(|&&(i, _)| EvalProblem {
                    level: DIVERSIFY_LEVEL,
                    problem_id: u32::try_from(i).expect("fewer problems than u32::MAX"),
                    name: problems[i].name.clone(),
                    source: problems[i].source.clone().into_bytes(),
                    defect: None,
                })
                .collect();
            let samples = group
                .iter()
                .map(|(i, program)| EvalSample {
                    level: DIVERSIFY_LEVEL,
                    problem_id: u32::try_from(*i).expect("fewer problems than u32::MAX"),
                    sample_id: attempt,
                    code: program.clone().map(String::into_bytes),
                    origin: format!("{} attempt {attempt}", problems[*i].name),
                })
                .collect();
            evaluator.submit(Batch::new(eval_problems, samples)?)?;
            // The round's outcomes are in the store once the evaluator has told them all.
            while evaluator.next()?.is_some() {}
        }
        judged.read(&Store::open(&db)?)?;
    }
    Ok(())
}

/// Writes `diversify-attempts.jsonl`, `diversify-pairs.jsonl` and `diversify.json` from what
/// was judged.
fn write_outcomes(
    run: &RunDir,
    options: &DiversifyOptions,
    problems: &[CatalogueProblem],
    answers: &HashMap<(usize, u32), String>,
    judged: &Judged,
) -> Result<DiversifySummary> {
    let mut summary = DiversifySummary {
        min_speedup: options.min_speedup,
        problems: problems.len(),
        ..DiversifySummary::default()
    };
    let mut attempts = Vec::new();
    let mut pairs = Vec::new();
    for (i, problem) in problems.iter().enumerate() {
        for attempt in 0..options.attempts {
            let Some(answer) = answers.get(&(i, attempt)) else {
                break;
            };
            let program = extract_first_code(answer).map(|p| normalize(&p));
            let id = content_id(&problem.source, program.as_deref());
            let outcome = match (
                judged.records.get(&(i, attempt)),
                judged.reference_errors.get(&i),
            ) {
                (Some(record), _) => decide(&id, record, options.min_speedup),
                (None, Some(error)) => VerifiedPair::reference_failed(id, error),
                // Asked but not judged yet (interrupted): the next run judges it.
                (None, None) => break,
            };
            summary.attempts += 1;
            match &outcome.reason {
                None => {
                    summary.kept += 1;
                    summary.speedups_kept.extend(outcome.speedup);
                    pairs.push(Pair {
                        id: outcome.id.clone(),
                        pytorch_code: problem.source.clone(),
                        cuda_code: program,
                        origin: format!("diversify:{}#{attempt}", problem.name),
                        label: None,
                    });
                }
                Some(reason) => *summary.dropped.entry(category(reason)).or_default() += 1,
            }
            let kept = outcome.kept;
            attempts.push(Attempt {
                problem: problem.name.clone(),
                attempt,
                outcome,
            });
            if kept {
                break;
            }
        }
    }
    write_jsonl(&run.diversify_attempts(), &attempts)?;
    write_jsonl(&run.diversify_pairs(), &pairs)?;
    write_json(&run.diversify_summary(), &summary)?;
    Ok(summary)
}

/// How the store of each precision judges: the caller's settings, in strict mode, at the
/// precision of its problems and, under `kernelbench_tolerance`, at that dtype's tolerance.
struct StoreSettings<'a> {
    judging: &'a EvalConfig,
    kernelbench_tolerance: bool,
    /// Names the drawn problems, so a store judged for other problems is refused.
    source: String,
}

impl StoreSettings<'_> {
    fn config(&self, db: PathBuf, precision: Precision) -> EvalConfig {
        let mut config = self.judging.clone();
        config.db = db;
        config.precision = precision;
        if self.kernelbench_tolerance {
            config.atol = precision.kernelbench_tolerance();
            config.rtol = config.atol;
        }
        config.strict = true;
        config.source.clone_from(&self.source);
        config
    }
}

fn problems_digest(problems: &[CatalogueProblem]) -> String {
    let mut hasher = Sha256::new();
    for problem in problems {
        hasher.update(problem.source.as_bytes());
        hasher.update([0]);
    }
    hex::encode(hasher.finalize())[..16].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_store_judges_at_its_precision_and_under_kernelbench_tolerance_at_its_dtypes() {
        let mut judging = EvalConfig::new(PathBuf::from("judge.db"), "verify".into());
        judging.atol = 0.05;
        judging.rtol = 0.05;
        let mut settings = StoreSettings {
            judging: &judging,
            kernelbench_tolerance: false,
            source: "dice curate diversify 0123".into(),
        };
        let bf16 = settings.config("diversify-bf16.db".into(), Precision::Bf16);
        assert_eq!(bf16.db, PathBuf::from("diversify-bf16.db"));
        assert_eq!(
            (bf16.precision, bf16.atol, bf16.rtol),
            (Precision::Bf16, 0.05, 0.05)
        );
        assert!(bf16.strict);
        assert_eq!(bf16.source, "dice curate diversify 0123");
        settings.kernelbench_tolerance = true;
        for (precision, tolerance) in [
            (Precision::Fp32, 1e-4),
            (Precision::Fp16, 1e-2),
            (Precision::Bf16, 1e-2),
        ] {
            let config = settings.config("store.db".into(), precision);
            assert_eq!(
                (config.atol, config.rtol),
                (tolerance, tolerance),
                "{precision:?}"
            );
        }
    }
}
