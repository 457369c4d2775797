//! A deterministic stand-in model for unit tests of the scheduling logic: its logits are a
//! hash of everything a real model would see (committed tokens, block tokens, positions), and
//! it checks the calling protocol (whole-block prefill into empty slots, clean blocks only for
//! store, capacity respected).

use crate::model::{BlockDiffusionModel, BlockRow, PrefillRow};
use anyhow::{ensure, Result};
use candle_core::{Device, Tensor};
use std::cell::RefCell;

pub(crate) const VOCAB: usize = 64;
pub(crate) const MASK: u32 = 63;

pub(crate) struct SlotCache {
    slots: Vec<Vec<u32>>,
    capacity: usize,
}

#[derive(Default)]
pub(crate) struct HashModel {
    /// Every forward as ("forward", rows), ("store", rows storing a block), ("merged", rows
    /// storing a block and denoising the next); every prefill as ("prefill", rows).
    pub calls: RefCell<Vec<(&'static str, usize)>>,
    /// The logit positions every forward returned.
    pub logit_positions: RefCell<Vec<usize>>,
    /// Return NaN logits, as an overflowing fp16 forward would.
    pub overflow: bool,
    /// Always predict the mask token.
    pub predict_mask: bool,
}

fn mix(mut h: u64, x: u64) -> u64 {
    h ^= x
        .wrapping_add(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(h << 6)
        .wrapping_add(h >> 2);
    h.wrapping_mul(0xff51_afd7_ed55_8ccd)
}

impl HashModel {
    pub(crate) fn block_logits(committed: &[u32], block: &[u32]) -> Vec<f32> {
        let context = committed.iter().fold(17u64, |h, &t| mix(h, u64::from(t)));
        let visible = block
            .iter()
            .filter(|&&t| t != MASK)
            .fold(context, |h, &t| mix(h, u64::from(t)));
        let mut out = Vec::with_capacity(block.len() * VOCAB);
        for position in 0..block.len() {
            let h = mix(visible, (committed.len() + position) as u64);
            let peak = (h % (VOCAB as u64 - 1)) as f32;
            let sharpness = 0.5 + ((h >> 20) % 4) as f32;
            out.extend((0..VOCAB).map(|t| -sharpness * (t as f32 - peak).abs()));
        }
        out
    }
}

impl BlockDiffusionModel for HashModel {
    type Cache = SlotCache;

    fn vocab_size(&self) -> usize {
        VOCAB
    }

    fn mask_token_id(&self) -> u32 {
        MASK
    }

    fn check_block_length(&self, block_length: usize) -> Result<()> {
        ensure!(
            block_length <= 16,
            "block length {block_length} is too long for the test model"
        );
        Ok(())
    }

    fn new_cache(&self, slots: usize, capacity: usize) -> Result<SlotCache> {
        Ok(SlotCache {
            slots: vec![Vec::new(); slots],
            capacity,
        })
    }

    fn clear_slot(&self, cache: &mut SlotCache, slot: usize) -> Result<()> {
        cache.slots[slot].clear();
        Ok(())
    }

    fn prefill(
        &self,
        cache: &mut SlotCache,
        rows: &[PrefillRow<'_>],
        block_length: usize,
    ) -> Result<()> {
        self.calls.borrow_mut().push(("prefill", rows.len()));
        for row in rows {
            let slot = &mut cache.slots[row.slot];
            ensure!(slot.is_empty(), "prefill into a used slot");
            ensure!(
                !row.tokens.is_empty() && row.tokens.len() % block_length == 0,
                "prefill of a partial block"
            );
            slot.extend_from_slice(row.tokens);
        }
        Ok(())
    }

    fn forward_blocks(
        &self,
        cache: &mut SlotCache,
        rows: &[BlockRow<'_>],
    ) -> Result<Option<Tensor>> {
        let stores = rows.iter().filter(|r| r.store.is_some()).count();
        let merged = rows
            .iter()
            .filter(|r| r.store.is_some() && r.denoise.is_some())
            .count();
        self.calls.borrow_mut().extend([
            ("forward", rows.len()),
            ("store", stores),
            ("merged", merged),
        ]);
        let Some(block) = rows
            .iter()
            .find_map(|r| r.store.or(r.denoise))
            .map(<[u32]>::len)
        else {
            anyhow::bail!("a forward without blocks");
        };
        // A forward of two blocks per row writes two blocks into every slot, as SDAR's
        // whole-cache forward does.
        if rows
            .iter()
            .any(|r| r.store.is_some() && r.denoise.is_some())
        {
            ensure!(
                cache
                    .slots
                    .iter()
                    .all(|slot| slot.len() + 2 * block <= cache.capacity),
                "slot capacity exceeded by a two-block forward"
            );
        }
        let mut data = Vec::new();
        let mut positions = 0;
        for row in rows {
            let slot = &mut cache.slots[row.slot];
            if let Some(tokens) = row.store {
                ensure!(tokens.len() == block, "rows of different block lengths");
                ensure!(
                    self.predict_mask || !tokens.contains(&MASK),
                    "store of a block with masks"
                );
                ensure!(
                    slot.len() + block <= cache.capacity,
                    "slot capacity exceeded"
                );
                slot.extend_from_slice(tokens);
            }
            let Some(tokens) = row.denoise else { continue };
            ensure!(tokens.len() == block, "rows of different block lengths");
            ensure!(
                slot.len() + block <= cache.capacity,
                "slot capacity exceeded"
            );
            let logits: Vec<f32> = if self.overflow {
                vec![f32::NAN; block * VOCAB]
            } else if self.predict_mask {
                (0..block * VOCAB)
                    .map(|i| if i % VOCAB == MASK as usize { 1.0 } else { 0.0 })
                    .collect()
            } else {
                Self::block_logits(slot, tokens)
            };
            for &p in row.logits {
                ensure!(p < block, "logits of a position past the block");
                data.extend_from_slice(&logits[p * VOCAB..(p + 1) * VOCAB]);
                positions += 1;
            }
        }
        self.logit_positions.borrow_mut().push(positions);
        if positions == 0 {
            return Ok(None);
        }
        Ok(Some(Tensor::from_vec(
            data,
            (positions, VOCAB),
            &Device::Cpu,
        )?))
    }
}
