//! `dice generate --endpoint` against `dice serve` on loopback gives the same text as local
//! generation, both on the formula golden's tiny checkpoint.

use crate::tiny_server::TinyServer;
use dice_test_support::checkpoint::formula_tiny;
use serde_json::Value;
use std::process::Command;

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

#[test]
fn endpoint_generation_against_dice_serve_equals_local_generation() {
    let dir = tempfile::tempdir().unwrap();
    let prompt = dir.path().join("prompt.txt");
    std::fs::write(&prompt, "Write a CUDA kernel that adds two vectors.").unwrap();
    let model = formula_tiny().to_str().unwrap();

    let local = generate(&["--model", model], &prompt);
    let local_text = local["samples"][0]["text"].as_str().unwrap().to_string();
    assert!(!local_text.is_empty());

    let mut server = TinyServer::start(2);
    let endpoint = server.endpoint.clone();
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
    assert!(server.wait_for_exit().success());
}
