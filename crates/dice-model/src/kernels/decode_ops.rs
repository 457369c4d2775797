//! Fused steps of the decoding forward (`decode_ops.cu`), each one launch instead of several
//! candle ops: residual add + RMSNorm, the SiLU gate, and qk-norm + RoPE + KV-cache write; and
//! the engine's greedy and sampled selections over the logits ([`greedy_summary`],
//! [`sample_summary`]).
//!
//! Their numerics are those of the candle CUDA kernels they replace, rounding for rounding (the
//! top of `decode_ops.cu` lists them), so a forward gives the same bits with or without them;
//! tests/decode_ops_emulated.rs checks the kernels' indexing and rounding steps on the CPU.
//!
//! Every function only allocates and launches on the device's stream (no copies between host
//! and device, no synchronisation), so that it can run inside CUDA graph capture; the positions
//! of the new tokens are read from a device buffer of per-row lengths, which a graph replay
//! sees with its current contents.

use super::device_ptr::{alloc, rows_ptr, slice_ptr, tensor_ptr, wrap};
use super::nvrtc::{self, dtype_index, PerDevice, Source};
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{bail, DType, Device, Result, Tensor};
use std::sync::Arc;

pub(super) const SOURCE: Source = Source {
    text: include_str!("decode_ops.cu"),
    file_name: c"decode_ops.cu",
    what: "the decode kernels",
    arch_specific: false,
};

/// Head dims `qk_norm_rope_cache` takes (`MAX_HEAD_DIM` of `decode_ops.cu` is the largest).
const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Warps per CTA of `qk_norm_rope_cache` (`ROPE_WARPS`), one head vector each at a time.
const ROPE_WARPS: u32 = 8;

/// Token rows below which `qk_norm_rope_cache` spreads a token's head vectors over several
/// CTAs (one per warp at most), so that a small batch still keeps many SMs busy.
const ROPE_SPREAD_ROWS: usize = 256;

/// CTAs sharing one token's `heads` head vectors in `qk_norm_rope_cache`, for `rows` token rows.
fn rope_head_ctas(heads: usize, rows: usize) -> usize {
    let spread = ROPE_SPREAD_ROWS.div_ceil(rows.max(1));
    spread.min(heads.div_ceil(ROPE_WARPS as usize)).max(1)
}

/// Threads per CTA of `add_rms_norm_wide` (`WIDE_THREADS`), each taking `WIDE_COLS` contiguous
/// columns of a 16-byte aligned row (`Octet`) for 8 of candle's 1024 threads.
const WIDE_THREADS: u32 = 128;
const WIDE_COLS: usize = 8;

/// Threads per CTA of `greedy_summary` (`GREEDY_THREADS`).
const GREEDY_THREADS: u32 = 256;

/// Threads per CTA of `sample_summary` (`SAMPLE_THREADS`).
const SAMPLE_THREADS: u32 = 256;

/// Threads per CTA of `silu_mul` (16 bytes of columns each), and most rows of its grid (CUDA's
/// limit on grid y; it strides over the rest).
const ELEMENTWISE_THREADS: u32 = 256;
const MAX_GRID_Y: usize = 65535;

/// The kernels, loaded on one device.
struct Loaded {
    /// By dtype, in the order of [`dtype_index`].
    add_rms_norm: [CudaFunction; 3],
    add_rms_norm_wide: [CudaFunction; 3],
    silu_mul: [CudaFunction; 3],
    qk_norm_rope_cache: [CudaFunction; 3],
    greedy_summary: [CudaFunction; 3],
    sample_summary: [CudaFunction; 3],
}

/// Kernels by device.
static LOADED: PerDevice<(), Loaded> = PerDevice::new();

fn loaded(dev: &CudaDevice) -> Option<Arc<Loaded>> {
    LOADED.get(
        dev,
        (),
        "fused decode kernels unavailable, the forward runs candle ops",
        || load(dev),
    )
}

fn load(dev: &CudaDevice) -> anyhow::Result<Loaded> {
    let module = nvrtc::load_module(dev, &SOURCE, &[])?;
    let by_dtype = |name| nvrtc::by_dtype(&module, &SOURCE, name);
    Ok(Loaded {
        add_rms_norm: by_dtype("add_rms_norm")?,
        add_rms_norm_wide: by_dtype("add_rms_norm_wide")?,
        silu_mul: by_dtype("silu_mul")?,
        qk_norm_rope_cache: by_dtype("qk_norm_rope_cache")?,
        greedy_summary: by_dtype("greedy_summary")?,
        sample_summary: by_dtype("sample_summary")?,
    })
}

/// Whether the fused decode kernels run on `dev` for activations of `dtype` and heads of
/// `head_dim`: they compiled there (the first call compiles them; a failure is
/// warned about once), f32, bf16 or f16, and a head dim of 16, 32, 64 or 128.
pub(crate) fn available(dev: &CudaDevice, dtype: DType, head_dim: usize) -> bool {
    dtype_index(dtype).is_some() && HEAD_DIMS.contains(&head_dim) && loaded(dev).is_some()
}

/// The CUDA device of `tensors`, the loaded kernels and the index of their common dtype.
fn kernels_for(op: &str, tensors: &[&Tensor]) -> Result<(CudaDevice, Arc<Loaded>, usize)> {
    let first = tensors[0];
    let Device::Cuda(dev) = first.device() else {
        bail!(
            "{op} runs on CUDA devices only, got a tensor on {:?}",
            first.device()
        );
    };
    for t in tensors {
        if !t.device().same_device(first.device()) || t.dtype() != first.dtype() {
            bail!(
                "{op} takes tensors of one dtype on one device, got {:?} on {:?} and {:?} on {:?}",
                first.dtype(),
                first.device(),
                t.dtype(),
                t.device()
            );
        }
    }
    let Some(index) = dtype_index(first.dtype()) else {
        bail!(
            "{op} takes f32, bf16 or f16 tensors, got {:?}",
            first.dtype()
        );
    };
    let Some(kernels) = loaded(dev) else {
        bail!("{op}: the fused decode kernels failed to build on this device (see the warning)");
    };
    Ok((dev.clone(), kernels, index))
}

/// Copies `values` from the host into contiguous u32 CUDA tensor `dst`, in place: how a graph
/// replay refreshes the buffers its kernels read, without a new buffer and a device copy.
pub(crate) fn write_u32(dst: &Tensor, values: &[u32]) -> Result<()> {
    let Device::Cuda(dev) = dst.device() else {
        bail!("write_u32 writes into CUDA tensors only");
    };
    if dst.dtype() != DType::U32 || dst.elem_count() != values.len() {
        bail!(
            "write_u32 of {} values into a {:?} tensor of {} elements",
            values.len(),
            dst.dtype(),
            dst.elem_count()
        );
    }
    let stream = dev.cuda_stream();
    // What cudarc's own copies do first: the raw call below does not.
    stream.context().bind_to_thread().w()?;
    let (storage, layout) = dst.storage_and_layout();
    let (ptr, _record) = tensor_ptr((&storage, layout), "the destination", &stream)?;
    // SAFETY: `ptr` addresses `values.len()` u32 of `dst` (checked above); from pageable host
    // memory the call returns once `values` has been staged, so it may be dropped after it.
    unsafe {
        candle_core::cuda_backend::cudarc::driver::result::memcpy_htod_async(
            ptr,
            values,
            stream.cu_stream(),
        )
    }
    .w()
}

/// `(residual + delta, rmsnorm(residual + delta) * weight)` over the last dim, each of the shape
/// of `residual`: the residual add and the next RMSNorm of a layer in one launch, with the
/// rounding of candle's T add and its fused `rmsnorm` (f32 statistics, eps in f32).
pub(crate) fn add_rms_norm(
    residual: &Tensor,
    delta: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "add_rms_norm";
    let (dev, kernels, dtype) = kernels_for(OP, &[residual, delta, weight])?;
    let hidden = residual.dim(candle_core::D::Minus1)?;
    if delta.dims() != residual.dims() || weight.dims() != [hidden] || residual.elem_count() == 0 {
        bail!(
            "{OP} takes residual and delta of one non-empty shape and a weight of their last \
             dim, got {:?}, {:?} and {:?}",
            residual.dims(),
            delta.dims(),
            weight.dims()
        );
    }
    let rows = residual.elem_count() / hidden;
    let stream = dev.cuda_stream();
    let sum = alloc(&dev, residual.dtype(), residual.elem_count())?;
    let normed = alloc(&dev, residual.dtype(), residual.elem_count())?;
    {
        let (residual_s, residual_l) = residual.storage_and_layout();
        let (delta_s, delta_l) = delta.storage_and_layout();
        let (weight_s, weight_l) = weight.storage_and_layout();
        let residual_p = tensor_ptr((&residual_s, residual_l), "the residual", &stream)?;
        let delta_p = tensor_ptr((&delta_s, delta_l), "the delta", &stream)?;
        let weight_p = tensor_ptr((&weight_s, weight_l), "the norm weight", &stream)?;
        let sum_p = slice_ptr(&sum.slice, 0, &stream)?;
        let normed_p = slice_ptr(&normed.slice, 0, &stream)?;
        let (hidden_i, eps) = (hidden as i32, eps as f32);
        // candle-nn's rmsnorm launch (its f32 sum is added in the order these threads give), or
        // for 1024 threads its order at 8 columns per thread where every row allows 16-byte
        // accesses.
        let aligned = [residual_p.0, delta_p.0, weight_p.0, sum_p.0, normed_p.0]
            .iter()
            .all(|&ptr| ptr % 16 == 0);
        let (function, threads) = if hidden < 1024 {
            (&kernels.add_rms_norm[dtype], 32)
        } else if hidden.is_multiple_of(WIDE_COLS) && aligned {
            (&kernels.add_rms_norm_wide[dtype], WIDE_THREADS)
        } else {
            (&kernels.add_rms_norm[dtype], 1024)
        };
        let mut launch = stream.launch_builder(function);
        launch
            .arg(&residual_p.0)
            .arg(&delta_p.0)
            .arg(&weight_p.0)
            .arg(&sum_p.0)
            .arg(&normed_p.0)
            .arg(&hidden_i)
            .arg(&eps);
        // SAFETY: the arguments match `add_rms_norm_*` and `add_rms_norm_wide_*` (whose 16-byte
        // accesses are aligned, checked above); every pointer covers `rows * hidden` elements
        // (`hidden` for the weight), as checked above.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .w()?;
    }
    let shape = residual.shape().clone();
    Ok((wrap(sum, shape.clone()), wrap(normed, shape)))
}

/// The rows and vocabulary of `logits` (`[.., vocab]`) for the one-CTA-per-row kernels, whose
/// column indices are 32-bit.
fn logit_rows(op: &str, logits: &Tensor) -> Result<(usize, usize)> {
    let vocab = logits.dim(candle_core::D::Minus1)?;
    if vocab == 0 || vocab > i32::MAX as usize {
        bail!("{op} takes rows of 1 to 2^31 - 1 logits, got {vocab}");
    }
    Ok((logits.elem_count() / vocab, vocab))
}

/// The greedy pick of every row of `logits` (`[.., vocab]`, f32, bf16 or f16, contiguous on a
/// CUDA device), in one pass over each row: u32 `[3, rows]` holding per row the lowest index of
/// its highest value, how many entries equal that value, and 1 where the row has a NaN, a +inf
/// maximum or only -inf (else 0). What `max`, `eq`, `where_cond`, `min` and `sum` over the whole
/// tensor give, without materialising `[rows, vocab]` intermediates.
pub fn greedy_summary(logits: &Tensor) -> Result<Tensor> {
    const OP: &str = "greedy_summary";
    let (dev, kernels, dtype) = kernels_for(OP, &[logits])?;
    let (rows, vocab) = logit_rows(OP, logits)?;
    let stream = dev.cuda_stream();
    let out = alloc(&dev, DType::U32, 3 * rows)?;
    if rows > 0 {
        let (logits_s, logits_l) = logits.storage_and_layout();
        let logits_p = tensor_ptr((&logits_s, logits_l), "the logits", &stream)?;
        let out_p = slice_ptr(&out.slice, 0, &stream)?;
        let (rows_i, vocab_i) = (rows as i32, vocab as i32);
        let mut launch = stream.launch_builder(&kernels.greedy_summary[dtype]);
        launch
            .arg(&logits_p.0)
            .arg(&out_p.0)
            .arg(&rows_i)
            .arg(&vocab_i);
        // SAFETY: the arguments match `greedy_summary_*`; the logits cover `rows * vocab`
        // elements and the output `3 * rows`.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (GREEDY_THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .w()?;
    }
    Ok(wrap(out, (3, rows)))
}

/// A sampled candidate of every row of `logits` (`[.., vocab]`, f32, bf16 or f16, contiguous on
/// a CUDA device) with no top-k or top-p filter: row `r`'s logits divided by `temperatures[r]`
/// (f32 `[rows]`), softmax, and the inverse-CDF draw of `uniforms[r]` (f64 `[rows]`, in [0, 1))
/// in index order. u32 `[4, rows]`: per row the token, the f32 bits of its probability, the f32
/// bits of the distribution's entropy (0 unless `with_entropy`), and 1 where the row has a NaN,
/// a +inf or only -inf (else 0). Three passes over each row on the device, so only these 16
/// bytes per row reach the host instead of the row's `vocab` logits.
pub fn sample_summary(
    logits: &Tensor,
    temperatures: &Tensor,
    uniforms: &Tensor,
    with_entropy: bool,
) -> Result<Tensor> {
    const OP: &str = "sample_summary";
    let (dev, kernels, dtype) = kernels_for(OP, &[logits])?;
    let (rows, vocab) = logit_rows(OP, logits)?;
    for (what, t, want) in [
        ("temperatures", temperatures, DType::F32),
        ("uniforms", uniforms, DType::F64),
    ] {
        if t.dims() != [rows] || t.dtype() != want || !t.device().same_device(logits.device()) {
            bail!(
                "{OP} takes {what} of {want:?} [{rows}] on the logits' device, got {:?} {:?}",
                t.dtype(),
                t.dims()
            );
        }
    }
    let stream = dev.cuda_stream();
    let out = alloc(&dev, DType::U32, 4 * rows)?;
    if rows > 0 {
        let (logits_s, logits_l) = logits.storage_and_layout();
        let logits_p = tensor_ptr((&logits_s, logits_l), "the logits", &stream)?;
        let (temperatures_s, temperatures_l) = temperatures.storage_and_layout();
        let temperatures_p = tensor_ptr(
            (&temperatures_s, temperatures_l),
            "the temperatures",
            &stream,
        )?;
        let (uniforms_s, uniforms_l) = uniforms.storage_and_layout();
        let uniforms_p = tensor_ptr((&uniforms_s, uniforms_l), "the uniforms", &stream)?;
        let out_p = slice_ptr(&out.slice, 0, &stream)?;
        let (rows_i, vocab_i, entropy_i) = (rows as i32, vocab as i32, i32::from(with_entropy));
        let mut launch = stream.launch_builder(&kernels.sample_summary[dtype]);
        launch
            .arg(&logits_p.0)
            .arg(&temperatures_p.0)
            .arg(&uniforms_p.0)
            .arg(&out_p.0)
            .arg(&rows_i)
            .arg(&vocab_i)
            .arg(&entropy_i);
        // SAFETY: the arguments match `sample_summary_*`; the logits cover `rows * vocab`
        // elements, the temperatures and uniforms `rows` (checked above) and the output
        // `4 * rows`.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (SAMPLE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .w()?;
    }
    Ok(wrap(out, (4, rows)))
}

/// `T(silu(f32(gate))) * up`, element-wise (candle: `gate.to_dtype(F32).silu().to_dtype(T)`,
/// then `* up` in T), as a contiguous tensor. `gate` and `up` may be narrows of one tensor's last
/// dim (the two halves of a fused gate/up projection): their rows must be contiguous and equally
/// spaced.
pub(crate) fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    const OP: &str = "silu_mul";
    let (dev, kernels, dtype) = kernels_for(OP, &[gate, up])?;
    if gate.dims() != up.dims() || gate.elem_count() == 0 {
        bail!(
            "{OP} takes gate and up of one non-empty shape, got {:?} and {:?}",
            gate.dims(),
            up.dims()
        );
    }
    let n = gate.elem_count();
    let stream = dev.cuda_stream();
    let out = alloc(&dev, gate.dtype(), n)?;
    {
        let (gate_s, gate_l) = gate.storage_and_layout();
        let (up_s, up_l) = up.storage_and_layout();
        let gate_p = rows_ptr((&gate_s, gate_l), "the gate", &stream)?;
        let up_p = rows_ptr((&up_s, up_l), "up", &stream)?;
        if gate_p.2 != up_p.2 {
            bail!(
                "{OP} takes gate and up rows equally spaced, got strides {} and {}",
                gate_p.2,
                up_p.2
            );
        }
        let out_p = slice_ptr(&out.slice, 0, &stream)?;
        let cols = gate.dim(candle_core::D::Minus1)?;
        let rows = n / cols;
        let (Ok(rows_i), Ok(cols_i)) = (i32::try_from(rows), i32::try_from(cols)) else {
            bail!("{OP} takes fewer than 2^31 rows and columns, got {rows} x {cols}");
        };
        let in_stride_u64 = gate_p.2 as u64;
        let mut launch = stream.launch_builder(&kernels.silu_mul[dtype]);
        launch
            .arg(&gate_p.0)
            .arg(&up_p.0)
            .arg(&out_p.0)
            .arg(&rows_i)
            .arg(&cols_i)
            .arg(&in_stride_u64);
        let grid = (
            cols.div_ceil(16 / gate.dtype().size_in_bytes() * ELEMENTWISE_THREADS as usize) as u32,
            rows.min(MAX_GRID_Y) as u32,
            1,
        );
        // SAFETY: the arguments match `silu_mul_*`; gate and up hold `rows` rows of `cols`
        // elements `in_stride` apart (checked by `rows_ptr`), the output `rows * cols` elements.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: grid,
                block_dim: (ELEMENTWISE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .w()?;
    }
    Ok(wrap(out, gate.shape().clone()))
}

/// One layer's step between the q/k/v projections and attention: q `[B, T, Hq * D]` and k
/// `[B, T, Hkv * D]` each RMS-normed per head over D with `q_norm` / `k_norm` `[D]` and rotated
/// (rotate-half RoPE, `inv_freq` `[D/2]` f32, position `lens[b] + t`); returns q `[B, Hq, T, D]`
/// and writes k and `v` `[B, T, Hkv * D]` into `k_cache` / `v_cache` `[B, Hkv, capacity, D]` at
/// slots `lens[b] + t`, in place, touching no other slot. q, k and v may be narrows of one
/// projection's `[B, T, (Hq + 2 Hkv) * D]` output (k and v rows spaced alike).
///
/// `lens` (u32 `[B]`, on the device) is read by the kernel, never here, so a captured graph
/// replays with the lengths the buffer holds then; the caller makes sure that
/// `lens[b] + T <= capacity` (slots past the capacity are not written).
#[allow(clippy::too_many_arguments)]
pub(crate) fn qk_norm_rope_cache(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    q_norm: &Tensor,
    k_norm: &Tensor,
    inv_freq: &Tensor,
    lens: &Tensor,
    eps: f64,
    k_cache: &Tensor,
    v_cache: &Tensor,
) -> Result<Tensor> {
    const OP: &str = "qk_norm_rope_cache";
    let (dev, kernels, dtype) = kernels_for(OP, &[q, k, v, q_norm, k_norm, k_cache, v_cache])?;
    let (batch, tokens, q_width) = q.dims3()?;
    let head_dim = q_norm.dim(0)?;
    let kv_width = k.dim(2)?;
    let (q_heads, kv_heads) = (q_width / head_dim.max(1), kv_width / head_dim.max(1));
    let (_, _, capacity, _) = k_cache.dims4()?;
    let shapes_agree = q_width == q_heads * head_dim
        && kv_width == kv_heads * head_dim
        && k.dims() == [batch, tokens, kv_width]
        && v.dims() == k.dims()
        && q_norm.dims() == [head_dim]
        && k_norm.dims() == [head_dim]
        && inv_freq.dims() == [head_dim / 2]
        && k_cache.dims() == [batch, kv_heads, capacity, head_dim]
        && v_cache.dims() == k_cache.dims()
        && lens.dims() == [batch]
        && batch * tokens > 0;
    if !shapes_agree || !HEAD_DIMS.contains(&head_dim) {
        bail!(
            "{OP} takes q [B, T, Hq * D], k and v [B, T, Hkv * D], norms [D], inv_freq [D/2], \
             caches [B, Hkv, capacity, D] and B lens with D in {HEAD_DIMS:?}, got q {:?}, k {:?}, \
             v {:?}, norms {:?} {:?}, inv_freq {:?}, caches {:?} {:?}, lens {:?}",
            q.dims(),
            k.dims(),
            v.dims(),
            q_norm.dims(),
            k_norm.dims(),
            inv_freq.dims(),
            k_cache.dims(),
            v_cache.dims(),
            lens.dims()
        );
    }
    for (what, t, dtype) in [
        ("inv_freq", inv_freq, DType::F32),
        ("lens", lens, DType::U32),
    ] {
        if t.dtype() != dtype || !t.device().same_device(q.device()) {
            bail!("{OP} takes {what} as {dtype:?} on the device of q");
        }
    }
    let stream = dev.cuda_stream();
    let q_out = alloc(&dev, q.dtype(), q.elem_count())?;
    {
        let (q_s, q_l) = q.storage_and_layout();
        let (k_s, k_l) = k.storage_and_layout();
        let (v_s, v_l) = v.storage_and_layout();
        let (q_norm_s, q_norm_l) = q_norm.storage_and_layout();
        let (k_norm_s, k_norm_l) = k_norm.storage_and_layout();
        let (inv_freq_s, inv_freq_l) = inv_freq.storage_and_layout();
        let (k_cache_s, k_cache_l) = k_cache.storage_and_layout();
        let (v_cache_s, v_cache_l) = v_cache.storage_and_layout();
        let q_p = rows_ptr((&q_s, q_l), "q", &stream)?;
        let k_p = rows_ptr((&k_s, k_l), "k", &stream)?;
        let v_p = rows_ptr((&v_s, v_l), "v", &stream)?;
        if k_p.2 != v_p.2 {
            bail!(
                "{OP} takes k and v rows equally spaced, got strides {} and {}",
                k_p.2,
                v_p.2
            );
        }
        let q_norm_p = tensor_ptr((&q_norm_s, q_norm_l), "q_norm", &stream)?;
        let k_norm_p = tensor_ptr((&k_norm_s, k_norm_l), "k_norm", &stream)?;
        let (lens_s, lens_l) = lens.storage_and_layout();
        let inv_freq_p = tensor_ptr((&inv_freq_s, inv_freq_l), "inv_freq", &stream)?;
        let lens_p = tensor_ptr((&lens_s, lens_l), "lens", &stream)?;
        // The caches are written through these addresses, in place.
        let k_cache_p = tensor_ptr((&k_cache_s, k_cache_l), "the k cache", &stream)?;
        let v_cache_p = tensor_ptr((&v_cache_s, v_cache_l), "the v cache", &stream)?;
        let q_out_p = slice_ptr(&q_out.slice, 0, &stream)?;
        let int = |x: usize| x as i32;
        let (tokens_i, q_heads_i, kv_heads_i, head_dim_i, capacity_i) = (
            int(tokens),
            int(q_heads),
            int(kv_heads),
            int(head_dim),
            int(capacity),
        );
        let (q_stride, kv_stride) = (int(q_p.2), int(k_p.2));
        let eps = eps as f32;
        let mut launch = stream.launch_builder(&kernels.qk_norm_rope_cache[dtype]);
        launch
            .arg(&q_p.0)
            .arg(&k_p.0)
            .arg(&v_p.0)
            .arg(&q_norm_p.0)
            .arg(&k_norm_p.0)
            .arg(&inv_freq_p.0)
            .arg(&lens_p.0)
            .arg(&q_out_p.0)
            .arg(&k_cache_p.0)
            .arg(&v_cache_p.0)
            .arg(&tokens_i)
            .arg(&q_heads_i)
            .arg(&kv_heads_i)
            .arg(&head_dim_i)
            .arg(&capacity_i)
            .arg(&q_stride)
            .arg(&kv_stride)
            .arg(&eps);
        let head_ctas = rope_head_ctas(q_heads + kv_heads, batch * tokens);
        let grid = (head_ctas as u32, tokens as u32, batch as u32);
        // SAFETY: the arguments match `qk_norm_rope_cache_*`; every pointer covers the shape
        // checked above, and the kernel writes cache slots below `capacity` only.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: grid,
                block_dim: (32 * ROPE_WARPS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .w()?;
    }
    Ok(wrap(q_out, (batch, q_heads, tokens, head_dim)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{IndexOp, D};

    /// Runs wherever NVRTC loads (no GPU needed). The head dim is a kernel argument, so one
    /// compile covers every head dim; sm_80 is the oldest architecture of the bf16 fma.
    #[test]
    fn the_decode_kernels_compile_with_nvrtc() {
        for arch in [(8, 0), (9, 0)] {
            let cubin = nvrtc::compile_cubin(&SOURCE, &[], arch).unwrap();
            assert!(!cubin.is_empty(), "empty cubin for sm_{}{}", arch.0, arch.1);
        }
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        let values = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        let values = values.to_vec1::<f32>().unwrap();
        values.iter().map(|x| x.to_bits()).collect()
    }

    fn assert_same_bits(what: &str, got: &Tensor, want: &Tensor) {
        assert_eq!(got.dims(), want.dims(), "{what}: shapes differ");
        let (got, want) = (bits(got), bits(want));
        let differ = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        assert_eq!(
            differ,
            0,
            "{what}: {differ} of {} elements differ",
            want.len()
        );
    }

    fn randn(device: &Device, dtype: DType, shape: &[usize], mean: f32, sd: f32) -> Tensor {
        Tensor::randn(mean, sd, shape, device)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    const EPS: f64 = 1e-6;

    /// sdar.rs: `residual + o`, then `candle_nn::ops::rms_norm`.
    fn check_add_rms_norm(device: &Device, dtype: DType, hidden: usize) {
        let residual = randn(device, dtype, &[2, 3, hidden], 0., 2.);
        let delta = randn(device, dtype, &[2, 3, hidden], 0., 0.5);
        let weight = randn(device, dtype, &[hidden], 1., 0.2);
        let (sum, normed) = add_rms_norm(&residual, &delta, &weight, EPS).unwrap();
        let want_sum = (&residual + &delta).unwrap();
        let want_normed = candle_nn::ops::rms_norm(&want_sum, &weight, EPS as f32).unwrap();
        assert_same_bits(&format!("{dtype:?} sum {hidden}"), &sum, &want_sum);
        assert_same_bits(&format!("{dtype:?} normed {hidden}"), &normed, &want_normed);
    }

    /// sdar.rs: `silu_in_f32(gate) * up`, with gate and up separate and as the halves of one
    /// gate/up projection's rows.
    fn check_silu_mul(device: &Device, dtype: DType) {
        let gate_up = randn(device, dtype, &[2, 4, 2000], 0., 2.);
        let halves = (
            gate_up.narrow(2, 0, 1000).unwrap(),
            gate_up.narrow(2, 1000, 1000).unwrap(),
        );
        let separate = (halves.0.copy().unwrap(), halves.1.copy().unwrap());
        for (what, (gate, up)) in [("halves", &halves), ("separate", &separate)] {
            let silu = gate.to_dtype(DType::F32).unwrap().silu().unwrap();
            let want = silu.to_dtype(dtype).unwrap().mul(up).unwrap();
            let got = silu_mul(gate, up).unwrap();
            assert_same_bits(&format!("{dtype:?} silu_mul {what}"), &got, &want);
        }
    }

    /// sdar.rs: qk-norm, head transpose, `Rope` with per-row positions; the new K/V slots of
    /// the caches hold what the cache write would put there, and no other slot changes.
    fn check_qk_norm_rope_cache(device: &Device, dtype: DType, head_dim: usize, tokens: usize) {
        let what = format!("{dtype:?} D={head_dim} T={tokens}");
        let (batch, q_heads, kv_heads) = (3, 4, 2);
        let lens = [0u32, 7, 300];
        let capacity = 300 + tokens + 3;
        // q, k and v as the parts of one q/k/v projection's rows.
        let (q_width, kv_width) = (q_heads * head_dim, kv_heads * head_dim);
        let qkv = randn(
            device,
            dtype,
            &[batch, tokens, q_width + 2 * kv_width],
            0.,
            1.,
        );
        let q = qkv.narrow(2, 0, q_width).unwrap();
        let k = qkv.narrow(2, q_width, kv_width).unwrap();
        let v = qkv.narrow(2, q_width + kv_width, kv_width).unwrap();
        let q_norm = randn(device, dtype, &[head_dim], 1., 0.2);
        let k_norm = randn(device, dtype, &[head_dim], 1., 0.2);
        let inv_freq: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0 / 1e6f32.powf(2.0 * i as f32 / head_dim as f32))
            .collect();
        let inv_freq = Tensor::new(inv_freq, device).unwrap();
        let cache_shape = [batch, kv_heads, capacity, head_dim];
        let k_cache = randn(device, dtype, &cache_shape, 0., 1.);
        let v_cache = randn(device, dtype, &cache_shape, 0., 1.);
        let (k_before, v_before) = (k_cache.copy().unwrap(), v_cache.copy().unwrap());
        let lens_dev = Tensor::new(&lens, device).unwrap();
        let q_out = qk_norm_rope_cache(
            &q, &k, &v, &q_norm, &k_norm, &inv_freq, &lens_dev, EPS, &k_cache, &v_cache,
        )
        .unwrap();

        let positions: Vec<u32> = lens
            .iter()
            .flat_map(|&len| len..len + tokens as u32)
            .collect();
        let angles = Tensor::new(positions, device)
            .and_then(|p| p.reshape((batch, tokens))?.to_dtype(DType::F32))
            .and_then(|p| p.unsqueeze(D::Minus1)?.broadcast_mul(&inv_freq))
            .unwrap();
        let cos = angles.cos().unwrap().to_dtype(dtype).unwrap();
        let sin = angles.sin().unwrap().to_dtype(dtype).unwrap();
        let heads = |x: &Tensor| {
            let n = x.dim(2).unwrap() / head_dim;
            x.contiguous()
                .unwrap()
                .reshape((batch, tokens, n, head_dim))
                .unwrap()
        };
        let norm_rope = |x: &Tensor, norm: &Tensor| {
            let x = candle_nn::ops::rms_norm(&heads(x), norm, EPS as f32).unwrap();
            let x = x.transpose(1, 2).unwrap().contiguous().unwrap();
            candle_nn::rotary_emb::rope(&x, &cos, &sin).unwrap()
        };
        assert_same_bits(&format!("{what} q"), &q_out, &norm_rope(&q, &q_norm));
        let want_k = norm_rope(&k, &k_norm);
        let want_v = heads(&v).transpose(1, 2).unwrap().contiguous().unwrap();
        for (cache, before, want) in [
            (&k_cache, &k_before, &want_k),
            (&v_cache, &v_before, &want_v),
        ] {
            for (b, &len) in lens.iter().enumerate() {
                let (len, end) = (len as usize, len as usize + tokens);
                let slots = |t: &Tensor, from: usize, to: usize| {
                    t.i(b).unwrap().narrow(1, from, to - from).unwrap()
                };
                let new = slots(cache, len, end);
                assert_same_bits(&format!("{what} row {b} new"), &new, &want.i(b).unwrap());
                // Empty ranges are skipped: candle's CUDA ops fail on empty tensors.
                for (from, to) in [(0, len), (end, capacity)] {
                    if from < to {
                        assert_same_bits(
                            &format!("{what} row {b} untouched {from}..{to}"),
                            &slots(cache, from, to),
                            &slots(before, from, to),
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_token_s_head_vectors_spread_over_ctas_only_in_small_batches() {
        // SDAR-4B: 32 + 8 head vectors; batch 128 and batch 1, 4 tokens per row.
        assert_eq!(rope_head_ctas(40, 512), 1);
        assert_eq!(rope_head_ctas(40, 4), 5);
        assert_eq!(rope_head_ctas(1, 1), 1);
    }

    /// The fused kernels against the candle ops that the forward runs without them, bit for bit.
    #[test]
    #[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored"]
    fn the_decode_kernels_give_the_bits_of_candles_ops_on_a_gpu() {
        let device = Device::new_cuda(0).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            assert!(available(device.as_cuda_device().unwrap(), dtype, 128));
            for hidden in [64, 1000, 2560, 5128] {
                check_add_rms_norm(&device, dtype, hidden);
            }
            check_silu_mul(&device, dtype);
            for head_dim in [16, 128] {
                for tokens in [4, 8] {
                    check_qk_norm_rope_cache(&device, dtype, head_dim, tokens);
                }
            }
        }
    }
}
