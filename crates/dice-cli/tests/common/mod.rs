//! Where the workspace's test data lives.

use std::path::PathBuf;

/// The workspace's `tests/data` (KernelBench problems, DICE data files, tokenizer, goldens).
pub(crate) fn test_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data")
}
