//! `dice report`: metrics and reports of an evaluation run, or runs side by side.

use anyhow::{bail, Context, Result};
use clap::Args;
use dice_pipeline::{read_compared_run, read_turns_report, STORE_FILE};
use dice_report::{
    parse_thresholds, read_report, render, render_comparison, Comparison, Format, DEFAULT_FAST_P,
};
use dice_store::Store;
use std::path::{Path, PathBuf};

/// Shown after the flags by `dice report --help`.
const REPORT_MANUAL: &str = "\
Metrics follow KernelBench: per level, over all problems of the run, scoring sample 0 of each
problem (a problem without one counts as a failure): compiled and correct rates, fast_p (correct
and speedup strictly above p), the geometric-mean speedup of correct problems, and with several
samples per problem pass@k and fast_p@k (unbiased estimator, k = 1, 5, 10, 20, 50, ... up to the
samples per problem). Every metric is shown raw and robust (deceptive samples, i.e. reward hacks,
count as incorrect). Problems whose reference failed stay in the denominators and are listed
separately.

Several run folders are compared side by side in the DICE paper's layout (its Tables 2 and 6):
per level, Exec (compiled and correct), fast_1 and fast_2, raw and robust, a column pair per run;
as md, json or html (with a bar chart per level and figure).

A run of several turns (`dice kernelbench --turns N`: turn t in RUN_DIR/turn-t) is reported at its
last turn, each sample at its best so far, and each level adds a table turn by turn: Exec, fast_1,
fast_2 and pass@k at that turn, the samples fixed at it (correct for the first time, and their
share of those not correct before), and the tokens generated so far per correct kernel. Set
beside a run of one turn, it shows what the turns bought.

Examples:
  dice report runs/l1
  dice report runs/l1 --format html --output l1.html
  dice report runs/l1 --format json --fast-p 0,1,1.5,2 --strict
  dice report runs/sdar runs/dice --format html --output side-by-side.html
  dice report runs/sdar runs/sdar-3turns";

#[derive(Debug, Args)]
#[command(after_help = REPORT_MANUAL)]
pub(crate) struct ReportArgs {
    /// The run folder given to `dice eval` or `dice kernelbench` (its store is
    /// RUN_DIR/dice.db); several folders are compared side by side.
    #[arg(value_name = "RUN_DIR", required = true)]
    pub run_dirs: Vec<PathBuf>,
    /// Read this store instead of RUN_DIR/dice.db (one run only).
    #[arg(long, value_name = "FILE", conflicts_with = "store")]
    pub db: Option<PathBuf>,
    /// Read the run from a PostgreSQL database (postgres://USER@HOST:PORT/DB): RUN_DIR is the
    /// run's name there, as given to `dice eval --store URL --run NAME` (one run only).
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// Output format: md (Markdown tables), csv (one row per sample), json (everything:
    /// `samples`, `levels`, `problem_errors`, `run`), html (one self-contained page with the
    /// tables, a speedup histogram and a per-problem strip chart). Runs side by side: md, json
    /// or html.
    #[arg(long, value_name = "FORMAT", default_value = "md", value_parser = parse_format)]
    pub format: Format,
    /// Comma-separated speedup thresholds p for fast_p (correct and speedup > p); reports
    /// key them as written. Default: KernelBench's 0,0.5,0.8,1,1.5,2. Example: --fast-p 0,1,2.
    /// One run only: runs side by side show the paper's fast_1 and fast_2.
    #[arg(long, value_name = "LIST")]
    pub fast_p: Option<String>,
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

pub(crate) fn run(args: ReportArgs) -> Result<()> {
    let text = match args.run_dirs.as_slice() {
        [run_dir] => one_run(run_dir, &args)?,
        run_dirs => side_by_side(run_dirs, &args)?,
    };
    match &args.output {
        Some(path) => std::fs::write(path, text)
            .with_context(|| format!("cannot write the report to {}", path.display()))?,
        None => print!("{text}"),
    }
    Ok(())
}

fn one_run(run_dir: &Path, args: &ReportArgs) -> Result<String> {
    let thresholds = parse_thresholds(args.fast_p.as_deref().unwrap_or(DEFAULT_FAST_P))?;
    if args.db.is_none() && args.store.is_none() {
        if let Some(report) = read_turns_report(run_dir, &thresholds, args.strict)? {
            return render(&report, args.format);
        }
    }
    let (store, location) =
        Store::open_run_to_read(run_dir, args.db.as_deref(), args.store.as_deref())?;
    let Some(report) = read_report(&store, &thresholds, args.strict)? else {
        bail!(no_run_yet(&location));
    };
    render(&report, args.format)
}

fn side_by_side(run_dirs: &[PathBuf], args: &ReportArgs) -> Result<String> {
    if args.db.is_some() || args.store.is_some() {
        bail!(
            "--db and --store read one run; runs side by side are read from each RUN_DIR/dice.db"
        );
    }
    if args.fast_p.is_some() {
        bail!("--fast-p applies to one run; runs side by side show the paper's fast_1 and fast_2");
    }
    let runs = run_dirs
        .iter()
        .map(|dir| {
            read_compared_run(dir, &dir.display().to_string(), args.strict)?
                .with_context(|| no_run_yet(&dir.join(STORE_FILE).display().to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    render_comparison(&Comparison { runs }, args.format)
}

fn no_run_yet(store: &str) -> String {
    format!("{store} holds no run yet (was `dice eval` interrupted before it started?)")
}
