//! The continuous-batching decoder: many sequences at once, each in its own phase, in the
//! slots of one preallocated KV cache; a finished sequence's slot is refilled before the next
//! forward. Unlike JetEngine's scheduler (spec §7.3) one forward serves both the store pass
//! of clean blocks and the denoising of the others, and in a batch in lock-step the store
//! pass rides along with the first denoising step of the next block.

use crate::greedy::greedy_candidates;
use crate::model::{BlockDiffusionModel, BlockRow, PrefillRow};
use crate::params::DecodeParams;
use crate::sampled::{sampled_candidates, Draw};
use crate::sampling::Candidate;
use crate::sequence::{FinishReason, Phase, Sequence};
use anyhow::{bail, ensure, Context, Result};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

pub type RequestId = u64;

#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: DecodeParams,
}

/// A finished sequence.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    pub id: RequestId,
    /// Generated ids only (the prompt is not repeated).
    pub token_ids: Vec<u32>,
    /// For each generated token, the 1-based index of the denoising forward of this
    /// response in which it was unmasked (TraceRL's step map).
    pub trace: Vec<u32>,
    pub finish_reason: FinishReason,
    pub prompt_len: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A block was committed: its generated tokens (in order, after the stopping rules).
    Tokens {
        id: RequestId,
        tokens: Vec<u32>,
    },
    Finished(Completion),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Sequences decoded at once (KV-cache slots).
    pub max_batch: usize,
    /// Positions per slot: a request needs its prompt plus max_new_tokens, rounded up to
    /// whole blocks.
    pub max_seq_len: usize,
    /// Prompt tokens per prefill forward (a longer single prompt still goes alone).
    pub max_prefill_tokens: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch: 32,
            max_seq_len: 8192,
            max_prefill_tokens: 16384,
        }
    }
}

/// Model forwards an engine has run since it was created: what throughput is measured per.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardCounts {
    /// Block-causal prefill forwards (one per prefill chunk).
    pub prefill: u64,
    /// Decoding forwards (one per block length per step that has a decoding sequence).
    pub decode: u64,
}

impl ForwardCounts {
    pub fn total(&self) -> u64 {
        self.prefill + self.decode
    }
}

struct Active {
    id: RequestId,
    slot: usize,
    sequence: Sequence,
}

pub struct Engine<M: BlockDiffusionModel> {
    model: M,
    config: EngineConfig,
    /// Allocated at the first step, then reused for the engine's lifetime.
    cache: Option<M::Cache>,
    /// Popped from the back: slot 0 first.
    free_slots: Vec<usize>,
    waiting: VecDeque<(RequestId, Request)>,
    active: Vec<Active>,
    next_id: RequestId,
    forwards: ForwardCounts,
}

impl<M: BlockDiffusionModel> Engine<M> {
    pub fn new(model: M, config: EngineConfig) -> Result<Self> {
        ensure!(
            config.max_batch > 0,
            "the engine needs a batch size of at least 1"
        );
        Ok(Engine {
            model,
            config,
            cache: None,
            free_slots: every_slot(config.max_batch),
            waiting: VecDeque::new(),
            active: Vec::new(),
            next_id: 0,
            forwards: ForwardCounts::default(),
        })
    }

    pub fn model(&self) -> &M {
        &self.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Gives the model back (e.g. to build an engine of another batch size around it).
    pub fn into_model(self) -> M {
        self.model
    }

    pub fn forward_counts(&self) -> ForwardCounts {
        self.forwards
    }

    /// Queues a request; it starts as soon as a slot is free.
    pub fn submit(&mut self, request: Request) -> Result<RequestId> {
        let params = &request.params;
        params.validate()?;
        self.model.check_block_length(params.block_length)?;
        let vocab = self.model.vocab_size();
        if let Some(bad) = request.prompt.iter().find(|&&t| t as usize >= vocab) {
            bail!("prompt token id {bad} is outside the model's vocabulary of {vocab}");
        }
        let needed = params.positions(request.prompt.len());
        ensure!(
            needed <= self.config.max_seq_len,
            "a prompt of {} tokens plus {} new tokens needs {needed} positions, more than the \
             engine's maximum sequence length {}: shorten the prompt or lower max new tokens",
            request.prompt.len(),
            params.max_new_tokens,
            self.config.max_seq_len
        );
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back((id, request));
        Ok(id)
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.active.is_empty()
    }

    /// Drops every queued and running sequence and the KV cache (after a failed forward),
    /// returning their ids.
    pub fn abort_all(&mut self) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> = self.active.drain(..).map(|a| a.id).collect();
        ids.extend(self.waiting.drain(..).map(|(id, _)| id));
        self.cache = None;
        self.free_slots = every_slot(self.config.max_batch);
        ids
    }

    /// One round: fill free slots with waiting requests and prefill them, then one forward
    /// per block length that stores every clean block and denoises every other block.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        if self.cache.is_none() {
            let cache = self
                .model
                .new_cache(self.config.max_batch, self.config.max_seq_len)
                .context("cannot allocate the KV cache")?;
            self.cache = Some(cache);
        }
        self.admit();
        self.prefill_new()?;
        let mut events = Vec::new();
        for block_length in self.block_lengths() {
            self.forward_group(block_length, &mut events)?;
        }
        Ok(events)
    }

    /// Runs the requests to completion; completions in request order.
    pub fn generate(&mut self, requests: Vec<Request>) -> Result<Vec<Completion>> {
        let ids = requests
            .into_iter()
            .map(|r| self.submit(r))
            .collect::<Result<Vec<_>>>()?;
        let mut done: BTreeMap<RequestId, Completion> = BTreeMap::new();
        while ids.iter().any(|id| !done.contains_key(id)) {
            for event in self.step()? {
                if let Event::Finished(c) = event {
                    done.insert(c.id, c);
                }
            }
        }
        Ok(ids.iter().filter_map(|id| done.remove(id)).collect())
    }

    /// Slots are empty when handed out: they are cleared when their sequence finishes. With no
    /// sequence running they are handed out from slot 0 again, as a new engine hands them out:
    /// an engine kept for one batch of requests after another (a trainer's rollouts) places
    /// each batch as a new engine would.
    fn admit(&mut self) {
        if self.active.is_empty() {
            self.free_slots = every_slot(self.config.max_batch);
        }
        while !self.waiting.is_empty() {
            let Some(slot) = self.free_slots.pop() else {
                break;
            };
            let (id, request) = self.waiting.pop_front().expect("not empty");
            let sequence =
                Sequence::new(&request.prompt, request.params, self.model.mask_token_id());
            self.active.push(Active { id, slot, sequence });
        }
    }

    /// Block lengths of the running sequences, in first-seen order: one forward per group.
    fn block_lengths(&self) -> Vec<usize> {
        let mut lengths = Vec::new();
        for a in &self.active {
            if !lengths.contains(&a.sequence.block_length()) {
                lengths.push(a.sequence.block_length());
            }
        }
        lengths
    }

    fn prefill_new(&mut self) -> Result<()> {
        for block_length in self.block_lengths() {
            let pending: Vec<usize> = (0..self.active.len())
                .filter(|&i| {
                    let s = &self.active[i].sequence;
                    s.phase == Phase::Prefill && s.block_length() == block_length
                })
                .collect();
            for chunk in self.prefill_chunks(&pending) {
                let rows: Vec<PrefillRow<'_>> = chunk
                    .iter()
                    .map(|&i| PrefillRow {
                        slot: self.active[i].slot,
                        tokens: self.active[i].sequence.committed(),
                    })
                    .collect();
                let cache = self.cache.as_mut().expect("allocated");
                self.model
                    .prefill(cache, &rows, block_length)
                    .context("prefill forward failed")?;
                self.forwards.prefill += 1;
                for &i in &chunk {
                    self.active[i].sequence.prefilled();
                }
            }
        }
        Ok(())
    }

    /// Splits sequences into prefill batches of at most `max_prefill_tokens` tokens.
    fn prefill_chunks(&self, pending: &[usize]) -> Vec<Vec<usize>> {
        let mut chunks: Vec<Vec<usize>> = Vec::new();
        let mut tokens = 0;
        for &i in pending {
            let len = self.active[i].sequence.committed().len();
            match chunks.last_mut() {
                Some(chunk) if tokens + len <= self.config.max_prefill_tokens => {
                    chunk.push(i);
                    tokens += len;
                }
                _ => {
                    chunks.push(vec![i]);
                    tokens = len;
                }
            }
        }
        chunks
    }

    /// One forward for the sequences of `block_length`. Clean blocks are committed first: a
    /// sequence that finished with its block needs no forward for it, the others store it in
    /// this forward. When at least half of the sequences have a block to store (a batch in
    /// lock-step at a block boundary, or the most of one that a few have fallen behind) each of
    /// those also denoises its next block in the same forward, behind the stored one, so a block
    /// costs its denoising steps and no forward of its own to be stored; the forward then takes
    /// two blocks per row (the others' second block is padding, which must fit their slots).
    /// A minority storing stores alone, so that a few sequences out of step do not double the
    /// width of every forward.
    fn forward_group(&mut self, block_length: usize, events: &mut Vec<Event>) -> Result<()> {
        let Round { running, finished } = self.commit_clean_blocks(block_length, events)?;
        if !running.is_empty() {
            let merged = self.merges_store_pass(&running, block_length);
            self.denoise_forward(&running, merged)?;
        }
        // Members are in `active` order, so removing from the back keeps the indices valid.
        let mut completions = Vec::new();
        for (i, finish_reason) in finished.into_iter().rev() {
            let done = self.active.remove(i);
            self.free_slots.push(done.slot);
            let prompt_len = done.sequence.prompt_len();
            let (token_ids, trace) = done.sequence.into_output();
            completions.push(Event::Finished(Completion {
                id: done.id,
                token_ids,
                trace,
                finish_reason,
                prompt_len,
            }));
        }
        events.extend(completions.into_iter().rev());
        Ok(())
    }

    /// Commits the clean blocks of the group's sequences, emitting their tokens.
    fn commit_clean_blocks(
        &mut self,
        block_length: usize,
        events: &mut Vec<Event>,
    ) -> Result<Round> {
        let members: Vec<usize> = (0..self.active.len())
            .filter(|&i| {
                let s = &self.active[i].sequence;
                s.block_length() == block_length && s.phase != Phase::Prefill
            })
            .collect();
        let mut finished = Vec::new();
        let mut running: Vec<Running> = Vec::new();
        for &i in &members {
            let a = &mut self.active[i];
            if a.sequence.phase != Phase::Store {
                running.push((i, false));
                continue;
            }
            let committed = a.sequence.commit_block();
            if !committed.tokens.is_empty() {
                events.push(Event::Tokens {
                    id: a.id,
                    tokens: committed.tokens,
                });
            }
            match committed.finished {
                // Emptied before the forward, which covers every slot of the cache: the slot
                // may have no room left for two blocks.
                Some(reason) => {
                    let cache = self.cache.as_mut().expect("allocated");
                    self.model.clear_slot(cache, a.slot)?;
                    finished.push((i, reason));
                }
                None => running.push((i, true)),
            }
        }
        Ok(Round { running, finished })
    }

    /// Whether the store pass rides along with the next block's denoising (see
    /// [`Engine::forward_group`]).
    fn merges_store_pass(&self, running: &[Running], block_length: usize) -> bool {
        let storing = running.iter().filter(|&&(_, stores)| stores).count();
        let room_for_two = |i: usize| {
            self.active[i].sequence.committed().len() + 2 * block_length <= self.config.max_seq_len
        };
        storing > 0
            && 2 * storing >= running.len()
            && running.iter().all(|&(i, stores)| stores || room_for_two(i))
    }

    /// One forward of the running members (each with whether it stores its last committed
    /// block), every one of them denoising its block unless it stores alone (`merged` false).
    fn denoise_forward(&mut self, running: &[Running], merged: bool) -> Result<()> {
        // A row denoises its block unless it stores alone.
        let denoises = |stores: bool| merged || !stores;
        // The positions whose logits each denoising row needs, and how each position's
        // candidate is picked (a sampled row draws its uniform numbers now, before the forward).
        let positions: Vec<Vec<usize>> = running
            .iter()
            .map(|&(i, stores)| match denoises(stores) {
                true => self.active[i].sequence.logit_positions(),
                false => Vec::new(),
            })
            .collect();
        let mut picks = Vec::new();
        for (&(i, _), listed) in running.iter().zip(&positions) {
            if listed.is_empty() {
                continue;
            }
            let sequence = &mut self.active[i].sequence;
            let sampling = *sequence.sampling();
            if sampling.is_greedy() {
                picks.extend(std::iter::repeat_n(Pick::Greedy, listed.len()));
            } else {
                let with_entropy = sequence.needs_entropy();
                picks.extend(sequence.listed_uniforms().into_iter().map(|uniform| {
                    Pick::Draw(Draw {
                        sampling,
                        uniform,
                        with_entropy,
                    })
                }));
            }
        }
        let rows: Vec<BlockRow<'_>> = running
            .iter()
            .zip(&positions)
            .map(|(&(i, stores), logits)| {
                let sequence = &self.active[i].sequence;
                BlockRow {
                    slot: self.active[i].slot,
                    store: stores.then(|| sequence.last_committed_block()),
                    denoise: denoises(stores).then(|| sequence.block()),
                    logits,
                }
            })
            .collect();
        let cache = self.cache.as_mut().expect("allocated");
        let logits = self
            .model
            .forward_blocks(cache, &rows)
            .context("decoding forward failed")?;
        self.forwards.decode += 1;
        drop(rows);
        let candidates = match logits {
            Some(logits) => picked_candidates(&logits, &picks, self.model.vocab_size())?,
            None => Vec::new(),
        };
        // Each denoising row's candidates, in the order of its listed positions.
        let mut rest = &candidates[..];
        for (&(i, stores), listed) in running.iter().zip(&positions) {
            if !denoises(stores) {
                continue;
            }
            let (row, after) = rest
                .split_at_checked(listed.len())
                .context("the model returned too few logit rows")?;
            self.active[i].sequence.denoise_listed(row);
            rest = after;
        }
        Ok(())
    }
}

/// Every slot of an engine of `max_batch`, free, in the order [`Engine::admit`] hands them out.
fn every_slot(max_batch: usize) -> Vec<usize> {
    (0..max_batch).rev().collect()
}

/// A running member of a forward: its index in `active`, and whether the forward stores (writes
/// the K/V of) its last committed block.
type Running = (usize, bool);

/// A group's members once their clean blocks are committed: those that run a forward, and
/// those that finished (index in `active`, reason), whose slots are emptied.
struct Round {
    running: Vec<Running>,
    finished: Vec<(usize, FinishReason)>,
}

/// How one logit row's candidate is picked.
#[derive(Clone, Copy)]
enum Pick {
    /// Top-k 1, on the logits' device ([`greedy_candidates`]).
    Greedy,
    Draw(Draw),
}

/// The candidate of every row of `logits` (`[rows, vocab]`) as `picks[row]` says, in row order:
/// the greedy rows' picked with one kernel and the sampled rows' drawn with another (on CUDA),
/// so only a few numbers per row come back to the host.
fn picked_candidates(logits: &Tensor, picks: &[Pick], vocab: usize) -> Result<Vec<Candidate>> {
    let rows = picks.len();
    ensure!(
        logits.dims() == [rows, vocab],
        "the model returned logits of shape {:?}, expected [{rows}, {vocab}]",
        logits.dims()
    );
    let greedy: Vec<bool> = picks.iter().map(|p| matches!(p, Pick::Greedy)).collect();
    let draws: Vec<Draw> = picks
        .iter()
        .filter_map(|p| match p {
            Pick::Draw(d) => Some(*d),
            Pick::Greedy => None,
        })
        .collect();
    let mut greedy_picked = match select_rows(logits, &greedy, true)? {
        Some(l) => greedy_candidates(&l)?,
        None => Vec::new(),
    }
    .into_iter();
    let mut drawn = match select_rows(logits, &greedy, false)? {
        Some(l) => sampled_candidates(&l, &draws)?,
        None => Vec::new(),
    }
    .into_iter();
    greedy
        .iter()
        .map(|&g| {
            if g {
                greedy_picked.next()
            } else {
                drawn.next()
            }
        })
        .collect::<Option<Vec<_>>>()
        .context("a pick returned too few candidates")
}

/// The rows `r` of `logits` with `greedy[r] == wanted`, or `None` when there is none.
fn select_rows(logits: &Tensor, greedy: &[bool], wanted: bool) -> Result<Option<Tensor>> {
    let rows: Vec<u32> = (0..greedy.len() as u32)
        .filter(|&r| greedy[r as usize] == wanted)
        .collect();
    if rows.is_empty() {
        return Ok(None);
    }
    if rows.len() == greedy.len() {
        return Ok(Some(logits.clone()));
    }
    let index = Tensor::new(rows.as_slice(), logits.device())?;
    Ok(Some(logits.index_select(&index, 0)?))
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
