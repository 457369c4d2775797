//! [`Collective`] over NCCL, for ranks that train on CUDA GPUs (one GPU per rank).
//!
//! **This path has not yet run on a GPU**: it compiles with `--features cuda`, and the CPU
//! tests exercise the same trainer code through [`super::tcp::TcpGroup`], but no NCCL
//! communicator has been created by it yet.
//!
//! The ranks meet through an existing collective (the torchrun rendezvous's
//! [`super::tcp::TcpGroup`], of one rank too: `--nproc-per-node 1` checks this path on a
//! single GPU), over which rank 0 broadcasts the NCCL unique id; NCCL then connects the GPUs
//! itself. The communicator runs on the candle device's stream, so its
//! operations are ordered with the model's kernels without extra synchronisation.
//!
//! NCCL adds the ranks' buffers in the order of its ring or tree, not in rank order: sums over
//! several ranks agree with [`super::tcp::TcpGroup`]'s up to f32 rounding; over one rank
//! every operation is the identity. Tensors travel as f32 (exact for the f32, bf16 and f16
//! weights and gradients a trainer exchanges); host buffers are copied to the GPU and back.
//! NCCL's reduce-scatter and all-gather take equal segments, so segments of unequal lengths
//! are padded to the longest.

use super::{check_counts, check_gather_counts, Collective};
use anyhow::{anyhow, ensure, Context, Result};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Storage, Tensor};
use cudarc::driver::CudaSlice;
use cudarc::nccl::{Comm, Id, NcclType, ReduceOp};
use std::ffi::c_char;
use std::sync::Mutex;

/// One rank of an NCCL communicator on this process's GPU.
pub struct NcclGroup {
    rank: usize,
    world_size: usize,
    device: CudaDevice,
    comm: Mutex<SendComm>,
}

/// The communicator, used by one thread at a time (behind [`NcclGroup`]'s mutex).
struct SendComm(Comm);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent, which the mutex around it ensures.
#[allow(unsafe_code)]
unsafe impl Send for SendComm {}

/// Elements of an NCCL unique id.
const ID_BYTES: usize = 128;

impl NcclGroup {
    /// Joins the ranks of `bootstrap` in an NCCL communicator on `device` (this rank's GPU):
    /// rank 0 creates the unique id and broadcasts it over `bootstrap`. Every rank calls it.
    pub fn new(bootstrap: &dyn Collective, device: &Device) -> Result<Self> {
        let Device::Cuda(device) = device else {
            anyhow::bail!("NCCL needs a CUDA device, not {device:?}");
        };
        let (rank, world_size) = (bootstrap.rank(), bootstrap.world_size());
        let mine = if rank == 0 {
            Id::new().map_err(|e| anyhow!("cannot create an NCCL id: {e:?}"))?
        } else {
            Id::uninit([0; ID_BYTES])
        };
        // The id's bytes as f32 values 0..=255 (exact), whether c_char is signed or not.
        let bytes: Vec<f32> = mine
            .internal()
            .iter()
            .map(|b| f32::from(b.to_ne_bytes()[0]))
            .collect();
        let shared = bootstrap
            .broadcast(&Tensor::from_vec(bytes, ID_BYTES, &Device::Cpu)?, 0)?
            .to_vec1::<f32>()?;
        let mut internal = [0; ID_BYTES];
        for (byte, value) in internal.iter_mut().zip(shared) {
            *byte = c_char::from_ne_bytes([value as u8]);
        }
        let comm = Comm::from_rank(device.cuda_stream(), rank, world_size, Id::uninit(internal))
            .map_err(|e| {
                anyhow!(
                    "rank {rank} of {world_size} cannot join the NCCL communicator ({e:?}): \
                     check that every rank sees its GPU and that libnccl.so.2 is installed"
                )
            })?;
        Ok(Self {
            rank,
            world_size,
            device: device.clone(),
            comm: Mutex::new(SendComm(comm)),
        })
    }

    fn comm(&self) -> std::sync::MutexGuard<'_, SendComm> {
        self.comm.lock().expect("an NCCL call panicked")
    }

    /// A copy of `values` on the GPU.
    fn upload<T: cudarc::driver::DeviceRepr + 'static>(
        &self,
        values: &[T],
    ) -> Result<CudaSlice<T>> {
        Ok(self.device.clone_htod(values)?)
    }

    /// The values of `slice`, on the host (after the operations queued before).
    fn download<T: cudarc::driver::DeviceRepr>(&self, slice: &CudaSlice<T>) -> Result<Vec<T>> {
        Ok(self.device.clone_dtoh(slice)?)
    }

    /// `tensor`'s values as a fresh f32 buffer on the GPU.
    fn f32_buffer(&self, tensor: &Tensor) -> Result<CudaSlice<f32>> {
        let flat = tensor
            .to_device(&Device::Cuda(self.device.clone()))?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .contiguous()?;
        let (storage, layout) = flat.storage_and_layout();
        let Storage::Cuda(storage) = &*storage else {
            anyhow::bail!("internal error: a CUDA tensor without CUDA storage");
        };
        let (start, end) = layout
            .contiguous_offsets()
            .context("internal error: a contiguous tensor without contiguous offsets")?;
        let slice = storage.as_cuda_slice::<f32>()?.slice(start..end);
        self.device
            .cuda_stream()
            .clone_dtod(&slice)
            .map_err(|e| anyhow!("cannot copy a buffer on the GPU: {e:?}"))
    }

    /// A tensor like `like` (shape, dtype, device) holding the f32 values of `buffer`.
    fn tensor_like(&self, buffer: CudaSlice<f32>, like: &Tensor) -> Result<Tensor> {
        let storage = CudaStorage::wrap_cuda_slice(buffer, self.device.clone());
        let tensor = Tensor::from_storage(
            Storage::Cuda(storage),
            like.shape().clone(),
            BackpropOp::none(),
            false,
        );
        Ok(tensor.to_dtype(like.dtype())?.to_device(like.device())?)
    }

    fn all_reduce_host<T: NcclType + cudarc::driver::DeviceRepr + Copy + 'static>(
        &self,
        values: &mut [T],
    ) -> Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        let mut buffer = self.upload(values)?;
        self.comm()
            .0
            .all_reduce_in_place(&mut buffer, &ReduceOp::Sum)
            .map_err(|e| self.failed("all-reduce", e))?;
        values.copy_from_slice(&self.download(&buffer)?);
        Ok(())
    }

    fn failed(&self, what: &str, error: impl std::fmt::Debug) -> anyhow::Error {
        anyhow!(
            "rank {} of {}: the NCCL {what} failed ({error:?}); another rank may have stopped",
            self.rank,
            self.world_size
        )
    }
}

impl Collective for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_sum(&self, tensor: &Tensor) -> Result<Tensor> {
        let mut buffer = self.f32_buffer(tensor)?;
        self.comm()
            .0
            .all_reduce_in_place(&mut buffer, &ReduceOp::Sum)
            .map_err(|e| self.failed("all-reduce", e))?;
        self.tensor_like(buffer, tensor)
    }

    fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<()> {
        self.all_reduce_host(values)
    }

    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<()> {
        self.all_reduce_host(values)
    }

    fn reduce_scatter_sum_f32(&self, values: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        check_counts(counts, self.world_size, values.len())?;
        let segment = counts.iter().copied().max().unwrap_or(0);
        if segment == 0 {
            return Ok(Vec::new());
        }
        let mut padded = vec![0f32; segment * self.world_size];
        let mut start = 0;
        for (rank, &count) in counts.iter().enumerate() {
            padded[rank * segment..rank * segment + count]
                .copy_from_slice(&values[start..start + count]);
            start += count;
        }
        let send = self.upload(&padded)?;
        let mut receive = self.device.alloc_zeros::<f32>(segment)?;
        self.comm()
            .0
            .reduce_scatter(&send, &mut receive, &ReduceOp::Sum)
            .map_err(|e| self.failed("reduce-scatter", e))?;
        let mut mine = self.download(&receive)?;
        mine.truncate(counts[self.rank]);
        Ok(mine)
    }

    fn all_gather_f32(&self, mine: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        check_gather_counts(counts, self.rank, self.world_size, mine.len())?;
        let segment = counts.iter().copied().max().unwrap_or(0);
        if segment == 0 {
            return Ok(Vec::new());
        }
        let mut padded = mine.to_vec();
        padded.resize(segment, 0.0);
        let send = self.upload(&padded)?;
        let mut receive = self.device.alloc_zeros::<f32>(segment * self.world_size)?;
        self.comm()
            .0
            .all_gather(&send, &mut receive)
            .map_err(|e| self.failed("all-gather", e))?;
        let all = self.download(&receive)?;
        Ok(counts
            .iter()
            .enumerate()
            .flat_map(|(rank, &count)| &all[rank * segment..rank * segment + count])
            .copied()
            .collect())
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        ensure!(
            root < self.world_size,
            "rank {root} does not exist in a run of {} ranks",
            self.world_size
        );
        let mut buffer = self.f32_buffer(tensor)?;
        self.comm()
            .0
            .broadcast_in_place(&mut buffer, root as i32)
            .map_err(|e| self.failed("broadcast", e))?;
        self.tensor_like(buffer, tensor)
    }

    fn barrier(&self) -> Result<()> {
        self.all_reduce_host(&mut [0f32])
    }
}
