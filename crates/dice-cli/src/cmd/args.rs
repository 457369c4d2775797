//! Argument types that several commands share; this module depends on no command.

use anyhow::{ensure, Context, Result};
use candle_core::DType;
use clap::{Args, ValueEnum};
use dice_engine::{ApiClient, Generator, SamplingParams};
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

/// An OpenAI-compatible endpoint that answers prompts: `dice generate`, `dice kernelbench` and
/// `dice curate` ask it.
#[derive(Args, Clone, Debug)]
pub(crate) struct EndpointArgs {
    /// OpenAI-compatible API base (e.g. http://127.0.0.1:8000/v1).
    #[arg(long, value_name = "URL", requires = "model_name")]
    pub endpoint: Option<String>,
    /// Model name sent to the endpoint.
    #[arg(long, value_name = "NAME")]
    pub model_name: Option<String>,
    /// Environment variable holding the endpoint's API key.
    #[arg(long, value_name = "VAR")]
    pub api_key_env: Option<String>,
    /// Requests in flight at once against the endpoint.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub concurrency: usize,
}

impl EndpointArgs {
    /// The endpoint's client with its key read from `--api-key-env`; `None` without
    /// `--endpoint`.
    pub(crate) fn generator(&self) -> Result<Option<Generator>> {
        let Some(endpoint) = &self.endpoint else {
            return Ok(None);
        };
        ensure!(self.concurrency > 0, "--concurrency must be at least 1");
        let api_key = match &self.api_key_env {
            Some(var) => Some(std::env::var(var).with_context(|| {
                format!("environment variable {var} (--api-key-env) is not set")
            })?),
            None => None,
        };
        Ok(Some(Generator::Endpoint {
            client: ApiClient::new(endpoint, self.model_name()?, api_key),
            concurrency: self.concurrency,
        }))
    }

    /// The model name asked of the endpoint.
    pub(crate) fn model_name(&self) -> Result<&str> {
        self.model_name
            .as_deref()
            .context("--endpoint needs --model-name")
    }
}

/// How each token is drawn from the logits (`dice generate`'s decoding, `dice curate
/// diversify`'s endpoint).
#[derive(Args, Clone, Debug)]
pub(crate) struct SamplingArgs {
    /// Keep the k most likely tokens (1 = greedy, 0 = all).
    #[arg(long, default_value_t = 1)]
    pub top_k: usize,
    /// Logits are divided by this before sampling.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
}

impl SamplingArgs {
    pub(crate) fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
        }
    }
}
