//! AdamW's update where its state lives in host memory (CPU training, and ZeRO-Offload's split
//! for a model whose state does not fit beside it on the GPU): one pass over each weight's
//! gradient, moments and f32 master, on every core, writing the rounded compute weight in the
//! same pass.
//!
//! Why one pass: an offloaded 8B model's update is 8 billion elements. Three separate passes
//! (m, v, then the weights), a gradient converted to f32 on the device and read back whole
//! into fresh pageable memory, and the rounded weights built as a new host tensor (one thread)
//! and sent through pageable memory took 55 s a step on an H100 beside 1.3 s of forward and
//! backward. Here a device weight's gradient comes back in its own dtype (bf16 is half the
//! bytes of f32, and exact in f32 on the host) chunk by chunk into page-locked buffers, each
//! chunk is updated where it lies, and its rounded weights go back from a page-locked buffer
//! into the weight's own device memory, the neighbouring chunks' copies running meanwhile
//! (`DeviceTransfer`, CUDA builds).
//!
//! Every element's result depends on its own inputs only and takes the f32 operations of
//! [`crate::optim::AdamW::step`]'s tensor form in the same order, so neither the fusion nor the
//! split over threads changes a bit.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};
use dice_model::adamw::AdamWScalars;
use half::{bf16, f16};
use std::cell::RefCell;

#[cfg(feature = "cuda")]
mod transfer;
#[cfg(feature = "cuda")]
pub(crate) use transfer::DeviceTransfer;

/// Elements below which a pass is not split further (1 MiB of each f32 array): a thread's
/// share of one 8 M-element transfer chunk on 16 cores is 512 Ki elements.
pub(crate) const HOST_CHUNK: usize = 1 << 18;

/// A gradient's values as the host reads them (16-bit floats widen to f32 exactly).
#[derive(Clone, Copy)]
pub(crate) enum GradValues<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

/// Where the updated f32 master goes besides itself: nowhere when the master is the weight
/// (an f32 weight whose state is beside it on the host), else rounded into the compute
/// weight's values.
pub(crate) enum WeightOut<'a> {
    MasterIsWeight,
    F32(&'a mut [f32]),
    BF16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

/// One contiguous run of a weight's elements: its gradient, moments, master and output.
pub(crate) struct HostSlices<'a> {
    pub grad: GradValues<'a>,
    pub exp_avg: &'a mut [f32],
    pub exp_avg_sq: &'a mut [f32],
    pub master: &'a mut [f32],
    pub out: WeightOut<'a>,
}

impl<'a> HostSlices<'a> {
    fn len(&self) -> usize {
        self.master.len()
    }

    /// The first `at` elements and the rest.
    fn split_at(self, at: usize) -> (Self, Self) {
        let (grad_head, grad_tail) = match self.grad {
            GradValues::F32(g) => (GradValues::F32(&g[..at]), GradValues::F32(&g[at..])),
            GradValues::BF16(g) => (GradValues::BF16(&g[..at]), GradValues::BF16(&g[at..])),
            GradValues::F16(g) => (GradValues::F16(&g[..at]), GradValues::F16(&g[at..])),
        };
        let (out_head, out_tail) = match self.out {
            WeightOut::MasterIsWeight => (WeightOut::MasterIsWeight, WeightOut::MasterIsWeight),
            WeightOut::F32(o) => {
                let (a, b) = o.split_at_mut(at);
                (WeightOut::F32(a), WeightOut::F32(b))
            }
            WeightOut::BF16(o) => {
                let (a, b) = o.split_at_mut(at);
                (WeightOut::BF16(a), WeightOut::BF16(b))
            }
            WeightOut::F16(o) => {
                let (a, b) = o.split_at_mut(at);
                (WeightOut::F16(a), WeightOut::F16(b))
            }
        };
        let (m_head, m_tail) = self.exp_avg.split_at_mut(at);
        let (v_head, v_tail) = self.exp_avg_sq.split_at_mut(at);
        let (p_head, p_tail) = self.master.split_at_mut(at);
        (
            HostSlices {
                grad: grad_head,
                exp_avg: m_head,
                exp_avg_sq: v_head,
                master: p_head,
                out: out_head,
            },
            HostSlices {
                grad: grad_tail,
                exp_avg: m_tail,
                exp_avg_sq: v_tail,
                master: p_tail,
                out: out_tail,
            },
        )
    }

    /// The update on rayon's threads: halves updated side by side down to runs of
    /// [`HOST_CHUNK`] (an offloaded model's chunks of millions of elements fill every core; a
    /// small weight stays on this thread).
    pub(crate) fn update(self, s: &AdamWScalars) {
        if self.len() <= HOST_CHUNK {
            return self.update_here(s);
        }
        let half = self.len() / 2;
        let (head, tail) = self.split_at(half);
        rayon::join(|| head.update(s), || tail.update(s));
    }

    /// The update on this thread: one loop per pair of gradient and weight dtypes.
    fn update_here(self, s: &AdamWScalars) {
        let HostSlices {
            grad,
            exp_avg,
            exp_avg_sq,
            master,
            out,
        } = self;
        let state = (exp_avg, exp_avg_sq, master);
        match grad {
            GradValues::F32(g) => write_out(state, out, s, |i| g[i]),
            GradValues::BF16(g) => write_out(state, out, s, |i| g[i].to_f32()),
            GradValues::F16(g) => write_out(state, out, s, |i| g[i].to_f32()),
        }
    }
}

type State<'a> = (&'a mut [f32], &'a mut [f32], &'a mut [f32]);

fn write_out(state: State<'_>, out: WeightOut<'_>, s: &AdamWScalars, grad: impl Fn(usize) -> f32) {
    match out {
        WeightOut::MasterIsWeight => step_elements(state, s, grad, |_, _| {}),
        WeightOut::F32(o) => step_elements(state, s, grad, |i, p| o[i] = p),
        WeightOut::BF16(o) => step_elements(state, s, grad, |i, p| o[i] = bf16::from_f32(p)),
        WeightOut::F16(o) => step_elements(state, s, grad, |i, p| o[i] = f16::from_f32(p)),
    }
}

/// AdamW on each element, in the tensor form's f32 operations and order (candle's scalar
/// `affine` is `x·a + b`, kept with its `+ 0`): g ← g·c + 0 (with a gradient factor);
/// m ← m + ((g − m)·(1 − β1) + 0); v ← (v·β2 + 0) + (g·(1 − β2) + 0)·g; p ← p·decay + 0 (with
/// weight decay); p ← p + (m·(−step) + 0) / ((√v / bc2)·1 + ε); then `out(i, p)`.
#[inline(always)]
fn step_elements(
    (exp_avg, exp_avg_sq, master): State<'_>,
    s: &AdamWScalars,
    grad: impl Fn(usize) -> f32,
    mut out: impl FnMut(usize, f32),
) {
    let AdamWScalars {
        grad_factor,
        decay,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        bias_correction2_sqrt,
        eps,
        neg_step_size,
    } = *s;
    for (i, ((m, v), p)) in exp_avg
        .iter_mut()
        .zip(exp_avg_sq.iter_mut())
        .zip(master.iter_mut())
        .enumerate()
    {
        let g = match grad_factor {
            Some(c) => grad(i) * c + 0.0,
            None => grad(i),
        };
        *m += (g - *m) * one_minus_beta1 + 0.0;
        *v = (*v * beta2 + 0.0) + (g * one_minus_beta2 + 0.0) * g;
        if let Some(decay) = decay {
            *p = *p * decay + 0.0;
        }
        let denom = (v.sqrt() / bias_correction2_sqrt) * 1.0 + eps;
        *p += (*m * neg_step_size + 0.0) / denom;
        out(i, *p);
    }
}

/// Runs `f` on the storage of a CPU tensor, mutably: candle lends a tensor's memory for
/// writing to custom in-place operations only.
pub(crate) fn with_storage_mut<R>(
    tensor: &Tensor,
    f: impl FnOnce(&mut CpuStorage, &Layout) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    struct Lend<F, R> {
        f: RefCell<Option<F>>,
        result: RefCell<Option<R>>,
    }
    impl<F, R> InplaceOp1 for Lend<F, R>
    where
        F: FnOnce(&mut CpuStorage, &Layout) -> candle_core::Result<R>,
    {
        fn name(&self) -> &'static str {
            "host-values"
        }
        fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
            let f = self.f.borrow_mut().take();
            let f = f.ok_or_else(|| candle_core::Error::msg("internal error: lent twice"))?;
            *self.result.borrow_mut() = Some(f(storage, layout)?);
            Ok(())
        }
    }
    let lend = Lend {
        f: RefCell::new(Some(f)),
        result: RefCell::new(None),
    };
    tensor.inplace_op1(&lend)?;
    lend.result
        .into_inner()
        .ok_or_else(|| candle_core::Error::msg("internal error: nothing lent"))
}

/// Runs `f` on the host values of a weight's two moments, mutably.
pub(crate) fn with_state_values<R>(
    [exp_avg, exp_avg_sq]: [&Tensor; 2],
    f: impl FnOnce(&mut [f32], &mut [f32]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    with_storage_mut(exp_avg, |m, m_layout| {
        let m = f32_values_mut(m, m_layout)?;
        with_storage_mut(exp_avg_sq, |v, v_layout| f(m, f32_values_mut(v, v_layout)?))
    })
}

/// The f32 values of a contiguous CPU storage, mutably.
pub(crate) fn f32_values_mut<'s>(
    storage: &'s mut CpuStorage,
    layout: &Layout,
) -> candle_core::Result<&'s mut [f32]> {
    match (storage, layout.contiguous_offsets()) {
        (CpuStorage::F32(values), Some((start, end))) => Ok(&mut values[start..end]),
        _ => candle_core::bail!("internal error: the optimizer expects contiguous f32 tensors"),
    }
}

/// A contiguous CPU weight's values as the rounded output of the update.
pub(crate) fn weight_out<'s>(
    storage: &'s mut CpuStorage,
    layout: &Layout,
) -> candle_core::Result<WeightOut<'s>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("internal error: the optimizer expects contiguous weights")
    };
    Ok(match storage {
        CpuStorage::F32(v) => WeightOut::F32(&mut v[start..end]),
        CpuStorage::BF16(v) => WeightOut::BF16(&mut v[start..end]),
        CpuStorage::F16(v) => WeightOut::F16(&mut v[start..end]),
        other => candle_core::bail!("cannot optimize a weight of dtype {:?}", other.dtype()),
    })
}

/// Runs `f` on the values of a contiguous CPU gradient.
pub(crate) fn with_grad_values<R>(
    grad: &Tensor,
    f: impl FnOnce(GradValues<'_>) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (storage, layout) = grad.storage_and_layout();
    let (Storage::Cpu(storage), Some((start, end))) = (&*storage, layout.contiguous_offsets())
    else {
        candle_core::bail!("internal error: the host update expects a contiguous CPU gradient")
    };
    match storage {
        CpuStorage::F32(v) => f(GradValues::F32(&v[start..end])),
        CpuStorage::BF16(v) => f(GradValues::BF16(&v[start..end])),
        CpuStorage::F16(v) => f(GradValues::F16(&v[start..end])),
        other => candle_core::bail!(
            "cannot optimize with a gradient of dtype {:?}",
            other.dtype()
        ),
    }
}

/// AdamW's scalars of a step some way into a run (the tests' irregular values).
#[cfg(test)]
pub(crate) fn test_scalars(decay: Option<f32>) -> AdamWScalars {
    AdamWScalars {
        grad_factor: None,
        decay,
        one_minus_beta1: 0.1,
        beta2: 0.999,
        one_minus_beta2: 1e-3,
        bias_correction2_sqrt: 0.0447,
        eps: 1e-8,
        neg_step_size: -0.0137,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Split over threads, every element is updated once, with its own inputs, and rounded
    /// into its own output: the result equals one thread's bit for bit.
    #[test]
    fn a_pass_split_over_threads_equals_one_thread() {
        let len = 3 * HOST_CHUNK + 17;
        let s = test_scalars(Some(0.999));
        let grad: Vec<bf16> = (0..len)
            .map(|i| bf16::from_f32(((i % 1000) as f32 * 0.37).sin()))
            .collect();
        let run = |threads: bool| {
            let mut m: Vec<f32> = (0..len).map(|i| (i % 7) as f32 * 0.01).collect();
            let mut v: Vec<f32> = (0..len).map(|i| (i % 5) as f32 * 1e-4).collect();
            let mut p: Vec<f32> = (0..len).map(|i| ((i % 11) as f32).cos()).collect();
            let mut out = vec![bf16::ZERO; len];
            let slices = HostSlices {
                grad: GradValues::BF16(&grad),
                exp_avg: &mut m,
                exp_avg_sq: &mut v,
                master: &mut p,
                out: WeightOut::BF16(&mut out),
            };
            if threads {
                slices.update(&s);
            } else {
                slices.update_here(&s);
            }
            let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            (bits(&m), bits(&v), bits(&p), out)
        };
        let (one, many) = (run(false), run(true));
        assert!(one == many);
        assert!(one
            .3
            .iter()
            .zip(&one.2)
            .all(|(o, &p)| o.to_bits() == bf16::from_f32(f32::from_bits(p)).to_bits()));
    }
}
