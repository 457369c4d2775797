//! Two `dice eval` processes on one run folder share its samples: each sample is judged once, by
//! one of them, and the verdicts are those of a run judged by one process.
//! Builds share the suite's cache (`dice_test_support::shared_build_cache`).

use crate::example_runs::{finished, samples};
use dice_eval::{Store, Verdict};
use dice_test_support::{examples_dir, shared_build_cache};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn start_eval(run: &Path) -> Child {
    let kb = examples_dir().join("kernelbench");
    Command::new(env!("CARGO_BIN_EXE_dice"))
        .arg("eval")
        .arg(examples_dir().join("candidates.jsonl"))
        .arg("--kernelbench")
        .arg(kb)
        .arg("--run")
        .arg(run)
        .arg("--build-cache")
        .arg(shared_build_cache())
        .args(["--timeout", "20", "--perf-trials", "4"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the dice binary runs")
}

type Verdicts = BTreeMap<(u32, u32), Verdict>;

fn verdicts(run: &Path) -> Verdicts {
    crate::example_runs::verdicts(&Store::open_read_only(&run.join("dice.db")).unwrap())
}

#[test]
fn two_processes_share_one_run() {
    let _judging = crate::common::away_from_hostile_programs();
    let dir = tempfile::tempdir().unwrap();
    // The run of one process, whose verdicts the shared run must give, runs beside it.
    let alone = dir.path().join("alone");
    let alone_eval = start_eval(&alone);

    let shared = dir.path().join("shared");
    let first = start_eval(&shared);
    // The second starts once the first has begun the run (and drawn its seed), as a second
    // worker joining a run in progress does.
    let begun = Instant::now();
    while Store::open_read_only(&shared.join("dice.db"))
        .ok()
        .and_then(|store| store.run_info().ok().flatten())
        .is_none()
    {
        assert!(
            begun.elapsed() < Duration::from_secs(300),
            "the run never began"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let second = start_eval(&shared);
    let (stdout, _) = finished(alone_eval);
    let expected = verdicts(&alone);
    assert_eq!(samples(&stdout, "evaluated"), expected.len());
    let (first_out, first_err) = finished(first);
    let (second_out, second_err) = finished(second);

    assert_eq!(verdicts(&shared), expected);
    let judged = [&first_out, &second_out].map(|out| samples(out, "evaluated"));
    assert_eq!(
        judged.iter().sum::<usize>(),
        expected.len(),
        "{first_out}\n{second_out}"
    );
    for (out, err) in [(&first_out, &first_err), (&second_out, &second_err)] {
        assert!(!err.contains("took it over"), "judged twice: {err}");
        assert!(!err.contains("taken over"), "a lease expired: {err}");
        let accounted = samples(out, "evaluated")
            + samples(out, "already in the store (use --force to re-evaluate)")
            + samples(out, "judged by another dice eval on this run");
        assert_eq!(accounted, expected.len(), "{out}");
    }
}
