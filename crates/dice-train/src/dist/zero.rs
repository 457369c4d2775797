//! AdamW for data-parallel ranks, with the optimizer state replicated (stage 0) or sharded as
//! ZeRO does (stages 1 and 2, as DeepSpeed and torch FSDP's `SHARD_GRAD_OP` define them).
//!
//! Sharded, the parameters are flattened in name order and cut into one contiguous shard per
//! rank ([`contiguous_share`]: every rank computes the same cut). A rank keeps the f32 masters
//! and the AdamW moments of its shard only, 1/W of the 12 bytes per parameter of the state. A
//! step:
//! 1. the summed gradient of the shard: stage 1 all-reduces the whole gradient and keeps the
//!    shard; stage 2 reduce-scatters it, so no rank ever holds the whole summed gradient. Both
//!    add the ranks' gradients in rank order, as the all-reduce of stage 0 does;
//! 2. the global norm: every rank's sum of squares over its shard, added over the ranks
//!    ([`grad_clip`]), whose clipping factor the shard's update applies;
//! 3. AdamW on the shard, element by element as on the whole tensors;
//! 4. the updated masters all-gathered into every rank's model weights (rounded to the compute
//!    dtype).
//!
//! The update is the one of the replicated optimizer, bit for bit, apart from the one ulp the
//! regrouped norm can move (see [`grad_clip`]). The model's weights stay whole on
//! every rank (ZeRO-3 would shard them too), and each rank's gradient is whole until it is
//! reduced (there is no bucketing overlapped with the backward).
//!
//! Checkpoints: the shards are gathered on rank 0, which writes the optimizer state file of a
//! replicated run ([`crate::run::checkpoint::OPTIMIZER_STATE`]), so a checkpoint does not depend on
//! the stage and a run resumes with any stage. Rank 0 then holds the whole state on the host
//! for the time of the save. Resuming, every rank maps the file and reads its shard.

use super::collective::{contiguous_share, Collective, SingleProcess};
use crate::optim::{grad_clip, AdamW, AdamWConfig, OptimizerSnapshot, StoredState};
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

/// How the optimizer state is spread over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroStage {
    /// Every rank holds the whole state and the whole summed gradient.
    Replicated,
    /// ZeRO-1: the state sharded, the gradient all-reduced whole.
    ShardedState,
    /// ZeRO-2: the state sharded, the gradient reduce-scattered.
    ShardedStateAndGradients,
}

impl ZeroStage {
    /// The stage of the number DeepSpeed gives it (0, 1 or 2).
    pub fn from_number(stage: u8) -> Result<Self> {
        Ok(match stage {
            0 => Self::Replicated,
            1 => Self::ShardedState,
            2 => Self::ShardedStateAndGradients,
            _ => bail!("zero_stage must be 0, 1 or 2, not {stage} (stage 3 is not supported)"),
        })
    }
}

/// What one optimizer step does with the gradients summed over the ranks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepSettings {
    /// The summed gradient is multiplied by this before clipping.
    pub grad_scale: f64,
    /// Global gradient-norm clipping.
    pub max_grad_norm: f64,
    /// The learning rate of this step.
    pub lr: f64,
}

/// AdamW over the model's weights on the ranks of a data-parallel run.
pub enum DataParallelAdamW {
    Replicated(AdamW),
    Sharded(ShardedAdamW),
}

impl DataParallelAdamW {
    /// The optimizer of this rank for `weights` (the same on every rank); with `offload`, its
    /// state in host memory ([`AdamW::offloaded`]), which sharding does not take.
    pub fn new(
        weights: Vec<(String, Var)>,
        config: AdamWConfig,
        stage: ZeroStage,
        offload: bool,
        collective: &dyn Collective,
    ) -> Result<Self> {
        Ok(match stage {
            ZeroStage::Replicated if offload => {
                Self::Replicated(AdamW::offloaded(weights, config)?)
            }
            ZeroStage::Replicated => Self::Replicated(AdamW::new(weights, config)?),
            ZeroStage::ShardedState | ZeroStage::ShardedStateAndGradients => {
                ensure!(
                    !offload,
                    "the optimizer's state is either offloaded to the host or sharded over the \
                     ranks' devices, not both: drop --optimizer-offload or use ZeRO stage 0"
                );
                Self::Sharded(ShardedAdamW::new(weights, config, stage, collective)?)
            }
        })
    }

    /// Updates taken so far.
    pub fn steps(&self) -> u64 {
        match self {
            Self::Replicated(optimizer) => optimizer.steps(),
            Self::Sharded(optimizer) => optimizer.shard.steps(),
        }
    }

    /// f32 moment values this rank holds.
    pub fn moment_elements(&self) -> usize {
        match self {
            Self::Replicated(optimizer) => optimizer.moment_elements(),
            Self::Sharded(optimizer) => optimizer.shard.moment_elements(),
        }
    }

    /// Zero moments and step count, the weights kept: the next step is a fresh AdamW's first.
    pub fn reset_moments(&mut self) -> Result<()> {
        match self {
            Self::Replicated(optimizer) => optimizer.reset_moments(),
            Self::Sharded(optimizer) => optimizer.shard.reset_moments(),
        }
    }

    /// One step from this rank's gradients `grads` (every weight's, summed over its
    /// micro-batches): their sum over the ranks, times `step.grad_scale`, clipped to a global
    /// norm of `step.max_grad_norm`, and AdamW with learning rate `step.lr`. Returns the norm
    /// before clipping; when it is not finite the weights are left as they were (the caller
    /// decides what to do).
    pub fn step(
        &mut self,
        mut grads: HashMap<String, Tensor>,
        step: &StepSettings,
        collective: &dyn Collective,
    ) -> Result<f32> {
        match self {
            Self::Replicated(optimizer) => {
                all_reduce_each(&mut grads, collective)?;
                scale_each(&mut grads, step.grad_scale)?;
                let clip = grad_clip(&grads, step.max_grad_norm, &SingleProcess)?;
                if clip.norm.is_finite() {
                    optimizer.step(&grads, step.lr, clip.factor)?;
                }
                Ok(clip.norm)
            }
            Self::Sharded(optimizer) => {
                let mut shard = match optimizer.stage {
                    ZeroStage::ShardedStateAndGradients => {
                        optimizer.reduce_scatter(&grads, collective)?
                    }
                    _ => {
                        all_reduce_each(&mut grads, collective)?;
                        optimizer.pieces_of(&grads)?
                    }
                };
                scale_each(&mut shard, step.grad_scale)?;
                let clip = grad_clip(&shard, step.max_grad_norm, collective)?;
                if clip.norm.is_finite() {
                    optimizer.step(&shard, step.lr, clip.factor, collective)?;
                }
                Ok(clip.norm)
            }
        }
    }

    /// Restores a state file of [`OptimizerSnapshot::save_state`]: the whole of it, or this
    /// rank's shard.
    pub fn load_state(&mut self, path: &Path) -> Result<()> {
        match self {
            Self::Replicated(optimizer) => optimizer.load_state(path),
            Self::Sharded(optimizer) => optimizer.load_state(path),
        }
    }

    /// The whole state copied to rank 0's host memory ([`AdamW::snapshot`]: the masters, and
    /// the moments with `moments`), `None` on the other ranks; a sharded state is gathered for
    /// it, with every rank taking part.
    pub fn snapshot_on_rank0(
        &self,
        collective: &dyn Collective,
        moments: bool,
    ) -> Result<Option<OptimizerSnapshot>> {
        match self {
            Self::Replicated(optimizer) if collective.rank() == 0 => {
                Ok(Some(optimizer.snapshot(moments)?))
            }
            Self::Replicated(_) => Ok(None),
            Self::Sharded(optimizer) => optimizer.gather(collective, moments),
        }
    }
}

/// Every gradient multiplied by `scale` (left as it is when that is 1).
fn scale_each(grads: &mut HashMap<String, Tensor>, scale: f64) -> Result<()> {
    if scale != 1.0 {
        for grad in grads.values_mut() {
            *grad = (&*grad * scale)?;
        }
    }
    Ok(())
}

/// Every gradient replaced by its sum over the ranks, in name order so every rank issues the
/// same sequence.
fn all_reduce_each(grads: &mut HashMap<String, Tensor>, collective: &dyn Collective) -> Result<()> {
    if collective.world_size() == 1 {
        return Ok(());
    }
    let mut names: Vec<String> = grads.keys().cloned().collect();
    names.sort();
    for name in names {
        let summed = collective.all_reduce_sum(&grads[&name])?;
        grads.insert(name, summed);
    }
    Ok(())
}

/// AdamW over this rank's shard of the flattened parameters.
pub struct ShardedAdamW {
    stage: ZeroStage,
    config: AdamWConfig,
    /// The model's weights, whole on every rank, sorted by name (the flattening order).
    weights: Vec<(String, Var)>,
    /// Where each weight lies in the flattened parameters.
    spans: Vec<Range<usize>>,
    /// The flattened parameters each rank owns, in rank order.
    shards: Vec<Range<usize>>,
    /// This rank's pieces of weights: the weight's index and the range of its flattened
    /// elements, in flattening order.
    pieces: Vec<(usize, Range<usize>)>,
    /// AdamW over the pieces: 1-D f32 masters named as their weights.
    shard: AdamW,
    rank: usize,
}

impl ShardedAdamW {
    fn new(
        mut weights: Vec<(String, Var)>,
        config: AdamWConfig,
        stage: ZeroStage,
        collective: &dyn Collective,
    ) -> Result<Self> {
        weights.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(twin) = weights.windows(2).find(|w| w[0].0 == w[1].0) {
            bail!("the weight `{}` is listed twice", twin[0].0);
        }
        let mut spans = Vec::with_capacity(weights.len());
        let mut total = 0;
        for (_, weight) in &weights {
            spans.push(total..total + weight.elem_count());
            total += weight.elem_count();
        }
        let (rank, world) = (collective.rank(), collective.world_size());
        let shards: Vec<Range<usize>> = (0..world)
            .map(|r| contiguous_share(total, r, world))
            .collect();
        let pieces: Vec<(usize, Range<usize>)> = spans
            .iter()
            .enumerate()
            .map(|(w, span)| (w, overlap(span, &shards[rank])))
            .filter(|(_, range)| !range.is_empty())
            .collect();
        let masters = pieces
            .iter()
            .map(|(w, range)| {
                let (name, weight) = &weights[*w];
                let piece = weight
                    .as_tensor()
                    .flatten_all()?
                    .narrow(0, range.start, range.len())?
                    .to_dtype(DType::F32)?;
                let master = Var::zeros(range.len(), DType::F32, weight.device())?;
                master.set(&piece)?;
                Ok((name.clone(), master))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            stage,
            config,
            weights,
            spans,
            shards,
            pieces,
            shard: AdamW::new(masters, config)?,
            rank,
        })
    }

    fn device(&self) -> Device {
        self.weights
            .first()
            .map_or(Device::Cpu, |(_, w)| w.device().clone())
    }

    /// The pieces of this rank's shard cut from whole gradients (already summed over the ranks).
    fn pieces_of(&self, grads: &HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
        self.pieces
            .iter()
            .map(|(w, range)| {
                let name = &self.weights[*w].0;
                let grad = grads
                    .get(name)
                    .with_context(|| format!("no gradient for `{name}`"))?;
                let piece = grad
                    .flatten_all()?
                    .narrow(0, range.start, range.len())?
                    .to_dtype(DType::F32)?;
                Ok((name.clone(), piece))
            })
            .collect()
    }

    /// This rank's shard of the gradients summed over the ranks, reduce-scattered from every
    /// rank's whole gradients.
    fn reduce_scatter(
        &self,
        grads: &HashMap<String, Tensor>,
        collective: &dyn Collective,
    ) -> Result<HashMap<String, Tensor>> {
        let total = self.shards.last().map_or(0, |s| s.end);
        let mut flat = Vec::with_capacity(total);
        for (name, weight) in &self.weights {
            let grad = grads
                .get(name)
                .with_context(|| format!("no gradient for `{name}`"))?;
            ensure!(
                grad.shape() == weight.shape(),
                "the gradient of `{name}` has shape {:?}, the weight {:?}",
                grad.dims(),
                weight.dims()
            );
            flat.extend(grad.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
        }
        let counts: Vec<usize> = self.shards.iter().map(Range::len).collect();
        let mine = collective.reduce_scatter_sum_f32(&flat, &counts)?;
        let device = self.device();
        let mut start = 0;
        self.pieces
            .iter()
            .map(|(w, range)| {
                let piece = &mine[start..start + range.len()];
                start += range.len();
                Ok((
                    self.weights[*w].0.clone(),
                    Tensor::from_slice(piece, range.len(), &device)?,
                ))
            })
            .collect()
    }

    /// AdamW on the shard (every gradient multiplied by `grad_factor` as it is read), then every
    /// rank's updated masters gathered into the weights.
    fn step(
        &mut self,
        grads: &HashMap<String, Tensor>,
        lr: f64,
        grad_factor: Option<f32>,
        collective: &dyn Collective,
    ) -> Result<()> {
        self.shard.step(grads, lr, grad_factor)?;
        let mut mine = Vec::with_capacity(self.shards[self.rank].len());
        for (_, master) in self.shard.master_weights() {
            mine.extend(master.to_vec1::<f32>()?);
        }
        let counts: Vec<usize> = self.shards.iter().map(Range::len).collect();
        let all = collective.all_gather_f32(&mine, &counts)?;
        for ((_, weight), span) in self.weights.iter().zip(&self.spans) {
            let values = &all[span.clone()];
            let master = Tensor::from_slice(values, weight.shape(), weight.device())?;
            weight.set(&master.to_dtype(weight.dtype())?)?;
        }
        Ok(())
    }

    /// The whole state on rank 0 (on the host), gathered a weight at a time, the moments only
    /// with `moments`; `None` elsewhere.
    fn gather(
        &self,
        collective: &dyn Collective,
        moments: bool,
    ) -> Result<Option<OptimizerSnapshot>> {
        let kinds = if moments { 3 } else { 1 };
        let mut mine: HashMap<&str, [Tensor; 3]> = self.shard.state_tensors().collect();
        let mut whole = Vec::with_capacity(self.weights.len());
        for (w, (name, weight)) in self.weights.iter().enumerate() {
            let counts: Vec<usize> = self
                .shards
                .iter()
                .map(|shard| overlap(&self.spans[w], shard).len())
                .collect();
            let pieces = mine.remove(name.as_str());
            let mut tensors = Vec::with_capacity(kinds);
            for kind in 0..kinds {
                let piece = match &pieces {
                    Some(state) => state[kind].to_vec1::<f32>()?,
                    None => Vec::new(),
                };
                let values = collective.all_gather_f32(&piece, &counts)?;
                tensors.push(Tensor::from_vec(values, weight.shape(), &Device::Cpu)?);
            }
            whole.push((name.clone(), tensors));
        }
        if self.rank != 0 {
            return Ok(None);
        }
        Ok(Some(OptimizerSnapshot::from_gathered(
            self.shard.steps(),
            whole,
        )))
    }

    /// Restores this rank's shard of a whole state file, and every weight from its masters.
    fn load_state(&mut self, path: &Path) -> Result<()> {
        let shapes: Vec<(&str, &[usize])> = self
            .weights
            .iter()
            .map(|(name, weight)| (name.as_str(), weight.dims()))
            .collect();
        let state = StoredState::open(path, &shapes)?;
        let mut pieces = self.pieces.iter().peekable();
        let mut shard = Vec::with_capacity(self.pieces.len());
        for (w, (name, weight)) in self.weights.iter().enumerate() {
            let device = weight.device();
            let master = state.master(name, device)?;
            weight.set(&master.to_dtype(weight.dtype())?)?;
            let Some((_, range)) = pieces.next_if(|(p, _)| *p == w) else {
                continue;
            };
            let piece = |tensor: Tensor| -> Result<Tensor> {
                Ok(tensor
                    .flatten_all()?
                    .narrow(0, range.start, range.len())?
                    .copy()?)
            };
            let [exp_avg, exp_avg_sq] = match state.moments(name, device)? {
                Some([m, v]) => [piece(m)?, piece(v)?],
                None => {
                    let zeros = || Tensor::zeros(range.len(), DType::F32, device);
                    [zeros()?, zeros()?]
                }
            };
            shard.push((name.clone(), [piece(master)?, exp_avg, exp_avg_sq]));
        }
        let steps = state.steps();
        self.shard = AdamW::from_state(self.config, steps, shard)?;
        Ok(())
    }
}

/// The part of a weight's span of the flattened parameters inside `shard`, as a range of the
/// weight's own flattened elements.
fn overlap(span: &Range<usize>, shard: &Range<usize>) -> Range<usize> {
    let (from, to) = (span.start.max(shard.start), span.end.min(shard.end));
    if from < to {
        from - span.start..to - span.start
    } else {
        0..0
    }
}
