//! Helpers shared by the evaluator's integration tests: the examples, the settings every test
//! starts from (on the one build cache of the whole suite, where the examples' C++ source builds
//! once), and the machine's cores, which the timing tests have to themselves.

use dice_eval::{EvalConfig, EvalProblem, EvalSample, Verdict};
use dice_kernelbench::{load_candidates, KernelBench};
use dice_test_support::{examples_dir, shared_build_cache};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

/// Tests run concurrently in this binary. The timing tests want the machine to themselves: one
/// loads every core on purpose (the CPU hog), which would slow the candidates of others past
/// their short timeouts, and one needs no load but its own to see a forged clock. Every test
/// that runs the evaluator holds a share of the machine; the timing tests hold all of it.
static MACHINE: RwLock<()> = RwLock::new(());

/// A share of the machine: held by every test that runs the evaluator, beside the others.
pub(crate) fn machine_shared() -> RwLockReadGuard<'static, ()> {
    MACHINE.read().unwrap_or_else(PoisonError::into_inner)
}

/// The whole machine: no other evaluator test runs meanwhile.
pub(crate) fn machine_alone() -> RwLockWriteGuard<'static, ()> {
    MACHINE.write().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn kernelbench_problems(dir: &Path) -> Vec<EvalProblem> {
    let scan = KernelBench::open(dir).unwrap().scan(None).unwrap();
    scan.problems
        .into_iter()
        .map(|p| EvalProblem {
            level: p.level,
            problem_id: p.problem_id,
            name: p.name,
            source: p.source,
            defect: None,
        })
        .collect()
}

pub(crate) fn example_problems() -> Vec<EvalProblem> {
    kernelbench_problems(&examples_dir().join("kernelbench"))
}

pub(crate) fn example_samples() -> Vec<EvalSample> {
    load_candidates(&[examples_dir().join("candidates.jsonl")])
        .unwrap()
        .into_iter()
        .map(|c| EvalSample {
            level: c.level,
            problem_id: c.problem_id,
            sample_id: c.sample_id,
            code: c.code,
            origin: c.origin,
        })
        .collect()
}

/// The example whose code is the correct ReLU (its shared C++ source is every example's).
pub(crate) fn example(problem_id: u32, sample_id: u32) -> EvalSample {
    example_samples()
        .into_iter()
        .find(|s| s.problem_id == problem_id && s.sample_id == sample_id)
        .unwrap()
}

/// Level 1 problem 19 (`19_ReLU.py`) with `source`, and one sample of it for each of `codes`,
/// numbered from 0, named `{origin} {i}`.
pub(crate) fn relu_problem_and_samples(
    source: &str,
    codes: Vec<Vec<u8>>,
    origin: &str,
) -> (EvalProblem, Vec<EvalSample>) {
    let problem = EvalProblem {
        level: 1,
        problem_id: 19,
        name: "19_ReLU.py".into(),
        source: source.into(),
        defect: None,
    };
    let samples = codes
        .into_iter()
        .enumerate()
        .map(|(i, code)| EvalSample {
            level: 1,
            problem_id: 19,
            sample_id: i as u32,
            code: Some(code),
            origin: format!("{origin} {i}"),
        })
        .collect();
    (problem, samples)
}

/// Settings for tests: short timeouts, few timed trials, the suite's build cache.
pub(crate) fn test_config(run_dir: &Path) -> EvalConfig {
    let mut cfg = EvalConfig::new(run_dir.join("dice.db"), "kernelbench:examples".into());
    cfg.build_cache = shared_build_cache();
    cfg.timeout = Duration::from_secs(20);
    cfg.perf_trials = 10;
    cfg.timing_rounds = 2;
    cfg
}

/// (problem_id, sample_id) → verdict, as the examples' README documents them.
pub(crate) fn documented_verdicts() -> BTreeMap<(u32, u32), Verdict> {
    let readme = std::fs::read_to_string(examples_dir().join("README.md")).unwrap();
    let mut expected = BTreeMap::new();
    let mut problem = 0;
    for line in readme.lines().filter(|l| l.starts_with("| ")) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        let Some(sample) = cells.get(1).and_then(|c| c.parse::<u32>().ok()) else {
            continue;
        };
        if let Some(id) = cells[0]
            .split_whitespace()
            .next()
            .and_then(|c| c.parse().ok())
        {
            problem = id;
        }
        let verdict = cells[3].split('`').nth(1).unwrap().parse().unwrap();
        expected.insert((problem, sample), verdict);
    }
    expected
}

/// The ids of the host's processes, from /proc.
pub(crate) fn process_ids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// Whether process `pid`'s command line contains `needle` (false once it is gone).
pub(crate) fn command_line_has(pid: u32, needle: &str) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&cmdline).contains(needle)
}
