//! Supervised block-diffusion fine-tuning (the DICE recipe): the settings ([`config`]), the
//! rows each step trains on ([`plan`]) and the training loop ([`trainer`]).

pub mod config;
pub mod plan;
pub mod trainer;

pub use config::SftConfig;
pub use trainer::{Resume, RunOptions, SftTrainer, TrainSummary};
