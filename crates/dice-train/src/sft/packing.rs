//! The data of an SFT run packed as its settings say (the model's tokenizer, block length and
//! the packing settings), and the dry run's report of it.

use super::config::SftConfig;
use crate::data::{model_block_length, select_datasets, DatasetSpec, PackedDataset, Qwen3Encoder};
use anyhow::Result;
use dice_model::SdarTokenizer;

/// The training data of `config` (resolved): its named datasets, then its data files.
pub fn training_datasets(config: &SftConfig) -> Result<Vec<DatasetSpec>> {
    select_datasets(
        &config.data.files,
        config.data.dataset_info.as_deref(),
        &config.data.datasets,
    )
}

/// `datasets` encoded and packed into rows as `config` (resolved) packs them.
pub fn pack(config: &SftConfig, datasets: &[DatasetSpec]) -> Result<PackedDataset> {
    let tokenizer = SdarTokenizer::from_dir(config.model.tokenizer_dir())?;
    let encoder = Qwen3Encoder::new(&tokenizer)?;
    let options = config.pack_options(model_block_length(config.model.dir())?);
    PackedDataset::build(datasets, &encoder, &options)
}

/// The packing statistics of `config`'s training data (resolved here: records, samples packed
/// and dropped, rows, tokens, loss tokens, fill ratio), without loading the model: the model
/// folder gives the tokenizer and the block size only.
pub fn dry_run_report(config: SftConfig) -> Result<String> {
    let config = config.resolve()?;
    Ok(pack(&config, &training_datasets(&config)?)?
        .stats()
        .to_string())
}
