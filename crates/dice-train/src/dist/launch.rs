//! How the ranks of a run start and meet: `--nproc-per-node N` starts N ranks of this machine
//! as `torchrun --nproc-per-node` does ([`launch_local_ranks`]), and every rank, started so or
//! by torchrun, Slurm or Kubernetes, finds the others through torchrun's environment variables
//! ([`Rendezvous`]).

use super::collective::tcp::TcpGroup;
use super::collective::{Collective, SingleProcess};
use anyhow::{anyhow, bail, ensure, Context, Result};
use std::ffi::OsString;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

/// This process's place in a run: its collective, or `None` once the `nproc_per_node` ranks it
/// started (running `program args`, this command line without the rank count) have all
/// finished. Ranks started by torchrun, Slurm or Kubernetes (`WORLD_SIZE` set) join their
/// rendezvous and start nothing; a process alone is a [`SingleProcess`].
pub fn join_or_launch(
    nproc_per_node: Option<usize>,
    program: &Path,
    args: &[OsString],
) -> Result<Option<Box<dyn Collective>>> {
    let rendezvous = Rendezvous::from_env()?;
    if let (Some(nproc), None) = (nproc_per_node, &rendezvous) {
        launch_local_ranks(nproc, program, args)?;
        return Ok(None);
    }
    Ok(Some(match rendezvous {
        Some(rendezvous) => rendezvous.join()?,
        None => Box::new(SingleProcess),
    }))
}

/// This process's GPU on its machine: torchrun's `LOCAL_RANK`, 0 when unset.
pub fn local_rank() -> Result<usize> {
    Ok(Rendezvous::from_env()?.map_or(0, |r| r.local_rank))
}

/// Runs `program args` as `nproc` ranks of one machine, as `torchrun --nproc-per-node` does:
/// each child gets `RANK` = `LOCAL_RANK` = its index, `WORLD_SIZE` = `nproc` and a
/// rendezvous on localhost (`MASTER_PORT` from the environment, else a free port). Returns
/// once all have exited; when one fails, the others are stopped and the error names it.
pub fn launch_local_ranks(nproc: usize, program: &Path, args: &[OsString]) -> Result<()> {
    ensure!(nproc >= 1, "--nproc-per-node must be at least 1");
    let port = match std::env::var("MASTER_PORT") {
        Ok(port) if !port.is_empty() => port,
        _ => TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .context("cannot find a free port for the rendezvous: set MASTER_PORT")?
            .port()
            .to_string(),
    };
    let mut children = Vec::with_capacity(nproc);
    for rank in 0..nproc {
        let child = Command::new(program)
            .args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .spawn()
            .with_context(|| format!("cannot start rank {rank} ({})", program.display()));
        match child {
            Ok(child) => children.push(Some(child)),
            Err(e) => {
                stop(&mut children);
                return Err(e);
            }
        }
    }
    while children.iter().any(Option::is_some) {
        let mut failure = None;
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else {
                continue;
            };
            match child.try_wait() {
                Ok(None) => {}
                Ok(Some(status)) => {
                    *slot = None;
                    if !status.success() {
                        failure = Some(anyhow!(
                            "rank {rank} of {nproc} failed ({status}); the other ranks were stopped"
                        ));
                        break;
                    }
                }
                Err(e) => {
                    failure = Some(anyhow!(e).context(format!("cannot wait for rank {rank}")));
                    break;
                }
            }
        }
        if let Some(error) = failure {
            stop(&mut children);
            return Err(error);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Kills and reaps the ranks still running.
fn stop(children: &mut [Option<Child>]) {
    for mut child in children.iter_mut().filter_map(Option::take) {
        // A rank that exited meanwhile makes kill fail; wait reaps it either way.
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Where a rank finds the others: torchrun's environment variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    pub rank: usize,
    pub world_size: usize,
    /// The rank's GPU on its machine.
    pub local_rank: usize,
    /// Rank 0's listening address (`MASTER_ADDR:MASTER_PORT`).
    pub master: String,
}

impl Rendezvous {
    /// The rendezvous of `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`
    /// as torchrun, Slurm scripts and Kubernetes jobs set them; `None` when `WORLD_SIZE` is
    /// unset (a run of one process).
    pub fn from_env() -> Result<Option<Self>> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let Some(world_size) = var("WORLD_SIZE") else {
            return Ok(None);
        };
        let number = |name: &str, value: &str| -> Result<usize> {
            value
                .parse()
                .with_context(|| format!("{name}={value} is not a number: set it as torchrun does"))
        };
        let world_size = number("WORLD_SIZE", &world_size)?;
        let rank = var("RANK").map_or(Ok(0), |v| number("RANK", &v))?;
        let local_rank = var("LOCAL_RANK").map_or(Ok(0), |v| number("LOCAL_RANK", &v))?;
        ensure!(
            world_size >= 1 && rank < world_size,
            "RANK={rank} and WORLD_SIZE={world_size} do not fit: RANK must be below WORLD_SIZE"
        );
        let master = match (var("MASTER_ADDR"), var("MASTER_PORT")) {
            (Some(addr), Some(port)) => format!("{addr}:{port}"),
            _ if world_size == 1 => String::new(),
            _ => bail!(
                "WORLD_SIZE={world_size} needs MASTER_ADDR and MASTER_PORT: rank 0's host and a \
                 free port on it"
            ),
        };
        Ok(Some(Self {
            rank,
            world_size,
            local_rank,
            master,
        }))
    }

    /// The collective of this rank: [`SingleProcess`] for a world of one, else a
    /// [`TcpGroup`] joined at the master address.
    pub fn join(&self) -> Result<Box<dyn Collective>> {
        if self.world_size == 1 {
            return Ok(Box::new(SingleProcess));
        }
        let group = if self.rank == 0 {
            let listener = TcpListener::bind(&self.master).with_context(|| {
                format!(
                    "rank 0 cannot listen on MASTER_ADDR:MASTER_PORT = {}: pick a free port \
                     of this host",
                    self.master
                )
            })?;
            TcpGroup::host(listener, self.world_size)?
        } else {
            TcpGroup::join(&self.master, self.rank, self.world_size)?
        };
        Ok(Box::new(group))
    }
}
