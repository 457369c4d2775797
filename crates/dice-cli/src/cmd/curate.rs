//! `dice curate`: training data from PyTorch→CUDA pairs. The flags map onto `dice_curate`.

use super::args::DeviceKind;
use super::eval::JudgeArgs;
use anyhow::bail;
use anyhow::Result;
use clap::{Args, Subcommand, ValueEnum};
use dice_curate::{Difficulty, ExportOptions, RunDir, SftFormat};
use dice_eval::{Device, EvalConfig};
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Subcommand)]
pub(crate) enum CurateCommand {
    /// Read pairs (DICE JSON, LlamaFactory SFT files, folders of kernel files) into a run
    /// folder, normalised, with content ids, without exact and near duplicates.
    #[command(after_help = INGEST_MANUAL)]
    Ingest(IngestArgs),
    /// Judge every pair in strict mode; keep those correct, not deceptive and faster than the
    /// threshold with confidence.
    #[command(after_help = VERIFY_MANUAL)]
    Verify(VerifyArgs),
    /// Write the kept pairs as LlamaFactory SFT data and RL task files for both stages, in
    /// curriculum order.
    #[command(after_help = EXPORT_MANUAL)]
    Export(ExportArgs),
    /// Write the run's report (report.md, report.html): the funnel per stage, speedups before
    /// and after the threshold, why pairs were dropped, duplicate clusters.
    Report(ReportArgs),
    /// Split each program into the prefix, core and suffix of a kernel-infilling task.
    #[command(after_help = SPLIT_MANUAL)]
    Split(SplitArgs),
}

const INGEST_MANUAL: &str = "\
Inputs, told apart per record or by being a folder:
  pairs      JSON array / JSONL of {pytorch_code, cuda_code} (DICE, KernelBench style); an empty
             cuda_code is a problem-only record (DICE's end-to-end RL tasks); `level` is kept
  alpaca     {instruction, input, output} or {prompt, response}: the program is the response's
             first fenced block, the problem the prompt's last fenced block with `class Model`
  sharegpt   {conversations: [{from, value}]} or {messages: [{role, content}]}, read alike
  folder     NAME*.py files defining `class ModelNew` beside NAME.py defining `class Model`;
             a problem file without kernels is a problem-only record
Programs are normalised (LF line ends, no trailing white space, no blank lines at the ends) and
get the first 16 hex digits of the SHA-256 of their content as id. Exact duplicates have the
same tokens once comments and layout are ignored; near duplicates a Jaccard similarity of
5-token shingles of at least --near-threshold (candidates found by MinHash with 16 bands of 8
rows, every candidate checked exactly). The first of a group is kept.

The run folder then holds pairs.jsonl (kept), ingest-dropped.jsonl (each record left out and
why, with the pair it duplicates) and ingest.json (counts and duplicate clusters). Ingesting the
same inputs again writes the same files.

Example:
  dice curate ingest --run runs/cuke kernel_infilling_evaluation.json sft.json kernels/";

const VERIFY_MANUAL: &str = "\
Each pair of RUN_DIR/pairs.jsonl with a kernel is judged by the evaluator in strict mode (a
deceptive program is incorrect) and kept when it is correct, no reward-hack rule fired, and the
lower end of the 95 % confidence interval of its speedup is at least --min-speedup. The interval
is a bootstrap over the timed rounds, then over the calls within each drawn round, of candidate
and baseline together (crates/dice-eval/src/stats.rs). Problem-only records are not judged.

The verdicts go to RUN_DIR/dice.db, which skips what it has judged: after any interruption
(kill -9 included) the same command continues, and changes nothing already judged. Then
RUN_DIR/verified.jsonl holds one line per pair (verdict, speedup, its interval, flags, kept or
the reason it was dropped) and RUN_DIR/verify.json the counts.

Example:
  dice curate verify --run runs/cuke --device cuda";

const EXPORT_MANUAL: &str = "\
OUT then holds:
  sft.json, dataset_info.json  one record per kept pair: KernelBench's one-shot prompt of the
                               reference, the program in a ```python block as the response
                               (dice train sft --dataset-info OUT --dataset NAME reads them)
  rl_kernel_infilling.json     stage 1: kept pairs whose program splits (id, level,
                               pytorch_code, cuda_code, prefix, middle, suffix)
  rl_end_to_end.json           stage 2: the kept pairs' references and every problem-only
                               record (idx, id, level, pytorch_code, cuda_code empty)
The RL files are ordered by level, easiest first: the reference draws tasks in file order.
Levels come from the records' own labels (--difficulty label: the first number of `level`, 0
without one) or from pass rates (--difficulty pass-rate --pass-rates FILE: {id: rate} or
records {id, pass_rate}, e.g. a model's correct samples over k per task; rate 1 is level 1,
rate 0 level --levels, equal bands between, tasks without a rate last).

Example:
  dice curate export --run runs/cuke --out data/cuke --difficulty pass-rate --pass-rates rates.json";

const SPLIT_MANUAL: &str = "\
The core is the kernel source load_inline receives (cuda_sources; cpp_sources when there are no
CUDA sources): the module-level assignments it names, from the first to the last. The prefix is
everything before (imports, comments), the suffix everything after (declarations, the
load_inline call, ModelNew); prefix + core + suffix is the program, byte for byte. Records that
carry their own split (prefix, middle, suffix, as DICE's kernel_infilling_evaluation.json does)
are compared with it.

Example:
  dice curate split --pairs kernel_infilling_evaluation.json --out splits.jsonl";

#[derive(Args, Debug)]
pub(crate) struct SplitArgs {
    /// A JSON array or JSONL file of objects with the program in `cuda_code` (or `code`) and an
    /// optional `id`.
    #[arg(long, value_name = "FILE")]
    pub pairs: PathBuf,
    /// Where to write one JSON object per split program: id, prefix, core, suffix.
    #[arg(long, value_name = "FILE.jsonl")]
    pub out: PathBuf,
}

#[derive(Args, Debug)]
pub(crate) struct IngestArgs {
    /// Input files (JSON array or JSONL) and folders of kernel files, read in this order.
    #[arg(value_name = "INPUT", required = true)]
    pub inputs: Vec<PathBuf>,
    /// The curate run folder (created).
    #[arg(long, value_name = "RUN_DIR")]
    pub run: PathBuf,
    /// Jaccard similarity of token shingles from which two pairs are near duplicates.
    #[arg(long, value_name = "J", default_value_t = dice_curate::dedup::DEFAULT_THRESHOLD)]
    pub near_threshold: f64,
}

#[derive(Args, Debug)]
pub(crate) struct VerifyArgs {
    /// The curate run folder (after `dice curate ingest`).
    #[arg(long, value_name = "RUN_DIR")]
    pub run: PathBuf,
    /// Where pairs are judged (cuda: torch with CUDA, and nvcc on PATH).
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Keep a pair only when the lower end of its speedup's 95 % interval reaches this.
    #[arg(long, value_name = "X", default_value_t = dice_curate::DEFAULT_MIN_SPEEDUP)]
    pub min_speedup: f64,
    /// Judge every pair again, accepting a store judged with other settings or for other pairs
    /// (after ingesting other inputs).
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub judge: JudgeArgs,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum SftFormatArg {
    Alpaca,
    Sharegpt,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum DifficultyArg {
    /// The records' own `level` labels.
    Label,
    /// Pass rates per task, from --pass-rates.
    PassRate,
}

#[derive(Args, Debug)]
pub(crate) struct ExportArgs {
    /// The curate run folder (after `dice curate verify`).
    #[arg(long, value_name = "RUN_DIR")]
    pub run: PathBuf,
    /// The folder to write the SFT and RL files to (created).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// How the SFT records are laid out.
    #[arg(long, value_enum, default_value_t = SftFormatArg::Alpaca)]
    pub format: SftFormatArg,
    /// The SFT dataset's name in dataset_info.json.
    #[arg(long, value_name = "NAME", default_value = "cuke")]
    pub dataset: String,
    /// Where the curriculum levels come from.
    #[arg(long, value_enum, default_value_t = DifficultyArg::Label)]
    pub difficulty: DifficultyArg,
    /// Pass rates per pair id, for --difficulty pass-rate: a JSON object {id: rate} or
    /// records {id, pass_rate}.
    #[arg(long, value_name = "FILE")]
    pub pass_rates: Option<PathBuf>,
    /// Curriculum levels pass rates are cut into.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub levels: u32,
}

#[derive(Args, Debug)]
pub(crate) struct ReportArgs {
    /// The curate run folder (after `dice curate ingest`, and `verify` for the speedups).
    #[arg(long, value_name = "RUN_DIR")]
    pub run: PathBuf,
}

pub(crate) fn run(command: CurateCommand) -> Result<()> {
    match command {
        CurateCommand::Report(a) => {
            let written = dice_curate::write_report(&RunDir::new(&a.run))?;
            let names: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
            println!("wrote {}", names.join(", "));
            Ok(())
        }
        CurateCommand::Export(a) => export(&a),
        CurateCommand::Verify(a) => verify(&a),
        CurateCommand::Ingest(a) => ingest(&a),
        CurateCommand::Split(a) => split(&a),
    }
}

fn ingest(a: &IngestArgs) -> Result<()> {
    let run = RunDir::new(&a.run);
    let s = dice_curate::ingest(&run, &a.inputs, a.near_threshold)?;
    let read: Vec<String> = s.read.iter().map(|(f, n)| format!("{f} {n}")).collect();
    println!("read: {}", read.join(", "));
    println!(
        "kept {} ({} problem-only); dropped {} exact and {} near duplicates (J >= {}), {} unreadable",
        s.kept, s.problem_only, s.exact_duplicates, s.near_duplicates, s.threshold, s.rejected
    );
    println!(
        "{} duplicate clusters; {} lists every record left out",
        s.clusters.len(),
        run.ingest_dropped().display()
    );
    Ok(())
}

fn verify(a: &VerifyArgs) -> Result<()> {
    let run = RunDir::new(&a.run);
    let mut judging = EvalConfig::new(run.judge_store(), String::new());
    judging.set_device(match a.device {
        DeviceKind::Cpu => Device::Cpu,
        DeviceKind::Cuda => Device::Cuda,
    });
    a.judge.apply(&mut judging);
    judging.force = a.force;
    judging.progress = true;
    let s = dice_curate::verify(&run, judging, a.min_speedup)?;
    println!(
        "kept {} of {} pairs (speedup's lower bound >= {}x)",
        s.kept, s.pairs, s.min_speedup
    );
    for (reason, n) in &s.dropped {
        println!("dropped {n}: {reason}");
    }
    println!("{} lists every pair", run.verified().display());
    Ok(())
}

fn export(a: &ExportArgs) -> Result<()> {
    let difficulty = match (a.difficulty, &a.pass_rates) {
        (DifficultyArg::Label, _) => Difficulty::Label,
        (DifficultyArg::PassRate, Some(rates)) => Difficulty::PassRate {
            rates: rates.clone(),
            levels: a.levels,
        },
        (DifficultyArg::PassRate, None) => bail!("--difficulty pass-rate needs --pass-rates FILE"),
    };
    let options = ExportOptions {
        out: a.out.clone(),
        format: match a.format {
            SftFormatArg::Alpaca => SftFormat::Alpaca,
            SftFormatArg::Sharegpt => SftFormat::Sharegpt,
        },
        dataset: a.dataset.clone(),
        difficulty,
    };
    let e = dice_curate::export(&RunDir::new(&a.run), &options)?;
    println!(
        "wrote {} SFT records, {} infilling tasks ({} kept pairs do not split), {} end-to-end tasks to {}",
        e.sft,
        e.infilling,
        e.unsplit,
        e.end_to_end,
        a.out.display()
    );
    let levels: Vec<String> = e.levels.iter().map(|(l, n)| format!("{l}: {n}")).collect();
    println!("RL tasks per level: {}", levels.join(", "));
    Ok(())
}

fn split(a: &SplitArgs) -> Result<()> {
    let run = dice_curate::split_file(&a.pairs)?;
    dice_curate::write_splits(&run.records, &a.out)?;
    println!(
        "{} programs split into {}",
        run.records.len(),
        a.out.display()
    );
    let mut reasons: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (id, why) in &run.failures {
        reasons
            .entry(why.to_string())
            .or_default()
            .push(id.to_string());
    }
    for (why, ids) in reasons {
        let shown = ids.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
        let more = if ids.len() > 5 { ", …" } else { "" };
        println!("not split, {why}: {} ({shown}{more})", ids.len());
    }
    if let Some(agreement) = &run.agreement {
        println!("{agreement}");
    }
    Ok(())
}
