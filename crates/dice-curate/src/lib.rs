//! Training data from PyTorch→CUDA pairs, as DICE's CuKe set was made and stricter. Every
//! stage reads and writes one run folder ([`RunDir`]).
//!
//! * [`ingest`] reads pairs from DICE-style JSON, LlamaFactory SFT files and folders of kernel
//!   files, normalises them, gives them content ids and drops exact and near duplicates
//!   ([`dedup`] says how).
//! * [`verify`] judges every pair in strict mode and keeps those faster than their reference
//!   with confidence (the lower end of a bootstrap interval of the speedup).
//! * [`diversify`] draws problems from a [`catalogue`] of LLM building blocks, asks a
//!   generator for kernels and keeps the first attempt per problem that verify's rule keeps.
//! * [`export`] writes the kept pairs as LlamaFactory SFT data and RL task files for both stages
//!   of BiC-RL, ordered by the levels [`difficulty`] measures (pass rates of a file or of a
//!   run's samples, or an endpoint's ratings).
//! * [`report`] shows the funnel, the speedups before and after the threshold, the drop
//!   reasons and the duplicate clusters (Markdown and HTML).
//! * [`split`] cuts a program into the prefix, core and suffix of a kernel-infilling task, on
//!   its parse tree.

pub mod catalogue;
pub mod dedup;
pub mod difficulty;
pub mod diversify;
pub mod export;
pub mod ingest;
pub mod report;
pub mod run;
pub mod split;
pub mod verify;

pub use difficulty::{Measure, Measured};
pub use diversify::{
    diversify, Attempt, DiversifyOptions, DiversifySummary, KernelPrompt, KernelWriter, Progress,
    DEFAULT_ATTEMPTS,
};
pub use export::{
    export, rl_tasks, Difficulty, DifficultySummary, ExportOptions, Exported, SftFormat,
};
pub use ingest::{ingest, normalize, Cluster, DroppedRecord, IngestSummary, Pair};
pub use report::write_report;
pub use run::RunDir;
pub use split::{split_file, split_program, write_splits, Agreement, Split, SplitError, SplitRun};
pub use verify::{verify, VerifiedPair, VerifySummary, DEFAULT_MIN_SPEEDUP};
