//! `dice serve`: an OpenAI-compatible HTTP API over a block-diffusion model.

use super::generate::{DecodeArgs, RuntimeArgs};
use anyhow::{anyhow, Context, Result};
use clap::Args;
use dice_engine::{serve, Engine, EngineConfig, ServeOptions};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub(crate) struct ServeArgs {
    /// Model folder (config.json, safetensors, tokenizer files).
    #[arg(long)]
    pub model: PathBuf,
    /// Port to listen on (0 = any free port; the address is printed on stdout).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Address to listen on; loopback unless you mean to expose the model.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Name reported by /v1/models (default: the model folder's name).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Longest sequence (prompt + new tokens) a request may need.
    #[arg(long, default_value_t = 8192)]
    pub max_seq_len: usize,
    /// Exit after answering this many requests.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Defaults of requests that do not set them (max_tokens, temperature, top_p, top_k, seed,
    /// strategy, threshold).
    #[command(flatten)]
    pub decode: DecodeArgs,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
}

pub(crate) fn run(a: ServeArgs) -> Result<()> {
    let defaults = a.decode.params(Some(&a.model))?;
    let (model, codec) = a.runtime.load(&a.model, defaults.block_length)?;
    let config = EngineConfig {
        max_batch: a.runtime.max_batch.max(1),
        max_seq_len: a.max_seq_len,
        ..EngineConfig::default()
    };
    let engine = Engine::new(model, config)?;
    let address = format!("{}:{}", a.host, a.port);
    let http = tiny_http::Server::http(&address)
        .map_err(|e| anyhow!("cannot listen on {address}: {e}"))?;
    let bound = http
        .server_addr()
        .to_ip()
        .context("the server is not listening on an IP address")?;
    println!("listening on http://{bound}/v1");
    let model_name = a.model_name.clone().unwrap_or_else(|| {
        a.model
            .file_name()
            .map_or("dice".to_string(), |n| n.to_string_lossy().into_owned())
    });
    serve(
        http,
        engine,
        codec,
        ServeOptions {
            model_name,
            defaults,
            max_requests: a.max_requests,
        },
    )
}
