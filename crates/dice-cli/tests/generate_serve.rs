//! `dice generate --endpoint` against `dice serve` on loopback gives the same text as local
//! generation, both on the formula golden's tiny checkpoint.

mod common;
mod tiny_model;

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tiny_model::tiny_model;

fn dice() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dice"))
}

fn generate(extra: &[&str], prompt_file: &std::path::Path) -> Value {
    let output = dice()
        .arg("generate")
        .arg("--prompt-file")
        .arg(prompt_file)
        .args(["--max-new-tokens", "14", "--format", "json"])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "dice generate failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// Kills the server if the test fails before it exits on its own.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

#[test]
fn endpoint_generation_against_dice_serve_equals_local_generation() {
    let dir = tempfile::tempdir().unwrap();
    let prompt = dir.path().join("prompt.txt");
    std::fs::write(&prompt, "Write a CUDA kernel that adds two vectors.").unwrap();
    let model = tiny_model().to_str().unwrap();

    let local = generate(&["--model", model], &prompt);
    let local_text = local["samples"][0]["text"].as_str().unwrap().to_string();
    assert!(!local_text.is_empty());

    let mut child = dice()
        .args([
            "serve",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ])
        .args(["--max-requests", "2", "--model-name", "tiny"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut server = Server(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let endpoint = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line of dice serve: {line:?}"))
        .to_string();
    assert!(endpoint.starts_with("http://127.0.0.1:"), "{endpoint}");

    let remote = generate(
        &[
            "--endpoint",
            &endpoint,
            "--model-name",
            "tiny",
            "--samples",
            "2",
            "--concurrency",
            "2",
        ],
        &prompt,
    );
    let samples = remote["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 2);
    for sample in samples {
        assert_eq!(sample["text"].as_str().unwrap(), local_text);
        assert_eq!(sample["token_ids"], local["samples"][0]["token_ids"]);
        assert_eq!(sample["trace"], local["samples"][0]["trace"]);
    }

    // Two requests answered: the server exits by itself.
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = server.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "dice serve did not stop after its request limit"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success());
}
