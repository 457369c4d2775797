//! The fork server: one Python process that imported torch once and forks a child per job; and
//! the slot that keeps one running across samples and batches.

use crate::python::{last_line, Runtime};
use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// How a child ended, as the zygote saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Exit {
    Code(i32),
    Signal(i32),
    /// The zygote itself went away, taking the child with it.
    Lost,
}

struct Route {
    pid: Option<Sender<i32>>,
    exit: Sender<Exit>,
}

type Routes = Arc<Mutex<HashMap<u64, Route>>>;

pub(crate) struct Zygote {
    stdin: Mutex<ChildStdin>,
    routes: Routes,
    alive: Arc<AtomicBool>,
    process: Mutex<std::process::Child>,
    /// The compilers, torch and platform its children build with (python/buildcache.py).
    toolchain: Value,
}

const READY_TIMEOUT: Duration = Duration::from_secs(300);

impl Zygote {
    /// Starts the fork server with extra environment (e.g. CUDA_VISIBLE_DEVICES) and waits until
    /// torch is imported.
    pub(crate) fn start(rt: &Runtime, env: &[(String, String)], log_name: &str) -> Result<Zygote> {
        let log = std::fs::File::create(rt.dir.path().join(log_name))?;
        let mut cmd = Command::new(&rt.python);
        cmd.arg(rt.script("zygote.py"))
            .env("PATH", &rt.path_env)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .process_group(0);
        let mut process = cmd
            .spawn()
            .with_context(|| format!("starting {}", rt.python.display()))?;
        let stdin = process.stdin.take().expect("piped stdin");
        let stdout = process.stdout.take().expect("piped stdout");
        let routes: Routes = Arc::default();
        let alive = Arc::new(AtomicBool::new(true));
        let (ready_tx, ready_rx) = mpsc::channel();
        {
            let routes = routes.clone();
            let alive = alive.clone();
            std::thread::spawn(move || {
                route_events(BufReader::new(stdout), routes, alive, ready_tx);
            });
        }
        let ready = match ready_rx.recv_timeout(READY_TIMEOUT) {
            Ok(ready) => ready,
            Err(_) => {
                let _ = process.kill();
                let _ = process.wait();
                let log = std::fs::read_to_string(rt.dir.path().join(log_name)).unwrap_or_default();
                let last = last_line(&log).unwrap_or("no output");
                bail!("the Python worker failed to start: {last}");
            }
        };
        Ok(Zygote {
            stdin: Mutex::new(stdin),
            routes,
            alive,
            process: Mutex::new(process),
            toolchain: ready["toolchain"].clone(),
        })
    }

    pub(crate) fn toolchain(&self) -> &Value {
        &self.toolchain
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Forks a child for `request` (which must carry `job`); returns its pid and where its exit
    /// status will arrive.
    pub(crate) fn spawn(&self, job: u64, request: &Value) -> Result<(i32, Receiver<Exit>)> {
        let (pid_tx, pid_rx) = mpsc::channel();
        let (exit_tx, exit_rx) = mpsc::channel();
        self.routes.lock().unwrap().insert(
            job,
            Route {
                pid: Some(pid_tx),
                exit: exit_tx,
            },
        );
        let mut fields = request.as_object().cloned().unwrap_or_default();
        fields.insert("op".into(), "spawn".into());
        fields.insert("job".into(), job.into());
        let line = format!("{}\n", Value::Object(fields));
        let written = self.stdin.lock().unwrap().write_all(line.as_bytes());
        if written.is_err() || !self.is_alive() {
            self.routes.lock().unwrap().remove(&job);
            bail!("the Python worker is gone");
        }
        let pid = pid_rx
            .recv_timeout(Duration::from_secs(60))
            .map_err(|_| anyhow!("the Python worker did not fork a child"))?;
        Ok((pid, exit_rx))
    }
}

impl Drop for Zygote {
    fn drop(&mut self) {
        let mut process = self.process.lock().unwrap();
        let _ = process.kill();
        let _ = process.wait();
    }
}

/// A fork server started on first use, and again once it died or was given up.
pub(crate) struct ZygoteSlot {
    env: Vec<(String, String)>,
    log_name: String,
    current: Mutex<Option<Arc<Zygote>>>,
    /// Fork servers started in this slot so far, restarts included.
    starts: AtomicUsize,
    /// The background start of [`ZygoteSlot::start_early`], joined before the slot stops.
    early: Mutex<Option<JoinHandle<()>>>,
}

impl ZygoteSlot {
    pub(crate) fn new(env: Vec<(String, String)>, log_name: String) -> Self {
        ZygoteSlot {
            env,
            log_name,
            current: Mutex::default(),
            starts: AtomicUsize::new(0),
            early: Mutex::default(),
        }
    }

    /// The slot of the compile stage's fork server, which sees no GPU (builds need none).
    pub(crate) fn for_builds(device: crate::config::Device) -> Self {
        let env = vec![
            ("DICE_DEVICE".to_string(), device.as_str().to_string()),
            ("CUDA_VISIBLE_DEVICES".to_string(), String::new()),
        ];
        ZygoteSlot::new(env, "zygote-build.log".to_string())
    }

    /// The slot of a device's fork server: the CPU's, or GPU `gpu`'s (the only one it sees).
    pub(crate) fn for_device(env: &[(String, String)], gpu: Option<usize>) -> Self {
        let mut env = env.to_vec();
        let log_name = match gpu {
            Some(i) => {
                env.push(("CUDA_VISIBLE_DEVICES".to_string(), i.to_string()));
                format!("zygote-gpu{i}.log")
            }
            None => "zygote-cpu.log".to_string(),
        };
        ZygoteSlot::new(env, log_name)
    }

    pub(crate) fn get(&self, rt: &Runtime) -> Result<Arc<Zygote>> {
        let mut current = self.current();
        if let Some(z) = current.as_ref().filter(|z| z.is_alive()) {
            return Ok(z.clone());
        }
        let z = Arc::new(Zygote::start(rt, &self.env, &self.log_name)?);
        self.starts.fetch_add(1, Ordering::SeqCst);
        *current = Some(z.clone());
        Ok(z)
    }

    /// Starts the fork server now, in the background, so that it is ready (or being started)
    /// when first needed; a start that fails is tried again, and reported, by that `get`.
    pub(crate) fn start_early(self: &Arc<Self>, rt: &Arc<Runtime>) {
        let mut early = self
            .early
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if early.as_ref().is_some_and(|start| !start.is_finished()) {
            return;
        }
        let (slot, rt) = (self.clone(), rt.clone());
        *early = Some(std::thread::spawn(move || {
            let _ = slot.get(&rt);
        }));
    }

    /// The next `get` starts a fresh fork server, unless another caller already replaced `z`.
    pub(crate) fn discard(&self, z: &Arc<Zygote>) {
        let mut current = self.current();
        if current.as_ref().is_some_and(|c| Arc::ptr_eq(c, z)) {
            *current = None;
        }
    }

    pub(crate) fn starts(&self) -> usize {
        self.starts.load(Ordering::SeqCst)
    }

    /// Ends the fork server, once a start in the background has finished: no fork server, nor
    /// the scratch directory its start holds, outlives the evaluator.
    pub(crate) fn stop(&self) {
        let early = self
            .early
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(start) = early {
            let _ = start.join();
        }
        self.current().take();
    }

    fn current(&self) -> MutexGuard<'_, Option<Arc<Zygote>>> {
        self.current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Says once per evaluator what the sandbox cannot do on this machine (SANDBOX.md).
fn warn_about_sandbox(ready: &Value) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    if ready["namespaces"] == Value::Bool(false) {
        WARNED.call_once(|| {
            tracing::warn!(
                "this machine does not let the evaluator create namespaces: candidates run \
                 without network, PID and mount isolation, so a process a candidate detaches \
                 may outlive it (see crates/dice-eval/SANDBOX.md)"
            );
        });
    }
}

fn route_events(
    stdout: BufReader<std::process::ChildStdout>,
    routes: Routes,
    alive: Arc<AtomicBool>,
    ready: Sender<Value>,
) {
    for line in stdout.lines() {
        let Ok(line) = line else { break };
        let Ok(msg) = serde_json::from_str::<Value>(&line) else {
            tracing::warn!("unexpected line from the Python worker: {line}");
            continue;
        };
        let job = msg["job"].as_u64().unwrap_or(0);
        match msg["event"].as_str() {
            Some("ready") => {
                warn_about_sandbox(&msg);
                let _ = ready.send(msg);
            }
            Some("spawned") => {
                let mut routes = routes.lock().unwrap();
                if let Some(tx) = routes.get_mut(&job).and_then(|r| r.pid.take()) {
                    let _ = tx.send(msg["pid"].as_i64().unwrap_or(0) as i32);
                }
            }
            Some("exited") => {
                if let Some(route) = routes.lock().unwrap().remove(&job) {
                    let exit = match (msg["signal"].as_i64(), msg["code"].as_i64()) {
                        (Some(sig), _) => Exit::Signal(sig as i32),
                        (None, Some(code)) => Exit::Code(code as i32),
                        (None, None) => Exit::Lost,
                    };
                    let _ = route.exit.send(exit);
                }
            }
            _ => tracing::warn!("unexpected event from the Python worker: {line}"),
        }
    }
    alive.store(false, Ordering::SeqCst);
    for (_, route) in routes.lock().unwrap().drain() {
        let _ = route.exit.send(Exit::Lost);
    }
}
