//! The records of evaluation runs and the stores that keep them.
//!
//! The evaluator (dice-eval) writes a run's settings, problems, samples with their verdicts,
//! builds and timelines; reports (dice-report) read them. Both go through [`Store`], which holds
//! one [`Backend`]: today a SQLite file per run (`RUN_DIR/dice.db`). Another database is another
//! `Backend` implementation and a way to open it; the records and the callers stay as they are.

mod backend;
mod record;
mod sqlite;
mod store;
mod verdict;

pub use backend::Backend;
pub use record::{
    BuildRecord, KernelProfile, LaunchedKernel, ProblemRecord, RunInfo, RunTimeline, SampleExtras,
    SampleRecord, TimingStats,
};
pub use sqlite::Sqlite;
pub use store::Store;
pub use verdict::Verdict;
