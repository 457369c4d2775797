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
//! so the order is the curriculum); ties keep ingest order.

use crate::run::{read_jsonl, write_json, RunDir};
use crate::split::split_program;
use crate::Pair;
use anyhow::{bail, Context, Result};
use dice_kernelbench::prompt::one_shot_prompt;
use dice_kernelbench::read_records;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

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
    /// Pass rates per pair id (a JSON object `{id: rate}`, or records `{id, pass_rate}`), cut
    /// into `levels` equal bands: rate 1 is level 1, rate 0 level `levels`. Tasks without a
    /// rate get level `levels`.
    PassRate { rates: PathBuf, levels: u32 },
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
}

pub const SFT_FILE: &str = "sft.json";
pub const DATASET_INFO_FILE: &str = "dataset_info.json";
pub const INFILLING_FILE: &str = "rl_kernel_infilling.json";
pub const END_TO_END_FILE: &str = "rl_end_to_end.json";

pub fn export(run: &RunDir, options: &ExportOptions) -> Result<Exported> {
    let (pairs, kept) = curated(run)?;
    std::fs::create_dir_all(&options.out)
        .with_context(|| format!("cannot create {}", options.out.display()))?;
    let level = levels(&pairs, &options.difficulty)?;
    let mut ordered: Vec<&Pair> = pairs.iter().collect();
    ordered.sort_by_key(|p| level[&p.id]);

    let mut exported = Exported::default();
    let mut sft = Vec::new();
    let mut infilling = Vec::new();
    let mut end_to_end = Vec::new();
    for pair in &ordered {
        let task_level = level[&pair.id];
        match (&pair.cuda_code, kept.contains(&pair.id)) {
            (Some(program), true) => {
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
            (Some(_), false) => continue,
            (None, _) => {}
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
    write_json(&options.out.join(SFT_FILE), &sft)?;
    write_json(
        &options.out.join(DATASET_INFO_FILE),
        &dataset_info(&options.dataset, options.format),
    )?;
    write_json(&options.out.join(INFILLING_FILE), &infilling)?;
    write_json(&options.out.join(END_TO_END_FILE), &end_to_end)?;
    Ok(exported)
}

/// The pairs to export and the ids of those kept: ingest's pairs with verify's verdicts, then
/// the pairs diversify kept (a run folder may hold either or both).
fn curated(run: &RunDir) -> Result<(Vec<Pair>, HashSet<String>)> {
    let diversified = run.diversify_pairs();
    let (mut pairs, mut kept) = (Vec::new(), HashSet::new());
    if run.pairs().exists() || !diversified.exists() {
        pairs = run.read_pairs()?;
        kept = run
            .read_verified()?
            .into_iter()
            .filter(|v| v.kept)
            .map(|v| v.id)
            .collect();
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

/// The curriculum level of every pair id.
fn levels(pairs: &[Pair], difficulty: &Difficulty) -> Result<HashMap<String, u32>> {
    match difficulty {
        Difficulty::Label => Ok(pairs
            .iter()
            .map(|p| (p.id.clone(), p.label.as_deref().map_or(0, first_number)))
            .collect()),
        Difficulty::PassRate { rates, levels } => {
            if *levels == 0 {
                bail!("--levels must be at least 1");
            }
            let rates = read_pass_rates(rates)?;
            Ok(pairs
                .iter()
                .map(|p| {
                    let level = rates
                        .get(&p.id)
                        .map_or(*levels, |&rate| pass_rate_level(rate, *levels));
                    (p.id.clone(), level)
                })
                .collect())
        }
    }
}

/// Level 1 for a pass rate of 1, `levels` for 0, equal bands between.
pub fn pass_rate_level(rate: f64, levels: u32) -> u32 {
    let band = ((1.0 - rate.clamp(0.0, 1.0)) * f64::from(levels)).floor() as u32;
    1 + band.min(levels - 1)
}

/// The first number in a label (`"2"`, `"level \boxed{2}"`), 0 without one.
fn first_number(label: &str) -> u32 {
    label
        .split(|c: char| !c.is_ascii_digit())
        .find(|s| !s.is_empty())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
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
    fn labels_give_their_first_number() {
        assert_eq!(first_number("2"), 2);
        assert_eq!(first_number("level \\boxed{3}"), 3);
        assert_eq!(first_number("hard"), 0);
    }
}
