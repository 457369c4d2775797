//! `dice bench`: speed and memory of the model on its real sizes with random weights, the golden
//! outputs recomputed on a device, identity candidates for the evaluator. Each command calls the
//! library that does the work and prints its figures beside the targets and anchors of
//! `bench/targets.toml` that apply ([`dice_report::targets`]).

mod format;
mod generate;
mod golden;
mod identity;
mod model;
mod profile;
mod rl;
mod train;

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand)]
pub(crate) enum BenchCommand {
    /// Load, prefill and cached block-decoding speed and peak memory of a random-weight model.
    #[command(after_help = model::after_help())]
    Model(model::ModelBenchArgs),
    /// Recompute the reference's golden outputs on a device and dtype, and compare.
    Golden(golden::GoldenArgs),
    /// One checkpointed two-stream SFT step (loss and all gradients) of a random-weight model.
    #[command(after_help = train::AFTER_HELP)]
    Train(train::TrainBenchArgs),
    /// Decoding throughput and peak memory of the engine on a random-weight model.
    #[command(after_help = generate::after_help())]
    Generate(generate::GenerateBenchArgs),
    /// Identity candidates (each reference with `Model` renamed `ModelNew`) for timing precision.
    #[command(after_help = identity::AFTER_HELP)]
    Identity(identity::IdentityArgs),
    /// One full-size RL step judging recorded programs: its phases pipelined and back to back.
    #[command(after_help = rl::AFTER_HELP)]
    Rl(rl::RlBenchArgs),
}

pub(crate) fn run(command: BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Model(args) => model::run(args),
        BenchCommand::Golden(args) => golden::run(args),
        BenchCommand::Train(args) => train::run(args),
        BenchCommand::Generate(args) => generate::run(args),
        BenchCommand::Identity(args) => identity::run(args),
        BenchCommand::Rl(args) => rl::run(args),
    }
}
