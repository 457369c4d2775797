//! Training data from PyTorch→CUDA pairs, as DICE's CuKe set was made and stricter.
//!
//! * [`split`] cuts a program into the prefix, core and suffix of a kernel-infilling task, on
//!   its parse tree.

pub mod split;

pub use split::{split_file, split_program, write_splits, Agreement, Split, SplitError, SplitRun};
