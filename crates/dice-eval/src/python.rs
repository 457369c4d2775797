//! The Python side: finding an interpreter with torch and ninja, checking it, and the embedded
//! worker scripts written to a private runtime directory.

use crate::config::Device;
use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, PoisonError};

const SCRIPTS: [(&str, &str); 10] = [
    ("zygote.py", include_str!("../python/zygote.py")),
    ("sandbox.py", include_str!("../python/sandbox.py")),
    ("profiling.py", include_str!("../python/profiling.py")),
    ("roles.py", include_str!("../python/roles.py")),
    ("protocol.py", include_str!("../python/protocol.py")),
    ("kbtiming.py", include_str!("../python/kbtiming.py")),
    (
        "persisting_l2.py",
        include_str!("../python/persisting_l2.py"),
    ),
    ("buildcache.py", include_str!("../python/buildcache.py")),
    ("probe.py", include_str!("../python/probe.py")),
    (
        "shared_output.py",
        include_str!("../python/shared_output.py"),
    ),
];

/// The project's own environment, made by scripts/setup-python.sh.
const WORKSPACE_VENV_PYTHON: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../.dice/venv/bin/python");

/// What the interpreter reported about itself.
#[derive(Clone, Debug, Deserialize)]
pub struct PythonInfo {
    pub python: String,
    pub torch: String,
    pub cpu: String,
    pub gpus: Vec<GpuInfo>,
    pub nvcc: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct GpuInfo {
    pub name: String,
    /// Compute capability, e.g. `9.0`.
    pub arch: String,
}

/// An interpreter plus the directory holding the worker scripts.
pub struct Runtime {
    pub python: PathBuf,
    /// PATH for workers: the interpreter's bin directory first, so torch finds its ninja.
    pub path_env: String,
    /// Private scratch space: the scripts, and one directory per job.
    pub dir: tempfile::TempDir,
}

/// What the interpreter must offer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Probe {
    /// torch and ninja.
    Cpu,
    /// Also GPUs and nvcc.
    Cuda,
    /// Also nvcc, and no GPU: a CPU host that builds CUDA extensions (`dice eval --stage build`).
    CudaBuilds,
}

impl Probe {
    pub fn for_device(device: Device) -> Probe {
        match device {
            Device::Cpu => Probe::Cpu,
            Device::Cuda => Probe::Cuda,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Probe::Cpu => "cpu",
            Probe::Cuda => "cuda",
            Probe::CudaBuilds => "cuda-builds",
        }
    }
}

impl Runtime {
    /// Finds the interpreter and writes the worker scripts; [`Runtime::start_probe`] checks it.
    pub fn new(explicit: Option<&Path>) -> Result<Runtime> {
        let python = locate(explicit)?;
        let dir = scratch_dir()?;
        for (name, text) in SCRIPTS {
            std::fs::write(dir.path().join(name), text)
                .with_context(|| format!("writing worker script into {}", dir.path().display()))?;
        }
        std::fs::create_dir(dir.path().join("jobs"))?;
        // Sandboxed children run as other users: they pass through to their own job folder.
        for searchable in [dir.path().to_path_buf(), dir.path().join("jobs")] {
            std::fs::set_permissions(&searchable, std::fs::Permissions::from_mode(0o711))?;
        }
        let path_env = worker_path(&python);
        Ok(Runtime {
            python,
            path_env,
            dir,
        })
    }

    /// Starts checking the interpreter for `what`: it imports torch, seconds that the fork
    /// servers' own imports may overlap. An interpreter found fit for `what` (with the same
    /// visible GPUs) earlier in this process is not checked again: every judge a process starts
    /// (curation's one per precision, a test binary's dozens) would import torch once more for
    /// the same answer.
    pub fn start_probe(&self, what: Probe) -> Result<Probing> {
        let key = ProbeKey {
            python: self.python.clone(),
            what,
            visible_gpus: std::env::var_os("CUDA_VISIBLE_DEVICES"),
        };
        let known = PROBED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, info)) = known.iter().find(|(k, _)| *k == key) {
            return Ok(Probing(Check::Known(info.clone())));
        }
        drop(known);
        let mut probe = Command::new(&self.python);
        probe
            .arg(self.script("probe.py"))
            .arg(what.as_str())
            .env("PATH", &self.path_env);
        let script = JsonScript::start(
            &mut probe,
            &self.python,
            "probe torch, ninja and the compilers",
        )?;
        Ok(Probing(Check::Running { script, key }))
    }

    pub fn script(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn jobs_dir(&self) -> PathBuf {
        self.dir.path().join("jobs")
    }
}

/// What one check of an interpreter was for.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ProbeKey {
    python: PathBuf,
    what: Probe,
    visible_gpus: Option<std::ffi::OsString>,
}

/// The interpreters this process found fit, and what they reported.
static PROBED: Mutex<Vec<(ProbeKey, PythonInfo)>> = Mutex::new(Vec::new());

/// A check of the interpreter ([`Runtime::start_probe`]).
pub struct Probing(Check);

/// Running, or answered earlier in this process.
enum Check {
    Known(PythonInfo),
    Running { script: JsonScript, key: ProbeKey },
}

impl Probing {
    /// What the interpreter reported, once the check is done; why it is unfit otherwise.
    pub fn output(self) -> Result<PythonInfo> {
        match self.0 {
            Check::Known(info) => Ok(info),
            Check::Running { script, key } => {
                let info: PythonInfo = script.output()?;
                let mut known = PROBED.lock().unwrap_or_else(PoisonError::into_inner);
                if !known.iter().any(|(k, _)| *k == key) {
                    known.push((key, info.clone()));
                }
                Ok(info)
            }
        }
    }
}

/// `--python`, then `DICE_PYTHON`, then the workspace's venv, then `python3` on PATH.
pub fn locate(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("DICE_PYTHON").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let venv = Path::new(WORKSPACE_VENV_PYTHON);
    if venv.exists() {
        return Ok(venv.to_path_buf());
    }
    Ok(PathBuf::from("python3"))
}

fn worker_path(python: &Path) -> String {
    let inherited = std::env::var("PATH").unwrap_or_default();
    match python.parent().filter(|p| !p.as_os_str().is_empty()) {
        // Resolved, because inside the sandbox only the Python installation itself is mounted:
        // a path through other folders (the workspace venv's `crates/dice-eval/../..`) would
        // not resolve there, and torch would not find ninja.
        Some(bin) => {
            let bin = bin.canonicalize().unwrap_or_else(|_| bin.to_path_buf());
            format!("{}:{inherited}", bin.display())
        }
        None => inherited,
    }
}

const SCRATCH_PREFIX: &str = "dice-eval-";
const OWNER_FILE: &str = "owner.pid";

/// RAM-backed when possible: published outputs and FIFOs live here. Scratch directories left by
/// evaluators that were killed are removed first.
fn scratch_dir() -> Result<tempfile::TempDir> {
    let shm = Path::new("/dev/shm");
    let parent = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    remove_orphans(&parent);
    let dir = tempfile::Builder::new()
        .prefix(SCRATCH_PREFIX)
        .tempdir_in(&parent)
        .or_else(|_| tempfile::Builder::new().prefix(SCRATCH_PREFIX).tempdir())
        .context("creating a scratch directory")?;
    std::fs::write(dir.path().join(OWNER_FILE), std::process::id().to_string())?;
    Ok(dir)
}

#[allow(unsafe_code)] // kill(pid, 0) through libc
fn remove_orphans(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let ours = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(SCRATCH_PREFIX));
        let owner = std::fs::read_to_string(path.join(OWNER_FILE))
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok());
        if let (true, Some(pid)) = (ours, owner) {
            // SAFETY: signal 0 only checks whether the process exists.
            let gone = unsafe { libc::kill(pid, 0) } != 0
                && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
            if gone {
                let _ = std::fs::remove_dir_all(&path);
            }
        }
    }
}

/// What to do when the Python that dice runs lacks something.
const PYTHON_HINT: &str = "pass --python or DICE_PYTHON, or run scripts/setup-python.sh";

/// A script of `python` started to do something, whose stdout is JSON.
pub struct JsonScript {
    child: std::process::Child,
    python: PathBuf,
    do_what: String,
}

impl JsonScript {
    /// Starts `command`, a script of `python`, to `do_what`.
    pub fn start(command: &mut Command, python: &Path, do_what: &str) -> Result<JsonScript> {
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot run {} ({PYTHON_HINT})", python.display()))?;
        Ok(JsonScript {
            child,
            python: python.to_path_buf(),
            do_what: do_what.to_string(),
        })
    }

    /// Its stdout read as JSON, once it has exited. A failure is one line: what it was to do,
    /// and the last line the script wrote to stderr (its exception).
    pub fn output<T: DeserializeOwned>(self) -> Result<T> {
        let (python, do_what) = (self.python.display(), &self.do_what);
        let out = self
            .child
            .wait_with_output()
            .with_context(|| format!("cannot run {python} ({PYTHON_HINT})"))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let why = last_line(&stderr).unwrap_or("it failed");
            bail!("{python} cannot {do_what}: {why} ({PYTHON_HINT})");
        }
        serde_json::from_slice(&out.stdout)
            .with_context(|| format!("unexpected output from {python} asked to {do_what}"))
    }
}

/// Runs `command`, a script of `python`, to `do_what`, and reads its stdout as JSON
/// ([`JsonScript::output`]).
pub fn json_output<T: DeserializeOwned>(
    command: &mut Command,
    python: &Path,
    do_what: &str,
) -> Result<T> {
    JsonScript::start(command, python, do_what)?.output()
}

/// The last line of `text` that is not blank: where a Python process says why it stopped.
pub(crate) fn last_line(text: &str) -> Option<&str> {
    text.lines().rev().find(|l| !l.trim().is_empty())
}
