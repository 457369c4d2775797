//! The seam between the trainer and data parallelism: the few collective operations a training
//! step needs, behind a trait that a single process ([`SingleProcess`]), ranks as threads or
//! processes, or NCCL implement.
//!
//! Every rank calls the same operations in the same order with buffers of the same shape (the
//! contract of every collective library); the trainer sums gradients through
//! [`Collective::all_reduce_sum`], or with a sharded optimizer through
//! [`Collective::reduce_scatter_sum_f32`] and [`Collective::all_gather_f32`].
//!
//! [`TcpGroup`] runs ranks as processes (or threads) of one or several machines, met at a
//! torchrun-style rendezvous address; ranks on CUDA GPUs switch to NCCL through it
//! ([`for_device`]; the NCCL path has not yet run on a GPU). Its reductions are deterministic: rank 0 adds the ranks'
//! buffers in rank order, so results never depend on timing.

use anyhow::{anyhow, bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::ffi::OsString;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::process::{Child, Command};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Collective operations over the ranks of one training run.
pub trait Collective: Send + Sync {
    /// This process's (or thread's) rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Ranks taking part.
    fn world_size(&self) -> usize;

    /// The element-wise sum of `tensor` over all ranks, on every rank: same shape, dtype and
    /// device as `tensor`.
    fn all_reduce_sum(&self, tensor: &Tensor) -> Result<Tensor>;

    /// The element-wise sum of a host buffer (loss sums, token counts) over all ranks, written
    /// into `values` on every rank.
    fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<()>;

    /// The element-wise sum of a host buffer of f64 (loss sums, squared norms) over all ranks.
    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<()>;

    /// The element-wise sum of `values` over all ranks, cut into consecutive segments of
    /// `counts[r]` elements: rank r gets segment r (`counts` sums to `values.len()` and is the
    /// same on every rank).
    fn reduce_scatter_sum_f32(&self, values: &[f32], counts: &[usize]) -> Result<Vec<f32>>;

    /// Every rank's `mine` (`counts[r]` elements from rank r), concatenated in rank order, on
    /// every rank.
    fn all_gather_f32(&self, mine: &[f32], counts: &[usize]) -> Result<Vec<f32>>;

    /// Rank `root`'s `tensor` on every rank (the caller passes a tensor of the same shape and
    /// dtype everywhere; only root's values matter).
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;

    /// Whether the ranks met at a rendezvous (torchrun's, or `--nproc-per-node`'s, even a
    /// single rank): CUDA ranks then talk through NCCL ([`for_device`]).
    fn met_at_rendezvous(&self) -> bool {
        true
    }
}

/// One rank alone: every collective is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleProcess;

impl Collective for SingleProcess {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_reduce_sum(&self, tensor: &Tensor) -> Result<Tensor> {
        Ok(tensor.clone())
    }

    fn all_reduce_sum_f32(&self, _values: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn all_reduce_sum_f64(&self, _values: &mut [f64]) -> Result<()> {
        Ok(())
    }

    fn reduce_scatter_sum_f32(&self, values: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        check_counts(counts, 1, values.len())?;
        Ok(values.to_vec())
    }

    fn all_gather_f32(&self, mine: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        check_gather_counts(counts, 0, 1, mine.len())?;
        Ok(mine.to_vec())
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        anyhow::ensure!(root == 0, "rank {root} does not exist in a run of one rank");
        Ok(tensor.clone())
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }

    fn met_at_rendezvous(&self) -> bool {
        false
    }
}

/// The part of `0..len` that rank `rank` of `world` takes: contiguous shares in rank order, the
/// first `len % world` ranks one more. Rows of a step and shards of the parameters are cut so.
pub fn contiguous_share(len: usize, rank: usize, world: usize) -> std::ops::Range<usize> {
    let (size, longer) = (len / world, len % world);
    let start = rank * size + rank.min(longer);
    start..start + size + usize::from(rank < longer)
}

/// The collective the ranks of a run on `device` use: NCCL between CUDA ranks that met at a
/// rendezvous, as torchrun's ranks use it (in a binary built with the `cuda` feature; see
/// [`crate::nccl`]), even one alone, so that one GPU can check the NCCL path; `collective`
/// itself otherwise. NCCL's id travels over `collective`.
pub fn for_device(collective: Box<dyn Collective>, device: &Device) -> Result<Box<dyn Collective>> {
    if device.is_cuda() && collective.met_at_rendezvous() {
        return nccl_group(&*collective, device);
    }
    Ok(collective)
}

#[cfg(feature = "cuda")]
fn nccl_group(bootstrap: &dyn Collective, device: &Device) -> Result<Box<dyn Collective>> {
    Ok(Box::new(crate::nccl::NcclGroup::new(bootstrap, device)?))
}

#[cfg(not(feature = "cuda"))]
fn nccl_group(_: &dyn Collective, _: &Device) -> Result<Box<dyn Collective>> {
    bail!("CUDA ranks talk through NCCL: build dice with `--features cuda`")
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

/// How long ranks wait for each other to arrive at the rendezvous.
const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

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

/// Ranks connected in a star around rank 0 over TCP. Rank 0 reduces (adding the buffers in
/// rank order, its own first) and sends the results back; the other ranks talk only to it.
pub struct TcpGroup {
    rank: usize,
    world_size: usize,
    /// Rank 0: the streams of ranks 1..world_size, in rank order. Other ranks: rank 0's.
    peers: Mutex<Vec<Stream>>,
}

struct Stream {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
}

impl Stream {
    fn new(stream: TcpStream) -> Result<Self> {
        stream.set_nodelay(true)?;
        Ok(Self {
            reader: BufReader::new(stream.try_clone()?),
            writer: BufWriter::new(stream),
        })
    }

    fn send(&mut self, bytes: &[u8]) -> Result<()> {
        self.writer.write_all(&(bytes.len() as u64).to_le_bytes())?;
        self.writer.write_all(bytes)?;
        self.writer.flush()?;
        Ok(())
    }

    fn receive(&mut self, expected: usize) -> Result<Vec<u8>> {
        let mut len = [0u8; 8];
        self.reader.read_exact(&mut len)?;
        let len = u64::from_le_bytes(len) as usize;
        ensure!(
            len == expected,
            "a rank sent {len} bytes where {expected} were expected: the ranks run different \
             programs or settings"
        );
        let mut bytes = vec![0u8; len];
        self.reader.read_exact(&mut bytes)?;
        Ok(bytes)
    }
}

impl TcpGroup {
    /// Rank 0: accepts the other `world_size - 1` ranks on `listener`.
    pub fn host(listener: TcpListener, world_size: usize) -> Result<Self> {
        let mut peers: Vec<Option<Stream>> = (1..world_size).map(|_| None).collect();
        listener.set_nonblocking(true)?;
        let started = Instant::now();
        while peers.iter().any(Option::is_none) {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false)?;
                    let mut stream = Stream::new(stream)?;
                    let hello = stream.receive(16)?;
                    let rank = u64::from_le_bytes(hello[..8].try_into()?) as usize;
                    let world = u64::from_le_bytes(hello[8..].try_into()?) as usize;
                    ensure!(
                        world == world_size && (1..world_size).contains(&rank),
                        "a rank {rank} of a world of {world} joined a world of {world_size}: \
                         every rank needs the same WORLD_SIZE and its own RANK"
                    );
                    ensure!(
                        peers[rank - 1].is_none(),
                        "two processes joined as rank {rank}: give every process its own RANK"
                    );
                    peers[rank - 1] = Some(stream);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if started.elapsed() > RENDEZVOUS_TIMEOUT {
                        let missing: Vec<usize> = (1..world_size)
                            .filter(|&r| peers[r - 1].is_none())
                            .collect();
                        bail!(
                            "ranks {missing:?} did not join within {}s: start all {world_size} \
                             ranks with the same MASTER_ADDR and MASTER_PORT",
                            RENDEZVOUS_TIMEOUT.as_secs()
                        );
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e).context("the rendezvous failed"),
            }
        }
        Ok(Self {
            rank: 0,
            world_size,
            peers: Mutex::new(peers.into_iter().flatten().collect()),
        })
    }

    /// Rank `rank` (not 0): connects to rank 0 at `master`, retrying while it starts.
    pub fn join(master: impl ToSocketAddrs, rank: usize, world_size: usize) -> Result<Self> {
        ensure!(
            (1..world_size).contains(&rank),
            "rank {rank} cannot join a world of {world_size}"
        );
        let addrs: Vec<SocketAddr> = master
            .to_socket_addrs()
            .context("cannot resolve MASTER_ADDR")?
            .collect();
        let started = Instant::now();
        let stream = loop {
            match addrs.iter().find_map(|a| TcpStream::connect(a).ok()) {
                Some(stream) => break stream,
                None if started.elapsed() > RENDEZVOUS_TIMEOUT => bail!(
                    "rank {rank} could not reach rank 0 at {addrs:?} within {}s: check \
                     MASTER_ADDR and MASTER_PORT, and that rank 0 runs",
                    RENDEZVOUS_TIMEOUT.as_secs()
                ),
                None => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let mut stream = Stream::new(stream)?;
        let mut hello = (rank as u64).to_le_bytes().to_vec();
        hello.extend((world_size as u64).to_le_bytes());
        stream.send(&hello)?;
        Ok(Self {
            rank,
            world_size,
            peers: Mutex::new(vec![stream]),
        })
    }

    fn peers(&self) -> std::sync::MutexGuard<'_, Vec<Stream>> {
        self.peers.lock().expect("a collective call panicked")
    }

    /// Rank 0 gets every rank's buffer (its own first) and returns what `combine` makes of
    /// them, cut into one reply per rank; every rank returns its reply.
    fn gather_then_scatter<T: Element>(
        &self,
        mine: &[T],
        lens: &[usize],
        reply_lens: &[usize],
        combine: impl FnOnce(Vec<Vec<T>>) -> Vec<Vec<T>>,
    ) -> Result<Vec<T>> {
        let mut peers = self.peers();
        let failed = || format!("rank {} lost the connection to the other ranks", self.rank);
        if self.rank != 0 {
            let stream = &mut peers[0];
            stream.send(&T::to_bytes(mine)).with_context(failed)?;
            let reply = stream
                .receive(reply_lens[self.rank] * T::SIZE)
                .with_context(failed)?;
            return Ok(T::from_bytes(&reply));
        }
        let mut buffers = vec![mine.to_vec()];
        for (rank, stream) in (1..).zip(peers.iter_mut()) {
            let bytes = stream.receive(lens[rank] * T::SIZE).with_context(failed)?;
            buffers.push(T::from_bytes(&bytes));
        }
        let mut replies = combine(buffers).into_iter();
        let own = replies.next().expect("a reply for every rank");
        for (stream, reply) in peers.iter_mut().zip(replies) {
            stream.send(&T::to_bytes(&reply)).with_context(failed)?;
        }
        Ok(own)
    }

    fn all_reduce<T: Element>(&self, values: &mut [T]) -> Result<()> {
        let lens = vec![values.len(); self.world_size];
        let world = self.world_size;
        let sum = self.gather_then_scatter(values, &lens, &lens, |buffers| {
            vec![sum_in_rank_order(buffers); world]
        })?;
        values.copy_from_slice(&sum);
        Ok(())
    }
}

impl Collective for TcpGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_sum(&self, tensor: &Tensor) -> Result<Tensor> {
        let mut values = host_f32(tensor)?;
        self.all_reduce(&mut values)?;
        Ok(Tensor::from_vec(values, tensor.shape(), tensor.device())?.to_dtype(tensor.dtype())?)
    }

    fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<()> {
        self.all_reduce(values)
    }

    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<()> {
        self.all_reduce(values)
    }

    fn reduce_scatter_sum_f32(&self, values: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        check_counts(counts, self.world_size, values.len())?;
        let lens = vec![values.len(); self.world_size];
        self.gather_then_scatter(values, &lens, counts, |buffers| {
            let sum = sum_in_rank_order(buffers);
            let mut start = 0;
            counts
                .iter()
                .map(|&count| {
                    start += count;
                    sum[start - count..start].to_vec()
                })
                .collect()
        })
    }

    fn all_gather_f32(&self, mine: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        check_gather_counts(counts, self.rank, self.world_size, mine.len())?;
        let total: usize = counts.iter().sum();
        let world = self.world_size;
        self.gather_then_scatter(mine, counts, &vec![total; world], |buffers| {
            vec![buffers.concat(); world]
        })
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        ensure!(
            root < self.world_size,
            "rank {root} does not exist in a run of {} ranks",
            self.world_size
        );
        let values = host_f32(tensor)?;
        let lens = vec![values.len(); self.world_size];
        let world = self.world_size;
        let values = self.gather_then_scatter(&values, &lens, &lens, |mut buffers| {
            vec![std::mem::take(&mut buffers[root]); world]
        })?;
        Ok(Tensor::from_vec(values, tensor.shape(), tensor.device())?.to_dtype(tensor.dtype())?)
    }

    fn barrier(&self) -> Result<()> {
        self.all_reduce::<f32>(&mut [])
    }
}

/// A tensor's values as f32 on the host (exact for the f16, bf16 and f32 weights and
/// gradients a trainer exchanges).
fn host_f32(tensor: &Tensor) -> Result<Vec<f32>> {
    Ok(tensor.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?)
}

/// A reduce-scatter's segments: one per rank, together `len` values.
pub(crate) fn check_counts(counts: &[usize], world_size: usize, len: usize) -> Result<()> {
    ensure!(
        counts.len() == world_size && counts.iter().sum::<usize>() == len,
        "the segments {counts:?} do not fit {len} values over {world_size} ranks"
    );
    Ok(())
}

/// An all-gather's segments: one per rank, `rank`'s of `mine` values.
pub(crate) fn check_gather_counts(
    counts: &[usize],
    rank: usize,
    world_size: usize,
    mine: usize,
) -> Result<()> {
    ensure!(
        counts.len() == world_size && counts[rank] == mine,
        "rank {rank} gives {mine} values to an all-gather of segments {counts:?}"
    );
    Ok(())
}

/// The element-wise sum of the ranks' buffers, added in rank order.
fn sum_in_rank_order<T: Element>(buffers: Vec<Vec<T>>) -> Vec<T> {
    let mut buffers = buffers.into_iter();
    let mut sum = buffers.next().expect("rank 0's buffer");
    for buffer in buffers {
        for (s, x) in sum.iter_mut().zip(buffer) {
            *s = s.add(x);
        }
    }
    sum
}

/// The numbers a [`TcpGroup`] sends: little-endian bytes on the wire.
trait Element: Copy + Send {
    const SIZE: usize;
    fn add(self, other: Self) -> Self;
    fn to_bytes(values: &[Self]) -> Vec<u8>;
    fn from_bytes(bytes: &[u8]) -> Vec<Self>;
}

macro_rules! element {
    ($t:ty) => {
        impl Element for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn add(self, other: Self) -> Self {
                self + other
            }
            fn to_bytes(values: &[Self]) -> Vec<u8> {
                values.iter().flat_map(|v| v.to_le_bytes()).collect()
            }
            fn from_bytes(bytes: &[u8]) -> Vec<Self> {
                bytes
                    .chunks_exact(Self::SIZE)
                    .map(|b| <$t>::from_le_bytes(b.try_into().expect("a whole number")))
                    .collect()
            }
        }
    };
}
element!(f32);
element!(f64);

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Runs `body` on `world` ranks as threads joined through a [`TcpGroup`] on localhost.
    fn on_ranks<R: Send>(world: usize, body: impl Fn(&dyn Collective) -> R + Sync) -> Vec<R> {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let listener = Mutex::new(Some(listener));
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let (body, listener) = (&body, &listener);
                    scope.spawn(move || {
                        let group = if rank == 0 {
                            let listener = listener.lock().unwrap().take().unwrap();
                            TcpGroup::host(listener, world).unwrap()
                        } else {
                            TcpGroup::join(addr, rank, world).unwrap()
                        };
                        body(&group)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn contiguous_shares_cover_the_range_once_in_order() {
        for (len, world) in [(7, 3), (2, 4), (8, 2), (5, 1)] {
            let all: Vec<usize> = (0..world)
                .flat_map(|r| contiguous_share(len, r, world))
                .collect();
            assert_eq!(all, (0..len).collect::<Vec<_>>(), "{len} of {world} ranks");
        }
        assert_eq!(contiguous_share(7, 0, 3), 0..3);
        assert_eq!(contiguous_share(7, 2, 3), 5..7);
    }

    #[test]
    fn sums_are_added_in_rank_order_on_every_rank() {
        // 1e8 + 1 - 1e8 is 0 in f32 when added in rank order, 1 in another order.
        let results = on_ranks(3, |group| {
            let mine = [1e8f32, 1.0, -1e8][group.rank()];
            let mut values = [mine, group.rank() as f32];
            group.all_reduce_sum_f32(&mut values).unwrap();
            let mut wide = [f64::from(mine)];
            group.all_reduce_sum_f64(&mut wide).unwrap();
            let tensor = Tensor::new(&[mine, 2.0], &Device::Cpu).unwrap();
            let summed = group.all_reduce_sum(&tensor).unwrap();
            (values, wide, summed.to_vec1::<f32>().unwrap())
        });
        for (values, wide, summed) in results {
            assert_eq!(values, [0.0, 3.0]);
            assert_eq!(wide, [1.0]);
            assert_eq!(summed, [0.0, 6.0]);
        }
    }

    #[test]
    fn reduce_scatter_then_all_gather_is_an_all_reduce() {
        let counts = [2, 0, 3];
        let results = on_ranks(3, |group| {
            let values: Vec<f32> = (0..5).map(|i| (i * (group.rank() + 1)) as f32).collect();
            let shard = group.reduce_scatter_sum_f32(&values, &counts).unwrap();
            let gathered = group.all_gather_f32(&shard, &counts).unwrap();
            (shard, gathered)
        });
        let shards: Vec<Vec<f32>> = results.iter().map(|(s, _)| s.clone()).collect();
        assert_eq!(shards, [vec![0.0, 6.0], vec![], vec![12.0, 18.0, 24.0]]);
        for (_, gathered) in results {
            assert_eq!(gathered, [0.0, 6.0, 12.0, 18.0, 24.0]);
        }
    }

    #[test]
    fn broadcast_sends_the_root_tensor_in_its_dtype() {
        let results = on_ranks(2, |group| {
            let tensor = Tensor::new(&[group.rank() as f32 + 0.5, 7.0], &Device::Cpu)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            let received = group.broadcast(&tensor, 1).unwrap();
            group.barrier().unwrap();
            received
        });
        for received in results {
            assert_eq!(received.dtype(), DType::BF16);
            let values = received
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            assert_eq!(values, [1.5, 7.0]);
        }
    }

    #[test]
    fn ranks_of_a_rendezvous_even_one_would_use_nccl_on_cuda_and_a_lone_process_not() {
        assert!(!SingleProcess.met_at_rendezvous());
        assert_eq!(on_ranks(1, |group| group.met_at_rendezvous()), [true]);
        // On the CPU every collective stays what it is.
        let lone = for_device(Box::new(SingleProcess), &Device::Cpu).unwrap();
        assert!(!lone.met_at_rendezvous());
    }

    #[test]
    fn a_rank_outside_the_world_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let Err(error) = TcpGroup::join(listener.local_addr().unwrap(), 2, 2) else {
            panic!("rank 2 joined a world of 2");
        };
        assert!(error
            .to_string()
            .contains("rank 2 cannot join a world of 2"));
    }
}
