//! A run killed with SIGKILL mid-way resumes where it stopped and loses nothing.

use crate::common::{machine_shared, test_config};
use dice_eval::{EvalProblem, EvalSample, SampleRecord, Store, Verdict};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const RUN_DIR_VAR: &str = "DICE_EVAL_TEST_RESUME_RUN";

const IDENTITY: &str = "
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return x * 2

def get_inputs():
    return [torch.rand(4, 8)]

def get_init_inputs():
    return []
";

/// Correct candidates, with slow ones (timeouts) in between so that the kill lands mid-run.
fn workload() -> (Vec<EvalProblem>, Vec<EvalSample>) {
    let problem = EvalProblem {
        level: 1,
        problem_id: 1,
        name: "1_Double.py".into(),
        source: IDENTITY.into(),
        defect: None,
    };
    let samples = (0..6)
        .map(|i| {
            let body = if i % 3 == 2 { "import time; time.sleep(60)" } else { "return x + x" };
            let code = format!("import torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        {body}\n");
            EvalSample { level: 1, problem_id: 1, sample_id: i, code: Some(code.into_bytes()), origin: format!("sample {i}") }
        })
        .collect();
    (vec![problem], samples)
}

fn evaluate_into(run_dir: &Path) -> dice_eval::Summary {
    let mut cfg = test_config(run_dir);
    cfg.timeout = Duration::from_secs(4);
    let (problems, samples) = workload();
    dice_eval::evaluate(cfg, problems, samples, None).unwrap()
}

/// Not a test by itself: the evaluator process that `resumes_after_kill_9` kills.
#[test]
#[ignore = "helper process of resumes_after_kill_9"]
fn resume_helper_process() {
    let run_dir = PathBuf::from(std::env::var(RUN_DIR_VAR).expect("run by resumes_after_kill_9"));
    evaluate_into(&run_dir);
}

fn stored(run_dir: &Path) -> Vec<SampleRecord> {
    let db = run_dir.join("dice.db");
    if !db.exists() {
        return Vec::new();
    }
    Store::open(&db)
        .and_then(|s| s.samples())
        .unwrap_or_default()
}

#[test]
fn resumes_after_kill_9() {
    let _machine = machine_shared();
    let run = tempfile::tempdir().unwrap();
    let mut helper = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "resume::resume_helper_process",
            "--nocapture",
        ])
        .env(RUN_DIR_VAR, run.path())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while stored(run.path()).len() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the helper stored nothing"
        );
        assert!(
            helper.try_wait().unwrap().is_none(),
            "the helper ended before it was killed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    helper.kill().unwrap(); // SIGKILL
    helper.wait().unwrap();
    let before = stored(run.path());
    assert!(before.len() < 6, "the kill came too late to test anything");

    let conn = rusqlite::Connection::open(run.path().join("dice.db")).unwrap();
    let integrity: String = conn
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(integrity, "ok");

    let summary = evaluate_into(run.path());
    assert_eq!(summary.already_done, before.len());
    assert_eq!(summary.verdicts.values().sum::<usize>(), 6 - before.len());
    let after = stored(run.path());
    assert_eq!(after.len(), 6);
    for old in &before {
        assert!(
            after.contains(old),
            "a result stored before the kill changed: {old:?}"
        );
    }
    for s in &after {
        let expected = if s.sample_id % 3 == 2 {
            Verdict::Timeout
        } else {
            Verdict::Correct
        };
        assert_eq!(s.verdict, expected, "{s:?}");
    }
}
