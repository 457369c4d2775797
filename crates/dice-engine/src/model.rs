//! What block-diffusion decoding needs from a model (spec §3.2, §3.3): a batch KV cache of
//! fixed slots, one per running sequence, filled by a block-causal prefill and extended one
//! clean block at a time, and a forward that denoises one block per slot (storing the clean block
//! before it in the same forward).

use anyhow::Result;
use candle_core::Tensor;

/// Whole prompt blocks to prefill into an empty slot.
pub struct PrefillRow<'a> {
    pub slot: usize,
    pub tokens: &'a [u32],
}

/// One slot's part of a decoding forward: a clean block to store, a block to denoise, or both
/// (the clean block first, the block after it next). The first block sits at positions
/// `len..len + block` of the slot, where `len` is the slot's committed length.
pub struct BlockRow<'a> {
    pub slot: usize,
    /// `store_kv`: a clean block whose K/V become part of the slot (its logits are not needed).
    pub store: Option<&'a [u32]>,
    /// A block to denoise, attending to the committed prefix (with `store`) and
    /// bidirectionally within itself; the slot's committed content is otherwise unchanged.
    pub denoise: Option<&'a [u32]>,
    /// The positions of the denoised block whose logits are wanted, ascending (the lm_head runs
    /// for these only: a block's committed positions need none).
    pub logits: &'a [usize],
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
    /// One forward over the listed slots (every block of the same length): each row's store
    /// block is committed and its denoise block attends to the slot's committed prefix and
    /// bidirectionally within itself. Returns the logits of the wanted positions
    /// ([`BlockRow::logits`]) of the rows with a denoise block, in row order, then position
    /// order: `[positions, vocab]`, or `None` when no position is wanted.
    fn forward_blocks(
        &self,
        cache: &mut Self::Cache,
        rows: &[BlockRow<'_>],
    ) -> Result<Option<Tensor>>;
}
