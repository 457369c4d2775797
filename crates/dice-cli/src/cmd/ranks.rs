//! The ranks of a training run, shared by `dice train sft` and `dice train rl`: started here by
//! `--nproc-per-node N` as torchrun starts them, or by torchrun, Slurm or Kubernetes through
//! their environment variables.

use anyhow::Result;
use clap::Args;
use dice_train::dist::{join_or_launch, Collective};
use std::ffi::OsString;

#[derive(Args, Debug)]
pub(crate) struct RankArgs {
    /// Train with N ranks on this machine (one per GPU with --device cuda, talking through NCCL,
    /// even N = 1), as torchrun's --nproc-per-node starts them; each step's work is shared out
    /// among them. Launched by
    /// torchrun, Slurm or Kubernetes instead, the ranks read RANK, WORLD_SIZE, LOCAL_RANK,
    /// MASTER_ADDR and MASTER_PORT [default: 1].
    #[arg(long, value_name = "N")]
    pub nproc_per_node: Option<usize>,
}

impl RankArgs {
    /// This process's place in the run: its collective, or `None` once the `--nproc-per-node`
    /// ranks it started with this command line have all finished.
    pub(crate) fn join_or_launch(&self) -> Result<Option<Box<dyn Collective>>> {
        join_or_launch(self.nproc_per_node, &std::env::current_exe()?, &rank_args())
    }
}

/// This command line without `--nproc-per-node`: what every launched rank runs.
fn rank_args() -> Vec<OsString> {
    let mut args = std::env::args_os().skip(1);
    let mut kept = Vec::new();
    while let Some(arg) = args.next() {
        if arg == "--nproc-per-node" {
            args.next();
        } else if !arg.to_string_lossy().starts_with("--nproc-per-node=") {
            kept.push(arg);
        }
    }
    kept
}
