//! Training SDAR / DICE block-diffusion models: supervised fine-tuning data packed as the
//! reference packs it (LlamaFactory's formats, the qwen3 template, block padding, greedy
//! knapsack rows), the per-sample noising of the block-diffusion objective, the optimizer and
//! its schedules, data parallelism (the collective operations, the ranks' launch and
//! rendezvous, the optimizer state sharded over the ranks: [`dist`]), the SFT trainer with its
//! checkpoints and metrics, and BiC-RL (the TraceRL objective, and the loop that rolls out,
//! judges and updates).

pub mod checkpoint;
pub mod data;
pub mod dist;
pub mod metrics;
pub mod noise;
pub mod optim;
pub mod rl;
pub mod schedule;
pub mod sft;
pub mod step_timing;
