//! Where the workspace's test data lives, and running the `dice` binary as a user does.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The workspace's `tests/data` (KernelBench problems, DICE data files, tokenizer, goldens).
pub(crate) fn test_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data")
}

// The helpers below are used by some of the test binaries that declare `mod common`, not all.

#[allow(dead_code)]
pub(crate) fn dice(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dice"))
        .args(args)
        .output()
        .expect("the dice binary runs")
}

#[allow(dead_code)]
pub(crate) fn path_arg(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[allow(dead_code)]
pub(crate) fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
