//! `dice serve` of the tiny checkpoint (`dice_test_support::checkpoint`), for the tests that
//! ask an endpoint.

use dice_test_support::checkpoint::formula_tiny;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

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
            .arg(formula_tiny())
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
