//! dice-cli's integration tests, one binary: each module runs the `dice` binary as a user does,
//! for one command or one workflow. The harness runs the modules' tests side by side, so each
//! test keeps to its own temporary folders and ports; the build cache
//! (`dice_test_support::shared_build_cache`) and the tiny checkpoint
//! (`dice_test_support::checkpoint`) are the only things they share, both safe to share.

mod common;
mod example_runs;
mod tiny_server;

mod adversarial_eval;
mod bench_cli;
mod bench_generate;
mod bench_identity;
mod bench_profile;
mod bench_rl;
mod curate_cli;
mod eval_build_stage;
mod eval_cli;
mod eval_postgres;
mod eval_workers;
mod generate_kernelbench;
mod generate_serve;
mod help;
mod kernelbench_cli;
mod model_cli;
mod train_cli;
mod train_rl_cli;
