//! Data parallelism: the collective operations the ranks of a run exchange gradients through
//! ([`collective`]: one process alone, ranks over TCP, NCCL between CUDA ranks), how the ranks
//! start and meet ([`launch`]), the optimizer state sharded over them as ZeRO does ([`zero`]),
//! and each rank's device.
//!
//! Ranks on CUDA GPUs that met at a rendezvous talk through NCCL ([`for_device`]; the NCCL path
//! has not yet run on a GPU).

pub mod collective;
pub mod launch;
pub mod zero;

pub use collective::tcp::TcpGroup;
pub use collective::{contiguous_share, Collective, SingleProcess};
pub use launch::{join_or_launch, launch_local_ranks, local_rank, Rendezvous};

use anyhow::{Context, Result};

/// This rank's device for a run on `device`: the CPU, or its machine's GPU `LOCAL_RANK`.
pub fn rank_device(device: dice_eval::Device) -> Result<candle_core::Device> {
    match device {
        dice_eval::Device::Cpu => Ok(candle_core::Device::Cpu),
        dice_eval::Device::Cuda => dice_model::device::cuda_device(local_rank()?).context(
            "cannot use CUDA (is this binary built with `--features cuda` and is a GPU visible?)",
        ),
    }
}

/// The collective the ranks of a run on `device` use: NCCL between CUDA ranks that met at a
/// rendezvous, as torchrun's ranks use it (in a binary built with the `cuda` feature; see
/// [`collective::nccl`]), even one alone, so that one GPU can check the NCCL path; `collective`
/// itself otherwise. NCCL's id travels over `collective`.
pub fn for_device(
    collective: Box<dyn Collective>,
    device: &candle_core::Device,
) -> Result<Box<dyn Collective>> {
    if device.is_cuda() && collective.met_at_rendezvous() {
        return nccl_group(&*collective, device);
    }
    Ok(collective)
}

#[cfg(feature = "cuda")]
fn nccl_group(
    bootstrap: &dyn Collective,
    device: &candle_core::Device,
) -> Result<Box<dyn Collective>> {
    Ok(Box::new(collective::nccl::NcclGroup::new(
        bootstrap, device,
    )?))
}

#[cfg(not(feature = "cuda"))]
fn nccl_group(_: &dyn Collective, _: &candle_core::Device) -> Result<Box<dyn Collective>> {
    anyhow::bail!("CUDA ranks talk through NCCL: build dice with `--features cuda`")
}

#[cfg(test)]
mod tests {
    use super::collective::tcp::tests::on_ranks;
    use super::*;

    #[test]
    fn ranks_of_a_rendezvous_even_one_would_use_nccl_on_cuda_and_a_lone_process_not() {
        assert!(!SingleProcess.met_at_rendezvous());
        assert_eq!(on_ranks(1, |group| group.met_at_rendezvous()), [true]);
        // On the CPU every collective stays what it is.
        let lone = for_device(Box::new(SingleProcess), &candle_core::Device::Cpu).unwrap();
        assert!(!lone.met_at_rendezvous());
    }
}
