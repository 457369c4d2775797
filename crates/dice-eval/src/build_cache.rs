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
    /// The library, copied out of the builder's folder into `staged`.
    Library {
        staged: PathBuf,
        wall_s: f64,
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
    let built = run_builder(
        ctx,
        zygote,
        extension,
        &name,
        &staging.join(staging_name(&key)),
    )?;
    let entry = match built {
        Built::Library { staged, wall_s } => {
            let entry = Entry {
                key: key.clone(),
                ok: true,
                wall_s,
                log: String::new(),
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
    let text = std::fs::read(ctx.cfg.build_cache.join(key).join(RESULT_FILE)).ok()?;
    let entry: Entry = serde_json::from_slice(&text).ok()?;
    if let Some(timed_out) = entry.timed_out {
        let limit = limit_of(ctx, timed_out.phase);
        if ctx.cfg.force || limit.as_secs() > timed_out.limit_s {
            return None;
        }
    }
    Some(entry)
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
    #[allow(unsafe_code)] // flock through libc
    fn take(cache: &Path, key: &str) -> Result<KeyLock> {
        let locks = private_folder(cache, "locks")?;
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(locks.join(key))
            .with_context(|| format!("opening the lock of build {key}"))?;
        // SAFETY: flock on a file descriptor this function owns; it blocks until granted.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("locking build {key}"));
        }
        Ok(KeyLock { _held: file })
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
    staged: &Path,
) -> Result<Built> {
    let request = json!({
        "extension": extension,
        "limits": ctx.limits,
        "cores": ctx.cores,
        "nice": COMPILE_STAGE_NICENESS,
        "env": ctx.env,
        "sandbox": ctx.users.builder(),
    });
    let mut child = Child::start(zygote, &ctx.jobs_dir, "extension", &[], request)
        .context("starting an extension build")?;
    // Stopped while candidates are timed (quiet.rs), which its time limits do not count.
    let group = ctx.build_groups.register(child.pid);
    let limit = |phase| {
        let limit = limit_of(ctx, phase);
        Deadline::new(limit, limit).excluding(group.pauses())
    };
    let mut phase = Phase::Build;
    let mut deadline = limit(phase);
    let mut wall_s = 0.0;
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
                break copy_library(&mut child, extension, name, staged, wall_s)?;
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
                    if msg["ok"] != true {
                        let log = tail(msg["log"].as_str().unwrap_or_default());
                        let transient = msg["transient"] == true;
                        break Built::Failed { log, transient };
                    }
                    phase = Phase::Load;
                    deadline = limit(phase);
                }
                Some("loaded") if phase == Phase::Load => {
                    break copy_library(&mut child, extension, name, staged, wall_s)?;
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
    let target = staged.join(&artifact);
    let mut copy = OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o755)
        .open(&target)
        .with_context(|| format!("creating {}", target.display()))?;
    std::io::copy(&mut library, &mut copy)
        .with_context(|| format!("copying the library into {}", target.display()))?;
    Ok(Built::Library {
        staged: staged.to_path_buf(),
        wall_s,
    })
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

    #[test]
    fn names_stay_inside_the_builders_folder() {
        assert!(valid_name("fused_gelu-v2.1"));
        for bad in ["", "../x", "a/b", ".hidden", "a b"] {
            assert!(!valid_name(bad), "{bad}");
        }
    }
}
