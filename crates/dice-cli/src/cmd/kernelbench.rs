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

--turns N refines over turns: after each turn, every sample that is not yet correct and faster
than --target-speedup times the baseline (and not deceptive) gets the judge's verdict on its last
program as the next user message of its conversation, and answers again, up to N answers in all.
The feedback says, from the verdict alone: the compiler's error lines (an excerpt), the output
mismatch with its largest absolute and relative errors, the run-time error and the end of its
traceback, the shape or non-finite values found, a crash or a timeout, the judge's findings of
reward hacking in words, or for a correct program its speedup over the PyTorch reference and the
share of GPU time in its own kernels; then what to do (fix it, do the work in its own kernels,
or make it faster). It never gives the judge's inputs, seeds, tolerances or limits. Turn 1 is the
run folder as a run of one turn has it; turn t is the folder RUN_DIR/turn-t (its candidates,
dice.db and feedback.jsonl, the messages its prompts ended with). The reports take each sample at
its best so far and add, per level, Exec, fast_p and pass@k turn by turn, the samples fixed at
each turn and the tokens spent per correct kernel. With --model the conversation goes through the
model's chat template; with --endpoint, through /chat/completions as a list of messages.

--device is where the model runs and where candidates are judged (with --endpoint, only the
latter).

Examples:
  dice kernelbench --model SDAR-4B-Chat/ --kernelbench KernelBench/ --levels 1,2 --run runs/sdar \\
      --device cuda --dtype fp16
  dice kernelbench --endpoint http://127.0.0.1:8000/v1 --model-name qwen --kernelbench KernelBench/ \\
      --levels 1 --samples 5 --run runs/qwen --device cuda
  dice kernelbench --model SDAR-4B-Chat/ --kernelbench KernelBench/ --levels 1 --run runs/sdar-3 \\
      --device cuda --dtype fp16 --turns 3 --target-speedup 1.5

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
    /// verdicts, turns and reports are removed first).
    #[arg(long)]
    pub force: bool,
    /// Answers per sample: after each turn, a sample short of --target-speedup answers again
    /// with the judge's feedback on its last program (see below). 1 answers once.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub turns: u32,
    /// With --turns: a sample stops once it is correct, not deceptive and more than this many
    /// times as fast as the baseline.
    #[arg(long, value_name = "X", default_value_t = 1.0)]
    pub target_speedup: f64,
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
    run.turns = a.turns;
    run.target_speedup = a.target_speedup;
    run.judging.set_device(a.runtime.device);
    a.judge.apply(&mut run.judging);
    run.judging.progress = true;

    let mut generating: Option<ProgressBar> = None;
    let finished = run.run(&generator, &params, |event| match event {
        Event::Generating {
            turn,
            level,
            progress: Progress::Planned(count),
        } => {
            if let Some(bar) = generating.take() {
                bar.finish();
            }
            let what = turn_name(turn, level);
            if count == 0 {
                eprintln!("generate {what}: every candidate is in the run folder already");
            } else {
                generating = Some(generation_bar(&what, count));
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
        Event::Judging { turn, candidates } => {
            if let Some(bar) = generating.take() {
                bar.finish();
            }
            let of_turn = if turn == 1 {
                String::new()
            } else {
                format!(" of turn {turn}")
            };
            eprintln!("judge {candidates} candidates{of_turn} (those judged before are skipped)");
        }
        Event::AllStopped { turn } => eprintln!(
            "turn {turn}: no sample goes on (each reached --target-speedup or has no verdict)"
        ),
    })?;
    for turn in &finished.turns {
        if finished.turns.len() > 1 {
            println!("turn {}:", turn.turn);
        }
        print_summary(&turn.judged, &turn.store.display().to_string());
    }
    print!("\n{}\n", render_comparison(&finished.report, Format::Md)?);
    let files: Vec<String> = finished
        .report_files
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    println!("reports: {}", files.join(", "));
    Ok(())
}

/// What a progress line calls a level's generation: `level L`, with the turn after the first.
fn turn_name(turn: u32, level: u32) -> String {
    if turn == 1 {
        format!("level {level}")
    } else {
        format!("level {level} turn {turn}")
    }
}

fn generation_bar(what: &str, count: usize) -> ProgressBar {
    let bar = ProgressBar::new(count as u64);
    bar.set_style(
        ProgressStyle::with_template("generate {prefix} {elapsed_precise} [{bar:30}] {pos}/{len}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(what.to_string());
    bar
}
