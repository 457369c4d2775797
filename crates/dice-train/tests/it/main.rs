//! dice-train's integration tests, one binary: SFT data (formats, packing, noise), the optimizer
//! and the TraceRL objective against the formula golden, the timed SFT step, checkpoints, and
//! the SFT and BiC-RL trainers on the CPU. Tests run at once on the harness's threads: each writes into a
//! temporary folder of its own and joins its ranks on a port of its own.

mod adamw_golden;
mod checkpoints;
mod common;
mod formats;
mod noise;
mod packing;
mod rl_trainer;
mod sft_trainer;
mod step_timing;
mod tracerl_golden;
