//! TraceRL's policy loss (spec bicrl §9.1–§9.2, `compute_logp_old_tok_parallel` and
//! `forward_process` of the reference's `rl_sdar.py`): PPO-clip on the tokens each replay
//! sample decodes, plus a k3 KL penalty against the weights the RL step started from.
//!
//! For sample n with advantage A and Δ_t = log π_θ(x_t) − log π_old(x_t) on its loss positions:
//! ρ_t = exp(clamp(Δ_t, −10, 10)),
//! L_n = −(1/L1) Σ_t min(ρ_t A, clamp(ρ_t, 1−ε, 1+ε) A) + β (1/L1) Σ_t (exp(clamp(−Δ_t, −10, 10)) − 1 + Δ_t),
//! with L1 the replay's loss normaliser (not a token count). The loss of a group of samples is
//! the mean of their L_n.

use super::replay::{Replay, ReplaySample};
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use dice_model::masks::KeySpans;
use dice_model::sdar::QUERY_CHUNK;
use dice_model::{MaskedSequence, Sdar};
use std::collections::HashMap;
use std::ops::Range;

/// Δ is clamped to ±this before it is exponentiated, as the reference does.
const LOG_RATIO_CLAMP: f32 = 10.0;

/// The loss's hyper-parameters (spec bicrl §2 `training.eps`, `training.beta`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyLossSettings {
    /// PPO's clip range ε: ratios are clipped to [1 − ε, 1 + ε].
    pub clip_eps: f32,
    /// Weight β of the k3 KL estimate (0 turns the penalty off).
    pub kl_beta: f32,
}

impl Default for PolicyLossSettings {
    /// DICE's: ε 0.2, β 0.01.
    fn default() -> Self {
        Self {
            clip_eps: 0.2,
            kl_beta: 0.01,
        }
    }
}

/// The loss of one sample.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleLoss {
    /// L_n, as the model computed it (f32).
    pub loss: f32,
    /// The KL term of L_n, β (1/L1) Σ k3 (f64 from the same log-probabilities).
    pub kl: f64,
    /// ρ_t at each loss position, in the order of the sample's loss positions.
    pub ratios: Vec<f32>,
    /// Whether the clip took over at each loss position: A > 0 and ρ > 1 + ε, or A < 0 and
    /// ρ < 1 − ε (the token then contributes no policy gradient).
    pub clipped: Vec<bool>,
}

/// The loss of a group of samples and its gradient.
#[derive(Debug, Clone)]
pub struct PolicyLoss {
    /// The mean of the samples' L_n ([`policy_loss_and_grads`]) or their sum
    /// ([`policy_loss_and_grad_sums`]).
    pub total: f32,
    pub samples: Vec<SampleLoss>,
    /// d total / d weight for every checkpoint tensor, keyed by its checkpoint name, in f32.
    pub grads: HashMap<String, Tensor>,
}

impl PolicyLoss {
    pub fn loss_tokens(&self) -> usize {
        self.samples.iter().map(|s| s.ratios.len()).sum()
    }

    pub fn clipped_tokens(&self) -> usize {
        self.samples
            .iter()
            .flat_map(|s| &s.clipped)
            .filter(|&&c| c)
            .count()
    }

    /// The share of loss tokens whose ratio was clipped.
    pub fn clip_fraction(&self) -> f64 {
        self.clipped_tokens() as f64 / self.loss_tokens().max(1) as f64
    }

    /// The mean of the samples' KL terms.
    pub fn kl(&self) -> f64 {
        self.samples.iter().map(|s| s.kl).sum::<f64>() / self.samples.len().max(1) as f64
    }
}

/// Builds each sample's model input, making a record's visibility once for all its samples
/// (they come in record order): its key spans where the model trains on them (CUDA, bf16/f16),
/// else (the CPU, f32, or a record whose rows see more than two ranges of keys) its N² mask.
struct Sequences<'a> {
    replay: &'a Replay,
    device: &'a Device,
    spans_suffice: bool,
    visibility: Option<(usize, Option<Tensor>, Option<KeySpans>)>,
}

impl<'a> Sequences<'a> {
    fn new(replay: &'a Replay, model: &'a Sdar) -> Result<Self> {
        Ok(Self {
            replay,
            device: model.device(),
            spans_suffice: model.trains_on_key_spans()?,
            visibility: None,
        })
    }

    fn get(&mut self, sample: &ReplaySample) -> Result<MaskedSequence> {
        let (mask, spans) = match &self.visibility {
            Some((record, mask, spans)) if *record == sample.record => {
                (mask.clone(), spans.clone())
            }
            _ => {
                // Each is N² calls of the replay's visibility: the spans only where the model
                // reads them, the mask only where it must.
                let spans = self
                    .spans_suffice
                    .then(|| self.replay.key_spans(sample.record))
                    .flatten();
                let mask = match spans {
                    Some(_) => None,
                    None => Some(self.replay.attention_mask(sample.record, self.device)?),
                };
                self.visibility = Some((sample.record, mask.clone(), spans.clone()));
                (mask, spans)
            }
        };
        Ok(self.replay.sequence(sample, mask, spans))
    }
}

/// The most tokens of one packed model input where the model trains on key spans (CUDA,
/// bf16/f16: the fused attention skips the key tiles no query of a packed part sees, so a pack
/// costs its parts' attention, not its square), else 0: one sample per input, since the
/// composite attention of the CPU and f32 computes the whole N² of a pack. Each input pays a
/// forward's and a backward's fixed costs (every layer's launches and host work), so short
/// samples are packed up to the tokens an SFT row holds.
pub fn pack_tokens(model: &Sdar) -> Result<usize> {
    Ok(if model.trains_on_key_spans()? {
        PACK_TOKENS
    } else {
        0
    })
}

/// [`pack_tokens`] where packing pays: DICE's SFT row of 6,144 tokens, half the positions of an
/// SFT step (two streams), whose activations fit beside the optimizer state and a rollout
/// engine kept on the device (`dice bench train` at 1.7B: 33 GiB for 12,288 positions).
const PACK_TOKENS: usize = 6_144;

/// Hands `each` the samples `range` of `replay` as model inputs, one after another: runs of
/// consecutive samples packed into one input of at most `pack_tokens` tokens (one sample per
/// input when a sample is longer, or `pack_tokens` is 0), each sample seeing only its own
/// tokens; with the samples each input holds.
fn for_each_input(
    sequences: &mut Sequences,
    range: Range<usize>,
    pack_tokens: usize,
    mut each: impl FnMut(Range<usize>, MaskedSequence) -> Result<()>,
) -> Result<()> {
    let replay = sequences.replay;
    let width = replay.prompt_width + 2 * replay.region_width;
    let per_pack = (pack_tokens / width.max(1)).max(1);
    let mut parts: Vec<(usize, MaskedSequence)> = Vec::new();
    for n in range {
        let input = sequences.get(&replay.samples[n])?;
        // Spans and masks do not mix in one input (a record whose rows see more than two
        // ranges of keys keeps a mask).
        let joins = parts.len() < per_pack
            && parts
                .last()
                .is_none_or(|(_, last)| last.spans.is_some() == input.spans.is_some());
        if !joins {
            let (samples, packed) = pack(std::mem::take(&mut parts))?;
            each(samples, packed)?;
        }
        parts.push((n, input));
    }
    if !parts.is_empty() {
        let (samples, packed) = pack(parts)?;
        each(samples, packed)?;
    }
    Ok(())
}

/// Consecutive samples' inputs `parts` (sample index, input) as one input: tokens one after
/// another, each part's positions as they were, its visibility confined to its own tokens
/// (key spans shifted, or a block-diagonal mask).
fn pack(parts: Vec<(usize, MaskedSequence)>) -> Result<(Range<usize>, MaskedSequence)> {
    let samples = parts[0].0..parts[parts.len() - 1].0 + 1;
    if parts.len() == 1 {
        let (_, input) = parts.into_iter().next().expect("one part");
        return Ok((samples, input));
    }
    let total: usize = parts.iter().map(|(_, part)| part.tokens.len()).sum();
    let mut packed = MaskedSequence {
        tokens: Vec::with_capacity(total),
        positions: Vec::with_capacity(total),
        mask: None,
        spans: None,
        rows: Vec::new(),
        labels: Vec::new(),
    };
    let mut mask_rows = Vec::new();
    for (_, part) in &parts {
        let (offset, n) = (packed.tokens.len(), part.tokens.len());
        packed.tokens.extend_from_slice(&part.tokens);
        packed.positions.extend_from_slice(&part.positions);
        packed
            .rows
            .extend(part.rows.iter().map(|&row| row + offset as u32));
        packed.labels.extend_from_slice(&part.labels);
        if let Some(mask) = &part.mask {
            let hidden = |width: usize| Tensor::full(f32::NEG_INFINITY, (n, width), mask.device());
            let mut row = Vec::with_capacity(3);
            if offset > 0 {
                row.push(hidden(offset)?);
            }
            row.push(mask.clone());
            if offset + n < total {
                row.push(hidden(total - offset - n)?);
            }
            mask_rows.push(Tensor::cat(&row, 1)?);
        }
    }
    let spans: Option<Vec<&KeySpans>> = parts.iter().map(|(_, part)| part.spans.as_ref()).collect();
    packed.spans = spans.map(|spans| KeySpans::packed(&spans));
    if !mask_rows.is_empty() {
        packed.mask = Some(Tensor::cat(&mask_rows, 0)?);
    }
    Ok((samples, packed))
}

/// log π_old at every loss position of every sample (spec bicrl §9.1): the model as it is,
/// without autograd, on the same inputs the loss sees, samples packed into inputs of at most
/// `pack_tokens` tokens ([`pack_tokens`]). Computed once per RL step, before any update.
pub fn old_log_probs(model: &Sdar, replay: &Replay, pack_tokens: usize) -> Result<Vec<Vec<f32>>> {
    let mut sequences = Sequences::new(replay, model)?;
    let mut all = Vec::with_capacity(replay.samples.len());
    let every = 0..replay.samples.len();
    for_each_input(&mut sequences, every, pack_tokens, |samples, input| {
        let log_probs = model.masked_log_probs(&input, QUERY_CHUNK)?;
        let mut rest = log_probs.as_slice();
        for sample in &replay.samples[samples] {
            let (own, after) = rest.split_at(sample.loss_positions.len());
            all.push(own.to_vec());
            rest = after;
        }
        Ok(())
    })?;
    Ok(all)
}

/// The loss of the samples `range` of `replay` (mean of their L_n) and its gradient for every
/// weight, against the old log-probabilities of [`old_log_probs`]: the sums of
/// [`policy_loss_and_grad_sums`] divided by the number of samples.
pub fn policy_loss_and_grads(
    model: &Sdar,
    replay: &Replay,
    range: Range<usize>,
    old_log_probs: &[Vec<f32>],
    settings: &PolicyLossSettings,
    pack_tokens: usize,
) -> Result<PolicyLoss> {
    let scale = 1.0 / range.len().max(1) as f64;
    let sums =
        policy_loss_and_grad_sums(model, replay, range, old_log_probs, settings, pack_tokens)?;
    let grads = sums
        .grads
        .into_iter()
        .map(|(name, sum)| Ok((name, (sum * scale)?)))
        .collect::<Result<_>>()?;
    Ok(PolicyLoss {
        total: (sums.samples.iter().map(|s| f64::from(s.loss)).sum::<f64>() * scale) as f32,
        samples: sums.samples,
        grads,
    })
}

/// The sum of the L_n of the samples `range` of `replay` and its gradient for every weight.
/// The samples go through the model packed into inputs of at most `pack_tokens` tokens
/// ([`pack_tokens`]; one sample per input at 0), each input with the checkpointed forward and
/// backward of [`Sdar::masked_loss_and_grads`]; gradients are summed in f32, in input order. A
/// sample alone in its input keeps the model's L_n; one packed with others gets L_n from the
/// same log-probabilities in f64 (the input's loss is their sum).
pub fn policy_loss_and_grad_sums(
    model: &Sdar,
    replay: &Replay,
    range: Range<usize>,
    old_log_probs: &[Vec<f32>],
    settings: &PolicyLossSettings,
    pack_tokens: usize,
) -> Result<PolicyLoss> {
    ensure!(
        range.end <= replay.samples.len() && old_log_probs.len() == replay.samples.len(),
        "samples {range:?} of a replay of {} samples with {} old log-probability rows",
        replay.samples.len(),
        old_log_probs.len()
    );
    ensure!(!range.is_empty(), "no samples to compute the loss of");
    let device = model.device();
    let normaliser = replay.loss_normaliser as f64;
    let mut sequences = Sequences::new(replay, model)?;
    let mut samples = Vec::with_capacity(range.len());
    let mut grads: HashMap<String, Tensor> = HashMap::new();
    for_each_input(&mut sequences, range, pack_tokens, |packed, input| {
        let (mut old_rows, mut advantages) = (Vec::new(), Vec::new());
        for n in packed.clone() {
            let sample = &replay.samples[n];
            let old = &old_log_probs[n];
            ensure!(
                old.len() == sample.loss_positions.len(),
                "sample {n} has {} loss positions but {} old log-probabilities",
                sample.loss_positions.len(),
                old.len()
            );
            old_rows.extend_from_slice(old);
            let advantage = replay.records[sample.record].advantage as f32;
            advantages.extend(std::iter::repeat_n(advantage, old.len()));
        }
        let old_tensor = Tensor::new(old_rows.as_slice(), device)?;
        let advantage_tensor = Tensor::new(advantages.as_slice(), device)?;
        let loss = |log_probs: &Tensor, rows: Range<usize>| {
            sample_loss(
                log_probs,
                &old_tensor.narrow(0, rows.start, rows.len())?,
                &advantage_tensor.narrow(0, rows.start, rows.len())?,
                normaliser,
                settings,
            )
        };
        let step = model.masked_loss_and_grads(&input, loss, QUERY_CHUNK)?;
        let alone = packed.len() == 1;
        let mut rest = step.log_probs.as_slice();
        for n in packed {
            let sample = &replay.samples[n];
            let (own, after) = rest.split_at(sample.loss_positions.len());
            rest = after;
            samples.push(describe(
                alone.then_some(step.loss),
                own,
                &old_log_probs[n],
                replay.records[sample.record].advantage as f32,
                normaliser,
                settings,
            ));
        }
        for (name, grad) in step.grads {
            let grad = grad.to_dtype(DType::F32)?;
            let sum = match grads.remove(&name) {
                Some(sum) => (sum + grad)?,
                None => grad,
            };
            grads.insert(name, sum);
        }
        Ok(())
    })?;
    let total = samples.iter().map(|s| f64::from(s.loss)).sum::<f64>();
    Ok(PolicyLoss {
        total: total as f32,
        samples,
        grads,
    })
}

/// L_n's terms for a run of loss positions in f32 candle ops, as `forward_process` computes
/// them (the reference's min and clamp have the same gradients as candle's); `advantages`: the
/// advantage of each position's sample (a packed input holds several samples).
fn sample_loss(
    log_probs: &Tensor,
    old: &Tensor,
    advantages: &Tensor,
    normaliser: f64,
    settings: &PolicyLossSettings,
) -> candle_core::Result<Tensor> {
    let delta = (log_probs - old)?;
    let ratio = delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)?.exp()?;
    let clipped = ratio.clamp(1.0 - settings.clip_eps, 1.0 + settings.clip_eps)?;
    let surrogate = (&ratio * advantages)?.minimum(&(clipped * advantages)?)?;
    let policy = (surrogate.sum_all()? / -normaliser)?;
    let k3 = ((delta
        .neg()?
        .clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)?
        .exp()?
        - 1.0)?
        + &delta)?;
    let kl = (k3.sum_all()? * (f64::from(settings.kl_beta) / normaliser))?;
    policy + kl
}

/// The per-token statistics of a sample from the log-probabilities its loss was computed from.
fn describe(
    loss: Option<f32>,
    log_probs: &[f32],
    old: &[f32],
    advantage: f32,
    normaliser: f64,
    settings: &PolicyLossSettings,
) -> SampleLoss {
    let (low, high) = (1.0 - settings.clip_eps, 1.0 + settings.clip_eps);
    let deltas: Vec<f32> = log_probs.iter().zip(old).map(|(lp, o)| lp - o).collect();
    let ratios: Vec<f32> = deltas
        .iter()
        .map(|d| d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp())
        .collect();
    let clipped = ratios
        .iter()
        .map(|&r| (advantage > 0.0 && r > high) || (advantage < 0.0 && r < low))
        .collect();
    let k3_sum: f64 = deltas
        .iter()
        .map(|&d| {
            let d = f64::from(d);
            let bound = f64::from(LOG_RATIO_CLAMP);
            (-d).clamp(-bound, bound).exp() - 1.0 + d
        })
        .sum();
    let kl = f64::from(settings.kl_beta) * k3_sum / normaliser;
    // A sample packed with others has no loss of its own from the model: the same terms in f64.
    let loss = loss.unwrap_or_else(|| {
        let a = f64::from(advantage);
        let (low, high) = (f64::from(low), f64::from(high));
        let surrogate: f64 = ratios
            .iter()
            .map(|&r| {
                let r = f64::from(r);
                (r * a).min(r.clamp(low, high) * a)
            })
            .sum();
        (-surrogate / normaliser + kl) as f32
    });
    SampleLoss {
        loss,
        kl,
        ratios,
        clipped,
    }
}
