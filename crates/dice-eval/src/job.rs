//! What the stages share: the job context, and the outcome of evaluating one candidate.

use crate::config::EvalConfig;
use crate::quiet::BuildGroups;
use crate::runtime::Finding;
use crate::sandbox::SandboxUsers;
use dice_store::{BuildRecord, KernelProfile, SpeedupInterval, TimingStats, Verdict};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;

pub(crate) struct JobContext {
    pub cfg: EvalConfig,
    pub jobs_dir: PathBuf,
    /// Resource limits applied in every child before it runs anything it was handed.
    pub limits: Value,
    /// The unprivileged users sandboxed children become.
    pub users: SandboxUsers,
    /// `{"timed": [...], "untimed": [...]}`: CPU cores kept for timing on CUDA, where small
    /// kernels are timed by how fast Python launches them (python/protocol.py `Timer`); every
    /// child runs on the others. Null when the machine has too few cores to spare two.
    pub cores: Value,
    /// Environment of every child (the CUDA architectures extensions are built for): given per
    /// job, so the fork servers can start before the interpreter check has named the GPUs.
    pub env: Value,
    /// The compile stage's process groups, stopped while a candidate is timed (within
    /// `cfg.quiet_timing_share`).
    pub build_groups: BuildGroups,
    /// The run's seed of correctness trials and timing inputs (python/protocol.py `Seeds`).
    pub seed: u64,
}

impl JobContext {
    pub(crate) fn new(cfg: EvalConfig, jobs_dir: PathBuf, env: Value, seed: u64) -> JobContext {
        let limits = child_limits(&cfg);
        let cores = match cfg.device {
            crate::config::Device::Cuda => process_core_split(),
            crate::config::Device::Cpu => Value::Null,
        };
        let build_groups = BuildGroups::new(cfg.quiet_timing_share);
        JobContext {
            cfg,
            jobs_dir,
            limits,
            users: SandboxUsers::new(),
            cores,
            env,
            build_groups,
            seed,
        }
    }
}

/// Niceness of the compile stage's children (the candidate's import and the extension builds,
/// and the compilers they start). A run slot whose child waits for a core holds its sample's
/// device pass and claim, so builds competing on equal terms slow the run stage, which then
/// idles the GPU while built candidates queue; niced, the builds take what the run stage
/// leaves (most of the machine) and yield it when a run-stage child needs a core.
pub(crate) const COMPILE_STAGE_NICENESS: i32 = 10;

/// The split of this process's cores into timed and untimed ones (`timing_cores`), made once
/// per process from the cores it started with; this process's own threads then keep off the
/// timed cores too (`run_on`): the evaluator's threads (reading children's replies, writing the
/// store, watching builds) would otherwise take a timed core from the timing thread for a
/// scheduler slice, milliseconds inside a call of microseconds. An evaluator made later in the
/// same process (tests, the RL trainer's judge) gets the same split, not one of the remainder.
pub(crate) fn process_core_split() -> Value {
    static SPLIT: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    SPLIT
        .get_or_init(|| {
            let split = timing_cores(&usable_cores(), core_siblings);
            if let Some(untimed) = split["untimed"].as_array() {
                let cores: Vec<usize> = untimed
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|c| c as usize)
                    .collect();
                if let Err(e) = run_on(&cores) {
                    tracing::warn!("the evaluator's threads stay on every core: {e}");
                }
            }
            split
        })
        .clone()
}

/// Moves every thread of this process onto `cores`; threads started later inherit the set from
/// the thread that starts them.
#[allow(unsafe_code)] // sched_setaffinity through libc
fn run_on(cores: &[usize]) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it for every core
    // below CPU_SETSIZE.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cores.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(c, &mut set);
        }
        set
    };
    for task in std::fs::read_dir("/proc/self/task")? {
        let Some(tid) = task?
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: `set` is a valid cpu_set_t of the size passed. A thread that ended since the
        // folder was read fails with ESRCH, which is harmless.
        let done = unsafe { libc::sched_setaffinity(tid, std::mem::size_of_val(&set), &set) };
        if done != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(e);
            }
        }
    }
    Ok(())
}

/// The cores this process may run on.
#[allow(unsafe_code)] // sched_getaffinity through libc
fn usable_cores() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set, filled in by sched_getaffinity.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Two logical cores for timing, the rest for everything else; nothing below eight cores, where
/// two spared would starve the builds. The timed cores are whole physical cores: a logical core
/// shares its physical core's pipelines and caches with its hyper-threaded siblings, so a
/// compiler on a sibling would slow the timed process's launches as if it shared the core. With
/// two threads per core that is one physical core (both of its threads timed), without SMT two.
fn timing_cores(cores: &[usize], siblings: impl Fn(usize) -> Vec<usize>) -> Value {
    if cores.len() < 8 {
        return Value::Null;
    }
    let mut timed: Vec<usize> = Vec::new();
    for &core in cores.iter().rev() {
        if timed.len() >= 2 {
            break;
        }
        if timed.contains(&core) {
            continue;
        }
        let mut physical = siblings(core);
        physical.retain(|c| *c != core);
        physical.push(core);
        // A physical core this process may not wholly use is left to the untimed work.
        if physical.iter().all(|c| cores.contains(c)) {
            timed.extend(physical);
        }
    }
    if timed.len() < 2 || timed.len() * 4 > cores.len() {
        // No two whole cores to spare (or threads per core so many that a core is a quarter of
        // the machine): the last two logical cores, as without SMT.
        timed = cores[cores.len() - 2..].to_vec();
    }
    timed.sort_unstable();
    let untimed: Vec<usize> = cores
        .iter()
        .copied()
        .filter(|c| !timed.contains(c))
        .collect();
    json!({"timed": timed, "untimed": untimed})
}

/// The logical cores that share `core`'s physical core, itself included (itself alone when the
/// kernel does not say).
fn core_siblings(core: usize) -> Vec<usize> {
    let path = format!("/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list");
    std::fs::read_to_string(path)
        .ok()
        .and_then(|list| parse_cpu_list(list.trim()))
        .unwrap_or_else(|| vec![core])
}

/// A kernel CPU list (`0-3,8,10-11`).
fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cores = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((first, last)) => cores.extend(first.parse::<usize>().ok()?..=last.parse().ok()?),
            None => cores.push(part.parse().ok()?),
        }
    }
    Some(cores)
}

/// CPU seconds (all threads) as a backstop to the wall-clock limits, bounded file size, and on the
/// CPU an address-space bound of the machine's RAM (CUDA needs huge virtual mappings, so not there).
fn child_limits(cfg: &EvalConfig) -> Value {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get) as u64;
    let wall = cfg.compile_timeout + cfg.timeout * (cfg.timing_rounds + 1);
    let mut limits = json!({
        "RLIMIT_CPU": wall.as_secs().saturating_mul(cores).max(60),
        "RLIMIT_FSIZE": 16u64 << 30,
    });
    if cfg.device == crate::config::Device::Cpu {
        if let Some(ram) = physical_memory() {
            limits["RLIMIT_AS"] = json!(ram);
        }
    }
    limits
}

#[allow(unsafe_code)] // sysconf through libc
fn physical_memory() -> Option<u64> {
    // SAFETY: sysconf has no preconditions.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages > 0 && size > 0).then(|| pages as u64 * size as u64)
}

/// The fields of every request to a run-stage child (reference or candidate).
pub(crate) fn common_request(ctx: &JobContext) -> Value {
    json!({
        "device": ctx.cfg.device.as_str(),
        "precision": ctx.cfg.precision.as_str(),
        "trials": ctx.cfg.correctness_trials,
        "seed": ctx.seed,
        "timing": ctx.cfg.timing.as_str(),
        "checked_timed_calls": ctx.cfg.timing.checked_timed_calls(),
        "timed_outputs_whole_up_to": ctx.cfg.timed_outputs_whole_up_to,
        "limits": ctx.limits,
        "cores": ctx.cores,
        "env": ctx.env,
    })
}

/// The milliseconds of a `times` reply.
pub(crate) fn times_of(reply: &Value) -> Vec<f64> {
    reply["ms"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

/// A timed call this many times its round's median, and over LONG_CALL_MIN_MS, is logged.
const LONG_CALL_FACTOR: f64 = 5.0;
const LONG_CALL_MIN_MS: f64 = 0.2;

/// Logs the calls of a timed round (a `times` reply of `side` in the job in `dir`) that took
/// over LONG_CALL_FACTOR times the round's median, each with what the timing thread's host side
/// did while it enqueued the call (python/protocol.py `HostSide`). Identity candidates timed in
/// a batch show one to three such calls of 8-66 ms among calls of tens of microseconds, on
/// either side (bench/notes/eval-h200.md, sessions 23-24); these lines say whether the host or
/// the device held them up.
pub(crate) fn log_long_calls(dir: &std::path::Path, side: &str, reply: &Value) {
    let ms = times_of(reply);
    let mut sorted = ms.clone();
    sorted.sort_by(f64::total_cmp);
    let Some(&median) = sorted.get(sorted.len() / 2) else {
        return;
    };
    let host = reply["host"].as_array();
    for (call, &t) in ms.iter().enumerate() {
        if t <= LONG_CALL_FACTOR * median || t <= LONG_CALL_MIN_MS {
            continue;
        }
        let field = |k: usize| {
            host.and_then(|h| h.get(call))
                .and_then(|c| c.get(k))
                .and_then(Value::as_f64)
                .unwrap_or(f64::NAN)
        };
        tracing::info!(
            target: "dice_eval::long_calls",
            "{}: {side} call {call}: {t:.3} ms, round median {median:.4} ms; host enqueued it in \
             {:.3} ms ({:.3} ms on the cpu, {} preemptions, {} page faults)",
            dir.display(),
            field(0),
            field(1),
            field(2),
            field(3),
        );
    }
}

/// The persisting L2 state a timer reported (`persisting_l2.py`'s `Guard.found`): its
/// description by kind, "limit" (a persisting reservation) or "window" (an access-policy window
/// on the timed stream).
pub(crate) fn persisting_l2_of(reply: &Value) -> BTreeMap<String, String> {
    reply["persisting_l2"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(kind, why)| Some((kind.clone(), why.as_str()?.to_string())))
        .collect()
}

/// What the compile stage leaves for the run stage.
#[derive(Clone, Debug, Default)]
pub(crate) struct Compiled {
    pub builds: Vec<BuildRecord>,
    pub wall_s: f64,
}

/// The evaluation of one candidate, before it becomes a stored record.
#[derive(Clone, Debug)]
pub(crate) struct Outcome {
    pub verdict: Verdict,
    pub message: Option<String>,
    pub max_abs_error: Option<f64>,
    pub max_rel_error: Option<f64>,
    pub trials_passed: u32,
    pub candidate_timing: Option<TimingStats>,
    pub baseline_timing: Option<TimingStats>,
    pub candidate_wall_ms: Option<f64>,
    pub baseline_wall_ms: Option<f64>,
    /// The baseline's time over the candidate's, by the statistic of the timing
    /// (stats.rs `Statistic`), or by the evaluator's clock where the candidate's own was caught
    /// out; stored only for a correct candidate.
    pub speedup: Option<f64>,
    pub speedup_interval: Option<SpeedupInterval>,
    pub timing_remeasures: u32,
    pub log: String,
    pub builds: Vec<BuildRecord>,
    pub wall_s: f64,
    /// Run-time reward-hack findings.
    pub findings: Vec<Finding>,
    /// The kernels of the profiled correctness trial (CUDA).
    pub kernels: Option<KernelProfile>,
    /// Seconds per run-stage step (reference start, import, construct, trials, gate wait,
    /// timing, ...), in order: where the evaluator's time went.
    pub stages: Vec<(String, f64)>,
}

impl Outcome {
    pub(crate) fn failed(
        verdict: Verdict,
        message: String,
        log: String,
        builds: Vec<BuildRecord>,
        wall_s: f64,
    ) -> Outcome {
        Outcome {
            verdict,
            message: Some(message),
            max_abs_error: None,
            max_rel_error: None,
            trials_passed: 0,
            candidate_timing: None,
            baseline_timing: None,
            candidate_wall_ms: None,
            baseline_wall_ms: None,
            speedup: None,
            speedup_interval: None,
            timing_remeasures: 0,
            log,
            builds,
            wall_s,
            findings: Vec::new(),
            kernels: None,
            stages: Vec::new(),
        }
    }
}

/// A `build` event of a child as a record.
pub(crate) fn build_record(msg: &Value) -> BuildRecord {
    BuildRecord {
        key: msg["key"].as_str().unwrap_or_default().to_string(),
        name: msg["name"].as_str().unwrap_or_default().to_string(),
        ok: msg["ok"].as_bool().unwrap_or(false),
        cached: msg["cached"].as_bool().unwrap_or(false),
        wall_s: msg["wall_s"].as_f64().unwrap_or(0.0),
        log: msg["log"].as_str().unwrap_or_default().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `run_on` moves the threads already running, and threads started afterwards inherit it.
    #[test]
    fn every_thread_of_the_process_moves_off_the_timed_cores() {
        let all = usable_cores();
        let (ask, asked) = std::sync::mpsc::channel::<()>();
        let older = std::thread::spawn(move || {
            asked.recv().unwrap();
            usable_cores()
        });
        run_on(&all[..1]).unwrap();
        let newer = std::thread::spawn(usable_cores).join().unwrap();
        ask.send(()).unwrap();
        let older = older.join().unwrap();
        let here = usable_cores();
        run_on(&all).unwrap();
        assert_eq!(older, all[..1]);
        assert_eq!(newer, all[..1]);
        assert_eq!(here, all[..1]);
        assert_eq!(usable_cores(), all);
    }

    #[test]
    fn two_cores_are_kept_for_timing_on_machines_that_can_spare_them() {
        let cores: Vec<usize> = (0..16).collect();
        let alone = |c| vec![c];
        let split = timing_cores(&cores, alone);
        assert_eq!(split["timed"], json!([14, 15]));
        assert_eq!(split["untimed"], json!((0..14).collect::<Vec<_>>()));
        assert!(timing_cores(&cores[..4], alone).is_null());
        assert!(!usable_cores().is_empty());
        assert!(!core_siblings(usable_cores()[0]).is_empty());
    }

    /// With SMT, timing gets one whole physical core: no untimed process runs on a sibling of a
    /// timed core, whichever way the kernel numbers the siblings.
    #[test]
    fn the_timed_cores_share_no_physical_core_with_untimed_ones() {
        let cores: Vec<usize> = (0..16).collect();
        // Siblings numbered apart (0 and 8, …, 7 and 15), as on most cloud hosts.
        let split = timing_cores(&cores, |c| vec![c % 8, c % 8 + 8]);
        assert_eq!(split["timed"], json!([7, 15]));
        assert_eq!(
            split["untimed"],
            json!([0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14])
        );
        // Siblings side by side (0 and 1, …).
        let split = timing_cores(&cores, |c| vec![c & !1, c | 1]);
        assert_eq!(split["timed"], json!([14, 15]));
        // The last core's sibling outside the usable set (a cpuset): the next whole core.
        let usable: Vec<usize> = (0..15).collect();
        let split = timing_cores(&usable, |c| vec![c % 8, c % 8 + 8]);
        assert_eq!(split["timed"], json!([6, 14]));
        assert!(!split["untimed"].as_array().unwrap().contains(&json!(6)));
    }

    #[test]
    fn kernel_cpu_lists_are_read() {
        assert_eq!(parse_cpu_list("7,15"), Some(vec![7, 15]));
        assert_eq!(parse_cpu_list("0-3,8"), Some(vec![0, 1, 2, 3, 8]));
        assert_eq!(parse_cpu_list("4"), Some(vec![4]));
        assert_eq!(parse_cpu_list("x"), None);
    }
}
