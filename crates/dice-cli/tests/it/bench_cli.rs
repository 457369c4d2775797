//! `dice problems`, `dice prompt` and `dice report` as a user runs them.

use crate::common::{dice, path_arg, stderr};
use dice_eval::store::{SampleExtras, Store};
use dice_eval::{ProblemRecord, RunInfo, SampleRecord, TimingStats, Verdict};
use dice_test_support::test_data;
use serde_json::Value;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

#[test]
fn problems_list_json_counts_every_level() {
    let kb = test_data().join("kernelbench");
    let out = dice(&[
        "problems",
        "list",
        "--kernelbench",
        path_arg(&kb),
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stderr(&out), "");
    let rows: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    for (level, count) in [(1, 100), (2, 100), (3, 50), (4, 20)] {
        let ids: Vec<u64> = rows
            .iter()
            .filter(|r| r["level"] == level)
            .map(|r| r["problem_id"].as_u64().unwrap())
            .collect();
        assert_eq!(ids, (1..=count).collect::<Vec<u64>>(), "level {level}");
    }
    let first = &rows[0];
    assert_eq!(first["name"], "1_Square_matrix_multiplication_");
    assert!(first["path"]
        .as_str()
        .unwrap()
        .ends_with("level1/1_Square_matrix_multiplication_.py"));

    let out = dice(&[
        "problems",
        "list",
        "--kernelbench",
        path_arg(&kb),
        "--level",
        "3",
        "--format",
        "json",
    ]);
    let rows: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows.len(), 50);
}

#[test]
fn problems_list_reports_invalid_files_on_stderr_only() {
    let dir = tempfile::tempdir().unwrap();
    let level = dir.path().join("level1");
    fs::create_dir(&level).unwrap();
    fs::write(
        level.join("1_Good.py"),
        "class Model:\n    pass\ndef get_inputs():\n    return []\ndef get_init_inputs():\n    return []\n",
    )
    .unwrap();
    fs::write(
        level.join("2_NoInputs.py"),
        "class Model:\n    pass\ndef get_init_inputs():\n    return []\n",
    )
    .unwrap();
    fs::write(level.join("3_Bytes.py"), b"class Model:\n    x = '\xff'\n").unwrap();
    let out = dice(&[
        "problems",
        "list",
        "--kernelbench",
        path_arg(dir.path()),
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["problem_id"], 1);
    let err = stderr(&out);
    let line = |name: &str| {
        err.lines()
            .find(|l| l.contains(name))
            .unwrap_or_else(|| panic!("{err}"))
            .to_string()
    };
    assert!(line("2_NoInputs.py").contains("get_inputs"));
    assert!(line("3_Bytes.py").contains("UTF-8"));
}

#[test]
fn missing_folder_is_one_clear_line() {
    let out = dice(&["problems", "list", "--kernelbench", "/no/such/dir"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("error: ") && err.contains("/no/such/dir"),
        "{err}"
    );
}

#[test]
fn prompts_match_the_golden_files_byte_for_byte() {
    let golden = test_data().join("sdar/golden");
    let index: Vec<Value> =
        serde_json::from_str(&fs::read_to_string(golden.join("prompts/index.json")).unwrap())
            .unwrap();
    let kb = test_data().join("kernelbench");
    let tasks = test_data().join("dice/kernel_infilling_evaluation.json");
    let model = test_data().join("sdar");
    for entry in &index {
        if let Some(problem) = entry["problem"].as_str() {
            let (level, file) = problem.split_once('/').unwrap();
            let level = level.trim_start_matches("level");
            let id = file.split('_').next().unwrap();
            let base = [
                "prompt",
                "--kernelbench",
                path_arg(&kb),
                "--level",
                level,
                "--problem",
                id,
            ];
            let out = dice(&base);
            assert!(out.status.success(), "{}", stderr(&out));
            let user = fs::read(golden.join(entry["user_message"].as_str().unwrap())).unwrap();
            assert!(out.stdout == user, "{problem}: user message differs");
            let mut chat_args = base.to_vec();
            chat_args.extend(["--chat", "--model", path_arg(&model)]);
            let out = dice(&chat_args);
            assert!(out.status.success(), "{}", stderr(&out));
            let chat = fs::read(golden.join(entry["chat_text"].as_str().unwrap())).unwrap();
            assert!(out.stdout == chat, "{problem}: chat text differs");
        } else {
            let index = entry["source"]
                .as_str()
                .unwrap()
                .split("index ")
                .nth(1)
                .unwrap();
            let index = index.split(' ').next().unwrap();
            let out = dice(&[
                "prompt",
                "--infill",
                "--tasks",
                path_arg(&tasks),
                "--index",
                index,
            ]);
            assert!(out.status.success(), "{}", stderr(&out));
            let text = fs::read(golden.join(entry["text"].as_str().unwrap())).unwrap();
            assert!(out.stdout == text, "infilling task {index} differs");
        }
    }
    let out = dice(&[
        "prompt",
        "--infill",
        "--tasks",
        path_arg(&tasks),
        "--index",
        "99",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("--index must be 0–98"),
        "{}",
        stderr(&out)
    );
}

fn timing(mean_ms: f64) -> TimingStats {
    TimingStats {
        mean_ms,
        median_ms: mean_ms,
        std_ms: 0.0,
        min_ms: mean_ms,
        max_ms: mean_ms,
        trials: 10,
    }
}

fn sample(
    problem_id: u32,
    verdict: Verdict,
    candidate_ms: Option<f64>,
    deceptive: bool,
) -> SampleRecord {
    let correct = verdict == Verdict::Correct;
    SampleRecord {
        code_hash: Some("00".into()),
        message: (!correct).then(|| "failed".into()),
        trials_passed: if correct { 5 } else { 0 },
        candidate_timing: candidate_ms.map(timing),
        baseline_timing: candidate_ms.map(|_| timing(4.0)),
        speedup: candidate_ms.map(|ms| 4.0 / ms),
        flags: if deceptive {
            vec!["no_candidate_kernel_launched".into()]
        } else {
            Vec::new()
        },
        deceptive,
        wall_s: 1.0,
        ..SampleRecord::new(1, problem_id, 0, verdict)
    }
}

/// A run folder with 3 problems: a 2× kernel, a deceptive 4× kernel, a compile error.
fn make_run(dir: &Path) {
    let info = RunInfo {
        device: "cuda".into(),
        hardware: "NVIDIA H200".into(),
        torch_version: "2.11.0".into(),
        python_version: "3.12".into(),
        dice_version: "0.1.0".into(),
        correctness_trials: 5,
        perf_trials: 10,
        atol: 1e-2,
        rtol: 1e-2,
        baseline: "eager".into(),
        timing: "dice".into(),
        strict: false,
        source: "kernelbench".into(),
    };
    let mut store = Store::open(&dir.join("dice.db")).unwrap();
    store
        .begin_run(&info, &serde_json::json!({}), false)
        .unwrap();
    let problems: Vec<(ProblemRecord, String)> = (1..=3)
        .map(|id| {
            let p = ProblemRecord {
                level: 1,
                problem_id: id,
                name: format!("{id}_P"),
                reference_error: None,
            };
            (p, format!("{id:064}"))
        })
        .collect();
    store.add_problems(&problems).unwrap();
    for s in [
        sample(1, Verdict::Correct, Some(2.0), false),
        sample(2, Verdict::Correct, Some(1.0), true),
        sample(3, Verdict::CompileError, None, false),
    ] {
        store.put_sample(&s, &SampleExtras::default()).unwrap();
    }
}

#[test]
fn report_formats_from_a_run_store() {
    let dir = tempfile::tempdir().unwrap();
    make_run(dir.path());
    let run = path_arg(dir.path());

    let out = dice(&["report", run, "--format", "json", "--fast-p", "0,1,2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let l1 = &v["levels"]["1"];
    assert_eq!(l1["problems"], 3);
    assert!((l1["correct"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-12);
    assert!((l1["fast_p"]["2"].as_f64().unwrap() - 1.0 / 3.0).abs() < 1e-12);
    assert!((l1["robust"]["correct"].as_f64().unwrap() - 1.0 / 3.0).abs() < 1e-12);
    assert_eq!(v["samples"].as_array().unwrap().len(), 3);
    assert!(v["samples"][2]["speedup"].is_null());

    let out = dice(&["report", run, "--format", "json", "--strict"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!((v["levels"]["1"]["correct"].as_f64().unwrap() - 1.0 / 3.0).abs() < 1e-12);

    let out = dice(&["report", run]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("## Level 1: 3 problems, 3 samples"));

    let out = dice(&["report", run, "--format", "csv"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 4);

    let html = dir.path().join("r.html");
    let out = dice(&[
        "report",
        run,
        "--format",
        "html",
        "--output",
        path_arg(&html),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(out.stdout.is_empty());
    assert!(fs::read_to_string(&html).unwrap().contains("<svg"));
}

#[test]
fn report_refuses_what_it_cannot_read() {
    let dir = tempfile::tempdir().unwrap();
    let run = path_arg(dir.path());
    let db = dir.path().join("dice.db");
    let out = dice(&["report", run]);
    assert!(!out.status.success());
    let expected = format!(
        "error: {run} has no dice results (no {}): run `dice eval` first\n",
        db.display()
    );
    assert_eq!(stderr(&out), expected);
    assert!(!db.exists());
    fs::write(&db, b"").unwrap();
    let out = dice(&["report", run]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("is empty): run `dice eval` first"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        fs::metadata(&db).unwrap().len(),
        0,
        "the report wrote a schema"
    );
    fs::remove_file(&db).unwrap();

    make_run(dir.path());
    for (args, expected) in [
        (
            vec!["report", run, "--fast-p", "1,x"],
            "fast_p threshold `x`",
        ),
        (
            vec!["report", run, "--format", "pdf"],
            "unknown report format `pdf`",
        ),
    ] {
        let out = dice(&args);
        assert!(!out.status.success());
        assert!(stderr(&out).contains(expected), "{}", stderr(&out));
    }
}

/// A report only reads: it works on a run folder without write permission and leaves it as it
/// was.
#[test]
fn report_reads_a_read_only_run() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    fs::create_dir(&run_dir).unwrap();
    make_run(&run_dir);
    let run = path_arg(&run_dir);
    let writable = dice(&["report", run, "--format", "json"]);
    assert!(writable.status.success(), "{}", stderr(&writable));
    let files = || {
        let mut files: Vec<(std::ffi::OsString, Vec<u8>)> = fs::read_dir(&run_dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (e.file_name(), fs::read(e.path()).unwrap())
            })
            .collect();
        files.sort();
        files
    };
    let before = files();
    let permissions = fs::metadata(&run_dir).unwrap().permissions();
    fs::set_permissions(&run_dir, fs::Permissions::from_mode(0o555)).unwrap();
    let read_only = dice(&["report", run, "--format", "json"]);
    let after = files();
    fs::set_permissions(&run_dir, permissions).unwrap();
    assert!(read_only.status.success(), "{}", stderr(&read_only));
    assert_eq!(read_only.stdout, writable.stdout);
    assert!(before == after, "the report changed the run folder");
}

/// `dice bench train` on the CPU with the formula golden's tiny config: the step's time, its
/// TFLOP/s and an MFU against the peak it is given (none by default on the CPU), and with
/// `--profile` where the time of a step goes, as text and JSON.
#[test]
fn bench_train_reports_flops_and_mfu_against_the_given_peak() {
    let config = test_data().join("sdar/golden/formula/config.json");
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("train.json");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "train",
            "--config",
            path_arg(&config),
            "--tokens",
            "24",
            "--steps",
            "1",
            "--json",
            path_arg(&json),
        ];
        args.extend_from_slice(extra);
        let out = dice(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        let line = String::from_utf8_lossy(&out.stdout).into_owned();
        let result: Value = serde_json::from_str(&fs::read_to_string(&json).unwrap()).unwrap();
        (line, result)
    };
    let (line, result) = run(&[]);
    assert!(line.contains("TFLOP/s, MFU -;"), "{line}");
    assert_eq!(result["positions"], 48);
    let tflops = result["tflops"].as_f64().unwrap();
    assert!(tflops > 0.0, "{result}");
    assert!(result["mfu"].is_null(), "{result}");

    assert!(result.get("profile").is_none(), "{result}");

    let (text, result) = run(&["--peak-tflops", "0.5", "--profile"]);
    let mfu = result["mfu"].as_f64().unwrap();
    assert!(mfu > 0.0 && text.contains(" %;"), "{text}");
    // The profile: a table row per phase, and the same phases in the JSON.
    assert!(text.contains("| forward: attention | 2 |"), "{text}");
    assert!(text.contains("| backward: attention | 2 |"), "{text}");
    assert!(
        text.contains("| between phases (host bookkeeping) |"),
        "{text}"
    );
    assert_eq!(result["profile"]["phases"].as_array().unwrap().len(), 10);
    let expected = result["tflops"].as_f64().unwrap() / 0.5;
    assert!((mfu - expected).abs() < 1e-9 * expected, "{result}");
}
