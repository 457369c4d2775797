//! Refinement over turns (`dice kernelbench --turns N`): after each turn, each sample's verdict
//! becomes the next user message of its conversation ([`dice_eval::refinement_feedback`]), and
//! the model answers again, until the sample is correct and faster than the target speedup (not
//! deceptive) or the turns run out.
//!
//! Turn 1 is the run folder itself, as a run of one turn has it (`candidates.jsonl`,
//! `dice.db`); turn t ≥ 2 is the folder `turn-t` in it, a run folder of its own (its
//! `candidates.jsonl` and `dice.db`, and the `feedback.jsonl` its prompts ended with), which
//! `dice eval` and `dice report` take like any other. Each turn has a store of its own rather
//! than a turn in the key of one store: the store keys samples by (level, problem, sample)
//! everywhere (the claims of workers sharing a run, resumption, training rewards), and a turn
//! judged apart gets inputs drawn from a seed of its own. Every turn resumes like turn 1: an
//! answer stored is not asked for again, a verdict stored is not judged again, and the
//! conversations are rebuilt from what the turns before stored. Sample s decodes with the seed of
//! sample s at every turn: its prompt, not its seed, is what changes.

use crate::candidates::{stored_candidates, CandidateKey, CANDIDATES_FILE, STORE_FILE};
use anyhow::{Context, Result};
use dice_engine::{ChatMessage, Job};
use dice_eval::{refinement_feedback, ProblemRecord, RunInfo, SampleRecord, Store};
use dice_kernelbench::{CandidateBody, CandidateRecord};
use dice_report::{build_turns_report, ComparedRun, Report, StoredTurn, Threshold};
use serde_json::json;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The file of a turn's folder (turn 2 on) holding each sample's feedback on its turn before:
/// the user message its prompt ended with.
pub const FEEDBACK_FILE: &str = "feedback.jsonl";

/// The folder of `turn` (1-based) of the run folder `run`.
pub fn turn_dir(run: &Path, turn: u32) -> PathBuf {
    if turn == 1 {
        run.to_path_buf()
    } else {
        run.join(format!("turn-{turn}"))
    }
}

/// When a sample stops: correct, not deceptive and faster than `target_speedup` times the
/// baseline.
pub(crate) fn reached_target(record: &SampleRecord, target_speedup: f64) -> bool {
    record.verdict.is_correct()
        && !record.deceptive
        && record.speedup.is_some_and(|s| s > target_speedup)
}

/// One turn of a sample's conversation: the model's answer, and the judge's verdict on it in
/// words.
#[derive(Clone, Debug)]
struct Exchange {
    answer: String,
    feedback: String,
}

/// The conversations that go on after `turns_done` turns: those of the samples (`wanted`)
/// answered and judged at every turn so far whose last verdict did not reach `target_speedup`.
pub(crate) struct Conversations(BTreeMap<CandidateKey, Vec<Exchange>>);

impl Conversations {
    pub(crate) fn read(
        run: &Path,
        turns_done: u32,
        target_speedup: f64,
        wanted: impl Fn(CandidateKey) -> bool,
    ) -> Result<Conversations> {
        let mut going_on: BTreeMap<CandidateKey, Vec<Exchange>> = BTreeMap::new();
        for turn in 1..=turns_done {
            let dir = turn_dir(run, turn);
            let answers: BTreeMap<CandidateKey, CandidateRecord> =
                stored_candidates(&dir.join(CANDIDATES_FILE))?
                    .into_iter()
                    .map(|c| (c.key(), c))
                    .collect();
            let store = Store::open_read_only(&dir.join(STORE_FILE))?;
            let mut next = BTreeMap::new();
            for record in store.samples()? {
                let key = (record.level, record.problem_id, record.sample_id);
                let earlier = match turn {
                    1 => Vec::new(),
                    _ => match going_on.remove(&key) {
                        Some(exchanges) => exchanges,
                        None => continue,
                    },
                };
                let Some(answer) = answers.get(&key) else {
                    continue;
                };
                if !wanted(key) || reached_target(&record, target_speedup) {
                    continue;
                }
                let profile = store.kernel_profile(key.0, key.1, key.2)?;
                let feedback = refinement_feedback(&record, profile.and_then(|p| p.custom_share));
                let mut exchanges = earlier;
                exchanges.push(Exchange {
                    answer: answer_text(answer).to_string(),
                    feedback,
                });
                next.insert(key, exchanges);
            }
            going_on = next;
        }
        Ok(Conversations(going_on))
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The next turn's jobs of `level`: each conversation from the problem's prompt (`prompts`,
    /// by problem id) to the judge's last feedback, as the user's last message.
    pub(crate) fn jobs(
        &self,
        level: u32,
        prompts: &BTreeMap<u32, String>,
    ) -> Result<Vec<Job<CandidateKey>>> {
        self.0
            .iter()
            .filter(|(key, _)| key.0 == level)
            .map(|(&key, exchanges)| {
                let prompt = prompts
                    .get(&key.1)
                    .with_context(|| format!("level {level} has no problem {}", key.1))?;
                let mut history = vec![ChatMessage::new("user", prompt)];
                let (last, earlier) = exchanges.split_last().expect("a turn at least");
                for exchange in earlier {
                    history.push(ChatMessage::new("assistant", &exchange.answer));
                    history.push(ChatMessage::new("user", &exchange.feedback));
                }
                history.push(ChatMessage::new("assistant", &last.answer));
                Ok(Job {
                    key,
                    history,
                    text: last.feedback.clone(),
                    sample: key.2 as usize,
                })
            })
            .collect()
    }

    /// Writes each conversation's last feedback to the folder `dir` (created when missing), one
    /// JSON line per sample ([`FEEDBACK_FILE`]).
    pub(crate) fn write_feedback(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the turn's folder {}", dir.display()))?;
        let path = dir.join(FEEDBACK_FILE);
        let mut text = Vec::new();
        for (&(level, problem_id, sample_id), exchanges) in &self.0 {
            let feedback = &exchanges.last().expect("a turn at least").feedback;
            let line = json!({
                "level": level, "problem_id": problem_id, "sample_id": sample_id,
                "feedback": feedback,
            });
            writeln!(text, "{line}")?;
        }
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))
    }
}

fn answer_text(record: &CandidateRecord) -> &str {
    match &record.body {
        CandidateBody::Completion(text) | CandidateBody::Code(text) => text,
    }
}

/// The turns a run folder holds: 1, then each `turn-t` folder with a store, in order.
fn stored_turn_count(run: &Path) -> u32 {
    let mut turns = 1;
    while turn_dir(run, turns + 1).join(STORE_FILE).exists() {
        turns += 1;
    }
    turns
}

/// A run of several turns as stored: its settings and problems (turn 1's), and each turn's
/// verdicts and tokens.
struct StoredRun {
    info: RunInfo,
    problems: Vec<ProblemRecord>,
    turns: Vec<StoredTurn>,
}

/// The run of several turns in the run folder `run`; `None` for a run of one turn, or one that
/// has not begun judging.
fn read_turns(run: &Path) -> Result<Option<StoredRun>> {
    let count = stored_turn_count(run);
    if count < 2 {
        return Ok(None);
    }
    let first = Store::open_read_only(&run.join(STORE_FILE))?;
    let Some(info) = first.run_info()? else {
        return Ok(None);
    };
    let problems = first.problems()?;
    let turns = (1..=count)
        .map(|turn| {
            let dir = turn_dir(run, turn);
            let tokens = stored_candidates(&dir.join(CANDIDATES_FILE))?
                .iter()
                .map(|c| (c.key(), c.token_ids.as_ref().map(Vec::len)))
                .collect();
            let samples = Store::open_read_only(&dir.join(STORE_FILE))?.samples()?;
            Ok(StoredTurn { samples, tokens })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(StoredRun {
        info,
        problems,
        turns,
    }))
}

/// The report of the run folder `run` when it holds several turns: at its last turn, each
/// sample at its best so far, with each level's figures turn by turn; `None` for a run of one
/// turn (whose report is its store's).
pub fn read_turns_report(
    run: &Path,
    thresholds: &[Threshold],
    strict: bool,
) -> Result<Option<Report>> {
    Ok(read_turns(run)?
        .map(|r| build_turns_report(&r.info, &r.problems, &r.turns, thresholds, strict)))
}

/// The run folder `run` as runs side by side show it, called `label`: a run of several turns at
/// its last turn with its figures turn by turn, else its store's run; `None` when no run has
/// begun there.
pub fn read_compared_run(run: &Path, label: &str, strict: bool) -> Result<Option<ComparedRun>> {
    if let Some(r) = read_turns(run)? {
        return Ok(Some(ComparedRun::from_turns(
            label,
            &r.info,
            &r.problems,
            &r.turns,
            strict,
        )));
    }
    let store = Store::open_read_only(&run.join(STORE_FILE))?;
    ComparedRun::read(label, &store, strict)
}
