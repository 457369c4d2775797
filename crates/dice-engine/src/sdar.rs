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
    /// None captured yet, or the one captured serves another cache: capture at the next forward.
    Wanted(Option<dice_model::DecodeGraph>),
    /// Graphs do not apply here, or capturing failed (warned once): op by op from now on.
    Unavailable,
}

impl SdarDecoder {
    /// Loads a checkpoint directory for decoding with blocks of `block_length` tokens.
    pub fn load(dir: &Path, dtype: DType, device: &Device, block_length: usize) -> Result<Self> {
        let config = decoding_config(&SdarConfig::from_path(dir)?, block_length)?;
        let vb = checkpoint::mmaped_var_builder(dir, &config, dtype, device)?;
        let model = Sdar::new(&config, vb)
            .with_context(|| format!("cannot build the model from {}", dir.display()))?;
        SdarDecoder::new(model)
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

    /// On CUDA with `DICE_CONCAT_PROJECTIONS=1` the model's q/k/v and gate/up weights are
    /// stacked ([`Sdar::concatenate_projections`]): one matmul per group in the fused forward,
    /// opt-in until it has run on a GPU.
    fn new(mut model: Sdar) -> Result<Self> {
        let wanted = std::env::var("DICE_CONCAT_PROJECTIONS").is_ok_and(|v| v.trim() == "1");
        if wanted && model.device().is_cuda() {
            model.concatenate_projections()?;
        }
        Ok(SdarDecoder {
            model,
            #[cfg(feature = "cuda")]
            graph: std::sync::Mutex::new(GraphState::Wanted(None)),
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

    /// The decoding forward's final hidden states for one block per slot (`rows`), through the
    /// CUDA graph where there is one.
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

    /// [`Self::decode_hidden`] by the graph of `cache` (captured at its first forward), or
    /// `None` where graphs do not apply.
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
        let tokens = self.block_length();
        if let GraphState::Wanted(graph) = &mut *state {
            if !graph.as_ref().is_some_and(|g| g.serves(cache, tokens)) {
                *graph = None;
                match self.model.capture_decode(cache, tokens) {
                    Ok(Some(captured)) => *graph = Some(captured),
                    Ok(None) => *state = GraphState::Unavailable,
                    Err(e) => {
                        tracing::warn!("decoding runs without CUDA graphs: {e:#}");
                        *state = GraphState::Unavailable;
                    }
                }
            }
        }
        match &*state {
            GraphState::Wanted(Some(graph)) => graph
                .forward_hidden(&self.model, &rows.concat(), cache, commit)
                .map(Some),
            _ => Ok(None),
        }
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

    /// One forward over every slot of the cache; slots without a row get a masked block and
    /// commit nothing, so their content is unchanged.
    fn forward_blocks(&self, cache: &mut KvCache, rows: &[BlockRow<'_>]) -> Result<Option<Tensor>> {
        let block = self.block_length();
        let mask = self.mask_token_id();
        let mut ids = vec![vec![mask; block]; cache.batch_size()];
        let mut commit = vec![0; cache.batch_size()];
        for row in rows {
            ensure!(
                row.tokens.len() == block,
                "a block of {} tokens was given to a model loaded for block length {block}",
                row.tokens.len()
            );
            ids[row.slot] = row.tokens.to_vec();
            if row.store {
                commit[row.slot] = block;
            }
        }
        let hidden = self.decode_hidden(&ids, cache, &commit)?;
        let wanted: Vec<u32> = rows
            .iter()
            .filter(|r| !r.store)
            .map(|r| r.slot as u32)
            .collect();
        if wanted.is_empty() {
            return Ok(None);
        }
        let index = Tensor::new(wanted.as_slice(), self.model.device())?;
        let selected = hidden.index_select(&index, 0)?;
        Ok(Some(self.model.logits(&selected)?))
    }
}
