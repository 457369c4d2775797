//! The formula golden's tiny checkpoint, written by `dice model init` once per test binary into
//! the build's temporary folder (the same bytes from every binary, each file renamed into place).
//! Test binaries that use it declare `mod common` too.
#![allow(dead_code)] // each test binary uses a different subset

use super::common::test_data;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

pub(crate) fn golden_dir() -> PathBuf {
    test_data().join("sdar/golden/formula")
}

pub(crate) fn tiny_model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("formula-golden-tiny-cli");
        let out = Command::new(env!("CARGO_BIN_EXE_dice"))
            .args(["model", "init", "--weights", "formula", "--force"])
            .arg("--config")
            .arg(golden_dir().join("config.json"))
            .arg("--tokenizer")
            .arg(test_data().join("sdar"))
            .arg("--out")
            .arg(&dir)
            .output()
            .expect("the dice binary runs");
        assert!(
            out.status.success(),
            "dice model init failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    })
}
