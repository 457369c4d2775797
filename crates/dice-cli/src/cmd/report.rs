//! `dice report`: metrics and reports of an evaluation run.

use anyhow::{bail, Context, Result};
use clap::Args;
use dice_report::{parse_thresholds, read_report, render, Format, DEFAULT_FAST_P};
use dice_store::Store;
use std::path::PathBuf;

/// Shown after the flags by `dice report --help`.
const REPORT_MANUAL: &str = "\
Metrics follow KernelBench: per level, over all problems of the run, scoring sample 0 of each
problem (a problem without one counts as a failure): compiled and correct rates, fast_p (correct
and speedup strictly above p), the geometric-mean speedup of correct problems, and with several
samples per problem pass@k and fast_p@k (unbiased estimator, k = 1, 5, 10, 20, 50, ... up to the
samples per problem). Every metric is shown raw and robust (deceptive samples, i.e. reward hacks,
count as incorrect). Problems whose reference failed stay in the denominators and are listed
separately.

Examples:
  dice report runs/l1
  dice report runs/l1 --format html --output l1.html
  dice report runs/l1 --format json --fast-p 0,1,1.5,2 --strict";

#[derive(Debug, Args)]
#[command(after_help = REPORT_MANUAL)]
pub struct ReportArgs {
    /// The run folder given to `dice eval` (its store is RUN_DIR/dice.db).
    #[arg(value_name = "RUN_DIR")]
    pub run_dir: PathBuf,
    /// Read this store instead of RUN_DIR/dice.db.
    #[arg(long, value_name = "FILE")]
    pub db: Option<PathBuf>,
    /// Output format: md (Markdown tables), csv (one row per sample), json (everything:
    /// `samples`, `levels`, `problem_errors`, `run`), html (one self-contained page with the
    /// tables, a speedup histogram and a per-problem strip chart).
    #[arg(long, value_name = "FORMAT", default_value = "md", value_parser = parse_format)]
    pub format: Format,
    /// Comma-separated speedup thresholds p for fast_p (correct and speedup > p); reports
    /// key them as written. Default: KernelBench's 0,0.5,0.8,1,1.5,2. Example: --fast-p 0,1,2
    #[arg(long, value_name = "LIST", default_value = DEFAULT_FAST_P)]
    pub fast_p: String,
    /// Make the robust metrics (deceptive samples count as incorrect) the headline. Runs
    /// evaluated with --strict are reported this way without this flag.
    #[arg(long)]
    pub strict: bool,
    /// Write the report to FILE instead of stdout.
    #[arg(long, short, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

fn parse_format(s: &str) -> Result<Format, String> {
    s.parse().map_err(|e: anyhow::Error| e.to_string())
}

pub fn run(args: ReportArgs) -> Result<()> {
    let thresholds = parse_thresholds(&args.fast_p)?;
    let db = args
        .db
        .clone()
        .unwrap_or_else(|| args.run_dir.join("dice.db"));
    // Opening creates missing databases; a report must never do that.
    if !db.is_file() {
        bail!(
            "no run store at {} (run `dice eval` with this run folder first, or pass --db FILE)",
            db.display()
        );
    }
    let store = Store::open(&db)?;
    let Some(report) = read_report(&store, &thresholds, args.strict)? else {
        bail!(
            "{} holds no run yet (was `dice eval` interrupted before it started?)",
            db.display()
        );
    };
    let text = render(&report, args.format)?;
    match &args.output {
        Some(path) => std::fs::write(path, text)
            .with_context(|| format!("cannot write the report to {}", path.display()))?,
        None => print!("{text}"),
    }
    Ok(())
}
