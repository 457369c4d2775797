//! The optimizer side of a training step, as the reference's stack runs it (HF Trainer,
//! `torch.optim.AdamW`): gradients summed over micro-batches ([`GradientAccumulator`]),
//! global gradient-norm clipping ([`grad_clip`]: its coefficient applied by the update as it reads
//! each gradient), then one AdamW update ([`AdamW`]) with f32 master weights and moments, whose
//! state is saved and restored for resume.
//!
//! Hyper-parameters (spec §6.5): β = (0.9, 0.999), ε = 1e-8 and clipping at 1.0 are the
//! defaults of the HF Trainer that DICE's SFT runs unchanged; so is weight decay 0.0, the value
//! of [`AdamWConfig::default`] (DICE's RL also sets 0).

use crate::dist::Collective;
use crate::host_step::{
    f32_values_mut, weight_out, with_grad_values, with_state_values, with_storage_mut, GradValues,
    HostSlices, WeightOut,
};
use crate::readback::ReadBack;
use anyhow::{bail, ensure, Context, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor, Var};
use dice_model::adamw::AdamWScalars;
use std::collections::HashMap;
use std::path::Path;

/// Elements per f64 slice when a gradient's norm is summed (128 MiB of f64).
const NORM_CHUNK: usize = 1 << 24;

/// Elements per row when a slice's squares are summed on a device. candle reduces each output
/// element in one thread block, so a sum over a whole slice ran on one SM at the speed of its
/// loads' latency (the 1.7B model's norm took about 1.2 s of a 1.6 s update on the H100);
/// rows of this length give every SM blocks to reduce.
const NORM_ROW: usize = 4096;

/// A snapshot kept on the device must leave this share of the device's memory (1/N) free
/// beside itself: the next step starts while the writer reads it back (seconds).
const SNAPSHOT_RESERVE_SHARE: u64 = 4;

/// The environment variable that keeps snapshots off the device (`0`): read back at once, as
/// on a device without room for them.
const DEVICE_SNAPSHOT_SWITCH: &str = "DICE_DEVICE_SNAPSHOT";

/// AdamW hyper-parameters; the learning rate comes with each step (from the schedule).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    /// Added to √v̂ after the division by √(1 − β2ᵗ), as torch does.
    pub eps: f64,
    /// Decoupled decay, applied to every tensor (norms and embeddings included; with the
    /// reference's 0 the HF Trainer's no-decay groups make no difference).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

impl AdamWConfig {
    fn validate(&self) -> Result<()> {
        for (name, beta) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            ensure!(
                (0.0..1.0).contains(&beta),
                "AdamW {name} must be in [0, 1), not {beta}"
            );
        }
        ensure!(
            self.eps >= 0.0 && self.weight_decay >= 0.0,
            "AdamW eps and weight decay must not be negative (eps {}, weight decay {})",
            self.eps,
            self.weight_decay
        );
        Ok(())
    }
}

/// One optimized tensor: the model's weight and the optimizer's f32 state for it.
struct Param {
    name: String,
    /// The weight the model computes with, updated in place after every step.
    weight: Var,
    /// The f32 master copy when `weight` is not f32 (bf16 compute); otherwise `weight` is the
    /// master.
    master: Option<Tensor>,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

impl Param {
    /// The f32 weights the update applies to.
    fn master(&self) -> Tensor {
        match &self.master {
            Some(master) => master.clone(),
            None => self.weight.as_detached_tensor(),
        }
    }

    /// Replaces the f32 weights, rounding them into the compute weight if it is narrower.
    fn set_master(&mut self, master: Tensor) -> Result<()> {
        if self.master.is_some() {
            self.set_weight_from(&master)?;
            self.master = Some(master);
        } else {
            self.weight.set(&master)?;
        }
        Ok(())
    }

    /// The compute weight rounded from the f32 `master`, wherever each lives (an offloaded
    /// state's masters are in host memory, the weight on the device).
    fn set_weight_from(&self, master: &Tensor) -> Result<()> {
        let weight = master
            .to_dtype(self.weight.dtype())?
            .to_device(self.weight.device())?;
        Ok(self.weight.set(&weight)?)
    }
}

impl Param {
    /// The update of [`AdamW::step`] in tensor operations, on the weight's device.
    fn step_with_tensors(&mut self, grad: &Tensor, s: &AdamWScalars) -> Result<()> {
        let grad = &match s.grad_factor {
            Some(c) => grad.affine(f64::from(c), 0.0)?,
            None => grad.clone(),
        };
        let mut p = self.master();
        if let Some(decay) = s.decay {
            p = (p * f64::from(decay))?;
        }
        let exp_avg = (&self.exp_avg + ((grad - &self.exp_avg)? * f64::from(s.one_minus_beta1))?)?;
        let exp_avg_sq = ((&self.exp_avg_sq * f64::from(s.beta2))?
            + ((grad * f64::from(s.one_minus_beta2))? * grad)?)?;
        // A true division (candle's `Tensor / f64` multiplies by the reciprocal).
        let bias_correction2_sqrt = Tensor::new(s.bias_correction2_sqrt, grad.device())?;
        let denom = (exp_avg_sq.sqrt()?.broadcast_div(&bias_correction2_sqrt)? + f64::from(s.eps))?;
        let p = (p + ((&exp_avg * f64::from(s.neg_step_size))? / denom)?)?;
        self.set_master(p)?;
        self.exp_avg = exp_avg;
        self.exp_avg_sq = exp_avg_sq;
        Ok(())
    }

    /// The update of [`AdamW::step`] for a GPU weight: dice-model's AdamW kernel in place
    /// (one pass, the host update's operations, so the same values bit for bit), or the tensor
    /// form where the kernel is not available.
    fn step_on_device(&mut self, grad: &Tensor, s: &AdamWScalars) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            let stepped = dice_model::adamw_step(
                self.weight.as_tensor(),
                self.master.as_ref(),
                [&self.exp_avg, &self.exp_avg_sq],
                &grad.contiguous()?,
                s,
            )?;
            if stepped.is_some() {
                return Ok(());
            }
        }
        self.step_with_tensors(grad, s)
    }

    /// The update of [`AdamW::step`] where the state is in host memory, in place: one pass
    /// over the gradient (in its own dtype), m, v and the f32 master that also writes the
    /// rounded weight (`host_step`). A CPU weight is written where it lies; a device weight
    /// (an offloaded state) gets its gradient and weights through `transfer`'s page-locked
    /// buffers, chunk by chunk.
    fn step_on_host(
        &mut self,
        grad: &Tensor,
        s: &AdamWScalars,
        #[cfg(feature = "cuda")] transfer: &mut crate::host_step::DeviceTransfer,
    ) -> Result<()> {
        let grad = grad.contiguous()?;
        let state = [&self.exp_avg, &self.exp_avg_sq];
        if !self.weight.device().is_cpu() {
            #[cfg(feature = "cuda")]
            {
                let master = self.master.as_ref().context(
                    "internal error: an offloaded state keeps an f32 master for every weight",
                )?;
                return Ok(transfer.step(&self.weight, &grad, [state[0], state[1], master], s)?);
            }
            #[cfg(not(feature = "cuda"))]
            bail!(
                "internal error: a `{}` weight on {:?} in a build without CUDA",
                self.name,
                self.weight.device()
            );
        }
        let grad = grad.to_device(&Device::Cpu)?;
        with_state_values(state, |exp_avg, exp_avg_sq| {
            with_grad_values(&grad, |grad| {
                let mut update = |master: &mut [f32], out: WeightOut<'_>| {
                    HostSlices {
                        grad,
                        exp_avg,
                        exp_avg_sq,
                        master,
                        out,
                    }
                    .update(s);
                    Ok(())
                };
                match &self.master {
                    // The master apart: the pass rounds it into the weight.
                    Some(master) => with_storage_mut(master, |p, p_layout| {
                        let master = f32_values_mut(p, p_layout)?;
                        with_storage_mut(&self.weight, |w, w_layout| {
                            update(master, weight_out(w, w_layout)?)
                        })
                    }),
                    None => with_storage_mut(&self.weight, |p, p_layout| {
                        update(f32_values_mut(p, p_layout)?, WeightOut::MasterIsWeight)
                    }),
                }
            })
        })?;
        Ok(())
    }
}

/// Host bytes an offloaded state holds per parameter: the f32 master and both moments.
const OFFLOADED_BYTES_PER_PARAMETER: u64 = 12;

/// Refuses a host state of `needed` bytes that the host's `available` memory (where it is
/// known) cannot hold.
fn ensure_host_room(needed: u64, available: Option<u64>) -> Result<()> {
    let gib = |bytes: u64| bytes as f64 / f64::from(1u32 << 30);
    if let Some(available) = available {
        ensure!(
            needed <= available,
            "the offloaded optimizer state needs {:.1} GiB of host memory (12 bytes a parameter: \
             f32 masters and AdamW's two moments) and {:.1} GiB is available: free host memory, \
             train on more GPUs with --zero-stage 1 or 2 instead of --optimizer-offload, or a \
             smaller model",
            gib(needed),
            gib(available)
        );
    }
    Ok(())
}

/// The host memory available to a new allocation (`MemAvailable` of /proc/meminfo), where
/// the system says.
fn available_host_memory() -> Option<u64> {
    parse_mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

/// `MemAvailable` of a /proc/meminfo text, in bytes.
fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut fields = line.split_whitespace().skip(1);
    let value: u64 = fields.next()?.parse().ok()?;
    match fields.next() {
        Some("kB") => Some(value * 1024),
        _ => None,
    }
}

/// AdamW exactly as torch 2.11 runs it on CPU (`torch.optim.AdamW`, the single-tensor path,
/// amsgrad off). At step t (from 1), for every tensor, with m and v starting at zero:
///
/// ```text
/// p ← p·(1 − lr·wd)
/// m ← m + (1 − β1)·(g − m)
/// v ← β2·v + ((1 − β2)·g)·g
/// p ← p + (−lr/(1 − β1ᵗ))·m / (√v / √(1 − β2ᵗ) + ε)
/// ```
///
/// in f32 elementwise, the scalars computed in f64 and rounded to f32 as torch's kernels
/// receive them. (torch's `lerp` fuses the m update into one multiply-add, which changes its
/// last bit at most.) Weights that are not f32 get an f32 master copy, which every step
/// updates and rounds into the weight.
pub struct AdamW {
    config: AdamWConfig,
    /// Sorted by name, so that every pass over them (and their sums) has one order.
    params: Vec<Param>,
    steps: u64,
    /// The page-locked buffers through which an offloaded state's updates pass.
    #[cfg(feature = "cuda")]
    transfer: crate::host_step::DeviceTransfer,
}

impl AdamW {
    /// An optimizer over the named weights (for a model: the `VarMap` of
    /// `Sdar::load_trainable`, keyed by checkpoint name), its state beside them.
    pub fn new(
        weights: impl IntoIterator<Item = (String, Var)>,
        config: AdamWConfig,
    ) -> Result<Self> {
        Self::with_state(weights, config, false)
    }

    /// The same with its state in host memory however the weights are placed (ZeRO-Offload's
    /// split): the f32 masters (one for f32 weights too) and moments live on the host, every
    /// step reads the gradients back, updates there (on every core) and writes the rounded
    /// weights to their device. The device then holds the weights, gradients and activations
    /// only: what lets a model whose AdamW state does not fit beside it train on one GPU.
    ///
    /// Refused in one line, before anything is allocated, where the state (12 bytes a
    /// parameter) would not fit the host's available memory: a process killed for memory
    /// half-way through its first step loses the run.
    pub fn offloaded(
        weights: impl IntoIterator<Item = (String, Var)>,
        config: AdamWConfig,
    ) -> Result<Self> {
        let weights: Vec<(String, Var)> = weights.into_iter().collect();
        let parameters: usize = weights.iter().map(|(_, w)| w.elem_count()).sum();
        ensure_host_room(
            OFFLOADED_BYTES_PER_PARAMETER * parameters as u64,
            available_host_memory(),
        )?;
        Self::with_state(weights, config, true)
    }

    fn with_state(
        weights: impl IntoIterator<Item = (String, Var)>,
        config: AdamWConfig,
        on_host: bool,
    ) -> Result<Self> {
        config.validate()?;
        let mut params = weights
            .into_iter()
            .map(|(name, weight)| {
                ensure!(
                    weight.dtype().is_float(),
                    "cannot optimize `{name}`: its dtype {:?} is not a float type",
                    weight.dtype()
                );
                let state_device = if on_host {
                    Device::Cpu
                } else {
                    weight.device().clone()
                };
                let master = match weight.dtype() {
                    DType::F32 if !on_host => None,
                    // The host update writes the master in place: it must not be the weight's
                    // own storage, which an f32 weight already on the host would lend it.
                    DType::F32 if weight.device().is_cpu() => {
                        Some(weight.as_detached_tensor().copy()?)
                    }
                    _ => Some(
                        weight
                            .as_detached_tensor()
                            .to_dtype(DType::F32)?
                            .to_device(&state_device)?,
                    ),
                };
                // Two allocations: the CPU update writes each moment in place.
                let zeros = || Tensor::zeros(weight.shape(), DType::F32, &state_device);
                Ok(Param {
                    name,
                    master,
                    exp_avg: zeros()?,
                    exp_avg_sq: zeros()?,
                    weight,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        params.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(twin) = params.windows(2).find(|w| w[0].name == w[1].name) {
            bail!("the weight `{}` is listed twice", twin[0].name);
        }
        Ok(Self {
            config,
            params,
            steps: 0,
            #[cfg(feature = "cuda")]
            transfer: Default::default(),
        })
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// The f32 weights of every optimized tensor, sorted by name: what a checkpoint stores
    /// (the compute weights are these, rounded when they are narrower).
    pub fn master_weights(&self) -> impl Iterator<Item = (&str, Tensor)> + '_ {
        self.params.iter().map(|p| (p.name.as_str(), p.master()))
    }

    /// Updates taken so far (torch's `state["step"]`).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Zero moments and step count, the weights kept: the next update is a fresh AdamW's first
    /// (BiC-RL's reference builds a new optimizer for every RL step).
    pub fn reset_moments(&mut self) -> Result<()> {
        for param in &mut self.params {
            param.exp_avg = param.exp_avg.zeros_like()?;
            param.exp_avg_sq = param.exp_avg_sq.zeros_like()?;
        }
        self.steps = 0;
        Ok(())
    }

    /// One update with learning rate `lr` from `grads` (weight name → gradient, any float
    /// dtype), which must hold a gradient for every weight, each multiplied in f32 by
    /// `grad_factor` as it is read (clipping's coefficient: [`GradClip::factor`]).
    pub fn step(
        &mut self,
        grads: &HashMap<String, Tensor>,
        lr: f64,
        grad_factor: Option<f32>,
    ) -> Result<()> {
        ensure!(
            lr.is_finite() && lr >= 0.0,
            "the learning rate must be finite and not negative, not {lr}"
        );
        let AdamWConfig {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.config;
        let t = (self.steps + 1) as f64;
        let step_size = lr / (1.0 - beta1.powf(t));
        let bias_correction2_sqrt = (1.0 - beta2.powf(t)).sqrt();
        // Every gradient is checked before any weight moves, so a failed step changes nothing.
        let grads = self
            .params
            .iter()
            .map(|param| {
                let grad = grads.get(&param.name).with_context(|| {
                    format!(
                        "no gradient for `{}`: the step needs the gradients of all {} weights",
                        param.name,
                        self.params.len()
                    )
                })?;
                ensure!(
                    grad.shape() == param.weight.shape(),
                    "the gradient of `{}` has shape {:?}, the weight {:?}",
                    param.name,
                    grad.dims(),
                    param.weight.dims()
                );
                Ok(grad)
            })
            .collect::<Result<Vec<_>>>()?;
        let scalars = AdamWScalars {
            grad_factor,
            decay: (weight_decay != 0.0).then_some((1.0 - lr * weight_decay) as f32),
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            bias_correction2_sqrt: bias_correction2_sqrt as f32,
            eps: eps as f32,
            neg_step_size: -step_size as f32,
        };
        for (param, grad) in self.params.iter_mut().zip(grads) {
            if param.exp_avg.device().is_cpu() {
                param.step_on_host(
                    grad,
                    &scalars,
                    #[cfg(feature = "cuda")]
                    &mut self.transfer,
                )?;
            } else {
                param.step_on_device(&grad.to_dtype(DType::F32)?, &scalars)?;
            }
        }
        self.steps += 1;
        Ok(())
    }

    /// A copy of the state that later updates do not reach, so that the training can go on
    /// while it is written ([`OptimizerSnapshot::save_state`]): the f32 masters and step
    /// count, and the moments with `moments` (a run that resets them before every update has
    /// no use for them). On a CUDA device with room for it ([`SnapshotPlace::for_state`]) the
    /// copy is made on the device, in milliseconds, and read back by the writer
    /// ([`OptimizerSnapshot::into_host`]); else, or when the device's copy fails, it is read
    /// back here (a 1.7B model's masters took 5.5–9.1 s on the H200 into pageable memory,
    /// before reads went through a page-locked staging buffer).
    pub fn snapshot(&self, moments: bool) -> Result<OptimizerSnapshot> {
        let device = self
            .params
            .first()
            .map_or(Device::Cpu, |p| p.exp_avg.device().clone());
        let per_element = if moments { 12 } else { 4 };
        let elements: usize = self.params.iter().map(|p| p.weight.elem_count()).sum();
        if SnapshotPlace::for_state(&device, (per_element * elements) as u64)?
            == SnapshotPlace::Device
        {
            match self.snapshot_in(SnapshotPlace::Device, moments) {
                Ok(snapshot) => {
                    // candle's CUDA stream is the calling thread's own (CU_STREAM_PER_THREAD):
                    // the writer's thread reads on another, which does not wait for this one.
                    device.synchronize()?;
                    return Ok(snapshot);
                }
                Err(e) => tracing::warn!("the checkpoint's state is copied to the host: {e:#}"),
            }
        }
        self.snapshot_in(SnapshotPlace::Host, moments)
    }

    /// [`Self::snapshot`]'s copies, made in `place`.
    fn snapshot_in(&self, place: SnapshotPlace, moments: bool) -> Result<OptimizerSnapshot> {
        let mut readback = ReadBack::default();
        let mut copy = |tensor: &Tensor| match place {
            SnapshotPlace::Device => Ok(tensor.copy()?),
            SnapshotPlace::Host => readback.copy_to_host(tensor),
        };
        let mut snapshot = OptimizerSnapshot {
            steps: self.steps,
            masters: Vec::with_capacity(self.params.len()),
            moments: moments.then(Vec::new),
        };
        for param in &self.params {
            snapshot
                .masters
                .push((param.name.clone(), copy(&param.master())?));
            if let Some(moments) = &mut snapshot.moments {
                moments.push([copy(&param.exp_avg)?, copy(&param.exp_avg_sq)?]);
            }
        }
        Ok(snapshot)
    }

    /// The state file's keys of the moments and f32 weights of weight `name`.
    fn state_keys(name: &str) -> [String; 3] {
        ["exp_avg", "exp_avg_sq", "master"].map(|kind| format!("{kind}.{name}"))
    }

    /// Restores a state written by [`OptimizerSnapshot::save_state`] for the same weights: the
    /// f32 weights (the model's weights are overwritten with them), and the moments and step
    /// count, or those of a fresh AdamW when the file holds no moments.
    pub fn load_state(&mut self, path: &Path) -> Result<()> {
        let shapes: Vec<(&str, &[usize])> = self
            .params
            .iter()
            .map(|p| (p.name.as_str(), p.weight.dims()))
            .collect();
        let state = StoredState::open(path, &shapes)?;
        for param in &mut self.params {
            // Where the state lives: the weight's device, or the host when offloaded.
            let device = param.exp_avg.device().clone();
            if let Some([exp_avg, exp_avg_sq]) = state.moments(&param.name, &device)? {
                param.exp_avg = exp_avg;
                param.exp_avg_sq = exp_avg_sq;
            } else {
                param.exp_avg = param.exp_avg.zeros_like()?;
                param.exp_avg_sq = param.exp_avg_sq.zeros_like()?;
            }
            param.set_master(state.master(&param.name, &device)?)?;
        }
        self.steps = state.steps();
        Ok(())
    }

    /// f32 moment values held (m and v of every weight): what sharding the state divides.
    pub fn moment_elements(&self) -> usize {
        self.params
            .iter()
            .map(|p| p.exp_avg.elem_count() + p.exp_avg_sq.elem_count())
            .sum()
    }

    /// Every weight's name with its f32 master, m and v, sorted by name.
    pub(crate) fn state_tensors(&self) -> impl Iterator<Item = (&str, [Tensor; 3])> + '_ {
        self.params.iter().map(|p| {
            (
                p.name.as_str(),
                [p.master(), p.exp_avg.clone(), p.exp_avg_sq.clone()],
            )
        })
    }

    /// An optimizer in the state of `steps` steps: per weight its name, f32 master, m and v
    /// (the masters become its weights).
    pub(crate) fn from_state(
        config: AdamWConfig,
        steps: u64,
        state: Vec<(String, [Tensor; 3])>,
    ) -> Result<Self> {
        let mut optimizer = Self::new(
            state
                .iter()
                .map(|(name, [master, ..])| Ok((name.clone(), Var::from_tensor(master)?)))
                .collect::<Result<Vec<_>>>()?,
            config,
        )?;
        let mut state: HashMap<String, [Tensor; 3]> = state.into_iter().collect();
        for param in &mut optimizer.params {
            let [_, exp_avg, exp_avg_sq] =
                state.remove(&param.name).expect("a state for every weight");
            param.exp_avg = exp_avg;
            param.exp_avg_sq = exp_avg_sq;
        }
        optimizer.steps = steps;
        Ok(optimizer)
    }
}

/// A copy of an optimizer's state in host memory ([`AdamW::snapshot`]), the weights sorted by
/// name: what a checkpoint writes while the training goes on.
pub struct OptimizerSnapshot {
    steps: u64,
    /// Every weight's name and f32 master.
    masters: Vec<(String, Tensor)>,
    /// m and v of every weight, in the order of `masters`; `None` when not kept.
    moments: Option<Vec<[Tensor; 2]>>,
}

impl OptimizerSnapshot {
    /// The snapshot of a state gathered from shards: per weight its name and host tensors, the
    /// f32 master alone or followed by m and v.
    pub(crate) fn from_gathered(steps: u64, gathered: Vec<(String, Vec<Tensor>)>) -> Self {
        let mut masters = Vec::with_capacity(gathered.len());
        let mut moments = Vec::with_capacity(gathered.len());
        for (name, tensors) in gathered {
            let mut tensors = tensors.into_iter();
            masters.push((name, tensors.next().expect("a master per weight")));
            if let (Some(m), Some(v)) = (tensors.next(), tensors.next()) {
                moments.push([m, v]);
            }
        }
        let moments = (moments.len() == masters.len()).then_some(moments);
        Self {
            steps,
            masters,
            moments,
        }
    }

    /// Where the copy is held: on the device until [`Self::into_host`] reads it back.
    pub fn place(&self) -> SnapshotPlace {
        match self.masters.first() {
            Some((_, master)) if !master.device().is_cpu() => SnapshotPlace::Device,
            _ => SnapshotPlace::Host,
        }
    }

    /// The snapshot in host memory: a copy held on the device is read back, and its device
    /// memory freed, tensor by tensor. The checkpoint writer's thread runs it, on a CUDA
    /// stream of its own, beside the training's next step.
    pub fn into_host(self) -> Result<Self> {
        let mut readback = ReadBack::default();
        let mut on_host = |tensor: Tensor| -> Result<Tensor> {
            if tensor.device().is_cpu() {
                Ok(tensor)
            } else {
                readback.copy_to_host(&tensor)
            }
        };
        Ok(Self {
            steps: self.steps,
            masters: self
                .masters
                .into_iter()
                .map(|(name, master)| Ok((name, on_host(master)?)))
                .collect::<Result<_>>()?,
            moments: self
                .moments
                .map(|moments| {
                    moments
                        .into_iter()
                        .map(|[m, v]| Ok([on_host(m)?, on_host(v)?]))
                        .collect::<Result<_>>()
                })
                .transpose()?,
        })
    }

    /// Every weight's name and f32 master, sorted by name.
    pub fn masters(&self) -> impl Iterator<Item = (&str, &Tensor)> + '_ {
        self.masters.iter().map(|(name, t)| (name.as_str(), t))
    }

    /// Whether the snapshot holds the moments.
    pub fn has_moments(&self) -> bool {
        self.moments.is_some()
    }

    /// f32 values of every master (the parameters optimized).
    pub fn parameters(&self) -> u64 {
        self.masters
            .iter()
            .map(|(_, t)| t.elem_count() as u64)
            .sum()
    }

    /// Bytes of tensor data [`Self::save_state`] writes (the header aside): 4 per parameter
    /// for the masters when `masters`, 8 for the moments when the snapshot has them.
    pub fn state_bytes(&self, masters: bool) -> u64 {
        let per_parameter = 4 * u64::from(masters) + 8 * u64::from(self.has_moments());
        per_parameter * self.parameters()
    }

    /// Writes the state a resumed run needs into one safetensors file: `step` (I64), per
    /// weight NAME `master.NAME` (the f32 weights, so that a run whose checkpoints are bf16
    /// resumes from its exact f32 values) when `masters`, and `exp_avg.NAME`, `exp_avg_sq.NAME`
    /// when the snapshot has the moments. Without `masters` the f32 weights are those of the
    /// model saved beside it in f32 ([`AdamW::load_state`] reads them there). The file is
    /// written under a temporary name and renamed into place.
    pub fn save_state(&self, path: &Path, masters: bool) -> Result<()> {
        let mut tensors = HashMap::new();
        tensors.insert(
            "step".to_string(),
            Tensor::new(self.steps as i64, &Device::Cpu)?,
        );
        for (k, (name, master)) in self.masters.iter().enumerate() {
            let [exp_avg, exp_avg_sq, master_key] = AdamW::state_keys(name);
            if masters {
                tensors.insert(master_key, master.clone());
            }
            if let Some(moments) = &self.moments {
                tensors.insert(exp_avg, moments[k][0].clone());
                tensors.insert(exp_avg_sq, moments[k][1].clone());
            }
        }
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        candle_core::safetensors::save(&tensors, &partial)
            .with_context(|| format!("cannot write the optimizer state {}", path.display()))?;
        std::fs::rename(&partial, path)
            .with_context(|| format!("cannot move the optimizer state into {}", path.display()))
    }
}

/// Where an [`OptimizerSnapshot`] holds its copy of the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotPlace {
    /// In device memory, read back by the checkpoint writer.
    Device,
    /// In host memory, read back before the training went on.
    Host,
}

impl SnapshotPlace {
    /// Where a snapshot of `bytes` of state on `device` goes: on a CUDA device whose free
    /// memory holds it and still leaves [`SNAPSHOT_RESERVE_SHARE`] of the device free, the
    /// device (unless `DICE_DEVICE_SNAPSHOT=0`); else the host.
    fn for_state(device: &Device, bytes: u64) -> Result<Self> {
        if std::env::var(DEVICE_SNAPSHOT_SWITCH).is_ok_and(|v| v.trim() == "0") {
            return Ok(Self::Host);
        }
        if device.is_cuda() {
            // What the step freed goes back to the driver's count at a synchronization.
            device.synchronize()?;
        }
        Ok(match dice_model::memory::free_and_total(device)? {
            Some((free, total)) if free >= bytes + total / SNAPSHOT_RESERVE_SHARE => Self::Device,
            _ => Self::Host,
        })
    }
}

/// An optimizer state file of [`OptimizerSnapshot::save_state`], opened and checked against
/// the named weights of these shapes: every header is checked before anything is restored, so
/// a refused file changes nothing.
pub(crate) struct StoredState {
    file: MmapedSafetensors,
    /// The f32 model weights beside a file that holds no masters.
    model: Option<MmapedSafetensors>,
    moments: bool,
    steps: u64,
}

impl StoredState {
    #[allow(unsafe_code)] // the state file is memory-mapped (up to 12 bytes per parameter)
    pub(crate) fn open(path: &Path, shapes: &[(&str, &[usize])]) -> Result<Self> {
        let what = || format!("the optimizer state {}", path.display());
        // SAFETY: the files are mapped read-only while they are read here; like every
        // checkpoint reader we rely on nobody truncating them meanwhile.
        let file = unsafe { MmapedSafetensors::new(path) }
            .with_context(|| format!("cannot read {}", what()))?;
        let has = |kind: &str| {
            shapes
                .first()
                .is_some_and(|(name, _)| file.get(&format!("{kind}.{name}")).is_ok())
        };
        let (masters, moments) = (has("master"), has("exp_avg"));
        let stored = file.tensors().len();
        let expected = 1 + shapes.len() * (usize::from(masters) + 2 * usize::from(moments));
        ensure!(
            stored == expected,
            "{} holds {stored} tensors, this model's state has {expected}: it belongs to another model",
            what()
        );
        let steps = file
            .load("step", &Device::Cpu)
            .and_then(|t| t.to_scalar::<i64>())
            .with_context(|| format!("{} has no valid `step`", what()))?;
        let steps =
            u64::try_from(steps).with_context(|| format!("{}: negative step {steps}", what()))?;
        let model = if masters {
            None
        } else {
            let dir = path.parent().unwrap_or(Path::new("."));
            let files = model_files(dir, path)?;
            // SAFETY: as above.
            Some(
                unsafe { MmapedSafetensors::multi(&files) }.with_context(|| {
                    format!(
                        "{} holds no f32 masters and the model beside it cannot be read",
                        what()
                    )
                })?,
            )
        };
        for &(name, dims) in shapes {
            let [exp_avg, exp_avg_sq, master] = AdamW::state_keys(name);
            let mut keys: Vec<(&MmapedSafetensors, String)> = Vec::new();
            if moments {
                keys.extend([(&file, exp_avg), (&file, exp_avg_sq)]);
            }
            let beside = match &model {
                None => {
                    keys.push((&file, master));
                    ""
                }
                Some(model) => {
                    keys.push((model, name.to_string()));
                    " in the model beside it, which holds the f32 weights when the state has none"
                }
            };
            for (source, key) in keys {
                let view = source.get(&key).with_context(|| {
                    format!(
                        "{} has no `{key}`{beside}: it belongs to another model",
                        what()
                    )
                })?;
                let f32 = DType::try_from(view.dtype()).ok() == Some(DType::F32);
                ensure!(
                    f32 && view.shape() == dims,
                    "{}: `{key}`{beside} is {:?} {:?}, expected F32 {:?}",
                    what(),
                    view.dtype(),
                    view.shape(),
                    dims
                );
            }
        }
        Ok(Self {
            file,
            model,
            moments,
            steps,
        })
    }

    /// The update count: the file's, or a fresh AdamW's 0 when it holds no moments.
    pub(crate) fn steps(&self) -> u64 {
        if self.moments {
            self.steps
        } else {
            0
        }
    }

    /// The f32 master of weight `name`.
    pub(crate) fn master(&self, name: &str, device: &Device) -> Result<Tensor> {
        let loaded = match &self.model {
            None => self.file.load(&format!("master.{name}"), device),
            Some(model) => model.load(name, device),
        };
        loaded.with_context(|| format!("cannot read the f32 weights of `{name}`"))
    }

    /// m and v of weight `name`, when the file holds moments.
    pub(crate) fn moments(&self, name: &str, device: &Device) -> Result<Option<[Tensor; 2]>> {
        if !self.moments {
            return Ok(None);
        }
        let load = |kind: &str| {
            self.file
                .load(&format!("{kind}.{name}"), device)
                .with_context(|| format!("cannot read `{kind}.{name}`"))
        };
        Ok(Some([load("exp_avg")?, load("exp_avg_sq")?]))
    }
}

/// The model's weight files in `dir`: every `*.safetensors` but the state file `state`.
fn model_files(dir: &Path, state: &Path) -> Result<Vec<std::path::PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "safetensors") && path != state {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Global gradient-norm clipping, as `torch.nn.utils.clip_grad_norm_` does it: `total =
/// ‖(‖g_p‖₂)_p‖₂`, `coef = min(1, max_norm / (total + 1e-6))` in f32, `g ← coef·g`; the scaling
/// is left to the update, which applies `factor` as it reads each gradient (one pass over the
/// gradients fewer than scaling them here).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradClip {
    /// The norm before clipping. A non-finite norm is kept as it is and poisons the update, as
    /// in torch: the caller decides whether to skip the step.
    pub norm: f32,
    /// What every gradient is multiplied by: `None` when the norm is within `max_norm`.
    pub factor: Option<f32>,
}

/// [`GradClip`] of a gradient sharded over the ranks of `collective`, each holding the
/// gradients (or slices of them) in `grads`: the ranks' sums of squares are added in rank order,
/// so every rank scales its shard by the same coefficient. The squares are summed in f64 (torch
/// sums f32 pairwise; both are far below f32's resolution of the result), grouped by shard,
/// which can move the f32 norm by one ulp at most, and only when the f64 sum falls within
/// 1e-16 of an f32 rounding boundary.
pub fn grad_clip(
    grads: &HashMap<String, Tensor>,
    max_norm: f64,
    collective: &dyn Collective,
) -> Result<GradClip> {
    ensure!(
        max_norm > 0.0,
        "the gradient clipping norm must be positive, not {max_norm}"
    );
    let mut sum_of_squares = [squared_norms(grads)?.iter().sum::<f64>()];
    collective.all_reduce_sum_f64(&mut sum_of_squares)?;
    let norm = sum_of_squares[0].sqrt() as f32;
    let coef = max_norm as f32 / (norm + 1e-6);
    // `clamp(max = 1)` keeps a NaN, as torch's does.
    let factor = (coef < 1.0 || coef.is_nan()).then_some(coef);
    Ok(GradClip { norm, factor })
}

/// Σ x² of each gradient in f64, in the order of their names, each summed a slice at a time (on
/// the CPU straight from the host buffer). On a device the slices' sums stay there until every
/// gradient's are queued and are read back together: one synchronisation per step instead of
/// one per slice, each of which drained the device's queue and left it idle while the host
/// queued the next gradient's kernels.
fn squared_norms(grads: &HashMap<String, Tensor>) -> Result<Vec<f64>> {
    squared_norms_by(grads, NORM_CHUNK, NORM_ROW, |tensor| {
        tensor.device().is_cpu()
    })
}

/// [`squared_norms`] with slices of `chunk` elements and rows of `row`, summing on the host the
/// tensors `on_host` names (the tests queue CPU tensors as a device's are).
fn squared_norms_by(
    grads: &HashMap<String, Tensor>,
    chunk: usize,
    row: usize,
    on_host: impl Fn(&Tensor) -> bool,
) -> Result<Vec<f64>> {
    let mut names: Vec<&String> = grads.keys().collect();
    names.sort();
    // Every gradient's sums as 1-D f64 tensors, in order, and how many sums are each one's.
    let (mut sums, mut counts) = (Vec::new(), Vec::with_capacity(names.len()));
    for name in names {
        let tensor = &grads[name];
        let before = sums.len();
        queue_square_sums(tensor, chunk, row, on_host(tensor), &mut sums)
            .with_context(|| format!("cannot take the norm of the gradient of `{name}`"))?;
        counts.push(sums[before..].iter().map(Tensor::elem_count).sum::<usize>());
    }
    let mut read = if sums.is_empty() {
        Vec::new()
    } else {
        Tensor::cat(&sums, 0)?.to_vec1::<f64>()?
    }
    .into_iter();
    // Each gradient's sums added in order, as its norm always was.
    Ok(counts
        .into_iter()
        .map(|count| read.by_ref().take(count).fold(0.0, |acc, x| acc + x))
        .collect())
}

/// Appends Σ x² of `tensor` in f64 to `sums` as 1-D tensors of partial sums, whose sum in
/// order is the whole: one summed here from the host buffer (`on_host`), else on its device by
/// dice-model's kernel (one read of the gradient; [`dice_model::square_sums`]) or, where it is
/// not available, one per slice ([`slice_square_sums`]).
fn queue_square_sums(
    tensor: &Tensor,
    chunk: usize,
    row: usize,
    on_host: bool,
    sums: &mut Vec<Tensor>,
) -> Result<()> {
    let flat = tensor.flatten_all()?;
    #[cfg(feature = "cuda")]
    if !on_host && tensor.device().is_cuda() {
        if let Some(partial) = dice_model::square_sums(&flat.contiguous()?)? {
            sums.push(partial);
            return Ok(());
        }
    }
    if on_host {
        let flat = flat.to_dtype(DType::F32)?.contiguous()?;
        let sum: f64 = with_grad_values(&flat, |values| match values {
            GradValues::F32(values) => {
                Ok(values.iter().map(|&x| f64::from(x) * f64::from(x)).sum())
            }
            _ => candle_core::bail!("internal error: the norm sums f32 values"),
        })?;
        sums.push(Tensor::new(&[sum], tensor.device())?);
    } else {
        sums.extend(slice_square_sums(&flat, chunk, row)?);
    }
    Ok(())
}

/// Σ x² of each slice of `chunk` elements of the 1-D `flat`, in f64, as 1-element tensors on its
/// device (nothing is read back): each slice's squares summed over rows of `row` first (one
/// thread block each), then over the rows' sums and the rest.
fn slice_square_sums(flat: &Tensor, chunk: usize, row: usize) -> Result<Vec<Tensor>> {
    let len = flat.elem_count();
    let mut sums = Vec::new();
    for start in (0..len).step_by(chunk) {
        let squares = flat
            .narrow(0, start, chunk.min(len - start))?
            .to_dtype(DType::F64)?
            .sqr()?;
        let n = squares.elem_count();
        let whole = n / row * row;
        let mut parts = Vec::with_capacity(2);
        if whole > 0 {
            parts.push(
                squares
                    .narrow(0, 0, whole)?
                    .reshape((whole / row, row))?
                    .sum(1)?,
            );
        }
        if whole < n {
            parts.push(squares.narrow(0, whole, n - whole)?);
        }
        sums.push(Tensor::cat(&parts, 0)?.sum_all()?.reshape(1)?);
    }
    Ok(sums)
}

/// Gradients of several micro-batches, summed in f32.
///
/// There is no division by the number of micro-batches: the reference's stack does none.
/// Each micro-batch's loss is already normalized by its own loss-token count, and
/// transformers 4.52's Trainer skips its `1 / gradient_accumulation_steps` whenever the
/// model's `forward` takes `**kwargs` (SDAR's does) and the batch has labels, with DeepSpeed's
/// own scaling switched off (`scale_wrt_gas=False`). DICE's recipe accumulates 1 micro-batch,
/// where both readings agree.
#[derive(Default)]
pub struct GradientAccumulator {
    sums: HashMap<String, Tensor>,
    micro_batches: usize,
}

impl GradientAccumulator {
    /// Adds the gradients of one micro-batch (weight name → gradient, any float dtype).
    pub fn add(&mut self, grads: HashMap<String, Tensor>) -> Result<()> {
        for (name, grad) in grads {
            let grad = grad.to_dtype(DType::F32)?;
            match self.sums.get_mut(&name) {
                Some(sum) => {
                    *sum = (&*sum + &grad)
                        .with_context(|| format!("cannot add the gradients of `{name}`"))?;
                }
                None => {
                    self.sums.insert(name, grad);
                }
            }
        }
        self.micro_batches += 1;
        Ok(())
    }

    /// Micro-batches added since the last [`GradientAccumulator::take`].
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// The summed f32 gradients, leaving the accumulator empty.
    pub fn take(&mut self) -> HashMap<String, Tensor> {
        self.micro_batches = 0;
        std::mem::take(&mut self.sums)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::SingleProcess;

    /// The device's norm by chunks and rows (run here on the CPU's tensors) sums every
    /// element's square once: lengths below a row, of whole rows, and with a rest in the last
    /// chunk; values in eighths, so every order of f64 additions is exact.
    #[test]
    fn squares_summed_by_chunks_and_rows_count_every_element_once() {
        for len in [5, 64, 203, 256] {
            let values: Vec<f32> = (0..len)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
                .collect();
            let expected: f64 = values.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            let flat = Tensor::from_vec(values, len, &Device::Cpu).unwrap();
            for (chunk, row) in [(64, 8), (100, 7), (1024, 256)] {
                let got = slice_square_sums(&flat, chunk, row)
                    .unwrap()
                    .iter()
                    .map(|sum| sum.to_vec1::<f64>().unwrap()[0])
                    .sum::<f64>();
                assert_eq!(got, expected, "len {len}, chunk {chunk}, row {row}");
            }
        }
    }

    /// Gradients whose slice sums are queued and read back together get the sums the host
    /// gives, each its own (values in eighths: every order of f64 additions is exact).
    #[test]
    fn queued_slice_sums_are_read_back_to_their_own_gradients() {
        let grads: HashMap<String, Tensor> = [("a", 5usize), ("b", 203), ("c", 256), ("d", 64)]
            .into_iter()
            .map(|(name, len)| {
                let values: Vec<f32> = (0..len)
                    .map(|i| ((i * 5 + len) % 11) as f32 / 8.0 - 0.625)
                    .collect();
                (
                    name.to_string(),
                    Tensor::from_vec(values, len, &Device::Cpu).unwrap(),
                )
            })
            .collect();
        let on_host = squared_norms_by(&grads, 64, 8, |_| true).unwrap();
        let queued = squared_norms_by(&grads, 64, 8, |_| false).unwrap();
        assert_eq!(queued, on_host);
        // Sorted by name, and no two gradients alike.
        let mut distinct = on_host.clone();
        distinct.dedup();
        assert_eq!(distinct.len(), 4, "{on_host:?}");
    }

    /// On a GPU the squares are summed by dice-model's kernel: the same sums as the host's, for
    /// gradients of every dtype and of more elements than its grid's threads (values in eighths:
    /// every order of f64 additions is exact).
    #[test]
    #[cfg_attr(not(feature = "cuda"), ignore = "needs the cuda feature and a GPU")]
    fn a_gpu_sums_the_squares_as_the_host_does() {
        let gpu = dice_model::device::cuda_device(0).unwrap();
        let specs = [
            ("a", 5usize, DType::F32),
            ("b", 70_003, DType::BF16),
            ("c", 300_001, DType::F16),
        ];
        let mut grads = HashMap::new();
        let mut expected = Vec::new();
        for (name, len, dtype) in specs {
            let values: Vec<f32> = (0..len)
                .map(|i| ((i * 5 + len) % 11) as f32 / 8.0 - 0.625)
                .collect();
            expected.push(
                values
                    .iter()
                    .map(|&x| f64::from(x) * f64::from(x))
                    .sum::<f64>(),
            );
            let tensor = Tensor::from_vec(values, len, &gpu).unwrap();
            grads.insert(name.to_string(), tensor.to_dtype(dtype).unwrap());
        }
        assert_eq!(squared_norms(&grads).unwrap(), expected);
    }

    /// Two weights of a toy problem, in `dtype`, with fixed irregular values.
    fn weights(dtype: DType) -> Vec<(String, Var)> {
        let values = |n: usize, seed: f32| -> Vec<f32> {
            (0..n).map(|i| ((i as f32 + seed) * 0.37).sin()).collect()
        };
        [
            ("a.weight", vec![3, 5], 1.0),
            ("b.norm.weight", vec![7], 2.0),
        ]
        .into_iter()
        .map(|(name, shape, seed)| {
            let n = shape.iter().product();
            let t = Tensor::from_vec(values(n, seed), shape, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            (name.to_string(), Var::from_tensor(&t).unwrap())
        })
        .collect()
    }

    /// Gradients that depend on the weights (g = w² − 0.1·w − 0.2), accumulated over two
    /// micro-batches (`run` clips them as a training step does).
    fn grads(weights: &[(String, Var)]) -> HashMap<String, Tensor> {
        let mut accumulator = GradientAccumulator::default();
        for micro_batch in 0..2 {
            let grads = weights
                .iter()
                .map(|(name, w)| {
                    let w = w.as_detached_tensor();
                    let g = ((w.sqr().unwrap() - (&w * 0.1).unwrap()).unwrap()
                        - 0.2 * micro_batch as f64)
                        .unwrap();
                    (name.clone(), g)
                })
                .collect();
            accumulator.add(grads).unwrap();
        }
        assert_eq!(accumulator.micro_batches(), 2);
        accumulator.take()
    }

    fn run(weights: &[(String, Var)], optimizer: &mut AdamW, steps: u64) {
        let schedule = crate::schedule::LrSchedule {
            kind: crate::schedule::ScheduleKind::Cosine,
            peak_lr: 1e-2,
            warmup_steps: 2,
            total_steps: 8,
        };
        for _ in 0..steps {
            let lr = schedule.lr(optimizer.steps());
            let grads = grads(weights);
            let clip = grad_clip(&grads, 1.0, &SingleProcess).unwrap();
            optimizer.step(&grads, lr, clip.factor).unwrap();
        }
    }

    /// A weight's values in f32, to compare bit for bit.
    fn bits(w: &Var) -> Vec<f32> {
        w.as_detached_tensor()
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    /// The state with its masters and moments, as a checkpoint of SFT holds it.
    fn save_whole_state(optimizer: &AdamW, path: &Path) {
        optimizer
            .snapshot(true)
            .unwrap()
            .save_state(path, true)
            .unwrap();
    }

    fn config() -> AdamWConfig {
        AdamWConfig {
            weight_decay: 0.01,
            ..AdamWConfig::default()
        }
    }

    /// Interrupted after 3 of 8 steps and resumed from the saved state and the weights as a
    /// checkpoint stores them, the run ends with the state of the uninterrupted one, byte for
    /// byte (moments, f32 weights, step count).
    fn resume_is_bit_identical(dtype: DType) {
        let dir = tempfile::tempdir().unwrap();
        let straight_weights = weights(dtype);
        let mut straight = AdamW::new(straight_weights.clone(), config()).unwrap();
        run(&straight_weights, &mut straight, 8);
        save_whole_state(&straight, &dir.path().join("straight.safetensors"));

        let first_weights = weights(dtype);
        let mut first = AdamW::new(first_weights.clone(), config()).unwrap();
        run(&first_weights, &mut first, 3);
        let state = dir.path().join("state.safetensors");
        save_whole_state(&first, &state);
        let checkpoint: Vec<(String, Var)> = first_weights
            .iter()
            .map(|(name, w)| {
                (
                    name.clone(),
                    Var::from_tensor(&w.as_detached_tensor()).unwrap(),
                )
            })
            .collect();
        drop((first, first_weights));

        let mut resumed = AdamW::new(checkpoint.clone(), config()).unwrap();
        resumed.load_state(&state).unwrap();
        assert_eq!(resumed.steps(), 3);
        run(&checkpoint, &mut resumed, 5);
        save_whole_state(&resumed, &dir.path().join("resumed.safetensors"));

        let read = |name: &str| std::fs::read(dir.path().join(name)).unwrap();
        assert!(read("straight.safetensors") == read("resumed.safetensors"));
        for ((_, a), (_, b)) in straight_weights.iter().zip(&checkpoint) {
            assert_eq!(bits(a), bits(b));
        }
        assert_ne!(
            weights(dtype)[0]
                .1
                .as_detached_tensor()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap(),
            checkpoint[0]
                .1
                .as_detached_tensor()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap(),
            "the steps moved the weights"
        );
    }

    #[test]
    fn resume_is_bit_identical_in_f32() {
        resume_is_bit_identical(DType::F32);
    }

    #[test]
    fn resume_is_bit_identical_with_bf16_weights_and_f32_masters() {
        resume_is_bit_identical(DType::BF16);
    }

    /// With its state on the host (offloaded: an f32 master for f32 weights too, the rounded
    /// weights written into the weights by the same pass), AdamW takes the steps of the state kept
    /// beside the weights, bit for bit, and its saved state is the same file.
    #[test]
    fn an_offloaded_state_steps_as_the_one_beside_the_weights() {
        let dir = tempfile::tempdir().unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let (beside_weights, host_weights) = (weights(dtype), weights(dtype));
            let mut beside = AdamW::new(beside_weights.clone(), config()).unwrap();
            let mut host = AdamW::offloaded(host_weights.clone(), config()).unwrap();
            run(&beside_weights, &mut beside, 5);
            run(&host_weights, &mut host, 5);
            for ((_, a), (_, b)) in beside_weights.iter().zip(&host_weights) {
                assert_eq!(bits(a), bits(b), "{dtype:?}");
            }
            let (a, b) = (dir.path().join("a"), dir.path().join("b"));
            save_whole_state(&beside, &a);
            save_whole_state(&host, &b);
            assert!(
                std::fs::read(a).unwrap() == std::fs::read(b).unwrap(),
                "{dtype:?}"
            );
        }
    }

    /// On a GPU, an offloaded state (gradients read back and weights written through
    /// page-locked chunks, a weight longer than one chunk among them) steps as the state kept
    /// on the device (dice-model's AdamW kernel), bit for bit, in bf16 and f32.
    #[test]
    #[cfg_attr(not(feature = "cuda"), ignore = "needs the cuda feature and a GPU")]
    fn an_offloaded_state_on_a_gpu_steps_as_the_state_on_it() {
        let gpu = dice_model::device::cuda_device(0).unwrap();
        for dtype in [DType::BF16, DType::F32] {
            let on_gpu = || -> Vec<(String, Var)> {
                [("long.weight", (32 << 20) + 5), ("short.weight", 7)]
                    .into_iter()
                    .map(|(name, len)| {
                        let values = Tensor::arange(0u32, len as u32, &gpu)
                            .unwrap()
                            .to_dtype(DType::F32)
                            .unwrap();
                        let values = ((values * 0.37).unwrap().sin().unwrap())
                            .to_dtype(dtype)
                            .unwrap();
                        (name.to_string(), Var::from_tensor(&values).unwrap())
                    })
                    .collect()
            };
            let (device_weights, host_weights) = (on_gpu(), on_gpu());
            let mut device = AdamW::new(device_weights.clone(), config()).unwrap();
            let mut host = AdamW::offloaded(host_weights.clone(), config()).unwrap();
            run(&device_weights, &mut device, 3);
            run(&host_weights, &mut host, 3);
            for ((name, a), (_, b)) in device_weights.iter().zip(&host_weights) {
                assert!(bits(a) == bits(b), "{dtype:?} {name}");
            }
        }
    }

    /// An offloaded state the host cannot hold is refused in one line that says what it needs
    /// and what to do; the host's available memory is read from /proc/meminfo.
    #[test]
    fn an_offloaded_state_too_large_for_the_host_is_refused() {
        let meminfo = "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   100663296 kB\n";
        assert_eq!(parse_mem_available(meminfo), Some(96 << 30));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        // 8B parameters need 89.4 GiB of state: they fit 96 GiB, not 64.
        let needed = OFFLOADED_BYTES_PER_PARAMETER * 8_000_000_000;
        ensure_host_room(needed, Some(96 << 30)).unwrap();
        ensure_host_room(needed, None).unwrap();
        let refusal = ensure_host_room(needed, Some(64 << 30))
            .unwrap_err()
            .to_string();
        assert!(
            refusal.contains("needs 89.4 GiB") && refusal.contains("64.0 GiB is available"),
            "{refusal}"
        );
        assert!(refusal.contains("--zero-stage"), "{refusal}");
        if cfg!(target_os = "linux") {
            assert!(available_host_memory().is_some_and(|bytes| bytes > 0));
        }
    }

    #[test]
    fn a_state_of_other_weights_is_refused_and_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state.safetensors");
        let mut saved = AdamW::new(weights(DType::F32), config()).unwrap();
        saved
            .step(&grads(&weights(DType::F32)), 1e-2, None)
            .unwrap();
        save_whole_state(&saved, &state);

        let refusal = |weights: Vec<(String, Var)>| {
            let mut optimizer = AdamW::new(weights.clone(), config()).unwrap();
            let error = optimizer.load_state(&state).unwrap_err().to_string();
            assert_eq!(optimizer.steps(), 0);
            for (name, w) in weights {
                let values = w.as_detached_tensor().flatten_all().unwrap();
                assert_eq!(
                    values
                        .abs()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap(),
                    0.0,
                    "{name}"
                );
            }
            error
        };
        let zeros = |name: &str, shape: &[usize]| {
            (
                name.to_string(),
                Var::zeros(shape, DType::F32, &Device::Cpu).unwrap(),
            )
        };
        let error = refusal(vec![zeros("c.weight", &[2, 2])]);
        assert!(error.contains("holds 7 tensors"), "{error}");
        let error = refusal(vec![
            zeros("a.weight", &[5, 3]),
            zeros("b.norm.weight", &[7]),
        ]);
        assert!(
            error.contains("`exp_avg.a.weight` is F32 [3, 5], expected F32 [5, 3]"),
            "{error}"
        );
    }

    /// The host's one pass equals the tensor form bit for bit: f32 weights (the master is the
    /// weight) and bf16 and f16 weights (an f32 master, rounded into the weight), with
    /// gradients in f32 and in the weight's dtype (read by the pass as they are), with and
    /// without weight decay.
    #[test]
    fn the_host_update_equals_the_tensor_update_bit_for_bit() {
        let cases = [
            (DType::F32, DType::F32),
            (DType::BF16, DType::BF16),
            (DType::BF16, DType::F32),
            (DType::F16, DType::F16),
        ];
        for ((weight_dtype, grad_dtype), decay) in cases
            .into_iter()
            .flat_map(|case| [None, Some(0.999_9_f32)].map(|decay| (case, decay)))
        {
            let scalars = crate::host_step::test_scalars(decay);
            let [host, tensors] = [0, 1].map(|path| {
                let (name, weight) = weights(weight_dtype).remove(0);
                let f32_weight = weight.as_detached_tensor().to_dtype(DType::F32).unwrap();
                let mut param = Param {
                    name,
                    exp_avg: (&f32_weight * 0.3).unwrap(),
                    exp_avg_sq: f32_weight.sqr().unwrap(),
                    master: (weight_dtype != DType::F32).then(|| f32_weight.copy().unwrap()),
                    weight,
                };
                let grad = (f32_weight.cos().unwrap() * 0.7)
                    .unwrap()
                    .to_dtype(grad_dtype)
                    .unwrap();
                for _ in 0..3 {
                    if path == 0 {
                        param
                            .step_on_host(
                                &grad,
                                &scalars,
                                #[cfg(feature = "cuda")]
                                &mut Default::default(),
                            )
                            .unwrap();
                    } else {
                        let grad = grad.to_dtype(DType::F32).unwrap();
                        param.step_with_tensors(&grad, &scalars).unwrap();
                    }
                }
                let weight = param
                    .weight
                    .as_detached_tensor()
                    .to_dtype(DType::F32)
                    .unwrap();
                [param.master(), param.exp_avg, param.exp_avg_sq, weight].map(|t| {
                    t.flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>()
                })
            });
            assert_eq!(
                host, tensors,
                "{weight_dtype:?} weights, {grad_dtype:?} gradients, decay {decay:?}"
            );
        }
    }

    #[test]
    fn accumulation_sums_and_clipping_scales_to_the_norm() {
        let g = |v: Vec<f32>| Tensor::from_vec(v, 2, &Device::Cpu).unwrap();
        let mut accumulator = GradientAccumulator::default();
        accumulator
            .add(HashMap::from([("w".to_string(), g(vec![1.0, 2.0]))]))
            .unwrap();
        accumulator
            .add(HashMap::from([("w".to_string(), g(vec![2.0, 2.0]))]))
            .unwrap();
        let grads = accumulator.take();
        assert_eq!(accumulator.micro_batches(), 0);
        assert_eq!(grads["w"].to_vec1::<f32>().unwrap(), [3.0, 4.0]);
        let clip = |max_norm| grad_clip(&grads, max_norm, &SingleProcess).unwrap();
        assert_eq!(
            clip(10.0),
            GradClip {
                norm: 5.0,
                factor: None
            }
        );
        assert_eq!(
            clip(1.0),
            GradClip {
                norm: 5.0,
                factor: Some(1.0f32 / (5.0 + 1e-6))
            }
        );
        // The gradients are left to the update to scale.
        assert_eq!(grads["w"].to_vec1::<f32>().unwrap(), [3.0, 4.0]);
    }

    /// The update applying clipping's factor as it reads each gradient is the update of the
    /// gradients scaled first (torch's `g ← coef·g`, candle's `affine`), bit for bit, in the
    /// host's pass and in tensor operations.
    #[test]
    fn a_step_with_the_clip_factor_is_a_step_on_clipped_gradients() {
        let grads = grads(&weights(DType::F32));
        let factor = grad_clip(&grads, 1e-3, &SingleProcess).unwrap().factor;
        let c = f64::from(factor.expect("gradients far above the norm"));
        let scaled: HashMap<String, Tensor> = grads
            .iter()
            .map(|(name, g)| (name.clone(), g.affine(c, 0.0).unwrap()))
            .collect();
        for dtype in [DType::F32, DType::BF16] {
            let (scaled_first, folded) = (weights(dtype), weights(dtype));
            let mut first = AdamW::new(scaled_first.clone(), config()).unwrap();
            let mut second = AdamW::new(folded.clone(), config()).unwrap();
            for _ in 0..2 {
                first.step(&scaled, 1e-2, None).unwrap();
                second.step(&grads, 1e-2, factor).unwrap();
            }
            for ((name, a), (_, b)) in scaled_first.iter().zip(&folded) {
                assert_eq!(bits(a), bits(b), "{dtype:?} {name}");
            }
        }
        // The tensor form (the device's fallback when its kernel is unavailable) too.
        let scalars = |grad_factor| AdamWScalars {
            grad_factor,
            ..crate::host_step::test_scalars(None)
        };
        let mut scaled_first = AdamW::new(weights(DType::F32), config()).unwrap();
        let mut folded = AdamW::new(weights(DType::F32), config()).unwrap();
        for (a, b) in scaled_first.params.iter_mut().zip(&mut folded.params) {
            a.step_with_tensors(&scaled[&a.name], &scalars(None))
                .unwrap();
            b.step_with_tensors(&grads[&b.name], &scalars(factor))
                .unwrap();
            let values = |p: &Param| p.master().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(values(a), values(b), "{}", a.name);
        }
    }
}
