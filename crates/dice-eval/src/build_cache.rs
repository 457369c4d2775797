//! The shared build cache, which only the evaluator writes (SANDBOX.md).
//!
//! A candidate's compile stage does not build: its `load_inline`/`load` (python/buildcache.py)
//! describes the extension, and [`provide`] answers with the entry of its content key, computed
//! here from that description. On a miss a builder job compiles it: a sandboxed child, as a user
//! of its own, that runs torch's build of the described sources in its job folder and then loads
//! the result once, so that static initialisers run there and not in a candidate. Once the
//! builder is dead, the evaluator copies the library out of its folder (a regular file, never
//! through a link) into a fresh folder of the cache and renames that into place under the key:
//! entries appear whole, and nothing a candidate runs can write one. Failed builds and builds
//! that ran out of time are entries too, so the same sources are not built again; a timed-out
//! one is tried again under `--force` or a longer limit.
//!
//! A `load_inline` extension's main.cpp includes torch/extension.h first, and parsing it is most
//! of that compile (bench/notes/build-speed.md: 36 s of 36, 14.5 s with a precompiled header).
//! Once `pch_after_builds` builds of one host flag set were asked of the cache, a builder job
//! compiles torch's header alone with those flags (`pch-<key>`, published like an entry,
//! ~750 MB a flag set, at most [`MAX_PCHS`] a cache), and later builds of the set read it. Only
//! flags that cannot name files, load plugins or reach other tools go into a pch
//! ([`pch_flags`]), only GCC reads one, and it reads the header itself wherever the pch does not
//! fit, so a binary never depends on it.

use crate::child::{Child, Deadline, Event};
use crate::job::{JobContext, COMPILE_STAGE_NICENESS};
use crate::zygote::Zygote;
use anyhow::{bail, Context, Result};
use dice_store::BuildRecord;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The tail of a build log kept in an entry and in the store.
const LOG_CHARS: usize = 16384;
const RESULT_FILE: &str = "DICE_RESULT.json";
/// Bigger "libraries" are not copied into the cache.
const MAX_LIBRARY_BYTES: u64 = 4 << 30;
/// Precompiled headers one cache holds at most (about 3 GB): a flag set past them builds plain,
/// so candidates that each choose other flags cannot fill the disk with pchs.
const MAX_PCHS: usize = 4;
/// The header a pch stands for, under its folder (python/buildcache.py `PCH_HEADER`).
const PCH_FILES: [&str; 2] = ["extension.h", "extension.h.gch"];

/// What became of one extension a candidate asked for.
pub(crate) struct Provided {
    /// What the store keeps about the build (trusted: written here, not by the candidate).
    pub record: BuildRecord,
    pub outcome: Provision,
}

pub(crate) enum Provision {
    /// In the cache under the record's key: the candidate loads it from there.
    Ready,
    /// It does not build (the record's log says why).
    Failed,
    /// Its build, or its load, ran out of time: the message says which.
    TimedOut(String),
}

/// `<cache>/<key>/DICE_RESULT.json`: the result of one build.
#[derive(Debug, Deserialize, Serialize)]
struct Entry {
    key: String,
    ok: bool,
    #[serde(default)]
    wall_s: f64,
    #[serde(default)]
    log: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    timed_out: Option<TimedOut>,
}

/// Which step of a build ran past which limit.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum Phase {
    /// Compiling and linking: bounded by the compile timeout.
    Build,
    /// Loading the library (its static initialisers): bounded by the run timeout.
    Load,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
struct TimedOut {
    phase: Phase,
    limit_s: u64,
}

impl TimedOut {
    fn message(self, name: &str) -> String {
        match self.phase {
            Phase::Build => format!("an extension build ran past {} s", self.limit_s),
            Phase::Load => format!(
                "loading the extension `{name}` ran past {} s (a static initialiser that does not return)",
                self.limit_s
            ),
        }
    }
}

/// What one builder job came to.
enum Built {
    /// The library (or the pch), copied out of the builder's folder into `staged`.
    Library {
        staged: PathBuf,
        wall_s: f64,
        /// Whether the host compile read the pch it was given.
        pch_used: bool,
    },
    Failed {
        log: String,
        transient: bool,
    },
    TimedOut {
        timed_out: TimedOut,
        log: String,
    },
}

/// The cache entry for `extension` (a candidate's description, python/buildcache.py
/// `describe`), built first when it is missing. Err only when the evaluator itself failed.
pub(crate) fn provide(ctx: &JobContext, zygote: &Zygote, extension: &Value) -> Result<Provided> {
    let name = extension["arguments"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    if !valid_name(&name) {
        let log = format!(
            "extension name {name:?}: use letters, digits, `_`, `-` and `.` (not first), at most 128"
        );
        return Ok(uncached_failure(String::new(), name, log));
    }
    let cache = &ctx.cfg.build_cache;
    let key = content_key(extension, zygote.toolchain(), &ctx.env);
    if let Some(entry) = usable_entry(ctx, &key) {
        return Ok(from_entry(entry, name, true));
    }
    let _lock = KeyLock::take(cache, &key)?;
    if let Some(entry) = usable_entry(ctx, &key) {
        return Ok(from_entry(entry, name, true));
    }
    let staging = cache.join("tmp");
    remove_stale_staging(&staging, &key)?;
    let pch = precompiled_header(ctx, zygote, extension)?;
    let built = run_builder(
        ctx,
        zygote,
        extension,
        &name,
        pch.as_deref(),
        &staging.join(staging_name(&key)),
    )?;
    let entry = match built {
        Built::Library {
            staged,
            wall_s,
            pch_used,
        } => {
            let log = match (&pch, pch_used) {
                (Some(folder), true) => format!("host code compiled with {}", folder.display()),
                (Some(folder), false) => format!(
                    "{} did not fit this extension's host compile (GCC read torch/extension.h itself)",
                    folder.display()
                ),
                (None, _) => String::new(),
            };
            let entry = Entry {
                key: key.clone(),
                ok: true,
                wall_s,
                log,
                timed_out: None,
            };
            publish(cache, &staged, &entry)?;
            entry
        }
        Built::Failed { log, transient } => {
            if transient {
                return Ok(uncached_failure(key, name, log));
            }
            let entry = Entry {
                key: key.clone(),
                ok: false,
                wall_s: 0.0,
                log,
                timed_out: None,
            };
            publish_result(cache, &staging, &entry)?;
            entry
        }
        Built::TimedOut { timed_out, log } => {
            let entry = Entry {
                key: key.clone(),
                ok: false,
                wall_s: 0.0,
                log,
                timed_out: Some(timed_out),
            };
            publish_result(cache, &staging, &entry)?;
            entry
        }
    };
    Ok(from_entry(entry, name, false))
}

/// Torch makes files and a Python module of the name: nothing that leaves the builder's folder.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// The SHA-256 of the description, the toolchain and the build environment, as canonical JSON:
/// python/buildcache.py `content_key` computes the same, so that run-stage candidates find what
/// was published here.
fn content_key(extension: &Value, toolchain: &Value, env: &Value) -> String {
    let var = |name: &str| {
        env.get(name)
            .cloned()
            .or_else(|| std::env::var(name).ok().map(Value::from))
            .unwrap_or(Value::Null)
    };
    let mut material = json!({
        "extension": extension,
        "toolchain": toolchain,
        "arch": var("TORCH_CUDA_ARCH_LIST"),
        "cxx": var("CXX"),
    });
    material.sort_all_objects();
    let blob = serde_json::to_vec(&material).expect("a JSON value serializes");
    hex::encode(Sha256::digest(blob))
}

/// The stored entry of `key`, unless it is a timeout to try again: under `--force`, or when this
/// evaluation's limit for that step is longer than the one it ran past.
fn usable_entry(ctx: &JobContext, key: &str) -> Option<Entry> {
    let entry = read_entry(&ctx.cfg.build_cache.join(key))?;
    if let Some(timed_out) = entry.timed_out {
        let limit = limit_of(ctx, timed_out.phase);
        if ctx.cfg.force || limit.as_secs() > timed_out.limit_s {
            return None;
        }
    }
    Some(entry)
}

/// The result stored in an entry's folder, when there is one.
fn read_entry(folder: &Path) -> Option<Entry> {
    serde_json::from_slice(&std::fs::read(folder.join(RESULT_FILE)).ok()?).ok()
}

fn limit_of(ctx: &JobContext, phase: Phase) -> Duration {
    match phase {
        Phase::Build => ctx.cfg.compile_timeout,
        Phase::Load => ctx.cfg.timeout,
    }
}

fn from_entry(entry: Entry, name: String, cached: bool) -> Provided {
    let outcome = match entry.timed_out {
        Some(timed_out) => {
            let mut message = timed_out.message(&name);
            if cached {
                message.push_str(" (stored from an earlier run; --force tries it again)");
            }
            Provision::TimedOut(message)
        }
        None if entry.ok => Provision::Ready,
        None => Provision::Failed,
    };
    Provided {
        record: BuildRecord {
            key: entry.key,
            name,
            ok: entry.ok,
            cached,
            wall_s: if cached { 0.0 } else { entry.wall_s },
            log: entry.log,
        },
        outcome,
    }
}

fn uncached_failure(key: String, name: String, log: String) -> Provided {
    Provided {
        record: BuildRecord {
            key,
            name,
            ok: false,
            cached: false,
            wall_s: 0.0,
            log,
        },
        outcome: Provision::Failed,
    }
}

/// An exclusive lock on one key, across threads and evaluators sharing the cache: one build
/// per key at a time, and the others then find its entry.
struct KeyLock {
    _held: File,
}

impl KeyLock {
    /// The lock, waiting for it.
    fn take(cache: &Path, key: &str) -> Result<KeyLock> {
        Self::lock(cache, key, true)?.context("internal error: a blocking lock was not granted")
    }

    /// The lock when no one holds it now; None when someone does.
    fn try_take(cache: &Path, key: &str) -> Result<Option<KeyLock>> {
        Self::lock(cache, key, false)
    }

    #[allow(unsafe_code)] // flock through libc
    fn lock(cache: &Path, key: &str, wait: bool) -> Result<Option<KeyLock>> {
        let locks = private_folder(cache, "locks")?;
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(locks.join(key))
            .with_context(|| format!("opening the lock of build {key}"))?;
        let operation = if wait {
            libc::LOCK_EX
        } else {
            libc::LOCK_EX | libc::LOCK_NB
        };
        // SAFETY: flock on a file descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), operation) } == 0 {
            return Ok(Some(KeyLock { _held: file }));
        }
        let error = std::io::Error::last_os_error();
        if !wait && error.kind() == std::io::ErrorKind::WouldBlock {
            return Ok(None);
        }
        Err(error).with_context(|| format!("locking build {key}"))
    }
}

/// A folder of the cache only the evaluator's user may enter.
fn private_folder(cache: &Path, name: &str) -> Result<PathBuf> {
    let dir = cache.join(name);
    match std::fs::create_dir(&dir) {
        Ok(()) => std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
    }
    Ok(dir)
}

/// A unique name for one build's staging folder: `<key>.<pid>.<n>`.
fn staging_name(key: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::SeqCst);
    format!("{key}.{}.{n}", std::process::id())
}

/// Staging folders of `key` left by a killed evaluator; the caller holds the key's lock.
fn remove_stale_staging(staging: &Path, key: &str) -> Result<()> {
    private_folder(staging.parent().expect("tmp is in the cache"), "tmp")?;
    let prefix = format!("{key}.");
    for entry in std::fs::read_dir(staging)?.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    Ok(())
}

/// Runs one builder job, and copies its library into `staged` once it is dead.
fn run_builder(
    ctx: &JobContext,
    zygote: &Zygote,
    extension: &Value,
    name: &str,
    pch: Option<&Path>,
    staged: &Path,
) -> Result<Built> {
    let mut request = json!({ "extension": extension, "pch": pch });
    let mut child = start_builder(ctx, zygote, "extension", &mut request)?;
    // Stopped while candidates are timed (quiet.rs), which its time limits do not count.
    let group = ctx.build_groups.register(child.pid);
    let limit = |phase| {
        let limit = limit_of(ctx, phase);
        Deadline::new(limit, limit).excluding(group.pauses())
    };
    let mut phase = Phase::Build;
    let mut deadline = limit(phase);
    let mut wall_s = 0.0;
    let mut pch_used = false;
    let built = loop {
        match child.next_within(&mut deadline) {
            None => {
                let limit_s = limit_of(ctx, phase).as_secs();
                let timed_out = TimedOut { phase, limit_s };
                let log = timed_out.message(name);
                break Built::TimedOut { timed_out, log };
            }
            // Crashed while loading: the candidate's own load meets the same fate, and its verdict.
            Some(Event::Exited(_)) if phase == Phase::Load => {
                break copy_library(&mut child, extension, name, staged, wall_s, pch_used)?;
            }
            Some(Event::Exited(exit)) => {
                let why = crate::child::describe_exit(exit);
                let (_, output) = child.finish();
                return Ok(Built::Failed {
                    log: tail(&format!("the extension build {why}\n{output}")),
                    transient: true,
                });
            }
            Some(Event::Msg(msg)) => match msg["event"].as_str() {
                Some("compiled") if phase == Phase::Build => {
                    wall_s = msg["wall_s"].as_f64().unwrap_or(0.0);
                    pch_used = msg["pch_used"] == true;
                    if msg["ok"] != true {
                        let log = tail(msg["log"].as_str().unwrap_or_default());
                        let transient = msg["transient"] == true;
                        break Built::Failed { log, transient };
                    }
                    phase = Phase::Load;
                    deadline = limit(phase);
                }
                Some("loaded") if phase == Phase::Load => {
                    break copy_library(&mut child, extension, name, staged, wall_s, pch_used)?;
                }
                Some("sandbox_error") => bail!(
                    "cannot sandbox an extension build: {}",
                    msg["message"].as_str().unwrap_or("unknown error")
                ),
                _ => {}
            },
        }
    };
    drop(group);
    child.finish();
    Ok(built)
}

/// The last [`LOG_CHARS`] of a log.
fn tail(log: &str) -> String {
    let mut start = log.len().saturating_sub(LOG_CHARS);
    while !log.is_char_boundary(start) {
        start += 1;
    }
    log[start..].to_string()
}

/// Kills the builder, then copies the library it left in its job folder into `staged`.
fn copy_library(
    child: &mut Child,
    extension: &Value,
    name: &str,
    staged: &Path,
    wall_s: f64,
    pch_used: bool,
) -> Result<Built> {
    child.kill();
    let artifact = if extension["arguments"]["is_standalone"] == true {
        name.to_string()
    } else {
        format!("{name}.so")
    };
    let Some(mut library) = open_regular(&child.dir().join(&artifact))? else {
        return Ok(Built::Failed {
            log: format!("the build left no regular file {artifact}"),
            transient: false,
        });
    };
    std::fs::create_dir(staged).with_context(|| format!("creating {}", staged.display()))?;
    copy_into(&mut library, &staged.join(&artifact), 0o755)?;
    Ok(Built::Library {
        staged: staged.to_path_buf(),
        wall_s,
        pch_used,
    })
}

/// A new file `target` (mode `mode`) with the content of `from`.
fn copy_into(from: &mut File, target: &Path, mode: u32) -> Result<()> {
    let mut copy = OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(mode)
        .open(target)
        .with_context(|| format!("creating {}", target.display()))?;
    std::io::copy(from, &mut copy).with_context(|| format!("copying into {}", target.display()))?;
    Ok(())
}

/// Starts a builder job of `role` (python/roles.py) with `request` completed by what every
/// builder gets: its limits, cores, niceness, environment and sandbox user.
fn start_builder(
    ctx: &JobContext,
    zygote: &Zygote,
    role: &str,
    request: &mut Value,
) -> Result<Child> {
    for (field, value) in [
        ("limits", json!(ctx.limits)),
        ("cores", json!(ctx.cores)),
        ("nice", json!(COMPILE_STAGE_NICENESS)),
        ("env", json!(ctx.env)),
        ("sandbox", json!(ctx.users.builder())),
    ] {
        request[field] = value;
    }
    Child::start(zygote, &ctx.jobs_dir, role, &[], request.take())
        .with_context(|| format!("starting an extension build ({role})"))
}

/// The host flags a `load_inline` extension's main.cpp is compiled with, when a precompiled
/// torch/extension.h may serve them: `extra_cflags` and whether torch adds CUDA's headers. None
/// for other builds, extensions with include paths of their own, and any flag not known to be
/// harmless in a pch that other programs' builds read.
fn pch_flags(extension: &Value) -> Option<Value> {
    let args = &extension["arguments"];
    // torch's own `use_pch` is dropped by the builder (python/buildcache.py), which reads this
    // one instead.
    if extension["kind"] != "load_inline" {
        return None;
    }
    if !(args["extra_include_paths"].is_null()
        || args["extra_include_paths"]
            .as_array()
            .is_some_and(Vec::is_empty))
    {
        return None;
    }
    // Trimmed, as torch passes them on.
    let flags: Vec<&str> = match &args["extra_cflags"] {
        Value::Null => Vec::new(),
        Value::Array(flags) => flags
            .iter()
            .map(|f| f.as_str().map(str::trim))
            .collect::<Option<_>>()?,
        _ => return None,
    };
    if !flags.iter().all(|f| harmless_in_pch(f)) {
        return None;
    }
    // torch's `with_cuda` default: CUDA when there are CUDA sources (a string is one source).
    let with_cuda = match (&args["with_cuda"], &args["cuda_sources"]) {
        (Value::Bool(cuda), _) => *cuda,
        (Value::Null, Value::Null) => false,
        (Value::Null, Value::String(_)) => true,
        (Value::Null, Value::Array(sources)) => !sources.is_empty(),
        _ => return None,
    };
    Some(json!({ "extra_cflags": flags, "with_cuda": with_cuda }))
}

/// Whether the host compiler is GCC (its `--version` banner), whose `X.gch` beside a header on
/// the include path is read in its place and skipped with a warning where it does not fit.
/// Clang reads precompiled headers otherwise, and stops at one that does not fit.
fn is_gcc(toolchain: &Value) -> bool {
    toolchain["cxx"]
        .as_str()
        .is_some_and(|banner| banner.contains("Free Software Foundation"))
}

/// A compiler flag that changes only how torch's header is compiled: optimisation, language
/// standard, macros with plain values, warnings, debug info, machine and code-generation
/// switches. Never one that names a file, loads a plugin, reads profiles, or passes options to
/// the preprocessor, assembler or linker (`-Wp,` `-Wa,` `-Wl,`): builder jobs run candidates'
/// flags, and a pch is read by other programs' builds.
fn harmless_in_pch(flag: &str) -> bool {
    let plain = |s: &str, extra: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-".contains(c) || extra.contains(c))
    };
    let macro_flag = |s: &str| {
        let (name, value) = s.split_once('=').unwrap_or((s, ""));
        plain(name, "") && !name.contains('-') && plain(&format!("v{value}"), ".")
    };
    match flag.as_bytes() {
        [b'-', b'O', ..] => plain(&flag[1..], ""),
        [b'-', b'D' | b'U', ..] => macro_flag(&flag[2..]),
        [b'-', b'W', ..] => plain(&flag[2..], "="),
        [b'-', b'f', ..] => {
            let name = flag[2..].trim_start_matches("no-");
            plain(name, "=")
                && ![
                    "plugin",
                    "profile",
                    "auto-profile",
                    "sanitize",
                    "debug-prefix",
                    "file-prefix",
                    "macro-prefix",
                ]
                .iter()
                .any(|p| name.starts_with(p))
        }
        [b'-', b'm', ..] => plain(&flag[2..], "=."),
        _ => {
            matches!(
                flag,
                "-w" | "-g" | "-g0" | "-g1" | "-g2" | "-g3" | "-pthread"
            ) || flag.strip_prefix("-std=").is_some_and(|s| plain(s, "+"))
        }
    }
}

/// The published precompiled torch/extension.h for `extension`'s host flags (its folder, to put
/// first on the include path), made first when the flag set has been asked for
/// `pch_after_builds` times and no other builder is making it now; None where the extension
/// may not use one, the set is still rare, another builder is making it, or it failed to build
/// (stored, so not tried again).
fn precompiled_header(
    ctx: &JobContext,
    zygote: &Zygote,
    extension: &Value,
) -> Result<Option<PathBuf>> {
    let Some(flags) = pch_flags(extension).filter(|_| is_gcc(zygote.toolchain())) else {
        return Ok(None);
    };
    let cache = &ctx.cfg.build_cache;
    let key = format!(
        "pch-{}",
        content_key(&json!({ "pch": flags }), zygote.toolchain(), &ctx.env)
    );
    let folder = cache.join(&key);
    let published = |entry: Entry| entry.ok.then(|| folder.join("pch"));
    if let Some(entry) = read_entry(&folder) {
        return Ok(published(entry));
    }
    if asked_for(cache, &key)? < ctx.cfg.pch_after_builds || pch_count(cache)? >= MAX_PCHS {
        return Ok(None);
    }
    let Some(_lock) = KeyLock::try_take(cache, &key)? else {
        return Ok(None);
    };
    if let Some(entry) = read_entry(&folder) {
        return Ok(published(entry));
    }
    Ok(build_pch(ctx, zygote, key, flags)?.and_then(published))
}

/// Runs the pch job of flag set `flags` and publishes its result under `key` (a failure too, so
/// that the set is not tried again); None when it ran out of time or failed in a way worth
/// trying again later (the caller's build goes on plain).
fn build_pch(
    ctx: &JobContext,
    zygote: &Zygote,
    key: String,
    flags: Value,
) -> Result<Option<Entry>> {
    let cache = &ctx.cfg.build_cache;
    let staging = cache.join("tmp");
    remove_stale_staging(&staging, &key)?;
    let staged = staging.join(staging_name(&key));
    let mut request = flags;
    let mut child = start_builder(ctx, zygote, "pch", &mut request)?;
    let group = ctx.build_groups.register(child.pid);
    let limit = ctx.cfg.compile_timeout;
    let mut deadline = Deadline::new(limit, limit).excluding(group.pauses());
    // (ok, log, seconds), or None to build plain this time and try again later.
    let compiled = loop {
        match child.next_within(&mut deadline) {
            None => break None,
            Some(Event::Exited(exit)) => {
                let why = crate::child::describe_exit(exit);
                break Some((false, format!("the precompiled header's build {why}"), 0.0));
            }
            Some(Event::Msg(msg)) if msg["event"] == "compiled" => {
                let log = tail(msg["log"].as_str().unwrap_or_default());
                let seconds = msg["wall_s"].as_f64().unwrap_or(0.0);
                break (msg["transient"] != true).then_some((msg["ok"] == true, log, seconds));
            }
            Some(Event::Msg(msg)) if msg["event"] == "sandbox_error" => bail!(
                "cannot sandbox a precompiled header's build: {}",
                msg["message"].as_str().unwrap_or("unknown error")
            ),
            Some(Event::Msg(_)) => {}
        }
    };
    drop(group);
    child.kill();
    let Some((compiled_ok, log, wall_s)) = compiled else {
        child.finish();
        return Ok(None);
    };
    // Stored either way: a flag set whose pch failed is not tried again.
    let ok = compiled_ok && copy_pch(&child, &staged)?;
    let entry = Entry {
        key,
        ok,
        wall_s,
        log,
        timed_out: None,
    };
    if ok {
        publish(cache, &staged, &entry)?;
    } else {
        publish_result(cache, &staging, &entry)?;
    }
    child.finish();
    Ok(Some(entry))
}

/// Copies the pch a builder left in its folder into `staged` (readable to every sandbox user);
/// false when it left no regular files there.
fn copy_pch(child: &Child, staged: &Path) -> Result<bool> {
    let target = staged.join("pch").join("torch");
    std::fs::create_dir_all(&target).with_context(|| format!("creating {}", target.display()))?;
    for file in PCH_FILES {
        let Some(mut from) = open_regular(&child.dir().join("pch/torch").join(file))? else {
            return Ok(false);
        };
        copy_into(&mut from, &target.join(file), 0o644)?;
    }
    for dir in [staged.join("pch"), target] {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(true)
}

/// The precompiled headers published in the cache, failed ones included.
fn pch_count(cache: &Path) -> Result<usize> {
    let entries =
        std::fs::read_dir(cache).with_context(|| format!("reading {}", cache.display()))?;
    Ok(entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("pch-"))
        .count())
}

/// Counts one more build of a pch's flag set asked of the cache (across runs and evaluators
/// sharing it); the count so far.
fn asked_for(cache: &Path, key: &str) -> Result<u64> {
    let path = private_folder(cache, "locks")?.join(format!("{key}.asked"));
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    file.write_all(b".")?;
    Ok(file.metadata()?.len())
}

/// `path` opened for reading when it is a regular file of a sane size; never through a link
/// (the builder's user owns its folder).
fn open_regular(path: &Path) -> Result<Option<File>> {
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(file) => file,
        Err(_) => return Ok(None),
    };
    let meta = file.metadata()?;
    Ok((meta.is_file() && meta.len() <= MAX_LIBRARY_BYTES).then_some(file))
}

/// Writes `entry`'s result into `staged`, which holds its library, and renames the folder into
/// place under its key.
fn publish(cache: &Path, staged: &Path, entry: &Entry) -> Result<()> {
    let mut file = OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o644)
        .open(staged.join(RESULT_FILE))?;
    file.write_all(&serde_json::to_vec(entry)?)?;
    // Readable to every sandbox user whatever the evaluator's umask.
    std::fs::set_permissions(staged, std::fs::Permissions::from_mode(0o755))?;
    for item in std::fs::read_dir(staged)? {
        let path = item?.path();
        let mode = if path.ends_with(RESULT_FILE) {
            0o644
        } else {
            0o755
        };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
    }
    let target = cache.join(&entry.key);
    // Only a timeout tried again replaces an entry; the caller holds the key's lock.
    if target.exists() {
        std::fs::remove_dir_all(&target)
            .with_context(|| format!("replacing {}", target.display()))?;
    }
    std::fs::rename(staged, &target).with_context(|| format!("publishing build {}", entry.key))?;
    Ok(())
}

/// Publishes an entry without a library: a failure, or a timeout.
fn publish_result(cache: &Path, staging: &Path, entry: &Entry) -> Result<()> {
    let staged = staging.join(staging_name(&entry.key));
    std::fs::create_dir(&staged).with_context(|| format!("creating {}", staged.display()))?;
    publish(cache, &staged, entry)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The golden key is python/buildcache.py `content_key` of the same material: the two sides
    /// must agree byte for byte, or run-stage candidates miss what the compile stage published.
    #[test]
    fn keys_are_what_the_python_side_computes() {
        let source = "int x = 1;\n\"\u{e9}\"\u{1}\u{7f}";
        let extension = json!({"kind": "load_inline", "arguments": {"name": "relu", "cpp_sources": source}, "sources": {}});
        let toolchain = json!({"torch": "2.11.0", "cxx": "c++ (GCC) 13"});
        let env = json!({"TORCH_CUDA_ARCH_LIST": "9.0", "CXX": null});
        assert_eq!(
            content_key(&extension, &toolchain, &env),
            "847debd29c7b074a7c62e6f986e53d518d692c40cb56e2d247fe357c75bc2f0e"
        );
        let other_arch = json!({"TORCH_CUDA_ARCH_LIST": "8.0", "CXX": null});
        assert_ne!(
            content_key(&extension, &toolchain, &other_arch),
            content_key(&extension, &toolchain, &env)
        );
    }

    /// A pch serves `load_inline` extensions whose host flags cannot reach outside the compile
    /// of torch's header; everything else builds plain.
    #[test]
    fn only_harmless_host_flags_share_a_pch() {
        let inline = |args: Value| json!({"kind": "load_inline", "arguments": args});
        let flags = |extension: &Value| pch_flags(extension).map(|f| f["extra_cflags"].clone());
        assert_eq!(
            pch_flags(&inline(json!({"cpp_sources": "x", "cuda_sources": ["y"]}))),
            Some(json!({"extra_cflags": [], "with_cuda": true}))
        );
        assert_eq!(
            pch_flags(&inline(json!({"cpp_sources": "x", "cuda_sources": null}))),
            Some(json!({"extra_cflags": [], "with_cuda": false}))
        );
        let harmless = [
            "-O3",
            "-Ofast",
            " -O2 ",
            "-std=c++17",
            "-DUSE_FAST=1",
            "-DN=64",
            "-UNDEBUG",
            "-w",
            "-Wall",
            "-Wno-unused-variable",
            "-ffast-math",
            "-fno-exceptions",
            "-fopenmp",
            "-march=native",
            "-mavx2",
            "-g",
            "-pthread",
        ];
        for flag in harmless {
            assert!(
                flags(&inline(json!({"extra_cflags": [flag]}))).is_some(),
                "{flag}"
            );
        }
        let harmful = [
            "-Wl,-rpath,/tmp",
            "-Wp,-include,/etc/passwd",
            "-Wa,--defsym,x=1",
            "-fplugin=/tmp/evil.so",
            "-fprofile-use=/tmp/p",
            "-fprofile-generate",
            "-include/tmp/x.h",
            "-I/tmp",
            "-isystem",
            "/tmp",
            "-DX=$(touch /tmp/y)",
            "-DPATH=/tmp/x",
            "-specs=/tmp/s",
            "--sysroot=/tmp",
            "-B/tmp",
            "@/tmp/args",
            "-o",
            "-fsanitize-ignorelist=/tmp/l",
        ];
        for flag in harmful {
            assert!(
                flags(&inline(json!({"extra_cflags": [flag]}))).is_none(),
                "{flag}"
            );
        }
        for other in [
            json!({"kind": "load", "arguments": {}}),
            inline(json!({"extra_include_paths": ["/tmp"]})),
            inline(json!({"extra_cflags": "-O3"})),
        ] {
            assert_eq!(pch_flags(&other), None, "{other}");
        }
    }

    #[test]
    fn only_gcc_reads_the_pch() {
        let gcc = "c++ (Debian 12.2.0-14+deb12u1) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc.";
        assert!(is_gcc(&json!({ "cxx": gcc })));
        let clang = "Debian clang version 14.0.6\nTarget: x86_64-pc-linux-gnu";
        assert!(!is_gcc(&json!({ "cxx": clang })));
        assert!(!is_gcc(&json!({ "cxx": null })));
    }

    #[test]
    fn names_stay_inside_the_builders_folder() {
        assert!(valid_name("fused_gelu-v2.1"));
        for bad in ["", "../x", "a/b", ".hidden", "a b"] {
            assert!(!valid_name(bad), "{bad}");
        }
    }
}
