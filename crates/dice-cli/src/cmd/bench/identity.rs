//! `dice bench identity`: identity candidates (each reference with `Model` renamed `ModelNew`)
//! for the timing-precision benchmark, among the problems whose inputs fit a budget
//! ([`dice_kernelbench::pick_identity_problems`]).

use super::format::gib;
use anyhow::{ensure, Context, Result};
use clap::Args;
use dice_eval::python::json_output;
use dice_kernelbench::{
    identity_candidates_jsonl, input_sizes_command, pick_identity_problems, InputSize, KernelBench,
    LevelPick, Skip,
};
use std::io::Write;
use std::path::{Path, PathBuf};

pub(super) const AFTER_HELP: &str = "\
For each level, in problem-id order, takes the first N problems whose inputs fit the budget: the
tensors returned by get_inputs(), measured once for all problems by the project's Python on
torch's meta device (nothing is allocated). A problem over the budget, or whose inputs cannot be
measured, is skipped and the next one is taken instead. Writes JSONL lines
{level, problem_id, sample_id: 0, code}, the candidates `dice eval` reads; prints to stderr the
problems taken per level and every problem skipped, with its input size or the error.

Example (the evaluator's timing-precision benchmark):
  dice bench identity --kernelbench KernelBench/ --out identity.jsonl";

#[derive(Args)]
pub(crate) struct IdentityArgs {
    /// The KernelBench problem folder: the one holding level1/ … level4/ (a KernelBench
    /// clone's root works too).
    #[arg(long, value_name = "DIR")]
    pub kernelbench: PathBuf,
    /// The levels to take problems from, comma-separated.
    #[arg(
        long,
        value_name = "L,...",
        value_delimiter = ',',
        default_value = "1,2,3"
    )]
    pub levels: Vec<u32>,
    /// Problems taken per level: the first N in problem-id order whose inputs fit; a problem
    /// that does not fit is skipped and the next one is taken instead.
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub first: usize,
    /// The input budget in GiB: a problem whose `get_inputs()` tensors take more bytes than
    /// this (summed numel × element size, measured on torch's meta device without allocating
    /// them) is skipped, and so is one whose inputs cannot be measured.
    #[arg(long, value_name = "GIB", default_value_t = 8.0)]
    pub max_input_gib: f64,
    /// Python with torch, run once to measure the inputs [default: $DICE_PYTHON, else the
    /// project's .dice/venv].
    #[arg(long, value_name = "PATH")]
    pub python: Option<PathBuf>,
    /// Write the candidates to this file instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

pub(super) fn run(args: IdentityArgs) -> Result<()> {
    ensure!(args.first > 0, "--first must be at least 1");
    ensure!(
        args.max_input_gib.is_finite() && args.max_input_gib > 0.0,
        "--max-input-gib must be a positive number of GiB"
    );
    let max_bytes = (args.max_input_gib * (1u64 << 30) as f64) as u64;
    let kb = KernelBench::open(&args.kernelbench)?;
    let mut levels = args.levels.clone();
    levels.sort_unstable();
    levels.dedup();
    let mut problems = Vec::new();
    for &level in &levels {
        let scan = kb.scan_level(level)?;
        for bad in &scan.invalid {
            eprintln!("invalid problem {}: {}", bad.path.display(), bad.reason);
        }
        problems.push((level, scan.problems));
    }
    let paths: Vec<&Path> = problems
        .iter()
        .flat_map(|(_, ps)| ps.iter().map(|p| p.path.as_path()))
        .collect();
    let python = dice_eval::python::locate(args.python.as_deref())?;
    let sizes: Vec<InputSize> = json_output(
        &mut input_sizes_command(&python, &paths),
        &python,
        "measure problem inputs",
    )?;
    let picks = pick_identity_problems(problems, sizes, args.first, max_bytes)
        .with_context(|| format!("{} measured the wrong problems", python.display()))?;

    let jsonl = identity_candidates_jsonl(&picks)?;
    match &args.out {
        Some(path) => std::fs::write(path, &jsonl)
            .with_context(|| format!("cannot write {}", path.display()))?,
        None => std::io::stdout()
            .lock()
            .write_all(jsonl.as_bytes())
            .context("cannot write to stdout")?,
    }
    print_summary(&picks, args.first, args.max_input_gib);
    if let Some(path) = &args.out {
        let taken: usize = picks.iter().map(|p| p.taken.len()).sum();
        eprintln!("wrote {taken} identity candidates to {}", path.display());
    }
    Ok(())
}

fn print_summary(picks: &[LevelPick], first: usize, max_input_gib: f64) {
    for pick in picks {
        let ids: Vec<String> = pick
            .taken
            .iter()
            .map(|p| p.problem_id.to_string())
            .collect();
        let short = if pick.taken.len() < first {
            format!(" (only {} of {first} fit)", pick.taken.len())
        } else {
            String::new()
        };
        eprintln!(
            "level {}: {} taken{short}: {}",
            pick.level,
            pick.taken.len(),
            ids.join(", ")
        );
        for (problem, skip) in &pick.skipped {
            let why = match skip {
                Skip::TooLarge(bytes) => format!(
                    "inputs take {} ({bytes} bytes), over {max_input_gib} GiB",
                    gib(*bytes)
                ),
                Skip::Unmeasured(why) => format!("inputs cannot be measured: {why}"),
            };
            eprintln!("  skipped {}: {why}", problem.name);
        }
    }
}
