//! Training SDAR / DICE block-diffusion models: supervised fine-tuning data packed as the
//! reference packs it (LlamaFactory's formats, the qwen3 template, block padding, greedy
//! knapsack rows), the per-sample noising of the block-diffusion objective, the optimizer and
//! its schedules, data parallelism (the collective operations, the ranks' launch and
//! rendezvous, the optimizer state sharded over the ranks: [`dist`]), what every training run
//! has (settings, resuming, checkpoints, the progress loop: [`run`]), the SFT trainer, and
//! BiC-RL (the TraceRL objective, and the steps that roll out, judge and update).

pub mod data;
pub mod dist;
pub mod golden;
mod host_step;
pub mod metrics;
pub mod noise;
pub mod optim;
mod readback;
pub mod rl;
pub mod run;
pub mod schedule;
pub mod sft;
pub mod step_timing;
