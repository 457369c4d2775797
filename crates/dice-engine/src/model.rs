//! What block-diffusion decoding needs from a model (spec §3.2, §3.3): a batch KV cache of
//! fixed slots, one per running sequence, filled by a block-causal prefill and extended one
//! clean block at a time, and a forward that denoises one block per slot.

use anyhow::Result;
use candle_core::Tensor;

/// Whole prompt blocks to prefill into an empty slot.
pub struct PrefillRow<'a> {
    pub slot: usize,
    pub tokens: &'a [u32],
}

/// One block of one slot in a decoding forward. The block sits at positions
/// `len..len + block` of the slot, where `len` is the slot's committed length.
pub struct BlockRow<'a> {
    pub slot: usize,
    pub tokens: &'a [u32],
    /// `store_kv`: the block is clean and its K/V become part of the slot (its logits are not
    /// needed); otherwise the slot's committed content stays as it was.
    pub store: bool,
}

/// A block-diffusion language model (SDAR).
pub trait BlockDiffusionModel {
    /// K/V of `slots` sequences, each holding up to `capacity` positions.
    type Cache;

    fn vocab_size(&self) -> usize;
    /// Id of `<|MASK|>`.
    fn mask_token_id(&self) -> u32;
    /// Fails with a user-facing message when the model cannot decode with this block length.
    fn check_block_length(&self, block_length: usize) -> Result<()>;
    fn new_cache(&self, slots: usize, capacity: usize) -> Result<Self::Cache>;
    /// Empties a slot for a new sequence.
    fn clear_slot(&self, cache: &mut Self::Cache, slot: usize) -> Result<()>;
    /// Block-causal prefill (blocks of `block_length`) into empty slots, storing every token.
    fn prefill(
        &self,
        cache: &mut Self::Cache,
        rows: &[PrefillRow<'_>],
        block_length: usize,
    ) -> Result<()>;
    /// One forward of one block per listed slot (all of the same length): each block attends
    /// to its slot's committed prefix and bidirectionally within itself. Returns the logits of
    /// the rows with `store == false`, in row order: `[rows, block, vocab]`, or `None` when
    /// every row stores.
    fn forward_blocks(
        &self,
        cache: &mut Self::Cache,
        rows: &[BlockRow<'_>],
    ) -> Result<Option<Tensor>>;
}
