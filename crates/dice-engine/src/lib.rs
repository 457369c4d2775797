//! Block-diffusion decoding for SDAR / DICE models (spec §4, §7): block-by-block generation
//! with whole-block prefill, per-block denoising with a transfer schedule and a remasking
//! strategy, continuous batching over the slots of one preallocated KV cache, and TraceRL
//! step traces.
//!
//! [`Engine`] drives any [`BlockDiffusionModel`]; [`SdarDecoder`] is `dice_model`'s SDAR.
//! [`serve`] puts an engine behind an OpenAI-compatible HTTP API, [`ApiClient`] talks to one.
//! [`Generator`] answers batches of prompts with local engines or an endpoint.
//! [`DecodeSettings`] is how decoding parameters are built from what a user sets.
//! [`throughput`] measures decoding speed on random-weight models of real sizes; [`golden`]
//! decodes the formula golden's generations on any device and dtype.

mod batch;
mod client;
mod engine;
pub mod golden;
mod greedy;
mod model;
mod params;
mod sampled;
mod sampling;
mod schedule;
mod sdar;
mod sequence;
mod server;
mod strategy;
#[cfg(test)]
mod test_model;
mod text;
pub mod throughput;

pub use batch::{generate_samples, Generator, Job, LocalEngines, PromptStyle};
pub use client::{Answer, ApiClient, CompletionSettings, WHOLE_BLOCKS};
/// A chat message of a [`Job`]'s conversation.
pub use dice_model::chat::ChatMessage;
pub use engine::{Completion, Engine, EngineConfig, Event, ForwardCounts, Request, RequestId};
pub use greedy::greedy_candidates;
pub use model::{BlockDiffusionModel, BlockRow, PrefillRow};
pub use params::{DecodeParams, DecodeSettings};
pub use sampling::{sample_row, Candidate, SamplingParams};
pub use schedule::transfer_schedule;
pub use sdar::SdarDecoder;
pub use sequence::FinishReason;
pub use server::{serve, ServeOptions};
pub use strategy::{select_transfer, Overflow, Scored, Strategy};
pub use text::{default_stop_ids, TextCodec};
