//! `dice eval` as a user runs it: the examples' wiring, resumption, and bad input.
//! Builds share the suite's cache (`dice_test_support::shared_build_cache`).

use crate::example_runs::problem2_candidates;
use dice_eval::{Store, Verdict};
use dice_test_support::{examples_dir, shared_build_cache};
use std::path::Path;
use std::process::{Command, Output};

fn dice_eval(args: &[&str], run: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dice"))
        .arg("eval")
        .args(args)
        .args([
            "--run",
            run.to_str().unwrap(),
            "--build-cache",
            shared_build_cache().to_str().unwrap(),
        ])
        .args(["--timeout", "20", "--perf-trials", "4"])
        .output()
        .expect("the dice binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn evaluates_resumes_and_refuses_changed_settings() {
    let _judging = crate::common::away_from_hostile_programs();
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let candidates = problem2_candidates(dir.path());
    let kb = examples_dir().join("kernelbench");
    let args = [
        candidates.to_str().unwrap(),
        "--kernelbench",
        kb.to_str().unwrap(),
    ];
    let out = dice_eval(&args, &run);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("evaluated 3 samples"),
        "{}",
        text(&out.stdout)
    );
    let store = Store::open(&run.join("dice.db")).unwrap();
    let verdicts: Vec<(u32, Verdict)> = store
        .samples()
        .unwrap()
        .iter()
        .map(|s| (s.sample_id, s.verdict))
        .collect();
    assert_eq!(
        verdicts,
        [
            (0, Verdict::Correct),
            (1, Verdict::NoCode),
            (2, Verdict::Correct)
        ]
    );
    assert!(store
        .run_info()
        .unwrap()
        .unwrap()
        .source
        .starts_with("kernelbench:"));

    let again = dice_eval(&args, &run);
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert!(
        text(&again.stdout).contains("3 samples were already in the store"),
        "{}",
        text(&again.stdout)
    );

    let changed = dice_eval(&[&args[..], &["--tolerance", "0.5"]].concat(), &run);
    assert!(!changed.status.success());
    let err = text(&changed.stderr);
    assert!(
        err.contains("different settings") && err.contains("atol"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");

    let more_rounds = dice_eval(&[&args[..], &["--timing-rounds", "2"]].concat(), &run);
    assert!(!more_rounds.status.success());
    let err = text(&more_rounds.stderr);
    assert!(err.contains("(timing rounds)"), "{err}");
}

#[test]
fn bad_input_ends_with_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let kb = examples_dir().join("kernelbench");
    let jsonl = examples_dir().join("candidates.jsonl");

    let missing = dice_eval(
        &[jsonl.to_str().unwrap(), "--kernelbench", "/nonexistent/kb"],
        &run,
    );
    assert!(!missing.status.success());
    assert!(
        text(&missing.stderr).contains("/nonexistent/kb"),
        "{}",
        text(&missing.stderr)
    );

    let no_torch = dice_eval(
        &[
            jsonl.to_str().unwrap(),
            "--kernelbench",
            kb.to_str().unwrap(),
            "--python",
            "/nonexistent/python3",
        ],
        &run,
    );
    assert!(!no_torch.status.success());
    assert!(
        text(&no_torch.stderr).contains("/nonexistent/python3"),
        "{}",
        text(&no_torch.stderr)
    );

    // A percentage where a share is asked for.
    let percent = dice_eval(
        &[
            jsonl.to_str().unwrap(),
            "--kernelbench",
            kb.to_str().unwrap(),
            "--quiet-timing-share",
            "25",
        ],
        &run,
    );
    assert!(!percent.status.success());
    assert!(
        text(&percent.stderr).contains("25 is not a share from 0 to 1"),
        "{}",
        text(&percent.stderr)
    );

    let malformed = dir.path().join("bad.jsonl");
    std::fs::write(
        &malformed,
        "{\"level\": 1, \"problem_id\": 1, \"sample_id\": 0, \"code\": \"x\"}\n{not json\n",
    )
    .unwrap();
    let out = dice_eval(
        &[
            malformed.to_str().unwrap(),
            "--kernelbench",
            kb.to_str().unwrap(),
        ],
        &run,
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("bad.jsonl"),
        "{}",
        text(&out.stderr)
    );
    assert!(
        !run.join("dice.db").exists()
            || Store::open(&run.join("dice.db"))
                .unwrap()
                .samples()
                .unwrap()
                .is_empty()
    );

    let folder = dir.path().join("kernels");
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(
        folder.join("level_1_problem_1_sample_0_kernel.py"),
        b"x = '\xff\xfe'\n",
    )
    .unwrap();
    std::fs::write(folder.join("level_1_problem_1_sample_1.py"), b"x = 1\n").unwrap();
    let out = dice_eval(
        &[
            folder.to_str().unwrap(),
            "--kernelbench",
            kb.to_str().unwrap(),
        ],
        &run,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains(
            "1 Python file does not follow the candidate name pattern \
             `level_L_problem_ID_sample_S_kernel.py`: level_1_problem_1_sample_1.py (not \
             evaluated)"
        ),
        "{}",
        text(&out.stderr)
    );
    let samples = Store::open(&run.join("dice.db"))
        .unwrap()
        .samples()
        .unwrap();
    assert_eq!(samples.len(), 1);
    assert_eq!(
        samples[0].verdict,
        Verdict::LoadError,
        "{:?}",
        samples[0].message
    );
}
