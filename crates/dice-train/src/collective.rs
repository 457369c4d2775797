//! The seam between the trainer and data parallelism: the few collective operations a training
//! step needs, behind a trait that a single process ([`SingleProcess`]), ranks as threads or
//! processes, or NCCL implement.
//!
//! Every rank calls the same operations in the same order with buffers of the same shape (the
//! contract of every collective library); the trainer sums gradients through
//! [`Collective::all_reduce_sum`] and divides by [`Collective::world_size`].

use anyhow::Result;
use candle_core::Tensor;

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

    /// Rank `root`'s `tensor` on every rank (the caller passes a tensor of the same shape and
    /// dtype everywhere; only root's values matter).
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
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

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        anyhow::ensure!(root == 0, "rank {root} does not exist in a run of one rank");
        Ok(tensor.clone())
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}
