//! One sequence's decoding state: the committed prefix, the block being denoised, its step
//! counter and random stream (spec §4.1, §4.2, §4.6; JetEngine's `Sequence`, §7.2).

use crate::params::DecodeParams;
use crate::sampling::{Candidate, SamplingParams};
use crate::schedule::transfer_schedule;
use crate::strategy::{select_transfer, Overflow, Scored};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Whole prompt blocks wait for the block-causal prefill.
    Prefill,
    /// The current block still holds masks: one denoising forward per engine step.
    Denoise,
    /// The current block is clean: it is committed, and its K/V are written by the next
    /// forward unless the sequence finished with it.
    Store,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop id was generated; the output ends with it.
    Stop,
    /// The token limit was reached.
    Length,
}

impl FinishReason {
    /// The OpenAI API's name.
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What committing a block produced: the new output tokens and whether the sequence is done.
pub(crate) struct Committed {
    pub tokens: Vec<u32>,
    pub finished: Option<FinishReason>,
}

pub(crate) struct Sequence {
    params: DecodeParams,
    mask_token_id: u32,
    prompt_len: usize,
    /// Tokens whose clean K/V is in the cache (after prefill) or about to be (the prefill part).
    committed: Vec<u32>,
    block: Vec<u32>,
    /// Per block position: the denoising forward (1-based, whole response) that unmasked it.
    block_trace: Vec<u32>,
    block_step: usize,
    schedule: Vec<usize>,
    forwards: u32,
    /// Tokens up to which generation runs: whole blocks covering prompt + max_new_tokens.
    total_len: usize,
    output: Vec<u32>,
    trace: Vec<u32>,
    rng: StdRng,
    pub phase: Phase,
}

impl Sequence {
    pub(crate) fn new(prompt: &[u32], params: DecodeParams, mask_token_id: u32) -> Self {
        let b = params.block_length;
        let prompt_len = prompt.len();
        let prefill_len = prompt_len / b * b;
        let total_len = (prompt_len + params.max_new_tokens).div_ceil(b) * b;
        let mut sequence = Sequence {
            schedule: transfer_schedule(b, params.steps),
            rng: StdRng::seed_from_u64(params.seed),
            mask_token_id,
            prompt_len,
            committed: prompt[..prefill_len].to_vec(),
            block: Vec::with_capacity(b),
            block_trace: Vec::with_capacity(b),
            block_step: 0,
            forwards: 0,
            total_len,
            output: Vec::new(),
            trace: Vec::new(),
            phase: if prefill_len > 0 {
                Phase::Prefill
            } else {
                Phase::Denoise
            },
            params,
        };
        sequence.start_block(&prompt[prefill_len..]);
        sequence
    }

    pub(crate) fn block_length(&self) -> usize {
        self.params.block_length
    }

    pub(crate) fn committed(&self) -> &[u32] {
        &self.committed
    }

    pub(crate) fn block(&self) -> &[u32] {
        &self.block
    }

    /// The last committed block (prompt tail included): the one a store pass writes.
    pub(crate) fn last_committed_block(&self) -> &[u32] {
        &self.committed[self.committed.len() - self.params.block_length..]
    }

    pub(crate) fn prefilled(&mut self) {
        self.phase = Phase::Denoise;
    }

    fn start_block(&mut self, leading: &[u32]) {
        let b = self.params.block_length;
        self.block.clear();
        self.block.extend_from_slice(leading);
        self.block.resize(b, self.mask_token_id);
        self.block_trace.clear();
        self.block_trace.resize(b, 0);
        self.block_step = 0;
    }

    pub(crate) fn sampling(&self) -> &SamplingParams {
        &self.params.sampling
    }

    /// Whether the remasking strategy reads the candidates' entropy.
    pub(crate) fn needs_entropy(&self) -> bool {
        self.params.strategy.needs_entropy()
    }

    /// The block positions whose candidates the next denoising step asks for, ascending: the
    /// masked ones, or all of them with [`Overflow::Reference`] (its surplus picks rewrite
    /// unmasked positions). [`Sequence::denoise_step`] asks for no other.
    pub(crate) fn logit_positions(&self) -> Vec<usize> {
        (0..self.block.len()).filter(|&i| self.listed(i)).collect()
    }

    fn listed(&self, i: usize) -> bool {
        self.params.overflow == Overflow::Reference || self.block[i] == self.mask_token_id
    }

    /// Where each listed block position's outputs sit among those of
    /// [`Sequence::logit_positions`] (the listed positions before it).
    fn listed_ranks(&self) -> Vec<usize> {
        let mut rank = 0;
        (0..self.block.len())
            .map(|i| {
                let r = rank;
                rank += usize::from(self.listed(i));
                r
            })
            .collect()
    }

    /// One denoising step from the candidates of the positions [`Sequence::logit_positions`]
    /// lists, in its order.
    pub(crate) fn denoise_listed(&mut self, candidates: &[Candidate]) {
        let rank = self.listed_ranks();
        self.denoise_step(|i| candidates[rank[i]]);
    }

    /// The uniform numbers of the positions [`Sequence::logit_positions`] lists, in its order,
    /// for the next denoising step's draws. Every block position draws one, listed or not (the
    /// order seeded outputs rely on).
    pub(crate) fn listed_uniforms(&mut self) -> Vec<f64> {
        let uniforms: Vec<f64> = (0..self.params.block_length)
            .map(|_| self.rng.random::<f64>())
            .collect();
        (0..self.block.len())
            .filter(|&i| self.listed(i))
            .map(|i| uniforms[i])
            .collect()
    }

    /// One denoising step; `candidate(i)` is the candidate of block position `i`. It is asked
    /// for the masked positions and, with [`Overflow::Reference`], for the unmasked positions
    /// the step rewrites.
    fn denoise_step(&mut self, candidate: impl Fn(usize) -> Candidate) {
        self.forwards += 1;
        let b = self.params.block_length;
        let candidates: Vec<Option<Candidate>> = (0..b)
            .map(|i| (self.block[i] == self.mask_token_id).then(|| candidate(i)))
            .collect();
        let scores: Vec<Option<Scored>> = candidates
            .iter()
            .map(|c| {
                c.map(|c| Scored {
                    confidence: c.prob,
                    entropy: c.entropy,
                })
            })
            .collect();
        // JetEngine force-finishes a block whose step budget is spent; taking every remaining
        // candidate does the same without committing mask tokens.
        let chosen = match self.schedule.get(self.block_step) {
            Some(&count) => {
                select_transfer(&self.params.strategy, &scores, count, self.params.overflow)
            }
            None => (0..b).filter(|&i| scores[i].is_some()).collect(),
        };
        let block_start = self.committed.len();
        for i in chosen {
            let token = match candidates[i] {
                Some(c) => {
                    if block_start + i >= self.prompt_len {
                        self.block_trace[i] = self.forwards;
                    }
                    c.token
                }
                None => candidate(i).token,
            };
            self.block[i] = token;
        }
        self.block_step += 1;
        // A candidate can itself be the mask id; after the forced step such a block is
        // committed as it is, as JetEngine does, so decoding always terminates.
        if !self.block.contains(&self.mask_token_id) || self.block_step > self.params.steps {
            self.phase = Phase::Store;
        }
    }

    /// Appends the clean block and applies the stopping rules; a sequence that goes on starts
    /// its next block.
    pub(crate) fn commit_block(&mut self) -> Committed {
        let block_start = self.committed.len();
        self.committed.extend_from_slice(&self.block);
        let first_generated = self.prompt_len.saturating_sub(block_start);
        let mut tokens = self.block[first_generated..].to_vec();
        let mut trace = self.block_trace[first_generated..].to_vec();
        let mut finished = None;
        if self.params.exact_max {
            let room = self.params.max_new_tokens - self.output.len();
            if tokens.len() >= room {
                tokens.truncate(room);
                trace.truncate(room);
                finished = Some(FinishReason::Length);
            }
        }
        if let Some(stop) = tokens.iter().position(|t| self.params.stop_ids.contains(t)) {
            tokens.truncate(stop + 1);
            trace.truncate(stop + 1);
            finished = Some(FinishReason::Stop);
        }
        if finished.is_none() && self.committed.len() >= self.total_len {
            finished = Some(FinishReason::Length);
        }
        self.output.extend_from_slice(&tokens);
        self.trace.extend(trace);
        if finished.is_none() {
            self.start_block(&[]);
            self.phase = Phase::Denoise;
        }
        Committed { tokens, finished }
    }

    pub(crate) fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    pub(crate) fn into_output(self) -> (Vec<u32>, Vec<u32>) {
        (self.output, self.trace)
    }
}
