//! SDAR / DICE block-diffusion models in candle: checkpoint loading, the stateless model with
//! caller-owned KV caches, the two-stream SFT forward and loss (one autograd graph, or
//! checkpointed layer by layer), the timing of its inference forwards at real sizes, the Qwen2
//! tokenizer rebuilt from vocab + merges, the chat template, deterministic checkpoints of any
//! config (formula or seeded random weights) and the checks against the formula golden.

pub mod adamw;
pub mod chat;
pub mod checkpoint;
pub mod config;
mod cubin_cache;
pub mod device;
pub mod forward_timing;
pub mod golden;
pub mod init;
#[cfg(feature = "cuda")]
mod kernels;
mod layer_ops;
pub mod masks;
pub mod memory;
mod precompile;
pub mod sdar;
pub mod sft;
pub mod shards;
pub mod tokenizer;

pub use chat::ChatTemplate;
pub use config::SdarConfig;
pub use cubin_cache::{kernel_cache_folder, Precompiled, KERNEL_CACHE_ENV};
#[cfg(feature = "cuda")]
pub use kernels::decode_ops::{greedy_summary, sample_summary};
#[cfg(feature = "cuda")]
pub use kernels::optim::{adamw_step, square_sums};
pub use precompile::precompile_kernels;
#[cfg(feature = "cuda")]
pub use sdar::DecodeGraph;
pub use sdar::{KvCache, LossGradients, MaskedSequence, Sdar};
pub use sft::{PackedRow, TwoStreamBatch};
pub use tokenizer::SdarTokenizer;
