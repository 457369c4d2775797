//! `dice curate` end to end on the C++ CPU fixture of dice-curate: ingest, verify killed with
//! SIGKILL and resumed (nothing judged before changes), export packed by `dice train sft
//! --dry-run`, the report; `diversify` asking `dice serve` of the tiny checkpoint for kernels;
//! `export`'s levels from an evaluation run's samples and from `dice serve`, loaded by `dice
//! train rl --dry-run`; and `split` on DICE's released pairs.

use crate::common::{dice, path_arg, stderr};
use crate::tiny_server::TinyServer;
use dice_store::{SampleRecord, Store, Verdict};
use dice_test_support::{shared_build_cache, test_data};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../dice-curate/tests/fixtures/verify_pairs.json")
}

fn stored(run: &Path) -> Vec<SampleRecord> {
    let db = run.join("dice.db");
    if !db.exists() {
        return Vec::new();
    }
    Store::open_read_only(&db)
        .and_then(|s| s.samples())
        .unwrap_or_default()
}

fn verify_command(run: &Path) -> Command {
    // dice-curate's verify test shares the suite's build cache: the fixture's one C++ source
    // builds once.
    let cache = shared_build_cache();
    let mut command = Command::new(env!("CARGO_BIN_EXE_dice"));
    command.args([
        "curate",
        "verify",
        "--run",
        path_arg(run),
        "--build-cache",
        path_arg(&cache),
    ]);
    command.args([
        "--correctness-trials",
        "3",
        "--perf-trials",
        "48",
        "--timeout",
        "60",
    ]);
    command
}

/// `dice curate ingest --run RUN INPUT`, which must succeed.
fn ingest(run: &Path, input: &Path) {
    let out = dice(&["curate", "ingest", "--run", path_arg(run), path_arg(input)]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn curate_run_survives_kill_9_and_exports_trainable_data() {
    let _judging = crate::common::away_from_hostile_programs();
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    ingest(&run, &fixture());

    let mut verifying = verify_command(&run)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while stored(&run).is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "verify stored nothing"
        );
        assert!(
            verifying.try_wait().unwrap().is_none(),
            "verify ended before it was killed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    verifying.kill().unwrap(); // SIGKILL
    verifying.wait().unwrap();
    let before = stored(&run);
    assert!(before.len() < 4, "the kill came too late to test anything");

    let out = verify_command(&run).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("kept 1 of 4 pairs"), "{text}");
    let after = stored(&run);
    assert_eq!(after.len(), 4);
    for old in &before {
        assert!(
            after.contains(old),
            "a verdict stored before the kill changed: {old:?}"
        );
    }

    let data = tmp.path().join("data");
    let out = dice(&[
        "curate",
        "export",
        "--run",
        path_arg(&run),
        "--out",
        path_arg(&data),
        "--format",
        "sharegpt",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let tokenizer = test_data().join("sdar");
    let out = dice(&[
        "train",
        "sft",
        "--model",
        path_arg(&tokenizer),
        "--dataset-info",
        path_arg(&data),
        "--dataset",
        "cuke",
        "--dry-run",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let packed = String::from_utf8_lossy(&out.stdout);
    assert!(packed.contains("records      1 (cuke: 1)"), "{packed}");
    assert!(
        packed.contains("samples      1 packed, 0 dropped"),
        "{packed}"
    );

    let out = dice(&["curate", "report", "--run", path_arg(&run)]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(run.join("report.html").exists());
}

#[test]
fn split_reproduces_the_released_split() {
    let tmp = tempfile::tempdir().unwrap();
    let splits = tmp.path().join("splits.jsonl");
    let pairs = test_data().join("dice/kernel_infilling_evaluation.json");
    let out = dice(&[
        "curate",
        "split",
        "--pairs",
        path_arg(&pairs),
        "--out",
        path_arg(&splits),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("split agreement with the file's own: 99/99 exact (100.0 %)"),
        "{text}"
    );
    assert_eq!(
        std::fs::read_to_string(&splits).unwrap().lines().count(),
        99
    );
}

#[test]
fn diversify_asks_dice_serve_and_records_each_attempt() {
    // Three problems, one attempt each: the server answers three requests, then exits.
    let mut server = TinyServer::start(3);
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let cache = shared_build_cache();
    let diversify = |endpoint: &str| {
        dice(&[
            "curate",
            "diversify",
            "--run",
            path_arg(&run),
            "--endpoint",
            endpoint,
            "--model-name",
            "tiny",
            "--scale",
            "tiny",
            "--components",
            "rms_norm,softmax,mlp_swiglu",
            "--variants",
            "1",
            "--attempts",
            "1",
            "--max-new-tokens",
            "16",
            "--correctness-trials",
            "2",
            "--perf-trials",
            "8",
            "--build-cache",
            path_arg(&cache),
        ])
    };
    let out = diversify(&server.endpoint);
    assert!(out.status.success(), "{}", stderr(&out));
    let summary = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        summary.contains("3 problems, 3 attempts judged, 0 kept"),
        "{summary}"
    );
    assert!(server.wait_for_exit().success());

    // The random model writes no program: each attempt is recorded with its verdict and why it
    // was dropped.
    let attempts = std::fs::read_to_string(run.join("diversify-attempts.jsonl")).unwrap();
    let attempts: Vec<serde_json::Value> = attempts
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut problems: Vec<&str> = attempts
        .iter()
        .map(|a| a["problem"].as_str().unwrap())
        .collect();
    problems.sort_unstable();
    assert_eq!(problems.len(), 3);
    for (problem, component) in problems.iter().zip(["mlp_swiglu", "rms_norm", "softmax"]) {
        assert!(problem.starts_with(component), "{problems:?}");
    }
    for a in &attempts {
        assert_eq!(a["kept"], false, "{a}");
        assert!(a["verdict"].is_string(), "{a}");
        assert!(
            a["reason"].as_str().unwrap().starts_with("verdict: "),
            "{a}"
        );
    }
    let answers = std::fs::read_to_string(run.join("diversify-answers.jsonl")).unwrap();
    assert_eq!(answers.lines().count(), 3);

    // Done already: the rerun asks the stopped server nothing and writes the same files.
    let first = std::fs::read(run.join("diversify-attempts.jsonl")).unwrap();
    let out = diversify(&server.endpoint);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), summary);
    assert_eq!(
        std::fs::read(run.join("diversify-attempts.jsonl")).unwrap(),
        first
    );

    let out = dice(&["curate", "report", "--run", path_arg(&run)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report = std::fs::read_to_string(run.join("report.md")).unwrap();
    for line in ["| problems drawn | 3 |", "| attempts judged | 3 |"] {
        assert!(
            report.lines().any(|l| l == line),
            "no {line:?} in:\n{report}"
        );
    }
}

#[test]
fn diversify_refuses_settings_that_cannot_apply_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let refused = |extra: &[&str], why: &str| {
        let mut args = vec![
            "curate",
            "diversify",
            "--run",
            path_arg(&run),
            "--endpoint",
            "http://127.0.0.1:9/v1",
            "--model-name",
            "tiny",
        ];
        args.extend_from_slice(extra);
        let out = dice(&args);
        assert!(!out.status.success());
        let err = stderr(&out);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(why), "{err}");
    };
    refused(&["--precision", "bf16"], "--precision does not apply");
    refused(&["--attempts", "3", "--top-k", "1"], "greedy decoding");
    assert!(!run.exists());
}

#[test]
fn export_levels_come_from_a_run_or_dice_serve_and_load_for_rl() {
    // The fixture's references as problem-only records: export needs no verify.
    let tmp = tempfile::tempdir().unwrap();
    let records: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(fixture()).unwrap()).unwrap();
    let problems: Vec<serde_json::Value> = records
        .iter()
        .map(|r| serde_json::json!({"pytorch_code": r["pytorch_code"], "cuda_code": ""}))
        .collect();
    let input = tmp.path().join("problems.json");
    std::fs::write(&input, serde_json::to_string(&problems).unwrap()).unwrap();
    let run = tmp.path().join("run");
    ingest(&run, &input);
    let pairs: Vec<serde_json::Value> = std::fs::read_to_string(run.join("pairs.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let data = tmp.path().join("data");
    let export = |args: &[&str]| {
        let base = [
            "curate",
            "export",
            "--run",
            path_arg(&run),
            "--out",
            path_arg(&data),
        ];
        dice(&[&base[..], args].concat())
    };

    // One problem of an evaluation run has the first task's source: 1 of 2 samples correct.
    let eval_run = tmp.path().join("eval");
    std::fs::create_dir_all(&eval_run).unwrap();
    let mut store = Store::open(&eval_run.join("dice.db")).unwrap();
    let source = pairs[0]["pytorch_code"].as_str().unwrap();
    let problem = dice_store::ProblemRecord {
        level: 1,
        problem_id: 4,
        name: "first".into(),
        reference_error: None,
    };
    let sha256 = dice_eval::sha256_hex(source.as_bytes());
    store.add_problems(&[(problem, sha256)]).unwrap();
    for (sample_id, verdict) in [(0, Verdict::Correct), (1, Verdict::OutputMismatch)] {
        let sample = SampleRecord::new(1, 4, sample_id, verdict);
        store.put_sample(&sample, &Default::default()).unwrap();
    }
    drop(store);
    let out = export(&["--difficulty", "run", "--eval-run", path_arg(&eval_run)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    let rest = pairs.len() - 1;
    let expected = format!(
        "difficulty by run: {} tasks (1: 0, 2: 1, 3: {rest}); {rest} unmeasured",
        pairs.len()
    );
    assert!(text.contains(&expected), "{text}");

    // dice serve of the tiny checkpoint rates every task once; its answers are cached.
    let mut server = TinyServer::start(pairs.len());
    let endpoint = |url: &str| {
        export(&[
            "--difficulty",
            "endpoint",
            "--endpoint",
            url,
            "--model-name",
            "tiny",
        ])
    };
    let out = endpoint(&server.endpoint);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(server.wait_for_exit().success());
    let summary = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(summary.contains("difficulty by endpoint"), "{summary}");
    let answers = std::fs::read_to_string(run.join("difficulty-answers.jsonl")).unwrap();
    assert_eq!(answers.lines().count(), pairs.len());
    let levels: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("difficulty.json")).unwrap())
            .unwrap();
    for task in levels["tasks"].as_array().unwrap() {
        // The random model's answer parses to a level or falls back, and is kept either way.
        assert!(task["answer"].is_string(), "{task}");
        let status = task["status"].as_str().unwrap();
        assert!(
            status == "measured" || (status == "fallback" && task["level"] == 3),
            "{task}"
        );
    }
    let out = endpoint(&server.endpoint);
    assert!(
        out.status.success(),
        "the rerun asked the stopped server: {}",
        stderr(&out)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), summary);

    let tokenizer = test_data().join("sdar");
    let rl_tasks = data.join("rl_end_to_end.json");
    let out = dice(&[
        "train",
        "rl",
        "--model",
        path_arg(&tokenizer),
        "--dry-run",
        "--tasks",
        path_arg(&rl_tasks),
        "--stage",
        "e2e",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let loaded = String::from_utf8_lossy(&out.stdout);
    assert!(
        loaded.contains(&format!("tasks: {} from", pairs.len())),
        "{loaded}"
    );

    let out = dice(&["curate", "report", "--run", path_arg(&run)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report = std::fs::read_to_string(run.join("report.md")).unwrap();
    assert!(report.contains("## Difficulty"), "{report}");
}
