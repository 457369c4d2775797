//! `dice`: evaluate, generate, curate and train CUDA kernels written by diffusion language models.

mod cmd;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "dice",
    version,
    about = "Evaluate, generate and train CUDA kernels written by block-diffusion language models",
    long_about = "dice evaluates candidate kernels on KernelBench (compile, correctness, speedup, fast_p, \
reward-hack detection), generates kernels with SDAR / DICE block-diffusion models or any \
OpenAI-compatible endpoint, curates training pairs, and fine-tunes the models with \
block-diffusion SFT and BiC-RL (TraceRL rewarded by the evaluator).\n\n\
Logs go to stderr; set RUST_LOG (e.g. RUST_LOG=debug, or RUST_LOG=dice_eval=debug) for more detail."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List and validate the problems of a KernelBench tree.
    #[command(subcommand)]
    Problems(cmd::problems::ProblemsCommand),
    /// Evaluate candidate kernels: build, check correctness, time against the reference.
    Eval(cmd::eval::EvalArgs),
    /// Summarise an evaluation run: verdicts, correctness, fast_p, pass@k, speedups; or compare
    /// runs side by side.
    Report(cmd::report::ReportArgs),
    /// Print a KernelBench end-to-end prompt or a kernel-infilling prompt.
    Prompt(cmd::prompt::PromptArgs),
    /// Tokenize text with a model's tokenizer (optionally through its chat template).
    Tokenize(cmd::tokenize::TokenizeArgs),
    /// Turn token ids back into text.
    Detokenize(cmd::tokenize::DetokenizeArgs),
    /// Generate kernels (or any text) with a block-diffusion model or an OpenAI-compatible endpoint.
    #[command(after_help = cmd::cuda_decoding_env!())]
    Generate(cmd::generate::GenerateArgs),
    /// Run a model on KernelBench in one command: generate, judge and report, resumably.
    Kernelbench(cmd::kernelbench::KernelBenchArgs),
    /// Serve a model over an OpenAI-compatible HTTP API.
    #[command(after_help = cmd::cuda_decoding_env!())]
    Serve(cmd::serve::ServeArgs),
    /// Benchmarks and GPU checks: golden parity, model speed and memory, a training step,
    /// identity candidates for timing precision.
    #[command(subcommand)]
    Bench(cmd::bench::BenchCommand),
    /// Model folders: write a deterministic checkpoint of any config (formula or random weights).
    #[command(subcommand)]
    Model(cmd::model::ModelCommand),
    /// Curate training data from PyTorch→CUDA pairs: ingest and deduplicate, verify speedups,
    /// export SFT and RL task files, report; split programs for kernel infilling.
    #[command(subcommand)]
    Curate(cmd::curate::CurateCommand),
    /// Fine-tune a block-diffusion model: supervised (SFT) on chat data, then BiC-RL (TraceRL)
    /// rewarded by the evaluator.
    #[command(subcommand)]
    Train(cmd::train::TrainCommand),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Problems(c) => cmd::problems::run(c),
        Command::Eval(a) => cmd::eval::run(a),
        Command::Report(a) => cmd::report::run(a),
        Command::Prompt(a) => cmd::prompt::run(a),
        Command::Tokenize(a) => cmd::tokenize::run_tokenize(a),
        Command::Detokenize(a) => cmd::tokenize::run_detokenize(a),
        Command::Generate(a) => cmd::generate::run(a),
        Command::Kernelbench(a) => cmd::kernelbench::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Bench(c) => cmd::bench::run(c),
        Command::Model(c) => cmd::model::run(c),
        Command::Curate(c) => cmd::curate::run(c),
        Command::Train(c) => cmd::train::run(c),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
