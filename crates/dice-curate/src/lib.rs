//! Training data from PyTorch→CUDA pairs, as DICE's CuKe set was made and stricter. Every
//! stage reads and writes one run folder ([`RunDir`]).
//!
//! * [`ingest`] reads pairs from DICE-style JSON, LlamaFactory SFT files and folders of kernel
//!   files, normalises them, gives them content ids and drops exact and near duplicates
//!   ([`dedup`] says how).
//! * [`split`] cuts a program into the prefix, core and suffix of a kernel-infilling task, on
//!   its parse tree.

pub mod dedup;
pub mod ingest;
pub mod run;
pub mod split;

pub use ingest::{ingest, normalize, Cluster, DroppedRecord, IngestSummary, Pair};
pub use run::RunDir;
pub use split::{split_file, split_program, write_splits, Agreement, Split, SplitError, SplitRun};
