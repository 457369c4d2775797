//! Three `dice eval` workers on one run in a PostgreSQL database, one killed with -9 while it
//! judges: every sample is judged once, with the verdicts of the same candidates judged by one
//! process into SQLite, and `dice report` reads the same report from either store. The server
//! is the test's own (`dice_test_support::postgres`); builds share the suite's cache
//! (`dice_test_support::shared_build_cache`).

use crate::example_runs::{finished, samples, verdicts};
use dice_eval::store::{ProblemRecord, SampleExtras};
use dice_eval::Store;
use dice_test_support::postgres::PostgresServer;
use dice_test_support::{examples_dir, shared_build_cache};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn eval(run: &str, store: Option<&str>) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_dice"));
    command
        .arg("eval")
        .arg(examples_dir().join("candidates.jsonl"))
        .arg("--kernelbench")
        .arg(examples_dir().join("kernelbench"))
        .args(["--run", run])
        .arg("--build-cache")
        .arg(shared_build_cache())
        .args(["--timeout", "20", "--perf-trials", "4", "--input-seed", "7"])
        .args(store.map(|url| ["--store", url]).into_iter().flatten())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Waits until `ready` holds (checked every 100 ms), failing after five minutes.
fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    let begun = Instant::now();
    while !ready() {
        assert!(
            begun.elapsed() < Duration::from_secs(300),
            "{what} never happened"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn report(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_dice"))
        .arg("report")
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "dice report {args:?}: {stderr}");
    String::from_utf8(output.stdout).unwrap()
}

/// A SQLite store at `db` holding what `from` holds, record for record, as the backends read
/// them. The builds all go with the first sample: their order is what reports read.
fn copy_to_sqlite(from: &Store, db: &Path) {
    let mut to = Store::open(db).unwrap();
    let (info, settings) = from.run().unwrap().unwrap();
    to.set_run(&info, &settings).unwrap();
    let problems = from.problems().unwrap();
    let rows: Vec<(ProblemRecord, String)> = problems
        .iter()
        .map(|p| (p.clone(), String::new()))
        .collect();
    to.add_problems(&rows).unwrap();
    for p in &problems {
        to.set_reference_error(p.level, p.problem_id, p.reference_error.as_deref())
            .unwrap();
    }
    let mut builds = Some(from.builds().unwrap());
    for s in from.samples().unwrap() {
        let extras = SampleExtras {
            kernels: from
                .kernel_profile(s.level, s.problem_id, s.sample_id)
                .unwrap(),
            builds: builds.take().unwrap_or_default(),
            ..SampleExtras::default()
        };
        to.put_sample(&s, &extras).unwrap();
    }
    for timeline in from.timelines().unwrap() {
        to.add_timeline(&timeline).unwrap();
    }
}

#[test]
fn three_workers_on_postgres_one_killed() {
    let _judging = crate::common::away_from_hostile_programs();
    let server = PostgresServer::start();
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    // The run of one process into SQLite, whose verdicts the shared run must give, runs beside
    // it.
    let alone = dir.path().join("alone");
    let alone_eval = eval(alone.to_str().unwrap(), None).spawn().unwrap();

    let started = Instant::now();
    let first = eval("shared", Some(&url)).spawn().unwrap();
    // The others join once the first has begun the run (and drawn its seed).
    wait_for("the run's start", || {
        Store::open_postgres(&url, "shared")
            .ok()
            .and_then(|store| store.run_info().ok().flatten())
            .is_some()
    });
    let mut doomed = eval("shared", Some(&url))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let third = eval("shared", Some(&url)).spawn().unwrap();
    let doomed_pid = format!(":{}:", doomed.id());
    let store = Store::open_postgres(&url, "shared").unwrap();
    wait_for("a claim of the doomed worker", || {
        let holders = store.claim_holders().unwrap();
        holders.iter().any(|w| w.as_str().contains(&doomed_pid))
    });
    doomed.kill().unwrap();
    doomed.wait().unwrap();
    let (first_out, first_err) = finished(first);
    let (third_out, third_err) = finished(third);
    eprintln!(
        "three workers, PostgreSQL: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    finished(alone_eval);
    let expected = verdicts(&Store::open_read_only(&alone.join("dice.db")).unwrap());

    assert_eq!(verdicts(&store), expected);
    assert!(
        format!("{first_err}{third_err}").contains("taken over"),
        "the killed worker's claim went to no one:\n{first_err}\n{third_err}"
    );
    for (out, err) in [(&first_out, &first_err), (&third_out, &third_err)] {
        assert!(!err.contains("took it over"), "judged twice: {err}");
        let accounted = samples(out, "evaluated")
            + samples(out, "already in the store (use --force to re-evaluate)")
            + samples(out, "judged by another dice eval on this run");
        assert_eq!(accounted, expected.len(), "{out}");
    }
    assert!(store.claim_holders().unwrap().is_empty());

    let copy = dir.path().join("copy");
    copy_to_sqlite(&store, &copy.join("dice.db"));
    for format in ["md", "json"] {
        let from_postgres = report(&["shared", "--store", &url, "--format", format]);
        let from_sqlite = report(&[copy.to_str().unwrap(), "--format", format]);
        assert_eq!(from_postgres, from_sqlite, "{format}");
    }
    let no_server = url.replace(&format!(":{}/", server.port()), ":1/");
    let missing_database = format!("{}/missing", url.rsplit_once('/').unwrap().0);
    for (store, why) in [
        (url.as_str(), "holds no run yet"),
        (&no_server, "is the server running?"),
        (&missing_database, "database \"missing\" does not exist"),
    ] {
        let refused = Command::new(env!("CARGO_BIN_EXE_dice"))
            .args(["report", "nothing", "--store", store])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(
            !refused.status.success() && stderr.contains(why),
            "{stderr}"
        );
    }
}
