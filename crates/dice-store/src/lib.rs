//! The records of evaluation runs and the stores that keep them.
//!
//! The evaluator (dice-eval) writes a run's settings, problems, samples with their verdicts,
//! builds and timelines; reports (dice-report) read them. Both go through [`Store`], which holds
//! one [`Backend`]: a SQLite file per run (`RUN_DIR/dice.db`), or a PostgreSQL database holding
//! many runs by name, which workers on many hosts share ([`Store::open_postgres`]).
//!
//! Several workers (evaluating processes) may judge one run together: each claims samples before
//! judging them, under a lease its heartbeat renews, and stores each result once
//! ([`Backend::claim`], [`Backend::put_claimed_sample`]). Reports open the store read-only
//! ([`Store::open_read_only`]).

mod backend;
mod claim;
mod postgres;
mod record;
mod sqlite;
mod store;
mod verdict;

pub use backend::Backend;
pub use claim::{Claimed, SampleKey, WorkerId};
pub use postgres::Postgres;
pub use record::{
    BuildRecord, KernelProfile, LaunchedKernel, ProblemRecord, RunInfo, RunTimeline, SampleExtras,
    SampleRecord, SpeedupInterval, TimingStats,
};
pub use sqlite::Sqlite;
pub use store::Store;
pub use verdict::Verdict;
