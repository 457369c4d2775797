//! `dice eval --stage build`: two build workers split the examples and fill a fresh build cache;
//! a judging `dice eval` on that cache then builds nothing and gives the documented verdicts.
//! The cache is the test's own, not the suite's shared one: what the workers build is what it
//! counts.

use crate::example_runs::{finished, verdicts};
use dice_eval::{Store, Verdict};
use dice_kernelbench::{load_candidates, KernelBench};
use dice_test_support::examples_dir;
use std::path::Path;
use std::process::{Child, Command, Stdio};

fn start_eval(build_cache: &Path, args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_dice"))
        .arg("eval")
        .arg(examples_dir().join("candidates.jsonl"))
        .arg("--kernelbench")
        .arg(examples_dir().join("kernelbench"))
        .arg("--build-cache")
        .arg(build_cache)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the dice binary runs")
}

/// The counts of a build worker's summary line, by name.
fn build_counts(stdout: &str) -> Vec<(String, usize)> {
    let line = stdout
        .lines()
        .find_map(|l| l.split_once(" samples in this shard: "))
        .unwrap_or_else(|| panic!("no build summary in {stdout}"))
        .1;
    line.split(", ")
        .map(|count| {
            let (what, n) = count.rsplit_once(' ').unwrap();
            (what.to_string(), n.parse().unwrap())
        })
        .collect()
}

#[test]
fn build_workers_fill_the_cache_that_judging_uses() {
    let _judging = crate::common::away_from_hostile_programs();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("builds");
    let builders =
        ["0/2", "1/2"].map(|shard| start_eval(&cache, &["--stage", "build", "--shard", shard]));
    let mut totals = std::collections::BTreeMap::new();
    for builder in builders {
        let (stdout, _) = finished(builder);
        for (what, n) in build_counts(&stdout) {
            *totals.entry(what).or_insert(0) += n;
        }
    }
    // One extension builds, one fails; the other samples load the first, or build nothing.
    assert_eq!(totals.values().sum::<usize>(), 12, "{totals:?}");
    assert_eq!(totals["built"], 1, "{totals:?}");
    assert_eq!(totals["failed to build"], 1, "{totals:?}");
    assert_eq!(totals["no code"], 1, "{totals:?}");

    let run = dir.path().join("run");
    let run_arg = run.to_str().unwrap();
    let judge = start_eval(
        &cache,
        &["--run", run_arg, "--timeout", "20", "--perf-trials", "4"],
    );
    let (stdout, _) = finished(judge);
    assert!(stdout.contains("evaluated 12 samples"), "{stdout}");
    let store = Store::open_read_only(&run.join("dice.db")).unwrap();
    let builds = store.builds().unwrap();
    assert!(!builds.is_empty());
    assert!(
        builds.iter().all(|b| b.cached),
        "the judging run built: {builds:?}"
    );
    // examples/README.md's table.
    let documented = [
        ((1, 0), Verdict::Correct),
        ((1, 1), Verdict::OutputMismatch),
        ((1, 2), Verdict::CompileError),
        ((1, 3), Verdict::Crashed),
        ((1, 4), Verdict::Timeout),
        ((1, 5), Verdict::LoadError),
        ((1, 6), Verdict::ShapeMismatch),
        ((1, 7), Verdict::NanOrInf),
        ((1, 8), Verdict::RuntimeError),
        ((2, 0), Verdict::Correct),
        ((2, 1), Verdict::NoCode),
        ((2, 2), Verdict::Correct),
    ];
    assert_eq!(verdicts(&store), documented.into_iter().collect());

    // A strict build worker leaves alone what strict judging rejects before running: the
    // examples that a static rule makes deceptive whatever they run.
    let (stdout, _) = finished(start_eval(&cache, &["--stage", "build", "--strict"]));
    let counts: std::collections::BTreeMap<String, usize> =
        build_counts(&stdout).into_iter().collect();
    let rejected = examples_rejected_before_running();
    assert!(rejected > 0);
    assert_eq!(counts["rejected (--strict)"], rejected, "{stdout}");
    assert_eq!(counts["built"], 0, "{stdout}");
}

/// The example candidates that dice-audit's strict rules decide before they run.
fn examples_rejected_before_running() -> usize {
    let problems = KernelBench::open(&examples_dir().join("kernelbench"))
        .unwrap()
        .scan(None)
        .unwrap()
        .problems;
    let strict = dice_audit::AuditOptions { strict: true };
    load_candidates(&[examples_dir().join("candidates.jsonl")])
        .unwrap()
        .into_iter()
        .filter_map(|c| {
            let code = String::from_utf8(c.code?).ok()?;
            let problem = problems
                .iter()
                .find(|p| (p.level, p.problem_id) == (c.level, c.problem_id))?;
            let source = std::str::from_utf8(&problem.source).ok()?;
            Some(dice_audit::audit(&code, source, &strict))
        })
        .filter(|audit| audit.decided_without_running().is_some())
        .count()
}
