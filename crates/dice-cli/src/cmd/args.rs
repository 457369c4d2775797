//! Argument types that several commands share; this module depends on no command.

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use clap::{Args, ValueEnum};
use dice_model::SdarConfig;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum DeviceKind {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum DTypeArg {
    F32,
    Bf16,
    Fp16,
}

const NO_CUDA: &str =
    "cannot use CUDA (is this binary built with `--features cuda` and is a GPU visible?)";

impl DeviceKind {
    pub(crate) fn device(self) -> Result<Device> {
        match self {
            DeviceKind::Cpu => Ok(Device::Cpu),
            DeviceKind::Cuda => dice_model::device::cuda_device(0).context(NO_CUDA),
        }
    }

    /// The CPU, or every visible GPU.
    pub(crate) fn all(self) -> Result<Vec<Device>> {
        match self {
            DeviceKind::Cpu => Ok(vec![Device::Cpu]),
            DeviceKind::Cuda => dice_model::device::cuda_devices().context(NO_CUDA),
        }
    }
}

impl DTypeArg {
    pub(crate) fn dtype(self) -> DType {
        match self {
            DTypeArg::F32 => DType::F32,
            DTypeArg::Bf16 => DType::BF16,
            DTypeArg::Fp16 => DType::F16,
        }
    }

    /// The name the flag takes (`bf16`).
    pub(crate) fn name(self) -> String {
        self.to_possible_value()
            .expect("every dtype is a possible value")
            .get_name()
            .to_string()
    }
}

/// The model a benchmark builds: a real config's shapes with random weights.
#[derive(Args)]
pub(crate) struct RandomModelArgs {
    /// A model config.json (e.g. tests/data/sdar/configs/sdar-4b.json); weights are random.
    #[arg(long)]
    pub config: PathBuf,
    /// Where to run (cuda needs a binary built with `--features cuda`).
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceKind,
    /// Weight and activation dtype.
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: DTypeArg,
}

impl RandomModelArgs {
    pub(crate) fn resolve(&self) -> Result<(SdarConfig, Device, DType)> {
        Ok((
            SdarConfig::from_path(&self.config)?,
            self.device.device()?,
            self.dtype.dtype(),
        ))
    }

    pub(crate) fn config_name(&self) -> String {
        self.config.display().to_string()
    }
}
