//! dice-model's integration tests, one binary: the formula golden's forward passes and SFT step
//! on its tiny checkpoint (`dice_test_support::checkpoint`), checkpoints, initialisation, the
//! tokenizer and chat template, the decoding profile, the fused CUDA kernels emulated on the CPU,
//! and CUDA against the CPU (ignored without the cuda feature).

mod common;

mod block_attention_emulated;
mod checkpoint;
mod checkpointed_sft;
mod cuda;
mod decode_ops_emulated;
mod golden_forward;
mod golden_sft;
mod init;
mod optim_emulated;
mod profile;
mod tokenizer;
mod train_attention_emulated;
mod train_layer_emulated;
