//! SFT data as the reference prepares it (spec §5.4, §6.1): records from LlamaFactory-style
//! datasets ([`source`]), encoded with the `qwen3` training template ([`template`]), block
//! padded, dropped when too long and packed into fixed-length rows ([`pack`]).

pub mod pack;
pub mod source;
pub mod template;

pub use pack::{model_block_length, CleanRow, PackOptions, PackStats, PackedDataset};
pub use source::{select_datasets, DatasetSpec, DropReason, Location};
pub use template::{Qwen3Encoder, Sample};
