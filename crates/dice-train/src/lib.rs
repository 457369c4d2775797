//! Training SDAR / DICE block-diffusion models: supervised fine-tuning data packed as the
//! reference packs it (LlamaFactory's formats, the qwen3 template, block padding, greedy
//! knapsack rows), the per-sample noising of the block-diffusion objective, the optimizer and
//! its schedules (its state replicated or sharded over data-parallel ranks), the SFT trainer with its checkpoints and metrics, the collective operations
//! data parallelism goes through, and BiC-RL (the TraceRL objective, and the loop that rolls
//! out, judges and updates).

pub mod checkpoint;
pub mod collective;
pub mod data;
pub mod metrics;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod noise;
pub mod optim;
pub mod rl;
pub mod schedule;
pub mod sft;
pub mod step_timing;
pub mod zero;
