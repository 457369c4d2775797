//! Curriculum levels measured for the RL tasks `export` writes, three ways:
//!
//! * a pass-rate file the user made (`{id: rate}` or records `{id, pass_rate}`);
//! * a `dice eval` / `dice kernelbench` run's store: per problem, the samples counted correct in
//!   strict mode (correct and not deceptive) over the samples judged;
//! * an OpenAI-compatible endpoint asked to rate each task with [`RATING_PROMPT`], as DICE had
//!   Mercury Coder label its tasks.
//!
//! Pass rates are cut into `levels` equal bands, rate 1 level 1 and rate 0 level `levels`. A
//! task the method has no measure for (no rate in the file, no problem of the run with its
//! source) gets level `levels`, the hardest, and is counted as unmeasured, so the curriculum
//! reaches it last rather than dropping it; an endpoint answer without a level falls back to
//! the hardest level too, recorded as a fallback with the answer.
//!
//! Tasks meet a run's problems by the SHA-256 of their source, the hash the store keeps of each
//! problem: a run numbers problems as its input did (KernelBench's level and id, a pairs file's
//! positions), and a task's `level` is a difficulty label, not an id, so the source is what both
//! share however the run was made.

use crate::diversify::{KernelPrompt, KernelWriter};
use crate::run::RunDir;
use crate::Pair;
use anyhow::{bail, Context, Result};
use dice_eval::sha256_hex;
use dice_kernelbench::read_records;
use dice_store::Store;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

/// Levels measured for the tasks: what `export` orders them by.
#[derive(Clone, Debug, PartialEq)]
pub struct Measured {
    /// `pass-rate-file`, `run` or `endpoint`.
    pub method: &'static str,
    /// Where the measures came from (a file, a store, an endpoint and model).
    pub source: String,
    /// Levels run from 1 (easiest) to this.
    pub levels: u32,
    /// The measured tasks by id; tasks missing here are unmeasured.
    pub tasks: HashMap<String, Measure>,
}

/// One task's level and what it was derived from.
#[derive(Clone, Debug, PartialEq)]
pub struct Measure {
    pub level: u32,
    /// Shown per task in `difficulty.json`: the rate, the counts, or the endpoint's answer.
    pub detail: Value,
    /// The measure gave no level (an answer without one) and the task took the hardest.
    pub fallback: bool,
}

/// What the endpoint is asked, `{levels}` and `{source}` filled in. The answer's first number
/// in 1..=levels is the task's level.
pub const RATING_PROMPT: &str = "\
Rate how hard it is to write a correct CUDA kernel that runs faster than the following PyTorch \
program, on a scale from 1 (easy: one elementwise operation) to {levels} (hard: several fused \
operations, reductions or irregular memory access). Answer with the number only.

```python
{source}```";

/// Tokens the endpoint may write per rating: a number, with room for a word or two around it.
pub const RATING_TOKENS: usize = 16;

/// Level 1 for a pass rate of 1, `levels` for 0, equal bands between.
pub fn pass_rate_level(rate: f64, levels: u32) -> u32 {
    let band = ((1.0 - rate.clamp(0.0, 1.0)) * f64::from(levels)).floor() as u32;
    1 + band.min(levels - 1)
}

/// Pass rates from a file: a JSON object `{id: rate}`, or records `{id, pass_rate}`.
pub fn from_pass_rate_file(path: &Path, levels: u32) -> Result<Measured> {
    check_levels(levels)?;
    let tasks = read_pass_rates(path)?
        .into_iter()
        .map(|(id, rate)| {
            let measure = Measure {
                level: pass_rate_level(rate, levels),
                detail: json!({ "pass_rate": rate }),
                fallback: false,
            };
            (id, measure)
        })
        .collect();
    Ok(Measured {
        method: "pass-rate-file",
        source: path.display().to_string(),
        levels,
        tasks,
    })
}

/// Pass rates from a run's store: a task's samples are those of every problem whose source
/// hashes as the task's `pytorch_code` does; its rate is the samples correct and not deceptive
/// over the samples judged (no program, failed builds and time-outs count as judged).
pub fn from_run(store: &Store, location: &str, tasks: &[Pair], levels: u32) -> Result<Measured> {
    check_levels(levels)?;
    let mut problems_by_source: HashMap<String, Vec<(u32, u32)>> = HashMap::new();
    for (problem, sha256) in store.problem_sources()? {
        problems_by_source.entry(sha256).or_default().push(problem);
    }
    if problems_by_source.is_empty() {
        bail!("{location} holds no problems: run `dice eval` or `dice kernelbench` there first");
    }
    let mut counts: HashMap<(u32, u32), (u32, u32)> = HashMap::new();
    for sample in store.samples()? {
        let (correct, judged) = counts.entry((sample.level, sample.problem_id)).or_default();
        *judged += 1;
        *correct += u32::from(sample.counts_as_correct(true));
    }
    let mut measured = HashMap::new();
    for task in tasks {
        let Some(problems) = problems_by_source.get(&sha256_hex(task.pytorch_code.as_bytes()))
        else {
            continue;
        };
        let (correct, judged) = problems
            .iter()
            .filter_map(|p| counts.get(p))
            .fold((0, 0), |(c, j), (pc, pj)| (c + pc, j + pj));
        if judged == 0 {
            continue;
        }
        let rate = f64::from(correct) / f64::from(judged);
        let measure = Measure {
            level: pass_rate_level(rate, levels),
            detail: json!({
                "pass_rate": rate,
                "correct": correct,
                "judged": judged,
                "problems": problems,
            }),
            fallback: false,
        };
        measured.insert(task.id.clone(), measure);
    }
    Ok(Measured {
        method: "run",
        source: location.to_string(),
        levels,
        tasks: measured,
    })
}

/// One rating answer, as `difficulty-answers.jsonl` holds it: the prompt's hash makes an answer
/// count only for the same task, scale and prompt.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Rating {
    id: String,
    prompt_sha256: String,
    text: String,
}

/// Levels an endpoint gave: each task not yet answered in `difficulty-answers.jsonl` is asked
/// once (the answers are appended as they arrive, so a rerun asks only what is missing).
/// An answer without a number in 1..=levels falls back to the hardest level, marked so.
pub fn from_endpoint(
    run: &RunDir,
    tasks: &[Pair],
    rater: &dyn KernelWriter,
    source: &str,
    levels: u32,
) -> Result<Measured> {
    check_levels(levels)?;
    let answers_path = run.difficulty_answers();
    let mut answers: HashMap<String, String> = HashMap::new();
    if answers_path.exists() {
        for rating in crate::run::read_jsonl::<Rating>(&answers_path)? {
            answers.insert(rating.prompt_sha256, rating.text);
        }
    }
    let prompts: Vec<(String, String)> = tasks
        .iter()
        .map(|t| {
            let prompt = RATING_PROMPT
                .replace("{levels}", &levels.to_string())
                .replace("{source}", &t.pytorch_code);
            (sha256_hex(prompt.as_bytes()), prompt)
        })
        .collect();
    let missing: Vec<usize> = (0..tasks.len())
        .filter(|&i| !answers.contains_key(&prompts[i].0))
        .collect();
    if !missing.is_empty() {
        run.create()?;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&answers_path)
            .with_context(|| format!("cannot open {}", answers_path.display()))?;
        let asked = missing
            .iter()
            .map(|&i| KernelPrompt {
                text: prompts[i].1.clone(),
                attempt: 0,
            })
            .collect();
        rater.write(asked, &mut |k, text| {
            let i = missing[k];
            let rating = Rating {
                id: tasks[i].id.clone(),
                prompt_sha256: prompts[i].0.clone(),
                text,
            };
            writeln!(file, "{}", serde_json::to_string(&rating)?)?;
            answers.insert(rating.prompt_sha256, rating.text);
            Ok(())
        })?;
    }
    let measured = tasks
        .iter()
        .zip(&prompts)
        .map(|(task, (digest, _))| {
            let answer = &answers[digest];
            let level = first_number(answer).filter(|l| (1..=levels).contains(l));
            let measure = Measure {
                level: level.unwrap_or(levels),
                detail: json!({ "answer": answer }),
                fallback: level.is_none(),
            };
            (task.id.clone(), measure)
        })
        .collect();
    Ok(Measured {
        method: "endpoint",
        source: source.to_string(),
        levels,
        tasks: measured,
    })
}

fn check_levels(levels: u32) -> Result<()> {
    if levels == 0 {
        bail!("--levels must be at least 1");
    }
    Ok(())
}

/// The first number in a text (`"2"`, `"level \boxed{2}"`).
pub(crate) fn first_number(text: &str) -> Option<u32> {
    text.split(|c: char| !c.is_ascii_digit())
        .find(|s| !s.is_empty())
        .and_then(|s| s.parse().ok())
}

fn read_pass_rates(path: &Path) -> Result<HashMap<String, f64>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read pass rates from {}", path.display()))?;
    if let Ok(Value::Object(map)) = serde_json::from_str::<Value>(&text) {
        return map
            .into_iter()
            .map(|(id, rate)| match rate.as_f64() {
                Some(rate) => Ok((id, rate)),
                None => bail!("{}: the pass rate of {id} is not a number", path.display()),
            })
            .collect();
    }
    read_records(path)?
        .into_iter()
        .map(|r| {
            let id = r.required_str("id")?.to_string();
            let rate = r.fields.get("pass_rate").and_then(Value::as_f64);
            let rate = rate.with_context(|| format!("{}: no numeric `pass_rate`", r.origin))?;
            Ok((id, rate))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pass_rates_cut_into_equal_bands() {
        let levels: Vec<u32> = [1.0, 0.9, 0.67, 0.5, 0.2, 0.0]
            .iter()
            .map(|&r| pass_rate_level(r, 3))
            .collect();
        assert_eq!(levels, [1, 1, 1, 2, 3, 3]);
        assert_eq!(pass_rate_level(0.3, 1), 1);
    }

    #[test]
    fn first_numbers_of_answers() {
        assert_eq!(first_number("2"), Some(2));
        assert_eq!(first_number("level \\boxed{3}"), Some(3));
        assert_eq!(first_number("hard"), None);
    }
}
