//! `export`: the verified pairs as LlamaFactory SFT data for `dice train sft`, and RL task files
//! for both stages of BiC-RL (spec bicrl §12 field names), in curriculum order.
//!
//! * `sft.json` + `dataset_info.json`: one record per kept pair, the prompt KernelBench's
//!   one-shot prompt of the reference, the response the program in a ```` ```python ```` block
//!   (alpaca: `instruction`, `input`, `output`; sharegpt: `conversations` of `human` and `gpt`
//!   turns). `dice train sft` renders them with the qwen3 template.
//! * `rl_kernel_infilling.json` (stage 1): kept pairs whose program splits, as DICE's
//!   `kernel_infilling_*.json`: `id`, `level`, `pytorch_code`, `cuda_code`, `prefix`, `middle`,
//!   `suffix`.
//! * `rl_end_to_end.json` (stage 2): the references of the kept pairs and every problem-only
//!   record, as DICE's `end_to_end_kernel_generation_4000.json`: `idx`, `level`,
//!   `pytorch_code`, `cuda_code` (empty).
//!
//! The kept pairs are those `verify` kept and those `diversify` kept.
//!
//! Both RL files are ordered by level, easiest first (the reference draws tasks in file order,
//! so the order is the curriculum); ties keep ingest order. The levels are the records' labels
//! or those [`crate::difficulty`] measured, and `difficulty.json` in the run folder keeps them
//! for the report.

use crate::difficulty::{first_number, Measured};
use crate::run::{read_jsonl, write_json, RunDir};
use crate::split::split_program;
use crate::Pair;
use anyhow::{Context, Result};
use dice_kernelbench::prompt::one_shot_prompt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

/// How the SFT records are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SftFormat {
    Alpaca,
    Sharegpt,
}

/// Where a task's curriculum level comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum Difficulty {
    /// The label the source gave (`level`; its first number), 0 without one.
    Label,
    /// Levels [`crate::difficulty`] measured; tasks without a measure get the hardest.
    Measured(Measured),
}

#[derive(Clone, Debug)]
pub struct ExportOptions {
    pub out: PathBuf,
    pub format: SftFormat,
    /// The dataset's name in `dataset_info.json`.
    pub dataset: String,
    pub difficulty: Difficulty,
}

/// What export wrote.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Exported {
    pub sft: usize,
    pub infilling: usize,
    pub end_to_end: usize,
    /// Kept pairs left out of the infilling file because their program does not split.
    pub unsplit: usize,
    /// Tasks per level, over both RL files.
    pub levels: Vec<(u32, usize)>,
    /// What `difficulty.json` in the run folder holds.
    pub difficulty: DifficultySummary,
}

/// The levels of the RL tasks (each task once, whichever files hold it), as `difficulty.json`
/// keeps them for the report.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DifficultySummary {
    /// `label`, `pass-rate-file`, `run` or `endpoint`.
    pub method: String,
    pub source: String,
    /// Tasks per level, easiest first.
    pub histogram: Vec<(u32, usize)>,
    /// Tasks the method had no measure for, placed at the hardest level.
    pub unmeasured: usize,
    /// Tasks whose measure gave no level (an answer without one), placed at the hardest level.
    pub fallback: usize,
    /// Per task: `id`, `level`, `status` (`measured`, `unmeasured`, `fallback`, `label`) and the
    /// measure's details.
    pub tasks: Vec<Value>,
}

pub const SFT_FILE: &str = "sft.json";
pub const DATASET_INFO_FILE: &str = "dataset_info.json";
pub const INFILLING_FILE: &str = "rl_kernel_infilling.json";
pub const END_TO_END_FILE: &str = "rl_end_to_end.json";

pub fn export(run: &RunDir, options: &ExportOptions) -> Result<Exported> {
    let (pairs, kept) = curated(run)?;
    std::fs::create_dir_all(&options.out)
        .with_context(|| format!("cannot create {}", options.out.display()))?;
    let mut tasks: Vec<&Pair> = pairs.iter().filter(|p| is_rl_task(p, &kept)).collect();
    let (level, difficulty) = levels(&tasks, &options.difficulty);
    tasks.sort_by_key(|p| level[&p.id]);

    let mut exported = Exported::default();
    let mut sft = Vec::new();
    let mut infilling = Vec::new();
    let mut end_to_end = Vec::new();
    for pair in &tasks {
        let task_level = level[&pair.id];
        if let Some(program) = &pair.cuda_code {
            sft.push(sft_record(options.format, pair, program));
            match split_program(program) {
                Ok(split) => infilling.push(json!({
                    "id": pair.id,
                    "level": task_level,
                    "pytorch_code": pair.pytorch_code,
                    "cuda_code": program,
                    "prefix": split.prefix,
                    "middle": split.core,
                    "suffix": split.suffix,
                })),
                Err(_) => exported.unsplit += 1,
            }
        }
        end_to_end.push(json!({
            "idx": end_to_end.len(),
            "id": pair.id,
            "level": task_level,
            "pytorch_code": pair.pytorch_code,
            "cuda_code": "",
        }));
    }
    let mut per_level: std::collections::BTreeMap<u32, usize> = Default::default();
    for task in infilling.iter().chain(&end_to_end) {
        let level = task["level"].as_u64().map_or(0, |l| l as u32);
        *per_level.entry(level).or_default() += 1;
    }
    exported.sft = sft.len();
    exported.infilling = infilling.len();
    exported.end_to_end = end_to_end.len();
    exported.levels = per_level.into_iter().collect();
    write_json(&run.difficulty_summary(), &difficulty)?;
    exported.difficulty = difficulty;
    write_json(&options.out.join(SFT_FILE), &sft)?;
    write_json(
        &options.out.join(DATASET_INFO_FILE),
        &dataset_info(&options.dataset, options.format),
    )?;
    write_json(&options.out.join(INFILLING_FILE), &infilling)?;
    write_json(&options.out.join(END_TO_END_FILE), &end_to_end)?;
    Ok(exported)
}

/// The tasks of the RL files, each once: the kept pairs and the problem-only records, in ingest
/// order (what a difficulty measure is asked for).
pub fn rl_tasks(run: &RunDir) -> Result<Vec<Pair>> {
    let (pairs, kept) = curated(run)?;
    Ok(pairs.into_iter().filter(|p| is_rl_task(p, &kept)).collect())
}

fn is_rl_task(pair: &Pair, kept: &HashSet<String>) -> bool {
    pair.cuda_code.is_none() || kept.contains(&pair.id)
}

/// The pairs to export and the ids of those kept: ingest's pairs with verify's verdicts (none
/// needed when every pair is problem-only), then the pairs diversify kept (a run folder may
/// hold either or both).
fn curated(run: &RunDir) -> Result<(Vec<Pair>, HashSet<String>)> {
    let diversified = run.diversify_pairs();
    let (mut pairs, mut kept) = (Vec::new(), HashSet::new());
    if run.pairs().exists() || !diversified.exists() {
        pairs = run.read_pairs()?;
        // Problem-only inputs (end-to-end tasks) have nothing to verify.
        if pairs.iter().any(|p| p.cuda_code.is_some()) {
            kept = run
                .read_verified()?
                .into_iter()
                .filter(|v| v.kept)
                .map(|v| v.id)
                .collect();
        }
    }
    if diversified.exists() {
        for pair in read_jsonl::<Pair>(&diversified)? {
            kept.insert(pair.id.clone());
            pairs.push(pair);
        }
    }
    Ok((pairs, kept))
}

fn sft_record(format: SftFormat, pair: &Pair, program: &str) -> Value {
    let prompt = one_shot_prompt(&pair.pytorch_code);
    let response = format!("```python\n{program}```");
    match format {
        SftFormat::Alpaca => json!({"instruction": prompt, "input": "", "output": response}),
        SftFormat::Sharegpt => json!({"conversations": [
            {"from": "human", "value": prompt},
            {"from": "gpt", "value": response},
        ]}),
    }
}

fn dataset_info(name: &str, format: SftFormat) -> Value {
    let entry = match format {
        SftFormat::Alpaca => json!({
            "file_name": SFT_FILE,
            "formatting": "alpaca",
            "columns": {"prompt": "instruction", "query": "input", "response": "output"},
        }),
        SftFormat::Sharegpt => json!({
            "file_name": SFT_FILE,
            "formatting": "sharegpt",
            "columns": {"messages": "conversations"},
            "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"},
        }),
    };
    json!({ name: entry })
}

/// The curriculum level of every task id, and the summary `difficulty.json` keeps.
fn levels(tasks: &[&Pair], difficulty: &Difficulty) -> (HashMap<String, u32>, DifficultySummary) {
    let mut summary = DifficultySummary::default();
    let mut level = HashMap::new();
    for task in tasks {
        let (task_level, status, detail) = match difficulty {
            Difficulty::Label => {
                let label = task.label.as_deref();
                let task_level = label.and_then(first_number).unwrap_or(0);
                (task_level, "label", json!({ "label": label }))
            }
            Difficulty::Measured(measured) => match measured.tasks.get(&task.id) {
                Some(m) if m.fallback => (m.level, "fallback", m.detail.clone()),
                Some(m) => (m.level, "measured", m.detail.clone()),
                None => (measured.levels, "unmeasured", Value::Null),
            },
        };
        match status {
            "unmeasured" => summary.unmeasured += 1,
            "fallback" => summary.fallback += 1,
            _ => {}
        }
        let mut record = json!({ "id": task.id, "level": task_level, "status": status });
        if let Value::Object(fields) = detail {
            record.as_object_mut().expect("an object").extend(fields);
        }
        summary.tasks.push(record);
        level.insert(task.id.clone(), task_level);
    }
    let mut histogram: std::collections::BTreeMap<u32, usize> = Default::default();
    if let Difficulty::Measured(measured) = difficulty {
        histogram.extend((1..=measured.levels).map(|l| (l, 0)));
        summary.method = measured.method.to_string();
        summary.source = measured.source.clone();
    } else {
        summary.method = "label".to_string();
        summary.source = "the records' `level`".to_string();
    }
    for task_level in level.values() {
        *histogram.entry(*task_level).or_default() += 1;
    }
    summary.histogram = histogram.into_iter().collect();
    (level, summary)
}
