//! The formula golden's tiny checkpoint, written by `dice model init` once per test binary into
//! the build's temporary folder (the same bytes from every binary, each file renamed into place).
//! Test binaries that use it declare `mod common` too.
#![allow(dead_code)] // each test binary uses a different subset

use super::common::test_data;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

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

/// `dice serve` of the tiny checkpoint on a free loopback port, serving `max_requests` requests
/// under the model name `tiny`; killed on drop if it has not exited by then.
pub(crate) struct TinyServer {
    child: Child,
    /// The API base, `http://127.0.0.1:PORT/v1`.
    pub(crate) endpoint: String,
}

impl TinyServer {
    pub(crate) fn start(max_requests: usize) -> TinyServer {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dice"))
            .args(["serve", "--model"])
            .arg(tiny_model())
            .args(["--host", "127.0.0.1", "--port", "0", "--model-name", "tiny"])
            .args(["--max-requests", &max_requests.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        // Owned by the guard first, so that a bad first line does not leave the server running.
        let mut server = TinyServer {
            child,
            endpoint: String::new(),
        };
        server.endpoint = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line of dice serve: {line:?}"))
            .to_string();
        server
    }

    /// Waits for the server to exit by itself (after its last request), at most 30 s.
    pub(crate) fn wait_for_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "dice serve did not stop after its request limit"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for TinyServer {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
