//! `dice curate`: training data from PyTorch→CUDA pairs. The flags map onto `dice_curate`.

use anyhow::Result;
use clap::{Args, Subcommand};
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Subcommand)]
pub(crate) enum CurateCommand {
    /// Split each program into the prefix, core and suffix of a kernel-infilling task.
    #[command(after_help = SPLIT_MANUAL)]
    Split(SplitArgs),
}

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

pub(crate) fn run(command: CurateCommand) -> Result<()> {
    match command {
        CurateCommand::Split(a) => split(&a),
    }
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
