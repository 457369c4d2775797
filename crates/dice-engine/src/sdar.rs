//! [`BlockDiffusionModel`] for `dice_model`'s SDAR: one batch [`KvCache`] whose rows are the
//! engine's slots, updated in place by every forward. On CUDA the decoding forward over that
//! cache is captured once in a CUDA graph ([`dice_model::DecodeGraph`]) and replayed at every
//! step after; where no graph can be had it runs op by op.

use crate::model::{BlockDiffusionModel, BlockRow, PrefillRow};
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use dice_model::{checkpoint, KvCache, Sdar, SdarConfig};
use std::path::Path;

/// An SDAR model set up for one decoding block length.
pub struct SdarDecoder {
    model: Sdar,
    #[cfg(feature = "cuda")]
    graph: std::sync::Mutex<GraphState>,
}

/// Whether decoding forwards replay a CUDA graph.
#[cfg(feature = "cuda")]
enum GraphState {
    /// The graphs captured for the current cache, one per token count (one block per row, or
    /// two when a store rides along); a forward none serves captures one.
    Wanted(Vec<dice_model::DecodeGraph>),
    /// Graphs do not apply here, or capturing failed (warned once): op by op from now on.
    Unavailable,
}

impl SdarDecoder {
    /// Loads a checkpoint directory for decoding with blocks of `block_length` tokens.
    pub fn load(dir: &Path, dtype: DType, device: &Device, block_length: usize) -> Result<Self> {
        let load = || {
            let config = decoding_config(&SdarConfig::from_path(dir)?, block_length)?;
            let vb = checkpoint::mmaped_var_builder(dir, &config, dtype, device)?;
            let model = Sdar::new(&config, vb)
                .with_context(|| format!("cannot build the model from {}", dir.display()))?;
            SdarDecoder::new(model)
        };
        load().with_context(|| format!("cannot load the model in {}", dir.display()))
    }

    /// A model of `config`'s shapes with random weights ([`Sdar::random`]), for decoding with
    /// blocks of `block_length` tokens: for throughput benchmarks, where the weights' values
    /// do not matter.
    pub fn random(
        config: &SdarConfig,
        dtype: DType,
        device: &Device,
        block_length: usize,
    ) -> Result<Self> {
        let config = decoding_config(config, block_length)?;
        SdarDecoder::new(Sdar::random(&config, dtype, device)?)
    }

    /// A decoder over a model already in memory (its config's block size is the decoding
    /// block length): a trainer hands its current weights to the engine this way, without a
    /// disk round trip. On CUDA the model's q/k/v and gate/up weights are stacked
    /// ([`Sdar::concatenate_projections`]): one matmul per group in the fused forward.
    pub fn new(mut model: Sdar) -> Result<Self> {
        if model.device().is_cuda() {
            model.concatenate_projections()?;
        }
        Ok(SdarDecoder {
            model,
            #[cfg(feature = "cuda")]
            graph: std::sync::Mutex::new(GraphState::Wanted(Vec::new())),
        })
    }

    pub fn model(&self) -> &Sdar {
        &self.model
    }

    fn block_length(&self) -> usize {
        self.model.config().block_size
    }

    fn ids(&self, rows: &[Vec<u32>]) -> Result<Tensor> {
        let width = rows.first().map_or(0, Vec::len);
        let flat: Vec<u32> = rows.iter().flatten().copied().collect();
        Ok(Tensor::from_vec(
            flat,
            (rows.len(), width),
            self.model.device(),
        )?)
    }

    /// The decoding forward's final hidden states for one or two blocks per slot (`rows`),
    /// through the CUDA graph where there is one.
    fn decode_hidden(
        &self,
        rows: &[Vec<u32>],
        cache: &mut KvCache,
        commit: &[usize],
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(hidden) = self.replay(rows, cache, commit)? {
            return Ok(hidden);
        }
        self.model.forward_hidden(&self.ids(rows)?, cache, commit)
    }

    /// [`Self::decode_hidden`] by the graph of `cache` for this many tokens per row (captured
    /// at its first such forward), or `None` where graphs do not apply.
    #[cfg(feature = "cuda")]
    fn replay(
        &self,
        rows: &[Vec<u32>],
        cache: &mut KvCache,
        commit: &[usize],
    ) -> Result<Option<Tensor>> {
        let mut state = self
            .graph
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let tokens = rows.first().map_or(0, Vec::len);
        let GraphState::Wanted(graphs) = &mut *state else {
            return Ok(None);
        };
        graphs.retain(|g| g.captured_over(cache));
        let graph = match graphs.iter().position(|g| g.serves(cache, tokens)) {
            Some(index) => index,
            None => match self.model.capture_decode(cache, tokens) {
                Ok(Some(captured)) => {
                    graphs.push(captured);
                    graphs.len() - 1
                }
                Ok(None) => {
                    *state = GraphState::Unavailable;
                    return Ok(None);
                }
                Err(e) => {
                    tracing::warn!("decoding runs without CUDA graphs: {e:#}");
                    *state = GraphState::Unavailable;
                    return Ok(None);
                }
            },
        };
        graphs[graph]
            .forward_hidden(&self.model, &rows.concat(), cache, commit)
            .map(Some)
    }
}

/// The block length fixes the attention pattern of prefill and decoding (spec §3.2 uses the
/// decoding block length for the prefill mask), so it replaces `block_size` of the config.
fn decoding_config(config: &SdarConfig, block_length: usize) -> Result<SdarConfig> {
    ensure!(block_length > 0, "block length must be at least 1");
    Ok(SdarConfig {
        block_size: block_length,
        ..config.clone()
    })
}

impl BlockDiffusionModel for SdarDecoder {
    type Cache = KvCache;

    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    fn mask_token_id(&self) -> u32 {
        self.model.config().mask_token_id
    }

    fn check_block_length(&self, block_length: usize) -> Result<()> {
        ensure!(
            block_length == self.block_length(),
            "this model was loaded for block length {}, not {block_length}",
            self.block_length()
        );
        Ok(())
    }

    fn new_cache(&self, slots: usize, capacity: usize) -> Result<KvCache> {
        KvCache::new(
            self.model.config(),
            slots,
            capacity,
            self.model.dtype(),
            self.model.device(),
        )
    }

    fn clear_slot(&self, cache: &mut KvCache, slot: usize) -> Result<()> {
        cache.truncate_row(slot, 0)
    }

    /// Prefills in a staging cache of just these rows (prompts right-padded to a common
    /// length, each committing its own length), then copies each row into its slot once.
    fn prefill(
        &self,
        cache: &mut KvCache,
        rows: &[PrefillRow<'_>],
        block_length: usize,
    ) -> Result<()> {
        self.check_block_length(block_length)?;
        let width = rows.iter().map(|r| r.tokens.len()).max().unwrap_or(0);
        let mask = self.mask_token_id();
        let padded: Vec<Vec<u32>> = rows
            .iter()
            .map(|r| {
                let mut ids = r.tokens.to_vec();
                ids.resize(width, mask);
                ids
            })
            .collect();
        let commit: Vec<usize> = rows.iter().map(|r| r.tokens.len()).collect();
        let mut staging = KvCache::new(
            self.model.config(),
            rows.len(),
            cache.capacity(),
            self.model.dtype(),
            self.model.device(),
        )?;
        self.model
            .forward_hidden(&self.ids(&padded)?, &mut staging, &commit)?;
        for (i, row) in rows.iter().enumerate() {
            cache.copy_row_from(row.slot, &staging, i)?;
        }
        Ok(())
    }

    /// One forward over every slot of the cache; slots without a row get masked blocks and
    /// commit nothing, so their content is unchanged. Each slot takes one block, or two where
    /// some row both stores and denoises: a row's store block first, then its denoise block,
    /// masked blocks where it has no such part (commit covers the store block only). The lm_head
    /// runs on the wanted positions only.
    fn forward_blocks(&self, cache: &mut KvCache, rows: &[BlockRow<'_>]) -> Result<Option<Tensor>> {
        let block = self.block_length();
        let mask = self.mask_token_id();
        let blocks = if rows
            .iter()
            .any(|r| r.store.is_some() && r.denoise.is_some())
        {
            2
        } else {
            1
        };
        let slots = cache.batch_size();
        let mut ids = vec![vec![mask; blocks * block]; slots];
        let mut commit = vec![0; slots];
        // Rows of `hidden` seen as `[slots * blocks * block, hidden]` whose logits are wanted.
        let mut wanted = Vec::new();
        for row in rows {
            ensure!(row.slot < slots, "slot {} of a cache of {slots}", row.slot);
            let mut next = 0;
            for (part, store) in [(row.store, true), (row.denoise, false)] {
                let Some(tokens) = part else { continue };
                ensure!(
                    tokens.len() == block,
                    "a block of {} tokens was given to a model loaded for block length {block}",
                    tokens.len()
                );
                ids[row.slot][next * block..(next + 1) * block].copy_from_slice(tokens);
                if store {
                    commit[row.slot] = block;
                } else {
                    let first = (row.slot * blocks + next) * block;
                    for &p in row.logits {
                        ensure!(p < block, "logits of position {p} of a block of {block}");
                        wanted.push((first + p) as u32);
                    }
                }
                next += 1;
            }
        }
        let hidden = self.decode_hidden(&ids, cache, &commit)?;
        if wanted.is_empty() {
            return Ok(None);
        }
        let hidden = hidden.reshape((slots * blocks * block, self.model.config().hidden_size))?;
        let index = Tensor::new(wanted.as_slice(), self.model.device())?;
        let selected = hidden.index_select(&index, 0)?;
        Ok(Some(self.model.logits(&selected)?))
    }
}
