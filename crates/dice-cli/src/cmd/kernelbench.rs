//! `dice kernelbench`: a model on KernelBench in one command. The flags map onto
//! `dice_pipeline::KernelBenchRun`; generation takes the flags of `dice generate`, judging those
//! of `dice eval`.

use super::eval::{print_summary, JudgeArgs};
use super::generate::{parse_ids, DecodeArgs, EngineArgs, ModelSourceArgs, RuntimeArgs};
use anyhow::Result;
use clap::Args;
use dice_pipeline::{Event, KernelBenchRun, Progress};
use dice_report::{render_comparison, Format};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;

/// Shown after the flags by `dice kernelbench --help`.
const KERNELBENCH_MANUAL: &str = concat!(
    "\
The run folder holds everything: candidates.jsonl (the model's answers), generation.json (the
model and decoding settings), dice.db (the verdicts) and the reports in the DICE paper's layout
(report.md, report.html, report.json: per level Exec, fast_1 and fast_2, raw and robust).
Re-running the command continues where it stopped: candidates already generated are not
generated again and samples already judged are not judged again; other decoding or judging
settings are refused unless --force. `dice report RUN_DIR` gives the full report of the run,
`dice report RUN_A RUN_B` sets runs side by side.

--device is where the model runs and where candidates are judged (with --endpoint, only the
latter).

Examples:
  dice kernelbench --model SDAR-4B-Chat/ --kernelbench KernelBench/ --levels 1,2 --run runs/sdar \\
      --device cuda --dtype fp16
  dice kernelbench --endpoint http://127.0.0.1:8000/v1 --model-name qwen --kernelbench KernelBench/ \\
      --levels 1 --samples 5 --run runs/qwen --device cuda

",
    super::cuda_decoding_env!()
);

#[derive(Args, Debug)]
#[command(after_help = KERNELBENCH_MANUAL)]
pub(crate) struct KernelBenchArgs {
    #[command(flatten)]
    pub source: ModelSourceArgs,
    /// The KernelBench problem tree (the folder holding level1/ … level4/).
    #[arg(long, value_name = "DIR")]
    pub kernelbench: PathBuf,
    /// KernelBench levels, comma-separated (e.g. 1,2).
    #[arg(long, value_name = "LIST", value_delimiter = ',', required = true)]
    pub levels: Vec<u32>,
    /// Problem ids on every level, e.g. `1-100` or `1,5,7-9` (default: all of each level).
    #[arg(long, value_name = "IDS")]
    pub problems: Option<String>,
    /// Candidates per problem; the paper's figures score sample 0, `dice report RUN_DIR` adds
    /// pass@k over all of them.
    #[arg(long, value_name = "K", default_value_t = 1)]
    pub samples: u32,
    /// The run folder (created; re-running continues it).
    #[arg(long, value_name = "RUN_DIR")]
    pub run: PathBuf,
    /// Start the run folder over: generate and judge everything again (its candidates,
    /// verdicts and reports are removed first).
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub decode: DecodeArgs,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    #[command(flatten)]
    pub engines: EngineArgs,
    #[command(flatten)]
    pub judge: JudgeArgs,
}

pub(crate) fn run(a: KernelBenchArgs) -> Result<()> {
    let params = a.decode.params(a.source.model.as_deref())?;
    let generator = a.source.generator(&a.runtime, &a.engines)?;
    let mut run = KernelBenchRun::new(
        &a.kernelbench,
        a.run.clone(),
        a.levels.clone(),
        a.source.name()?,
    )?;
    run.problems = a.problems.as_deref().map(parse_ids).transpose()?;
    run.samples = a.samples;
    run.force = a.force;
    run.judging.set_device(a.runtime.device);
    a.judge.apply(&mut run.judging);
    run.judging.progress = true;

    let mut generating: Option<ProgressBar> = None;
    let finished = run.run(&generator, &params, |event| match event {
        Event::Generating {
            level,
            progress: Progress::Planned(count),
        } => {
            if let Some(bar) = generating.take() {
                bar.finish();
            }
            if count == 0 {
                eprintln!("generate level {level}: every candidate is in the run folder already");
            } else {
                generating = Some(generation_bar(level, count));
            }
        }
        Event::Generating {
            progress: Progress::Stored,
            ..
        } => {
            if let Some(bar) = &generating {
                bar.inc(1);
            }
        }
        Event::Judging { candidates } => {
            if let Some(bar) = generating.take() {
                bar.finish();
            }
            eprintln!("judge {candidates} candidates (those judged before are skipped)");
        }
    })?;
    print_summary(&finished.judged, &run.judging.db.display().to_string());
    print!("\n{}\n", render_comparison(&finished.report, Format::Md)?);
    let files: Vec<String> = finished
        .report_files
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    println!("reports: {}", files.join(", "));
    Ok(())
}

fn generation_bar(level: u32, count: usize) -> ProgressBar {
    let bar = ProgressBar::new(count as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "generate level {prefix} {elapsed_precise} [{bar:30}] {pos}/{len}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_prefix(level.to_string());
    bar
}
