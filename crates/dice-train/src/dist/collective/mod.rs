//! The seam between the trainer and data parallelism: the few collective operations a training
//! step needs, behind a trait that a single process ([`SingleProcess`]), ranks as threads or
//! processes ([`tcp::TcpGroup`]), or NCCL ([`nccl`], CUDA ranks) implement.
//!
//! Every rank calls the same operations in the same order with buffers of the same shape (the
//! contract of every collective library); the trainer sums gradients through
//! [`Collective::all_reduce_sum`], or with a sharded optimizer through
//! [`Collective::reduce_scatter_sum_f32`] and [`Collective::all_gather_f32`].

pub mod tcp;

#[cfg(feature = "cuda")]
pub mod nccl;

use anyhow::{ensure, Result};
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
        ensure!(root == 0, "rank {root} does not exist in a run of one rank");
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
