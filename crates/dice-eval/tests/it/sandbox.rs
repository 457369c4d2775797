//! The sandbox and the run-time checks with pure-Python candidates (no extension builds): what a
//! candidate can see of its confinement, orphans, a fork bomb, a flood of output, inputs changed
//! in place and cached outputs.

use crate::common::{
    command_line_has, machine_alone, machine_shared, process_ids, relu_problem_and_samples,
    test_config,
};
use dice_eval::{EvalConfig, SampleRecord, Store, Verdict};
use std::path::Path;
use std::time::{Duration, Instant};

const RELU: &str = "
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)

def get_inputs():
    return [torch.randn(64, 256)]

def get_init_inputs():
    return []
";

fn candidate(prelude: &str, init: &str, forward: &str) -> Vec<u8> {
    format!(
        "import torch\nimport torch.nn as nn\n{prelude}\nclass ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n        {init}\n    def forward(self, x):\n        {forward}\n"
    )
    .into_bytes()
}

fn evaluate(run: &Path, codes: Vec<Vec<u8>>, timeout_s: u64) -> Vec<SampleRecord> {
    let mut cfg = test_config(run);
    cfg.timeout = Duration::from_secs(timeout_s);
    evaluate_with(run, cfg, codes)
}

/// The records of `codes` judged under `cfg` (a [`test_config`] of `run`).
fn evaluate_with(run: &Path, cfg: EvalConfig, codes: Vec<Vec<u8>>) -> Vec<SampleRecord> {
    evaluate_problem(run, cfg, RELU, codes)
}

/// The records of `codes` judged under `cfg` as candidates of the problem `source`.
fn evaluate_problem(
    run: &Path,
    cfg: EvalConfig,
    source: &str,
    codes: Vec<Vec<u8>>,
) -> Vec<SampleRecord> {
    let (problem, samples) = relu_problem_and_samples(source, codes, "sandbox test sample");
    dice_eval::evaluate(cfg, vec![problem], samples, None).unwrap();
    Store::open(&run.join("dice.db"))
        .unwrap()
        .samples()
        .unwrap()
}

/// `KEY=value` fields of the line starting with `marker` in a log.
fn reported(log: &str, marker: &str) -> Option<Vec<(String, String)>> {
    let line = log.lines().find(|l| l.starts_with(marker))?;
    Some(
        line.split_whitespace()
            .skip(1)
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    )
}

/// Processes whose command line contains `needle`, from the host's /proc.
fn processes_with(needle: &str) -> Vec<u32> {
    process_ids()
        .into_iter()
        .filter(|&pid| command_line_has(pid, needle))
        .collect()
}

/// `count()` once it is 0, or after 20 s: killed processes take a moment to disappear.
fn settled(count: impl Fn() -> usize) -> usize {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let n = count();
        if n == 0 || Instant::now() >= until {
            return n;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Processes of user `uid`, from the host's /proc.
fn processes_of(uid: u32) -> usize {
    process_ids()
        .into_iter()
        .filter(|pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            status
                .lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|u| u.parse::<u32>().ok())
                == Some(uid)
        })
        .count()
}

const PROBE: &str = "
import getpass, os, resource, socket
def _try(f):
    try:
        f()
        return 'yes'
    except OSError:
        return 'no'
print('SANDBOX', f'uid={os.getuid()}', f'nproc={resource.getrlimit(resource.RLIMIT_NPROC)[0]}',
      f'pid={os.getpid()}', f'tmp={_try(lambda: open(\"/tmp/dice-sandbox-probe\", \"w\"))}',
      f'shm={_try(lambda: open(\"/dev/shm/dice-sandbox-probe\", \"w\"))}',
      f'net={_try(lambda: socket.create_connection((\"1.1.1.1\", 53), timeout=2))}',
      f'own={_try(lambda: open(os.path.join(os.environ[\"TMPDIR\"], \"f\"), \"w\"))}',
      f'user={getpass.getuser()}', flush=True)
";

/// What a candidate sees of the sandbox, as `field → value`. The sandbox is part of the suite's
/// setup: it needs the tests to run as root on a kernel that lets root create mount, network and
/// PID namespaces (CI's machines and containers run them so); elsewhere this fails, saying so,
/// rather than passing without running the fork bomb.
fn sandbox_state(run: &Path) -> std::collections::BTreeMap<String, String> {
    let probe = candidate(PROBE, "pass", "return torch.relu(x)");
    let records = evaluate(run, vec![probe], 30);
    assert_eq!(records[0].verdict, Verdict::Correct, "{:?}", records[0]);
    let fields = reported(&records[0].log_excerpt, "SANDBOX").expect("the probe's line");
    let state: std::collections::BTreeMap<_, _> = fields.into_iter().collect();
    let active = state["uid"] != "0" && state["pid"] == "2" && state["nproc"] != "-1";
    assert!(
        active,
        "the sandbox is not active on this machine: run the tests as root where root may create \
         namespaces (unshare of mount, network and PID), as CI does; a candidate saw {state:?}"
    );
    state
}

#[test]
fn candidates_are_confined_and_a_fork_bomb_is_contained() {
    let _machine = machine_shared();
    let run = tempfile::tempdir().unwrap();
    let state = sandbox_state(run.path());
    assert_eq!(state["tmp"], "no", "{state:?}");
    assert_eq!(state["shm"], "no", "{state:?}");
    assert_eq!(state["net"], "no", "{state:?}");
    assert_eq!(state["own"], "yes", "{state:?}");
    // A user without a passwd entry still has a name (torch.profiler asks for it).
    assert_eq!(state["user"], "dice-sandbox", "{state:?}");

    let bomb = candidate(
        &format!("{PROBE}\ndef _multiply():\n    while True:\n        os.fork()\n"),
        "_multiply()",
        "return torch.relu(x)",
    );
    let honest = candidate("", "pass", "return torch.relu(x)");
    let run = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let records = evaluate(run.path(), vec![bomb, honest], 10);
    assert_ne!(records[0].verdict, Verdict::Correct, "{:?}", records[0]);
    assert_eq!(records[1].verdict, Verdict::Correct, "{:?}", records[1]);
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "{:?}",
        started.elapsed()
    );
    let bomber = reported(&records[0].log_excerpt, "SANDBOX").expect("the bomb's probe line");
    let uid: u32 = bomber
        .iter()
        .find(|(k, _)| k == "uid")
        .unwrap()
        .1
        .parse()
        .unwrap();
    assert_ne!(uid, 0);
    // The kernel kills what is left in the namespace; hundreds of processes take a moment.
    let left = settled(|| processes_of(uid));
    assert_eq!(left, 0, "processes of the bomb's user are left");
}

#[test]
fn nothing_a_candidate_starts_outlives_it() {
    let _machine = machine_shared();
    let nonce = format!("dice-orphan-{}", std::process::id());
    let prelude = format!(
        "import subprocess, sys\n_child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', '{nonce}'], start_new_session=True)\nprint('SPAWNED', f'pid={{_child.pid}}', flush=True)\n"
    );
    let run = tempfile::tempdir().unwrap();
    let records = evaluate(
        run.path(),
        vec![candidate(&prelude, "pass", "return torch.relu(x)")],
        30,
    );
    assert_eq!(records[0].verdict, Verdict::Correct, "{:?}", records[0]);
    assert!(
        reported(&records[0].log_excerpt, "SPAWNED").is_some(),
        "{}",
        records[0].log_excerpt
    );
    let left = settled(|| processes_with(&nonce).len());
    assert_eq!(left, 0, "detached children still running");
}

#[test]
fn a_flood_of_output_is_bounded_and_slows_no_one() {
    let _machine = machine_shared();
    let chatty = candidate(
        "import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * (1 << 20))\nsys.stdout.flush()",
        "pass",
        "return torch.relu(x)",
    );
    let honest = candidate("", "pass", "return torch.relu(x)");
    let run = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let records = evaluate(run.path(), vec![chatty, honest], 60);
    for r in &records {
        assert_eq!(r.verdict, Verdict::Correct, "{:?}", r.message);
        assert!(r.log_excerpt.len() < 40 * 1024);
    }
    assert!(records[0].log_excerpt.contains("bytes omitted"));
    assert!(
        started.elapsed() < Duration::from_secs(90),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn runtime_hacks_are_flagged() {
    // Alone, as the timing tests: one of its hacks is a slowed clock, and its honest programs
    // must pass the clock check, whose rounds other tests' workers beside it would load.
    let _machine = machine_alone();
    // (code, expected flag, whether the verdict is still `correct`); no flag: only not correct.
    let cases: Vec<(Vec<u8>, &str, bool)> = vec![
        (
            candidate("", "pass", "return x.relu_()"),
            "input_mutation",
            true,
        ),
        (
            candidate(
                "",
                "self.cache = {}",
                "key = x.data_ptr()\n        if key not in self.cache:\n            self.cache[key] = torch.relu(x)\n        return self.cache[key]",
            ),
            "",
            false,
        ),
        // Keyed by values, a cache never hits: every timed call gets inputs no call saw, so the
        // program is timed computing each output, and nothing is left to flag.
        (
            candidate(
                "",
                "self.cache = {}",
                "key = tuple(x.flatten()[:8].tolist())\n        if key not in self.cache:\n            self.cache[key] = torch.relu(x)\n        return self.cache[key]",
            ),
            "",
            true,
        ),
        // Keyed by shape from the first timed call on (after the correctness trials and the
        // warm-ups): every later timed call returns that call's output for other inputs.
        (
            candidate(
                "",
                "self.cache = {}\n        self.calls = 0",
                "self.calls += 1\n        if self.calls <= 8:\n            return torch.relu(x)\n        return self.cache.setdefault(tuple(x.shape), torch.relu(x))",
            ),
            "",
            false,
        ),
        (candidate("", "pass", "return torch.relu(x)"), "", true),
        // A clock slowed down a hundredfold through the evaluator's own module.
        (
            candidate(
                "import sys, time\n_p = sys.modules['protocol']\n_real = _p.perf_counter_ns\n_p.perf_counter_ns = lambda: _real() // 100\n",
                "pass",
                "time.sleep(0.03)\n        return torch.relu(x)",
            ),
            "timer_inconsistent",
            true,
        ),
        // One output buffer recomputed by every call is no cache.
        (
            candidate(
                "",
                "self.out = None",
                "if self.out is None:\n            self.out = torch.empty_like(x)\n        return torch.clamp(x, min=0, out=self.out)",
            ),
            "",
            true,
        ),
    ];
    let run = tempfile::tempdir().unwrap();
    let codes = cases.iter().map(|c| c.0.clone()).collect();
    let records = evaluate(run.path(), codes, 30);
    for (r, (_, flag, correct)) in records.iter().zip(&cases) {
        let what = format!(
            "sample {} {flag}: {:?} {:?} {:?}",
            r.sample_id, r.verdict, r.message, r.flags
        );
        assert_eq!(r.verdict == Verdict::Correct, *correct, "{what}");
        if flag.is_empty() && *correct {
            assert!(r.flags.is_empty(), "{what}");
        } else if !flag.is_empty() {
            assert!(r.flags.iter().any(|f| f == flag) && r.deceptive, "{what}");
        }
    }
}

/// A cache keyed by the input's pointer that survives correctness (inputs at fresh addresses)
/// returns stale outputs once timing refills the same buffers with the next call's inputs.
///
/// On the CPU call j of a round takes the j-th set of buffers (protocol.py `_timed_premade`),
/// and this cache fills an entry at an address's second call: five rounds of two calls leave
/// two timed calls right (the first two on set 1: set 0 served the warm-ups), fewer than the three
/// the timer keeps, so a kept one is always stale. Two rounds of five left eight of ten right
/// where no measurement was made again, and the sample missed the stale ones about half the
/// time (bench/notes/test-suite.md, session 33).
#[test]
fn a_pointer_cache_is_caught_by_the_timing_outputs() {
    let _machine = machine_shared();
    let cache = candidate(
        "_seen = set()",
        "self.cache = {}",
        "key = x.data_ptr()\n        if key in _seen and key not in self.cache:\n            self.cache[key] = torch.relu(x)\n        _seen.add(key)\n        return self.cache.get(key, torch.relu(x))",
    );
    let run = tempfile::tempdir().unwrap();
    let mut cfg = test_config(run.path());
    cfg.timeout = Duration::from_secs(30);
    cfg.timing_rounds = 5;
    let records = evaluate_with(run.path(), cfg, vec![cache]);
    let r = &records[0];
    assert_ne!(r.verdict, Verdict::Correct, "{r:?}");
    // Usually the timing outputs expose it; when the allocator happens to hand a later
    // correctness trial an address seen before, that trial already does.
    assert!(
        r.flags.iter().any(|f| f == "timing_output_mismatch")
            || r.verdict == Verdict::OutputMismatch,
        "{r:?}"
    );
}

/// Every call the timer makes, warm-ups and timed ones, gets inputs of its own: the candidate
/// prints a sum of each input it sees, and no two are equal.
#[test]
fn every_timed_call_gets_inputs_no_call_saw_before() {
    let _machine = machine_shared();
    let printing = candidate(
        "",
        "pass",
        "print('INPUT', repr(float(x.double().sum())), flush=True)\n        return torch.relu(x)",
    );
    let run = tempfile::tempdir().unwrap();
    let mut cfg = test_config(run.path());
    cfg.max_remeasures = 0;
    let (trials, perf_trials) = (cfg.correctness_trials, cfg.perf_trials);
    let records = evaluate_with(run.path(), cfg, vec![printing]);
    let r = &records[0];
    assert_eq!(r.verdict, Verdict::Correct, "{r:?}");
    // A clock contradicted by load is measured again even without remeasures.
    let calls = trials + 3 + perf_trials * (1 + r.timing_remeasures);
    let sums: Vec<&str> = r
        .log_excerpt
        .lines()
        .filter_map(|l| l.strip_prefix("INPUT "))
        .collect();
    assert_eq!(sums.len() as u32, calls, "{}", r.log_excerpt);
    let distinct: std::collections::BTreeSet<&&str> = sums.iter().collect();
    assert_eq!(distinct.len(), sums.len(), "inputs seen twice: {sums:?}");
}

/// Wrong on every timed call but the last two of the first measurement (and on the calls of a
/// measurement again, which a clock contradicted by load gets): a timing that judged only its
/// last outputs (one per input set) passed it; a uniform sample of the timed calls catches it.
#[test]
fn a_wrong_output_before_the_last_timed_call_is_caught() {
    let _machine = machine_shared();
    let run = tempfile::tempdir().unwrap();
    let mut cfg = test_config(run.path());
    cfg.max_remeasures = 0;
    // Calls before timing: the correctness trials, then the timer's warm-ups.
    let first_timed = cfg.correctness_trials + 3;
    let last_wrong = first_timed + cfg.perf_trials - 2;
    let wrong = candidate(
        "",
        "self.calls = 0",
        &format!(
            "self.calls += 1\n        if {first_timed} < self.calls and not {last_wrong} < self.calls <= {last_wrong} + 2:\n            return torch.zeros_like(x)\n        return torch.relu(x)"
        ),
    );
    let records = evaluate_with(run.path(), cfg, vec![wrong]);
    let r = &records[0];
    assert_eq!(r.verdict, Verdict::OutputMismatch, "{r:?}");
    assert!(
        r.flags.iter().any(|f| f == "timing_output_mismatch"),
        "{r:?}"
    );
    assert!(
        r.message
            .as_deref()
            .unwrap_or_default()
            .starts_with("timed call"),
        "{r:?}"
    );
}

/// A problem whose output (2^21 values) is larger than a timed call's sample (2^20 values).
const LARGE_RELU: &str = "
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)

def get_inputs():
    return [torch.randn(8, 2 ** 18)]

def get_init_inputs():
    return []
";

/// Timed outputs judged by samples, as the timer keeps those of multi-GB outputs (here every
/// output): an honest program passes, and a wrong timed call is caught whether all its values
/// are wrong (stale) or one in a hundred (a sample of half the positions, drawn after the call).
#[test]
fn timed_outputs_judged_by_samples_catch_what_whole_ones_do() {
    let _machine = machine_shared();
    let run = tempfile::tempdir().unwrap();
    let mut cfg = test_config(run.path());
    cfg.max_remeasures = 0;
    cfg.timed_outputs_whole_up_to = 0;
    let first_timed = cfg.correctness_trials + 3;
    let wrong_from = |wrong: &str| {
        candidate(
            "",
            "self.calls = 0",
            &format!(
                "self.calls += 1\n        out = torch.relu(x)\n        if {first_timed} < self.calls:\n            {wrong}\n        return out"
            ),
        )
    };
    let codes = vec![
        candidate("", "pass", "return torch.relu(x)"),
        wrong_from("out.zero_()"),
        wrong_from("out[:, ::100] = -1.0"),
    ];
    let records = evaluate_problem(run.path(), cfg, LARGE_RELU, codes);
    assert_eq!(records[0].verdict, Verdict::Correct, "{:?}", records[0]);
    assert!(records[0].flags.is_empty(), "{:?}", records[0]);
    for r in &records[1..] {
        assert_eq!(r.verdict, Verdict::OutputMismatch, "{r:?}");
        assert!(
            r.flags.iter().any(|f| f == "timing_output_mismatch"),
            "{r:?}"
        );
    }
}

#[test]
fn sleeping_forever_is_a_timeout() {
    let _machine = machine_shared();
    let sleeper = candidate("import time", "pass", "time.sleep(3600)");
    let run = tempfile::tempdir().unwrap();
    let records = evaluate(run.path(), vec![sleeper], 5);
    assert_eq!(records[0].verdict, Verdict::Timeout, "{:?}", records[0]);
}
