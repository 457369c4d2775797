//! Argument types that several commands share; this module depends on no command.

use anyhow::{Context, Result};
use candle_core::DType;
use clap::{Args, ValueEnum};
use dice_eval::Device;
use dice_model::SdarConfig;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum DTypeArg {
    F32,
    Bf16,
    Fp16,
}

const NO_CUDA: &str =
    "cannot use CUDA (is this binary built with `--features cuda` and is a GPU visible?)";

/// Where a model runs on `device`: the CPU, or the first GPU.
pub(crate) fn candle_device(device: Device) -> Result<candle_core::Device> {
    match device {
        Device::Cpu => Ok(candle_core::Device::Cpu),
        Device::Cuda => dice_model::device::cuda_device(0).context(NO_CUDA),
    }
}

/// Where models run on `device`: the CPU, or every visible GPU.
pub(crate) fn candle_devices(device: Device) -> Result<Vec<candle_core::Device>> {
    match device {
        Device::Cpu => Ok(vec![candle_core::Device::Cpu]),
        Device::Cuda => dice_model::device::cuda_devices().context(NO_CUDA),
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
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// Weight and activation dtype.
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: DTypeArg,
}

impl RandomModelArgs {
    pub(crate) fn resolve(&self) -> Result<(SdarConfig, candle_core::Device, DType)> {
        Ok((
            SdarConfig::from_path(&self.config)?,
            candle_device(self.device)?,
            self.dtype.dtype(),
        ))
    }

    pub(crate) fn config_name(&self) -> String {
        self.config.display().to_string()
    }
}
