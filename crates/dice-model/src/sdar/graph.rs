//! The fused decoding forward ([`super::fused`]) captured once in a CUDA graph and replayed:
//! at batch 1 a forward is ~430 kernel launches of a few microseconds of work each, so the
//! CPU's launch rate, not the GPU, sets its time; a replay launches them all at once.
//!
//! A graph is bound to one cache's buffers, one batch size and one number of tokens per row (the
//! engine keeps one per count it meets: a block, or two when a store pass rides along): it reads
//! the token ids and the rows' lengths from its own device tensors (refreshed before each
//! replay) and writes the new K/V at `lens[i] + t` of the cache it was captured with. The
//! attention splits its keys for the cache's whole capacity, so one graph serves every position.
//!
//! `DICE_CUDA_GRAPHS=0` turns graphs off (the fused forward then runs op by op).

use super::fused::FusedDecode;
use super::stage::Unprobed;
use super::{KvCache, Sdar};
use crate::kernels::decode_ops::write_u32;
use anyhow::{ensure, Context};
use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph};
use candle_core::{DType, Device, Tensor};

/// The environment variable that turns graphs off (`0`).
const SWITCH: &str = "DICE_CUDA_GRAPHS";

/// A captured decoding forward of `T` tokens per row over one [`KvCache`]; see the module docs.
pub struct DecodeGraph {
    graph: CudaGraph,
    /// Token ids `[B, T]` (u32) the graph embeds.
    ids: Tensor,
    /// Committed length of each row `[B]` (u32): positions and attention spans.
    lens: Tensor,
    /// The final-normed hidden states `[B, T, H]` the graph leaves.
    hidden: Tensor,
    /// [`KvCache::buffers`] of the cache the graph writes.
    buffers: u64,
    tokens: usize,
}

// SAFETY: a CUDA graph may be used from any thread as long as no two threads use it at once
// (cuGraph* objects are not internally synchronized); `DecodeGraph` only hands out `&self`
// methods that launch it on its stream from the calling thread, and it is not `Sync`.
#[allow(unsafe_code)]
unsafe impl Send for DecodeGraph {}

impl Sdar {
    /// Captures the decoding forward of `tokens` new tokens per row of `cache` (whose lengths
    /// must leave room for them). `None` where graphs do not apply: not CUDA, the fused kernels
    /// unavailable, cudarc's event tracking on (its events would be recorded into the graph),
    /// or `DICE_CUDA_GRAPHS=0`.
    ///
    /// Runs the forward once uncaptured first (it loads every kernel, lets cuBLAS set up its
    /// shapes and fills candle's cache of kernel parameters, since nothing may be uploaded
    /// during a capture); that run writes only the scratch slots past each row's length.
    pub fn capture_decode(
        &self,
        cache: &KvCache,
        tokens: usize,
    ) -> anyhow::Result<Option<DecodeGraph>> {
        let Device::Cuda(dev) = self.device() else {
            return Ok(None);
        };
        if dev.is_event_tracking() || std::env::var(SWITCH).is_ok_and(|v| v.trim() == "0") {
            return Ok(None);
        }
        let b = cache.batch_size();
        let ids = Tensor::zeros((b, tokens), DType::U32, self.device())?;
        self.check_forward(&ids, cache, &vec![0; b])?;
        let lens = cache.device_lens()?;
        let Some(decode) = FusedDecode::plan(self, &lens, cache.capacity(), tokens)? else {
            return Ok(None);
        };
        let hidden = Tensor::zeros(
            (b, tokens, self.config.hidden_size),
            self.dtype(),
            self.device(),
        )?;
        // Every tensor of the forward is freed inside it (the output is copied into `hidden`),
        // so the graph owns no memory between replays.
        let forward = || {
            decode
                .forward_hidden(self, &ids, cache, &mut Unprobed)
                .and_then(|x| hidden.slice_set(&x, 0, 0))
        };
        let _parameters = dev.enable_cuda_graph_htod_cache();
        forward()?;
        let stream = dev.cuda_stream();
        let driver = |what: &str, e| anyhow::anyhow!("CUDA graph {what} failed: {e:?}");
        stream.synchronize().map_err(|e| driver("synchronize", e))?;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| driver("capture", e))?;
        let captured = forward();
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        captured.context("the decoding forward cannot be captured in a CUDA graph")?;
        let graph = graph
            .map_err(|e| driver("instantiation", e))?
            .context("CUDA graph capture returned no graph")?;
        graph.upload().map_err(|e| driver("upload", e))?;
        Ok(Some(DecodeGraph {
            graph,
            ids,
            lens,
            hidden,
            buffers: cache.buffers,
            tokens,
        }))
    }
}

impl DecodeGraph {
    /// Whether this graph computes forwards of `tokens` tokens per row over `cache`.
    pub fn serves(&self, cache: &KvCache, tokens: usize) -> bool {
        self.captured_over(cache) && tokens == self.tokens
    }

    /// Whether this graph was captured over `cache` (for whatever number of tokens).
    pub fn captured_over(&self, cache: &KvCache) -> bool {
        cache.buffers == self.buffers
    }

    /// [`Sdar::forward_hidden`] by replaying the graph: `input_ids` the `[B, T]` token ids row
    /// after row, `commit` as there. `model` must be the model the graph was captured from.
    pub fn forward_hidden(
        &self,
        model: &Sdar,
        input_ids: &[u32],
        cache: &mut KvCache,
        commit: &[usize],
    ) -> anyhow::Result<Tensor> {
        ensure!(
            self.serves(cache, self.tokens),
            "this CUDA graph was captured for another KV cache"
        );
        ensure!(
            input_ids.len() == self.ids.elem_count(),
            "{} token ids for a graph of {} rows of {} tokens",
            input_ids.len(),
            cache.batch_size(),
            self.tokens
        );
        model.check_forward(&self.ids, cache, commit)?;
        write_u32(&self.ids, input_ids)?;
        write_u32(&self.lens, &cache.lens_u32())?;
        self.graph
            .launch()
            .map_err(|e| anyhow::anyhow!("CUDA graph launch failed: {e:?}"))?;
        cache.advance(commit);
        // A copy: the next replay overwrites `hidden`.
        Ok(self.hidden.copy()?)
    }
}
