//! `dice problems list`: the problems of a KernelBench tree, validated.

use anyhow::Result;
use clap::{Args, Subcommand, ValueEnum};
use dice_kernelbench::KernelBench;
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Subcommand)]
pub(crate) enum ProblemsCommand {
    /// List the problems of a KernelBench tree (level, id, name, path), sorted by level and id.
    ///
    /// Every file `levelL/ID_Name.py` is read and checked on a Python parse tree: it must
    /// define `class Model`, `def get_inputs` and `def get_init_inputs` at module level and be
    /// UTF-8. Invalid files are reported on stderr, one line each (path: reason), and do not
    /// stop the listing; stdout holds only the valid problems.
    ///
    /// Examples:
    ///   dice problems list --kernelbench KernelBench/
    ///   dice problems list --kernelbench KernelBench/ --level 1 --format json
    #[command(verbatim_doc_comment)]
    List(ListArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ListFormat {
    /// One line per problem: `level  id  name  path` (tab-separated).
    Text,
    /// A JSON array of `{level, problem_id, name, path}` (stdout stays a clean array).
    Json,
}

#[derive(Debug, Args)]
pub(crate) struct ListArgs {
    /// The KernelBench problem folder: the one holding level1/ … level4/ (a KernelBench
    /// clone's root works too). Example: --kernelbench ~/KernelBench/KernelBench
    #[arg(long, value_name = "DIR")]
    pub kernelbench: PathBuf,
    /// Only this level (1–4 in KernelBench; level 4 needs network at run time to fetch
    /// Hugging Face models). Default: every level folder present.
    #[arg(long, value_name = "L")]
    pub level: Option<u32>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = ListFormat::Text)]
    pub format: ListFormat,
}

pub(crate) fn run(command: ProblemsCommand) -> Result<()> {
    match command {
        ProblemsCommand::List(args) => list(args),
    }
}

fn list(args: ListArgs) -> Result<()> {
    let kb = KernelBench::open(&args.kernelbench)?;
    let scan = kb.scan(args.level)?;
    for bad in &scan.invalid {
        eprintln!("invalid problem {}: {}", bad.path.display(), bad.reason);
    }
    let mut out = std::io::stdout().lock();
    match args.format {
        ListFormat::Json => {
            let rows: Vec<serde_json::Value> = scan
                .problems
                .iter()
                .map(|p| {
                    serde_json::json!({
                        "level": p.level,
                        "problem_id": p.problem_id,
                        "name": p.name,
                        "path": p.path,
                        "needs_network": p.needs_network(),
                    })
                })
                .collect();
            serde_json::to_writer_pretty(&mut out, &rows)?;
            writeln!(out)?;
        }
        ListFormat::Text => {
            for p in &scan.problems {
                let network = if p.needs_network() {
                    "\t(needs network)"
                } else {
                    ""
                };
                writeln!(
                    out,
                    "{}\t{}\t{}\t{}{network}",
                    p.level,
                    p.problem_id,
                    p.name,
                    p.path.display()
                )?;
            }
        }
    }
    Ok(())
}
