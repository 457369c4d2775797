//! `dice train`: block-diffusion fine-tuning.

use super::generate::DeviceKind;
use anyhow::{bail, Result};
use clap::{Args, Subcommand, ValueEnum};
use dice_model::SdarTokenizer;
use dice_train::data::{
    model_block_length, select_datasets, PackOptions, PackedDataset, Qwen3Encoder,
};
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum TrainCommand {
    /// Supervised block-diffusion fine-tuning (the DICE recipe) on chat data.
    #[command(after_help = SFT_MANUAL)]
    Sft(SftArgs),
}

const SFT_MANUAL: &str = "\
Data. Records are LlamaFactory's: --dataset-info names a dataset_info.json (or the folder holding
it) whose --dataset entries give file_name (relative to that folder; a folder means its files in
name order), formatting (alpaca | sharegpt), columns (alpaca: prompt, query, response, history,
system; sharegpt: messages, system) and, for sharegpt, tags (role_tag, content_tag, user_tag,
assistant_tag, observation_tag, function_tag, system_tag). As in LlamaFactory, a columns or tags
mapping replaces the defaults entirely: a key it omits is unset. --data FILE reads a plain file
whose first record tells the layout: {\"messages\": [{\"role\", \"content\"}, ...]},
{\"conversations\": [{\"from\", \"value\"}, ...]}, {\"instruction\", \"input\", \"output\"} or
{\"prompt\", \"response\"}. Files are a JSON array of objects or JSON Lines. Named datasets come
first, then data files, concatenated in the order given.

Encoding, as the reference (LlamaFactory's qwen3 template with thinking on): a prompt turn is
<|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n (a system text goes before the
first one), a response is {content}<|im_end|>\\n and carries loss; a response without <think> or
</think> gets the empty thought <think>\\n\\n</think>\\n\\n prepended, with loss. Each sample is
padded with the pad token to a multiple of the model's block size; the pads carry loss. Samples
longer than the cutoff are dropped, never truncated. LlamaFactory also skips records without a
response and sharegpt conversations whose roles do not alternate user/assistant; they are counted
and the first of each kind is named.

Packing: the samples of each preprocessing batch are packed greedily (the longest that still fits
first) into rows of --row-tokens tokens, filling at most --row-tokens - 1; position ids restart at
0 for every sample, and the rest of the row is pad tokens without loss, which the model treats as
one extra sample.

--dry-run prints the packing statistics (records, samples packed and dropped, rows, tokens, loss
tokens, fill ratio) without loading a model; --model (or --tokenizer) only provides the
tokenizer and the block size (config.json's block_size, 4 without one).

Example:
  dice train sft --model SDAR-4B-Chat/ --dataset-info data/ --dataset cuke --out runs/sft --dry-run";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TrainDType {
    /// float32 weights and compute (the CPU default).
    F32,
    /// bfloat16 compute with float32 master weights and optimizer moments (the reference).
    Bf16,
}

#[derive(Args, Debug)]
#[command(group = clap::ArgGroup::new("input").required(true).multiple(true).args(["data", "dataset"]))]
pub struct SftArgs {
    /// Base model folder (config.json, safetensors, tokenizer files, chat template).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Folder with the tokenizer files, when not the model folder.
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Plain data files (JSON array or JSON Lines), their layout told by their first record.
    #[arg(long, value_name = "FILE", num_args = 1..)]
    pub data: Vec<PathBuf>,
    /// LlamaFactory's dataset_info.json, or the folder holding it.
    #[arg(long, value_name = "F", requires = "dataset")]
    pub dataset_info: Option<PathBuf>,
    /// Datasets of --dataset-info to train on, mixed in the order given.
    #[arg(long, value_name = "NAME", num_args = 1.., requires = "dataset_info")]
    pub dataset: Vec<String>,
    /// Output folder: checkpoints (checkpoint-STEP/, final/), metrics.jsonl, the run's config.
    #[arg(long, value_name = "DIR", required_unless_present = "dry_run")]
    pub out: Option<PathBuf>,
    /// TOML file with the training settings; flags given on the command line override it.
    #[arg(long, value_name = "F")]
    pub config: Option<PathBuf>,
    /// Passes over the data [default: 3, the DICE recipe].
    #[arg(long, value_name = "E", conflicts_with = "max_steps")]
    pub epochs: Option<f64>,
    /// Stop after this many optimizer steps instead of counting epochs.
    #[arg(long, value_name = "N")]
    pub max_steps: Option<u64>,
    /// Peak learning rate [default: 1e-5, the DICE recipe].
    #[arg(long, value_name = "X")]
    pub lr: Option<f64>,
    /// Where the model trains; cuda needs a binary built with `--features cuda`.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceKind,
    /// Compute dtype [default: f32 on the CPU, bf16 on CUDA].
    #[arg(long, value_enum)]
    pub dtype: Option<TrainDType>,
    /// Seed of the data order, the noise and any random initialisation [default: 42].
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,
    /// Print the packing statistics and exit, without loading the model.
    #[arg(long)]
    pub dry_run: bool,
    /// Longest sample kept, in tokens after block padding [default: --row-tokens - 1, what
    /// LlamaFactory's cutoff_len: 6144 means with packing].
    #[arg(long, value_name = "N")]
    pub cutoff_len: Option<usize>,
    /// Tokens per packed row.
    #[arg(long, value_name = "N", default_value_t = 6144)]
    pub row_tokens: usize,
    /// Records per preprocessing batch; the packing only combines samples of one batch
    /// (LlamaFactory's preprocessing_batch_size).
    #[arg(long, value_name = "N", default_value_t = 1000)]
    pub preprocessing_batch_size: usize,
    /// Contiguous shards the records are split into before batching (LlamaFactory's
    /// preprocessing_num_workers; set it to the reference run's value to pack its rows).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub preprocessing_num_workers: usize,
}

pub fn run(command: TrainCommand) -> Result<()> {
    match command {
        TrainCommand::Sft(a) => run_sft(a),
    }
}

fn run_sft(a: SftArgs) -> Result<()> {
    if !a.dry_run {
        bail!("dice train sft: only --dry-run is available in this build");
    }
    let tokenizer = SdarTokenizer::from_dir(a.tokenizer.as_ref().unwrap_or(&a.model))?;
    let encoder = Qwen3Encoder::new(&tokenizer)?;
    let datasets = select_datasets(&a.data, a.dataset_info.as_deref(), &a.dataset)?;
    let options = PackOptions {
        row_tokens: a.row_tokens,
        cutoff_len: a.cutoff_len.unwrap_or(a.row_tokens.saturating_sub(1)),
        block_length: model_block_length(&a.model)?,
        preprocessing_batch_size: a.preprocessing_batch_size,
        preprocessing_num_workers: a.preprocessing_num_workers,
    };
    let packed = PackedDataset::build(&datasets, &encoder, &options)?;
    print!("{}", packed.stats());
    Ok(())
}
