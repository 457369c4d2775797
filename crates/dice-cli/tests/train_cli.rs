//! `dice train sft --dry-run`: the packing statistics of LlamaFactory-style data, without a
//! model (the tokenizer of tests/data/sdar).

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

fn train_data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../dice-train/tests/data")
        .join(name)
}

fn dice_train_sft(args: &[&str]) -> Output {
    let tokenizer = common::test_data().join("sdar");
    Command::new(env!("CARGO_BIN_EXE_dice"))
        .args(["train", "sft", "--model"])
        .arg(&tokenizer)
        .args(args)
        .output()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "dice failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn dry_run_prints_the_packing_statistics() {
    let data = train_data("packing.jsonl");
    let out = dice_train_sft(&[
        "--data",
        data.to_str().unwrap(),
        "--row-tokens",
        "41",
        "--dry-run",
    ]);
    let text = stdout(&out);
    // The hand-checked packing of crates/dice-train/tests/packing.rs: samples of 20, 16 and
    // 16 tokens into rows of 41, a 48-token sample dropped.
    for line in [
        &format!("records      4 ({}: 4)", data.display()),
        "samples      3 packed, 1 dropped",
        &format!(
            "  dropped    1 longer than 40 tokens (first: {} line 4)",
            data.display()
        ),
        "rows         2 of 41 tokens",
        "tokens       52 in samples (2 block pads), 30 row padding",
        "loss tokens  25",
        "longest      20 tokens",
        "fill ratio   63.41 %",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "no line {line:?} in:\n{text}"
        );
    }
}

#[test]
fn dry_run_reads_named_datasets_of_a_dataset_info() {
    let info = train_data("dataset_info.json");
    let out = dice_train_sft(&[
        "--dataset-info",
        info.to_str().unwrap(),
        "--dataset",
        "alpaca_demo",
        "sharegpt_demo",
        "--dry-run",
    ]);
    let text = stdout(&out);
    assert!(
        text.contains("records      5 (alpaca_demo: 2, sharegpt_demo: 3)"),
        "{text}"
    );
    assert!(text.contains("samples      3 packed, 2 dropped"), "{text}");
    assert!(text.contains("rows         1 of 6144 tokens"), "{text}");
}

#[test]
fn bad_data_fails_with_the_file_and_line() {
    let bad = train_data("bad.jsonl");
    let out = dice_train_sft(&["--data", bad.to_str().unwrap(), "--dry-run"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{} line 3", bad.display()))
            && stderr.contains("\"prompt\" must be a string"),
        "{stderr}"
    );
}

#[test]
fn training_without_dry_run_is_refused_in_this_build() {
    let data = train_data("packing.jsonl");
    let out = dice_train_sft(&["--data", data.to_str().unwrap(), "--out", "unused"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("only --dry-run is available in this build"),
        "{stderr}"
    );
}
