//! Metrics and reports of evaluation runs.
//!
//! [`build_report`] turns a run's records (as the evaluator stores them, read through dice-store's
//! [`Store`](dice_store::Store) by [`read_report`]) into a [`Report`]:
//! one row per sample and, per level, KernelBench's metrics (compiled and correct rates,
//! fast_p, geometric-mean speedup, pass@k, fast_p@k), each both *raw* and *robust*
//! (deceptive samples count as incorrect), as in the DICE paper's Table 6.
//! [`render`] writes it as Markdown, CSV, JSON or a self-contained HTML page.
//!
//! A [`Comparison`] sets runs side by side in the DICE paper's layout (Exec, fast_1 and fast_2
//! per level, raw and robust: its Tables 2 and 6); [`render_comparison`] writes it as Markdown,
//! JSON or an HTML page with bar charts.
//!
//! A run of several turns (`dice kernelbench --turns N`) is reported at its last turn, each sample
//! at its best so far ([`best_so_far`]), with each level's figures turn by turn ([`TurnRow`]:
//! Exec, fast_p and pass@k, the samples fixed at the turn, tokens per correct kernel):
//! [`build_turns_report`], [`ComparedRun::from_turns`].
//!
//! [`targets`] holds the GPU benchmarks' targets and anchors (`bench/targets.toml`) and tells
//! whether a measured figure meets them.
//!
//! Conventions (KernelBench `scripts/benchmark_eval_analysis.py`, `src/score.py`):
//! * rates are over all problems of the level in the run; only sample 0 of each problem
//!   counts, and a problem without a sample 0 counts as a failure;
//! * fast_p counts problems that are correct with speedup strictly greater than p; a correct
//!   sample without a speedup (no timing) is correct but never fast;
//! * problems whose reference failed stay in the denominators (they are failures for every
//!   candidate, as in KernelBench, where they cannot be solved) and are listed separately
//!   under `problem_errors` so that they can be told apart from candidate failures.

mod compare;
mod metrics;
mod ordered;
mod paper;
mod pass_at_k;
pub mod render;
mod report;
pub mod targets;
mod threshold;
mod turns;

pub use compare::{ComparedRun, Comparison, PaperLevel};
pub use metrics::{Outcome, ProblemOutcomes, Scores};
pub use ordered::OrderedMap;
pub use paper::{PaperScores, TurnRow};
pub use pass_at_k::{k_values, pass_at_k};
pub use render::{render, render_comparison, Format};
pub use report::{
    build_report, read_report, LevelReport, ProblemError, Report, SampleRow, Scoring,
};
pub use threshold::{parse_thresholds, Threshold, DEFAULT_FAST_P};
pub use turns::{best_so_far, build_turns_report, SampleKey, StoredTurn};
