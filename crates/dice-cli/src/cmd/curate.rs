//! `dice curate`: training data from PyTorch→CUDA pairs. The flags map onto `dice_curate`.

use super::args::{EndpointArgs, SamplingArgs};
use super::eval::JudgeArgs;
use anyhow::{bail, ensure, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use dice_curate::catalogue::{Component, Scale, COMPONENTS};
use dice_curate::{
    Difficulty, DiversifyOptions, ExportOptions, KernelPrompt, KernelWriter, Progress, RunDir,
    SftFormat,
};
use dice_engine::{DecodeParams, DecodeSettings, Generator, Job, PromptStyle};
use dice_eval::{Device, EvalConfig};
use dice_store::Store;
use indicatif::ProgressBar;
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
    /// Draw problems from a catalogue of LLM building blocks, ask an endpoint for kernels, and
    /// keep the first attempt per problem that is correct, not deceptive and faster than the
    /// threshold with confidence.
    #[command(after_help = DIVERSIFY_MANUAL)]
    Diversify(DiversifyArgs),
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

const DIVERSIFY_MANUAL: &str = "\
The catalogue (--components takes these names, or prefixes of them such as `attention`):
  attention_{mha,gqa,mqa}_{causal,sliding}  q, k, v heads (GQA: groups of query heads share a
                             key/value head; MQA: one), causal mask, or causal within a window
  mlp_swiglu, mlp_geglu      down_proj(act(gate_proj(x)) * up_proj(x)), no biases
  rms_norm, layer_norm       over the hidden size, with a learned weight (and bias)
  rotary                     rotary position embedding, rotate-half form
  softmax, cross_entropy     over the vocabulary
  residual_mlp               x + SwiGLU(RMSNorm(x))
  residual_attention         x + o_proj(GQA causal attention(RMSNorm(x)))
Each entry is drawn --variants times at shapes and a dtype (fp32, bf16; at --scale kernelbench
also fp16) from --seed: the same flags draw the same problems. --scale tiny draws tens of
elements per dimension (CPU tests); --scale kernelbench the sizes of KernelBench and real LLM
layers. Every problem is a KernelBench file (Model, get_inputs, get_init_inputs) whose tensors
and parameters are made in its dtype; it is judged at that precision (so --precision is refused),
and --kernelbench-tolerance takes the tolerance of that dtype.

Attempts go in rounds: each sends KernelBench's one-shot prompt of every problem without a
kept attempt to the endpoint (chat completions), extracts the answer's first fenced program and
judges it as `dice curate verify` judges a pair: strict mode, kept when correct, no reward-hack
rule fired and the lower end of the speedup's 95 % interval is at least --min-speedup. A
problem stops at its first kept attempt or after --attempts. Attempt k (from 0) samples with seed
--seed + k, so attempts differ only when decoding samples (--top-k other than 1).

The run folder keeps diversify-problems.jsonl (the drawn problems), diversify-answers.jsonl
(each answer, appended as it arrives), diversify-{fp32,fp16,bf16}.db (the evaluator's stores),
diversify-attempts.jsonl (every attempt: verdict, speedup and interval, kept or why dropped),
diversify-pairs.jsonl (the kept pairs, which `dice curate export` adds to verify's) and
diversify.json (counts). After any interruption the same command continues; a finished run
asks and judges nothing. A local model answers through `dice serve`.

Example:
  dice serve --model models/dice-8b --port 8000 &
  dice curate diversify --run runs/diverse --endpoint http://127.0.0.1:8000/v1 \\
      --model-name dice-8b --scale kernelbench --variants 20 --device cuda";

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
The RL tasks are the kept pairs and the problem-only records; --difficulty says how their
levels are measured:
  label      the records' own `level` (its first number; 0 without one)
  pass-rate  --pass-rates FILE: {id: rate} or records {id, pass_rate}
  run        a model's samples of the tasks, judged by `dice eval` or `dice kernelbench`:
             --eval-run RUN_DIR (its dice.db, opened read-only), or --store postgres://…
             --eval-run NAME. A task's pass rate is its samples correct and not deceptive over
             its samples judged (k per problem, as the run made them). Tasks meet the run's
             problems by the SHA-256 of their source (the store keeps it for every problem),
             so numbering does not matter, but the bytes do: the run's problems must be the
             references as exported (rl_end_to_end.json's pytorch_code, ingest's normalised
             text), e.g. `dice kernelbench` over the KernelBench tree ingested (clean files
             normalise to themselves), or `dice eval --pairs FILE` with k records
             {pytorch_code, cuda_code} per task (the problems of one source are pooled)
  endpoint   an OpenAI-compatible --endpoint (--model-name) rates each task from 1 to --levels,
             greedy, with this prompt (dice_curate::difficulty::RATING_PROMPT):
               Rate how hard it is to write a correct CUDA kernel that runs faster than the
               following PyTorch program, on a scale from 1 (easy: one elementwise operation)
               to N (hard: several fused operations, reductions or irregular memory access).
               Answer with the number only.  ```python <the reference>```
             The answer's first number in 1..=N is the level. Answers are appended to
             RUN_DIR/difficulty-answers.jsonl as they arrive: a rerun asks only tasks without
             one (a changed --levels or reference asks again)
Pass rates are cut into --levels equal bands: rate 1 is level 1, rate 0 level --levels. A task
without a measure (no rate, no sample) and an answer without a level go to the hardest level,
counted as unmeasured or fallback. RUN_DIR/difficulty.json keeps the method, the tasks per
level and each task's level, status and measure; `dice curate report` shows the histogram.

Examples:
  dice curate export --run runs/cuke --out data/cuke --difficulty pass-rate --pass-rates rates.json
  dice kernelbench --model M --kernelbench KernelBench/ --levels 1 --samples 8 --run runs/k8
  dice curate export --run runs/cuke --out data/cuke --difficulty run --eval-run runs/k8
  dice curate export --run runs/cuke --out data/cuke --difficulty endpoint \\
      --endpoint http://127.0.0.1:8000/v1 --model-name mercury-coder --levels 5";

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
#[command(
    mut_arg("endpoint", |a| a.required(true)),
    mut_arg("top_k", |a| a.default_value("0")),
)]
pub(crate) struct DiversifyArgs {
    /// The curate run folder (created).
    #[arg(long, value_name = "RUN_DIR")]
    pub run: PathBuf,
    /// The endpoint that writes the kernels.
    #[command(flatten)]
    pub endpoint: EndpointArgs,
    /// Catalogue entries to draw from, by name or prefix, comma-separated (default: all).
    #[arg(long, value_name = "NAMES", value_delimiter = ',')]
    pub components: Vec<String>,
    /// How large the drawn shapes are.
    #[arg(long, value_enum, default_value_t = ScaleArg::Kernelbench)]
    pub scale: ScaleArg,
    /// Problems drawn per catalogue entry (fewer when the scale has fewer distinct shapes).
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub variants: u32,
    /// Seeds the draws of shapes and dtypes, and (plus the attempt) the endpoint's sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Attempts per problem, at most.
    #[arg(long, value_name = "N", default_value_t = dice_curate::DEFAULT_ATTEMPTS)]
    pub attempts: u32,
    /// Tokens the endpoint may write per answer.
    #[arg(long, value_name = "N", default_value_t = 4096)]
    pub max_new_tokens: usize,
    /// How the endpoint samples (by default from every token: attempts differ).
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub judging: CurateJudgeArgs,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum ScaleArg {
    /// Tens of elements per dimension: every problem runs in milliseconds on a CPU.
    Tiny,
    /// KernelBench's sizes and those of real LLM layers (for a GPU).
    Kernelbench,
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
    #[command(flatten)]
    pub judging: CurateJudgeArgs,
}

/// How `verify` and `diversify` judge pairs and which they keep.
#[derive(Args, Debug)]
pub(crate) struct CurateJudgeArgs {
    /// Where pairs are judged (cuda: torch with CUDA, and nvcc on PATH).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// Keep a pair only when the lower end of its speedup's 95 % interval reaches this.
    #[arg(long, value_name = "X", default_value_t = dice_curate::DEFAULT_MIN_SPEEDUP)]
    pub min_speedup: f64,
    /// Judge everything again, accepting a store judged with other settings or for other pairs
    /// (after ingesting other inputs).
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub judge: JudgeArgs,
}

impl CurateJudgeArgs {
    /// The evaluator's settings for the judge store of `run`, with a progress bar.
    fn eval_config(&self, run: &RunDir) -> EvalConfig {
        let mut judging = EvalConfig::new(run.judge_store(), String::new());
        judging.set_device(self.device);
        self.judge.apply(&mut judging);
        judging.force = self.force;
        judging.progress = true;
        judging
    }
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
    /// Pass rates of a `dice eval` / `dice kernelbench` run's samples (--eval-run).
    Run,
    /// Levels an OpenAI-compatible --endpoint gives each task.
    Endpoint,
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
    /// Curriculum levels pass rates are cut into, or the endpoint rates on.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub levels: u32,
    /// For --difficulty run: the evaluation's run folder (its dice.db), or with --store its
    /// run name.
    #[arg(long, value_name = "RUN_DIR|NAME")]
    pub eval_run: Option<PathBuf>,
    /// For --difficulty run: the PostgreSQL database holding --eval-run
    /// (postgres://USER@HOST:PORT/DB).
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// The endpoint that rates difficulty (--difficulty endpoint).
    #[command(flatten)]
    pub rater: EndpointArgs,
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
        CurateCommand::Diversify(a) => diversify(&a),
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
    let judging = a.judging.eval_config(&run);
    let s = dice_curate::verify(&run, judging, a.judging.min_speedup)?;
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

/// The endpoint as diversify's kernel writer.
struct EndpointWriter {
    generator: Generator,
    params: DecodeParams,
}

impl KernelWriter for EndpointWriter {
    fn write(
        &self,
        prompts: Vec<KernelPrompt>,
        store: &mut dyn FnMut(usize, String) -> Result<()>,
    ) -> Result<()> {
        let jobs = prompts
            .into_iter()
            .enumerate()
            .map(|(key, prompt)| Job {
                key,
                history: Vec::new(),
                text: prompt.text,
                sample: prompt.attempt as usize,
            })
            .collect();
        self.generator
            .run(&self.params, PromptStyle::Chat, jobs, |key, answer| {
                store(key, answer.text)
            })
    }
}

fn diversify(a: &DiversifyArgs) -> Result<()> {
    ensure!(
        a.attempts <= 1 || a.sampling.top_k != 1,
        "--attempts {} with greedy decoding (--top-k 1) asks for the same kernel each time: sample (--top-k 0) or use --attempts 1",
        a.attempts
    );
    if let Some(unknown) = a
        .components
        .iter()
        .find(|name| Component::matching(name).is_empty())
    {
        bail!("--components: no catalogue entry is called {unknown} (see `dice curate diversify --help`)");
    }
    ensure!(
        a.judging.judge.precision.is_none(),
        "--precision does not apply to diversify: each drawn problem is judged in its own dtype (see `dice curate diversify --help`)"
    );
    let components = COMPONENTS
        .into_iter()
        .filter(|c| {
            a.components.is_empty()
                || a.components
                    .iter()
                    .any(|n| c.name().starts_with(n.as_str()))
        })
        .collect();
    let options = DiversifyOptions {
        components,
        scale: match a.scale {
            ScaleArg::Tiny => Scale::Tiny,
            ScaleArg::Kernelbench => Scale::KernelBench,
        },
        variants: a.variants,
        seed: a.seed,
        attempts: a.attempts,
        min_speedup: a.judging.min_speedup,
        kernelbench_tolerance: a.judging.judge.kernelbench_tolerance,
    };
    let settings = DecodeSettings {
        temperature: Some(a.sampling.temperature),
        top_k: Some(a.sampling.top_k),
        top_p: Some(a.sampling.top_p),
        seed: Some(a.seed),
        ..DecodeSettings::default()
    };
    let writer = EndpointWriter {
        generator: a
            .endpoint
            .generator()?
            .context("diversify needs --endpoint URL")?,
        params: settings.over(&DecodeParams::dice_eval(a.max_new_tokens))?,
    };
    let run = RunDir::new(&a.run);
    let judging = a.judging.eval_config(&run);
    let mut bar: Option<ProgressBar> = None;
    let s = dice_curate::diversify(
        &run,
        &options,
        &judging,
        &writer,
        &mut |event| match event {
            Progress::Asking { attempt, prompts } => {
                if let Some(done) = bar.take() {
                    done.finish();
                }
                let asking = ProgressBar::new(prompts as u64);
                asking.set_message(format!("attempt {}: kernels asked", attempt + 1));
                bar = Some(asking);
            }
            Progress::Answered => {
                if let Some(asking) = &bar {
                    asking.inc(1);
                }
            }
        },
    )?;
    if let Some(done) = bar {
        done.finish();
    }
    println!(
        "{} problems, {} attempts judged, {} kept (speedup's lower bound >= {}x)",
        s.problems, s.attempts, s.kept, s.min_speedup
    );
    for (reason, n) in &s.dropped {
        println!("dropped {n}: {reason}");
    }
    println!("{} lists every attempt", run.diversify_attempts().display());
    Ok(())
}

fn export(a: &ExportArgs) -> Result<()> {
    let run = RunDir::new(&a.run);
    let difficulty = match a.difficulty {
        DifficultyArg::Label => Difficulty::Label,
        DifficultyArg::PassRate => {
            let Some(rates) = &a.pass_rates else {
                bail!("--difficulty pass-rate needs --pass-rates FILE");
            };
            Difficulty::Measured(dice_curate::difficulty::from_pass_rate_file(
                rates, a.levels,
            )?)
        }
        DifficultyArg::Run => {
            let Some(eval_run) = &a.eval_run else {
                bail!("--difficulty run needs --eval-run RUN_DIR (a `dice eval` or `dice kernelbench` run)");
            };
            let (store, location) = Store::open_run_to_read(eval_run, None, a.store.as_deref())?;
            let tasks = dice_curate::rl_tasks(&run)?;
            Difficulty::Measured(dice_curate::difficulty::from_run(
                &store, &location, &tasks, a.levels,
            )?)
        }
        DifficultyArg::Endpoint => {
            let (Some(endpoint), Some(generator)) = (&a.rater.endpoint, a.rater.generator()?)
            else {
                bail!("--difficulty endpoint needs --endpoint URL and --model-name NAME");
            };
            let model_name = a.rater.model_name()?;
            let rater = EndpointWriter {
                generator,
                params: DecodeParams::dice_eval(dice_curate::difficulty::RATING_TOKENS),
            };
            let tasks = dice_curate::rl_tasks(&run)?;
            Difficulty::Measured(dice_curate::difficulty::from_endpoint(
                &run,
                &tasks,
                &rater,
                &format!("{endpoint} ({model_name})"),
                a.levels,
            )?)
        }
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
    let e = dice_curate::export(&run, &options)?;
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
    let d = &e.difficulty;
    let histogram: Vec<String> = d
        .histogram
        .iter()
        .map(|(l, n)| format!("{l}: {n}"))
        .collect();
    println!(
        "difficulty by {}: {} tasks ({}); {} unmeasured, {} fallback, at the hardest level; {} lists each",
        d.method,
        d.tasks.len(),
        histogram.join(", "),
        d.unmeasured,
        d.fallback,
        run.difficulty_summary().display()
    );
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
