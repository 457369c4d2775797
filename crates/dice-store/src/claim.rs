//! Claims on a run's samples, so that several evaluating processes (workers) can share one run:
//! a worker judges only the samples it claimed, a claim lasts a lease the worker renews while it
//! works, and a worker that stops renewing (killed, or its host gone) loses its claims to the
//! next worker that asks. Each result is stored once, by the holder of its sample's claim.

use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A sample of a run: (level, problem id, sample id).
pub type SampleKey = (u32, u32, u32);

/// One evaluating process, named by its host, its process id and its start time in
/// milliseconds since the Unix epoch (`host:pid:ms`): unique on a host, also after the process
/// id is reused.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WorkerId(String);

impl WorkerId {
    /// A new worker of this process, distinct from every other worker of this process (two
    /// started in the same millisecond get consecutive start times).
    pub fn new() -> WorkerId {
        static LAST_START_MS: AtomicU64 = AtomicU64::new(0);
        let now = unix_time().as_millis() as u64;
        let previous = LAST_START_MS
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |last| {
                Some(now.max(last + 1))
            })
            .expect("the update always succeeds");
        let start_ms = now.max(previous + 1);
        WorkerId(format!("{}:{}:{start_ms}", host_name(), std::process::id()))
    }

    /// A worker named `name`, as stored in a claim.
    pub fn from_name(name: impl Into<String>) -> WorkerId {
        WorkerId(name.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this worker is known to have ended: it ran on this host and no process has its
    /// id now, so its claims need not wait for their lease (a worker of another host, or one
    /// whose id a new process took, ends by its lease alone).
    pub fn has_ended(&self) -> bool {
        let mut parts = self.0.rsplitn(3, ':');
        let (_start_ms, pid, host) = (parts.next(), parts.next(), parts.next());
        let pid = pid.and_then(|pid| pid.parse::<u32>().ok());
        match (host, pid) {
            (Some(host), Some(pid)) => {
                host == host_name() && !Path::new(&format!("/proc/{pid}")).exists()
            }
            _ => false,
        }
    }
}

impl Default for WorkerId {
    fn default() -> Self {
        WorkerId::new()
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a worker's request for samples got.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Claimed {
    /// The samples now claimed, each with the worker whose expired lease it took over.
    pub samples: Vec<(SampleKey, Option<WorkerId>)>,
    /// The samples asked for that have a stored result (judged by this worker or another).
    pub finished: Vec<SampleKey>,
}

/// The time since the Unix epoch on this host's clock.
pub(crate) fn unix_time() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_string())
        .filter(|name| !name.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_of_one_process_are_distinct_and_name_host_and_process() {
        let (a, b) = (WorkerId::new(), WorkerId::new());
        assert_ne!(a, b);
        let parts: Vec<&str> = a.as_str().rsplitn(3, ':').collect();
        assert_eq!(parts[1], std::process::id().to_string());
        assert_eq!(parts[2], host_name());
        assert!(!a.has_ended());
        let gone = format!("{}:{}:1", host_name(), u32::MAX);
        assert!(WorkerId::from_name(gone).has_ended());
        let elsewhere = format!("{}-other:{}:1", host_name(), u32::MAX);
        assert!(!WorkerId::from_name(elsewhere).has_ended());
    }
}
