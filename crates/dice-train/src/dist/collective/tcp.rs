//! [`TcpGroup`]: ranks as processes (or threads) of one or several machines, met at a
//! torchrun-style rendezvous address ([`crate::dist::launch::Rendezvous`]). Its reductions are
//! deterministic: rank 0 adds the ranks' buffers in rank order, so results never depend on
//! timing.

use super::{check_counts, check_gather_counts, Collective};
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Tensor};
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long ranks wait for each other to arrive at the rendezvous.
const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

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
pub(crate) mod tests {
    use super::*;
    use candle_core::Device;

    /// Runs `body` on `world` ranks as threads joined through a [`TcpGroup`] on localhost.
    pub(crate) fn on_ranks<R: Send>(
        world: usize,
        body: impl Fn(&dyn Collective) -> R + Sync,
    ) -> Vec<R> {
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
