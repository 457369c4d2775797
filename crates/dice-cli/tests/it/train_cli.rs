//! `dice train sft`: the packing statistics of LlamaFactory-style data without a model
//! (`--dry-run`, the tokenizer of tests/data/sdar), the manual, and CPU training of the formula
//! golden's tiny model: killed and resumed, its final model generates.

use dice_test_support::checkpoint::formula_tiny;
use dice_test_support::test_data;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn train_data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../dice-train/tests/data")
        .join(name)
}

fn dice_train_sft(args: &[&str]) -> Output {
    let tokenizer = test_data().join("sdar");
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
fn help_is_a_manual() {
    let out = Command::new(env!("CARGO_BIN_EXE_dice"))
        .args(["train", "sft", "--help"])
        .output()
        .unwrap();
    let text = stdout(&out);
    for needle in [
        "--resume <DIR>",
        "--save-steps <N>",
        "--save-total-limit <K>",
        "--val-ratio <R>",
        "--zero-stage <0|1|2>",
        "[default: the DICE recipes': 1e-5 for sft, 1e-6 for rl]",
        "OUT/config.toml",
        "metrics.jsonl",
        "checkpoint-STEP/",
        "Examples:",
        "dice train sft --model SDAR-4B-Chat/",
    ] {
        assert!(text.contains(needle), "no {needle:?} in:\n{text}");
    }
    // Disk use and checkpoint timing, as the help's wrapped lines read joined.
    let joined = text.split_whitespace().collect::<Vec<_>>().join(" ");
    for needle in [
        "Only the newest checkpoint is resumable",
        "SDAR-1.7B (P = 2.03e9): sft 28.4 GB, rl 12.2 GB",
        "seconds_checkpoint_write",
    ] {
        assert!(joined.contains(needle), "no {needle:?} in:\n{text}");
    }
}

/// A CPU run of the tiny model on the 16 samples in rows of 128 tokens.
fn tiny_run(model: &Path, out: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_dice"));
    command
        .args(["train", "sft", "--model"])
        .arg(model)
        .arg("--data")
        .arg(train_data("overfit.jsonl"))
        .arg("--out")
        .arg(out)
        .args([
            "--row-tokens",
            "128",
            "--lr",
            "1e-3",
            "--device",
            "cpu",
            "--dtype",
            "f32",
            "--seed",
            "7",
        ]);
    command
}

/// [`tiny_run`] for 6 steps of all 4 rows, a checkpoint every 2.
fn train(model: &Path, out: &Path) -> Command {
    let mut command = tiny_run(model, out);
    command.args([
        "--max-steps",
        "6",
        "--save-steps",
        "2",
        "--save-total-limit",
        "2",
        "--batch-size",
        "4",
    ]);
    command
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The steps' losses of `metrics.jsonl` (its checkpoint lines aside).
fn losses(out: &Path) -> Vec<(u64, f64)> {
    String::from_utf8(read(&out.join("metrics.jsonl")))
        .unwrap()
        .lines()
        .filter_map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            Some((v["step"].as_u64().unwrap(), v["loss"].as_f64()?))
        })
        .collect()
}

/// Killed with SIGKILL after its first checkpoint and run again, a run resumes from the newest
/// complete checkpoint and ends with the bytes of an uninterrupted run: the bf16 weights of
/// final/ and the f32 masters and moments of the last checkpoint. The final model loads in
/// `dice generate`.
#[test]
fn a_run_killed_and_resumed_ends_with_the_weights_of_an_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let model = formula_tiny();
    let straight = dir.path().join("straight");
    let out = train(model, &straight).output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the uninterrupted run failed: {log}");
    // Its stderr is no terminal: plain progress lines instead of a bar, the first step's and
    // the last's among them.
    assert!(
        log.contains("step 1/6 · ") && log.contains("step 6/6 · "),
        "{log}"
    );

    let resumed = dir.path().join("resumed");
    let mut child = train(model, &resumed)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(300);
    while !resumed.join("checkpoint-2").exists() {
        assert!(Instant::now() < deadline, "no checkpoint-2 after 300 s");
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "the run ended before the kill"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!resumed.join("final").exists());
    assert!(!resumed.join("checkpoint-6").exists());

    let out = train(model, &resumed).output().unwrap();
    assert!(
        out.status.success(),
        "the resumed run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for file in [
        "final/model-00001-of-00001.safetensors",
        "checkpoint-6/optimizer.safetensors",
    ] {
        assert!(
            read(&straight.join(file)) == read(&resumed.join(file)),
            "{file} differs"
        );
    }
    assert_eq!(losses(&resumed), losses(&straight));
    assert_eq!(
        losses(&resumed).iter().map(|l| l.0).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 6]
    );
    let mut kept: Vec<String> = std::fs::read_dir(&resumed)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    kept.sort();
    assert_eq!(
        kept,
        [
            "checkpoint-4",
            "checkpoint-6",
            "config.toml",
            "final",
            "metrics.html",
            "metrics.jsonl"
        ]
    );

    let prompt = dir.path().join("prompt.txt");
    std::fs::write(&prompt, "Which op adds?").unwrap();
    let generated = Command::new(env!("CARGO_BIN_EXE_dice"))
        .arg("generate")
        .arg("--model")
        .arg(resumed.join("final"))
        .arg("--prompt-file")
        .arg(&prompt)
        .args(["--max-new-tokens", "8", "--format", "json"])
        .output()
        .unwrap();
    let json: serde_json::Value = serde_json::from_str(&stdout(&generated)).unwrap();
    assert!(json["samples"][0]["text"].is_string(), "{json}");
}

#[test]
fn a_run_without_data_says_what_to_pass() {
    let out = dice_train_sft(&["--out", "unused"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no training data: pass --data FILE or --dataset-info F --dataset NAME"),
        "{stderr}"
    );
}

/// 2 steps of 4 rows, one checkpoint, a micro-batch of 2 rows per rank: `extra` says how the
/// 4 rows are made up (ranks or accumulation).
fn two_steps(model: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut command = tiny_run(model, out);
    command
        .args(["--max-steps", "2", "--save-steps", "2", "--batch-size", "2"])
        .args(extra)
        .env_remove("MASTER_PORT");
    command
}

fn succeeded(what: &str, out: Output) {
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two ranks started by hand with torchrun's variables train on one machine and write one
/// checkpoint and the final model through rank 0; `--nproc-per-node 2` starts the same two
/// ranks itself (with the optimizer state sharded, `--zero-stage 2`), and one rank accumulating
/// both micro-batches ends with the same bytes, its optimizer state offloaded or not.
#[test]
fn two_ranks_launched_with_torchrun_variables_train_as_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let model = formula_tiny();
    let torchrun = dir.path().join("torchrun");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            two_steps(model, &torchrun, &[])
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (rank, child) in ranks.into_iter().enumerate() {
        succeeded(&format!("rank {rank}"), child.wait_with_output().unwrap());
    }
    let mut folders: Vec<String> = std::fs::read_dir(&torchrun)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("checkpoint-") || name == "final")
        .collect();
    folders.sort();
    assert_eq!(folders, ["checkpoint-2", "final"]);
    assert_eq!(losses(&torchrun).len(), 2);

    let launched = dir.path().join("launched");
    succeeded(
        "--nproc-per-node 2",
        two_steps(
            model,
            &launched,
            &["--nproc-per-node", "2", "--zero-stage", "2"],
        )
        .output()
        .unwrap(),
    );
    let alone = dir.path().join("alone");
    succeeded(
        "one rank",
        two_steps(model, &alone, &["--gradient-accumulation-steps", "2"])
            .output()
            .unwrap(),
    );
    // The optimizer's state in host memory (here the weights' own) takes the same steps.
    let offloaded = dir.path().join("offloaded");
    succeeded(
        "--optimizer-offload",
        two_steps(
            model,
            &offloaded,
            &["--gradient-accumulation-steps", "2", "--optimizer-offload"],
        )
        .output()
        .unwrap(),
    );
    // Offloaded or sharded, not both: one line says so.
    let both = two_steps(
        model,
        &dir.path().join("both"),
        &["--zero-stage", "2", "--optimizer-offload"],
    )
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&both.stderr);
    assert!(
        !both.status.success() && err.contains("not both") && err.lines().count() == 1,
        "{err}"
    );
    assert_eq!(losses(&torchrun), losses(&alone));
    for run in [&launched, &alone, &offloaded] {
        for file in [
            "final/model.safetensors.index.json",
            "checkpoint-2/optimizer.safetensors",
        ] {
            assert_eq!(read(&torchrun.join(file)), read(&run.join(file)), "{file}");
        }
    }
}
