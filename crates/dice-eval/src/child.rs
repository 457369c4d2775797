//! One forked job: its private directory, its drained stdout/stderr, its control socket, its
//! deadline, and the kill of its whole process group.

// Process control (fork, setuid, signals, process groups) goes through libc.
#![allow(unsafe_code)]

use crate::excerpt::Excerpt;
use crate::quiet::Pauses;
use crate::zygote::{Exit, Zygote};
use anyhow::{Context, Result};
use serde_json::Value;
use std::collections::VecDeque;
use std::ffi::CString;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Job ids are unique in the process: they name job directories shared by all fork servers.
static NEXT_JOB: AtomicU64 = AtomicU64::new(1);

/// Longest control line accepted from a child; a longer one ends the conversation.
const MAX_LINE: u64 = 8 << 20;
/// How long to wait for a dead child's last messages and output.
const GRACE: Duration = Duration::from_secs(3);

#[derive(Debug)]
pub(crate) enum Event {
    Msg(Value),
    Exited(Exit),
}

enum Wire {
    Msg(Value),
    Closed,
}

/// Run time left to a child, not counting time spent in extension builds, which have their own
/// limit per build, nor time the child spent stopped while others were timed (quiet.rs).
pub(crate) struct Deadline {
    pub run_left: Duration,
    pub compile_limit: Duration,
    /// When the build in progress began, and how long the child had been stopped by then.
    building_since: Option<(Instant, Duration)>,
    pauses: Option<Arc<Pauses>>,
}

impl Deadline {
    pub(crate) fn new(run: Duration, compile: Duration) -> Self {
        Deadline {
            run_left: run,
            compile_limit: compile,
            building_since: None,
            pauses: None,
        }
    }

    /// Time the child spends stopped (`pauses`) counts against neither limit.
    pub(crate) fn excluding(mut self, pauses: Arc<Pauses>) -> Self {
        self.pauses = Some(pauses);
        self
    }

    pub(crate) fn building(&self) -> bool {
        self.building_since.is_some()
    }

    fn stopped(&self) -> Duration {
        self.pauses.as_ref().map_or(Duration::ZERO, |p| p.stopped())
    }

    /// How long the child may still take for what it does now.
    fn left(&self) -> Duration {
        match self.building_since {
            Some((since, stopped_then)) => {
                let used = since
                    .elapsed()
                    .saturating_sub(self.stopped() - stopped_then);
                self.compile_limit.saturating_sub(used)
            }
            None => self.run_left,
        }
    }

    /// Charges the run time since `(started, stopped then)`, unless a build is in progress.
    fn charge(&mut self, (started, stopped_then): (Instant, Duration)) {
        if self.building_since.is_none() {
            let used = started
                .elapsed()
                .saturating_sub(self.stopped() - stopped_then);
            self.run_left = self.run_left.saturating_sub(used);
        }
    }
}

pub(crate) struct Child {
    pub pid: i32,
    dir: PathBuf,
    wire: Receiver<Wire>,
    exit: Receiver<Exit>,
    writer: Arc<Mutex<Option<UnixStream>>>,
    output: Arc<Mutex<Excerpt>>,
    stop: Arc<AtomicBool>,
    drain: Option<JoinHandle<()>>,
    pending: VecDeque<Event>,
    exited: Option<Exit>,
}

impl Child {
    /// Creates the job directory with `files`, and forks a child of `role` with `request`.
    pub(crate) fn start(
        zygote: &Zygote,
        jobs_dir: &Path,
        role: &str,
        files: &[(&str, &[u8])],
        mut request: Value,
    ) -> Result<Child> {
        let job = NEXT_JOB.fetch_add(1, Ordering::SeqCst);
        let dir = jobs_dir.join(format!("{role}-{job}"));
        std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        for (name, bytes) in files {
            std::fs::write(dir.join(name), bytes)?;
        }
        let fifo = dir.join("output.fifo");
        let socket = dir.join("control.sock");
        make_fifo(&fifo)?;
        // Opened read-write so the FIFO never reports end-of-file: the drain stops when told.
        let fifo_file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)?;
        let listener = UnixListener::bind(&socket)?;
        listener.set_nonblocking(true)?;
        let output = Arc::new(Mutex::new(Excerpt::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let drain = {
            let (output, stop) = (output.clone(), stop.clone());
            std::thread::spawn(move || drain_output(fifo_file, output, stop))
        };
        let writer = Arc::new(Mutex::new(None));
        let (wire_tx, wire) = mpsc::channel();
        {
            let (writer, stop) = (writer.clone(), stop.clone());
            std::thread::spawn(move || serve_socket(listener, writer, wire_tx, stop));
        }
        let fields = request.as_object_mut().expect("a request is a JSON object");
        fields.insert("role".into(), role.into());
        fields.insert("dir".into(), dir.to_string_lossy().into());
        fields.insert("fifo".into(), fifo.to_string_lossy().into());
        fields.insert("socket".into(), socket.to_string_lossy().into());
        // Stray files of the program (temporary files, caches under HOME, unwrapped torch
        // extension builds) stay in the job directory, which is removed with the job.
        let env = fields
            .entry("env")
            .or_insert_with(|| Value::Object(Default::default()));
        if let Some(env) = env.as_object_mut() {
            for (name, path) in [
                ("TMPDIR", dir.join("tmp")),
                ("HOME", dir.clone()),
                ("TORCH_EXTENSIONS_DIR", dir.join("torch_extensions")),
            ] {
                env.insert(name.into(), path.to_string_lossy().into());
            }
            // Sandbox users have no passwd entry: getpass.getuser(), which library code such as
            // torch.profiler calls, would fail on getpwuid without these.
            for name in ["USER", "LOGNAME"] {
                env.insert(name.into(), "dice-sandbox".into());
            }
        }
        let mut child = Child {
            pid: 0,
            dir,
            wire,
            exit: mpsc::channel().1,
            writer,
            output,
            stop,
            drain: Some(drain),
            pending: VecDeque::new(),
            exited: None,
        };
        let (pid, exit) = zygote.spawn(job, &request)?;
        child.pid = pid;
        child.exit = exit;
        Ok(child)
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Sends one operation; false when the child is not (or no longer) listening.
    pub(crate) fn send(&self, op: &Value) -> bool {
        let mut writer = self.writer.lock().unwrap();
        match writer.as_mut() {
            Some(stream) => stream.write_all(format!("{op}\n").as_bytes()).is_ok(),
            None => false,
        }
    }

    /// The next message or exit, or None when the deadline passed. Extension builds announced
    /// by the child (`build_start` … `build`) are charged to the compile limit, not the run time.
    pub(crate) fn next_within(&mut self, deadline: &mut Deadline) -> Option<Event> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                if let Event::Msg(msg) = &event {
                    match msg["event"].as_str() {
                        Some("build_start") => {
                            deadline.building_since = Some((Instant::now(), deadline.stopped()));
                        }
                        Some("build") => deadline.building_since = None,
                        _ => {}
                    }
                }
                return Some(event);
            }
            if self.exited.is_some() {
                return None;
            }
            let wait = deadline.left();
            if wait.is_zero() {
                return None;
            }
            let started = (Instant::now(), deadline.stopped());
            let got = self.next_raw(wait);
            deadline.charge(started);
            // Nothing came: the wait is over, unless the child was stopped meanwhile (the next
            // turn waits for the time that gave back).
            self.pending.extend(got);
        }
    }

    /// Waits up to `wait` for anything; an exit comes after every message the child sent.
    fn next_raw(&mut self, wait: Duration) -> Vec<Event> {
        let until = Instant::now() + wait;
        loop {
            match self.wire.try_recv() {
                Ok(Wire::Msg(msg)) => return vec![Event::Msg(msg)],
                Ok(Wire::Closed) | Err(mpsc::TryRecvError::Disconnected) => {}
                Err(mpsc::TryRecvError::Empty) => {}
            }
            match self.exit.try_recv() {
                Ok(exit) => return self.collect_after_exit(exit),
                Err(mpsc::TryRecvError::Disconnected) => {
                    return self.collect_after_exit(Exit::Lost)
                }
                Err(mpsc::TryRecvError::Empty) => {}
            }
            let now = Instant::now();
            if now >= until {
                return Vec::new();
            }
            match self
                .wire
                .recv_timeout((until - now).min(Duration::from_millis(20)))
            {
                Ok(Wire::Msg(msg)) => return vec![Event::Msg(msg)],
                Ok(Wire::Closed) | Err(RecvTimeoutError::Disconnected) => {
                    std::thread::sleep(Duration::from_millis(5).min(until - now));
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    fn collect_after_exit(&mut self, exit: Exit) -> Vec<Event> {
        self.exited = Some(exit);
        self.kill_group();
        self.stop.store(true, Ordering::SeqCst);
        let until = Instant::now() + GRACE;
        let mut events = Vec::new();
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            match self.wire.recv_timeout(left) {
                Ok(Wire::Msg(msg)) => events.push(Event::Msg(msg)),
                Ok(Wire::Closed) | Err(_) => break,
            }
        }
        events.push(Event::Exited(exit));
        events
    }

    fn kill_group(&self) {
        if self.pid > 0 {
            // SAFETY: kill(2) with a negative pid signals the child's own process group only.
            unsafe { libc::kill(-self.pid, libc::SIGKILL) };
        }
    }

    /// Kills the child and everything it started, and waits for its exit; its job directory
    /// stays until [`Child::finish`].
    pub(crate) fn kill(&mut self) {
        self.kill_group();
        if self.exited.is_none() {
            if let Ok(exit) = self.exit.recv_timeout(GRACE) {
                self.exited = Some(exit);
            }
        }
    }

    /// Kills the child and everything it started, waits for its exit, and returns its output
    /// excerpt. The job directory is removed.
    pub(crate) fn finish(mut self) -> (Option<Exit>, String) {
        self.kill();
        self.stop.store(true, Ordering::SeqCst);
        if let Some(stream) = self.writer.lock().unwrap().take() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        if let Some(drain) = self.drain.take() {
            let _ = drain.join();
        }
        let text = self.output.lock().unwrap().render();
        let _ = std::fs::remove_dir_all(&self.dir);
        (self.exited, text)
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if self.drain.is_some() {
            self.kill_group();
            self.stop.store(true, Ordering::SeqCst);
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// How a child ended, as a verdict's message says it.
pub(crate) fn describe_exit(exit: Exit) -> String {
    match exit {
        Exit::Signal(sig) => format!("was killed by signal {sig} ({})", signal_name(sig)),
        Exit::Code(code) => format!("exited with status {code}"),
        Exit::Lost => "was lost with its worker".to_string(),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGABRT => "SIGABRT",
        libc::SIGFPE => "SIGFPE",
        libc::SIGILL => "SIGILL",
        libc::SIGKILL => "SIGKILL",
        libc::SIGXCPU => "SIGXCPU, CPU time limit",
        libc::SIGXFSZ => "SIGXFSZ, file size limit",
        libc::SIGTERM => "SIGTERM",
        _ => "signal",
    }
}

fn make_fifo(path: &Path) -> Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
        return Err(std::io::Error::last_os_error()).context("creating an output FIFO");
    }
    Ok(())
}

/// Reads the child's stdout/stderr continuously so it never blocks on a full pipe; keeps only an
/// excerpt. After `stop`, reads what is left and returns.
fn drain_output(mut fifo: std::fs::File, output: Arc<Mutex<Excerpt>>, stop: Arc<AtomicBool>) {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let stopping = stop.load(Ordering::SeqCst);
        let mut pfd = libc::pollfd {
            fd: fifo.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, 50) };
        loop {
            match fifo.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => output.lock().unwrap().push(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        if stopping {
            return;
        }
    }
}

/// Accepts the child's connection, then forwards each JSON line it sends.
fn serve_socket(
    listener: UnixListener,
    writer: Arc<Mutex<Option<UnixStream>>>,
    wire: Sender<Wire>,
    stop: Arc<AtomicBool>,
) {
    let stream = loop {
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(e) if e.kind() == ErrorKind::WouldBlock && !stop.load(Ordering::SeqCst) => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(_) => {
                let _ = wire.send(Wire::Closed);
                return;
            }
        }
    };
    if stream.set_nonblocking(false).is_err() {
        let _ = wire.send(Wire::Closed);
        return;
    }
    *writer.lock().unwrap() = stream.try_clone().ok();
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        match (&mut reader).take(MAX_LINE).read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) if line.last() != Some(&b'\n') => break,
            Ok(_) => match serde_json::from_slice::<Value>(&line) {
                Ok(msg) if msg.is_object() => {
                    if wire.send(Wire::Msg(msg)).is_err() {
                        return;
                    }
                }
                _ => tracing::debug!("ignoring a malformed control line from a child"),
            },
        }
    }
    let _ = wire.send(Wire::Closed);
}
