//! Supervised block-diffusion fine-tuning (the DICE recipe): the settings ([`config`]), the
//! data packed as they say and the dry run's report of it ([`packing`]), the rows each step
//! trains on ([`plan`]) and the training steps ([`trainer`]).

pub mod config;
pub mod packing;
pub mod plan;
pub mod trainer;

pub use config::SftConfig;
pub use packing::dry_run_report;
pub use trainer::SftTrainer;
