//! The fused element-wise steps of a training decoder layer (`train_layer.cu`), forward and
//! backward: RMSNorm (with the residual add before it, and the residual gradient added to its
//! input gradient), the q/k heads' RMSNorm + RoPE into head-major order, SwiGLU, and the loss
//! head's label log-softmax: [`LayerOps`] on CUDA. With cuBLAS GEMMs between them (candle's
//! matmul) they make the hand-written layer of `crate::sdar`'s training, which replaces the
//! composite ops and their autograd on CUDA.
//!
//! Norm weights' gradients come back as f32 sums over partial sums reduced in a fixed order.
//! Checked on the CPU against direct references through the CUDA emulation
//! (tests/it/train_layer_emulated.rs) and on the GPU against the composite step
//! (tests/it/cuda.rs, `dice bench golden`).

use super::device_ptr::{launch, output, output_like, Arg, Scalar};
use super::nvrtc::{self, dtype_index, PerDevice, Source};
use crate::config::SdarConfig;
use crate::layer_ops::{LayerOps, TokenGroups};
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, DType, Device, Result, Tensor, D};
use std::sync::Arc;

pub(super) const SOURCE: Source = Source {
    text: include_str!("train_layer.cu"),
    file_name: c"train_layer.cu",
    what: "the training layer kernels",
    arch_specific: false,
};

/// `ROW_WARPS`, `NORM_MAX_THREADS`, `FLAT_THREADS` and `HEAD_THREADS` of
/// `train_layer.cu`.
const ROW_WARPS: usize = 8;
const NORM_MAX_THREADS: usize = 1024;
const FLAT_THREADS: usize = 256;
const HEAD_THREADS: usize = 1024;
/// CTAs of the strided kernels (heads_backward, the log-softmax backward): enough to fill any current GPU a few
/// times over; heads_backward writes one partial norm gradient per warp of them.
const STRIDED_CTAS: usize = 1024;
/// Rows summed per partial sum of a norm weight's gradient.
const NORM_GRAD_CHUNK_ROWS: usize = 128;

/// The kernels of one dtype.
struct DtypeKernels {
    rms_norm_forward: CudaFunction,
    rms_norm_backward: CudaFunction,
    norm_weight_grad: CudaFunction,
    heads_forward: CudaFunction,
    heads_backward: CudaFunction,
    swiglu_forward: CudaFunction,
    swiglu_backward: CudaFunction,
    label_log_softmax: CudaFunction,
    label_log_softmax_backward: CudaFunction,
    embedding_backward: CudaFunction,
}

/// The kernels on one device, in the order of [`dtype_index`].
struct Loaded([DtypeKernels; 3]);

static LOADED: PerDevice<(), Loaded> = PerDevice::new();

fn load(dev: &CudaDevice) -> anyhow::Result<Loaded> {
    let module = nvrtc::load_module(dev, &SOURCE, &[])?;
    let kernels = |suffix: &str| -> anyhow::Result<DtypeKernels> {
        let function = |name: &str| {
            module
                .load_function(&format!("{name}_{suffix}"))
                .map_err(nvrtc::driver_error(SOURCE.what))
        };
        Ok(DtypeKernels {
            rms_norm_forward: function("rms_norm_forward")?,
            rms_norm_backward: function("rms_norm_backward")?,
            norm_weight_grad: function("norm_weight_grad")?,
            heads_forward: function("heads_forward")?,
            heads_backward: function("heads_backward")?,
            swiglu_forward: function("swiglu_forward")?,
            swiglu_backward: function("swiglu_backward")?,
            label_log_softmax: function("label_log_softmax")?,
            label_log_softmax_backward: function("label_log_softmax_backward")?,
            embedding_backward: function("embedding_backward")?,
        })
    };
    Ok(Loaded([kernels("f32")?, kernels("bf16")?, kernels("f16")?]))
}

/// Whether training layers take the fused kernels where they can: `DICE_FUSED_LAYER=0` keeps
/// candle's composite ops and autograd (to compare the two in one binary).
fn fused_layer_enabled() -> bool {
    std::env::var("DICE_FUSED_LAYER").map_or(true, |v| v != "0")
}

/// The training layer's kernels for one dtype on one CUDA device.
pub(crate) struct TrainLayer {
    kernels: Arc<Loaded>,
    slot: usize,
    dtype: DType,
}

impl TrainLayer {
    /// The kernels for `dtype` on `device`, or `None` where layers keep the composite path
    /// (not CUDA, an odd head dim, kernels that failed to build,
    /// `DICE_FUSED_LAYER=0`).
    pub(crate) fn plan(
        device: &Device,
        dtype: DType,
        cfg: &SdarConfig,
    ) -> anyhow::Result<Option<Self>> {
        let Device::Cuda(dev) = device else {
            return Ok(None);
        };
        let Some(slot) = dtype_index(dtype) else {
            return Ok(None);
        };
        // RoPE pairs the halves of a head.
        if !cfg.head_dim.is_multiple_of(2) || !fused_layer_enabled() {
            return Ok(None);
        }
        let Some(kernels) = LOADED.get(
            dev,
            (),
            "fused training layer unavailable, training layers run as candle ops",
            || load(dev),
        ) else {
            return Ok(None);
        };
        Ok(Some(Self {
            kernels,
            slot,
            dtype,
        }))
    }

    fn kernels(&self) -> &DtypeKernels {
        &self.kernels.0[self.slot]
    }

    /// Launches `function` on `grid` CTAs of `threads` with the pointer arguments `tensors`
    /// (values of the kernels' dtype, f32 statistics, u32 labels) followed by `scalars`.
    fn launch(
        &self,
        function: &CudaFunction,
        (grid, threads): ((usize, usize), usize),
        tensors: &[Arg],
        scalars: &[Scalar],
    ) -> Result<()> {
        for (t, what) in tensors.iter().filter_map(Arg::tensor) {
            if t.dtype() != self.dtype && !matches!(t.dtype(), DType::F32 | DType::U32) {
                bail!(
                    "{what} is {:?}, the kernels run {:?}",
                    t.dtype(),
                    self.dtype
                );
            }
        }
        let config = LaunchConfig {
            grid_dim: (grid.0 as u32, grid.1 as u32, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every caller passes the pointers and scalars of its kernel's signature in
        // order, for tensors of the shapes that kernel reads and writes (checked by the caller).
        unsafe { launch(function, config, tensors, scalars) }
    }

    /// Rows and width of a 2-d tensor of the kernels' dtype.
    fn rows(&self, x: &Tensor, what: &str) -> Result<(usize, usize)> {
        if x.dtype() != self.dtype {
            bail!(
                "{what} is {:?}, the kernels run {:?}",
                x.dtype(),
                self.dtype
            );
        }
        x.dims2()
    }

    fn row_grid(rows: usize) -> ((usize, usize), usize) {
        ((rows.div_ceil(ROW_WARPS), 1), 32 * ROW_WARPS)
    }

    /// The grid of the RMSNorm kernels: a CTA per row, a thread per 16-byte pack of it
    /// (train_layer.cu `rms_norm_forward_row`), rounded up to whole warps.
    fn norm_grid(rows: usize, n: usize, dtype: DType) -> ((usize, usize), usize) {
        let packs = n.div_ceil(16 / dtype.size_in_bytes());
        ((rows, 1), (32 * packs.div_ceil(32)).min(NORM_MAX_THREADS))
    }

    fn norm_forward(
        &self,
        a: &Tensor,
        b: Option<&Tensor>,
        w: &Tensor,
        eps: f64,
    ) -> Result<(Option<Tensor>, Tensor, Tensor)> {
        let (rows, n) = self.rows(a, "the normed rows")?;
        if w.dims() != [n] || b.is_some_and(|b| b.dims() != a.dims()) {
            bail!("RMSNorm of [{rows}, {n}] rows takes a weight of [{n}] and a residual like them");
        }
        let y = output_like(a)?;
        let rstd = output(rows, DType::F32, a.device())?;
        let sum = b.map(|_| output_like(a)).transpose()?;
        let (b_arg, sum_arg) = match (b, &sum) {
            (Some(b), Some(sum)) => (Arg::Whole(b, "the residual"), Arg::Whole(sum, "the sum")),
            _ => (Arg::Null, Arg::Null),
        };
        self.launch(
            &self.kernels().rms_norm_forward,
            Self::norm_grid(rows, n, a.dtype()),
            &[
                Arg::Whole(a, "the normed rows"),
                b_arg,
                sum_arg,
                Arg::Whole(w, "the norm weight"),
                Arg::Whole(&y, "the normed output"),
                Arg::Whole(&rstd, "rstd"),
            ],
            &[Scalar::int(n), Scalar::F32(eps as f32)],
        )?;
        Ok((sum, y, rstd))
    }

    fn check_norm(
        &self,
        w: &Tensor,
        [cos, sin]: [&Tensor; 2],
        tokens: usize,
        head_dim: usize,
    ) -> Result<()> {
        let table = [tokens, head_dim / 2];
        if w.dims() != [head_dim] || cos.dims() != table || sin.dims() != table {
            bail!(
                "the head norm of [{tokens}, {head_dim}] rows takes a weight of [{head_dim}] and \
                 rotary tables of {table:?}"
            );
        }
        Ok(())
    }

    /// How many elements apart the rows of `x` are.
    fn row_stride(&self, x: &Tensor) -> Result<usize> {
        let (_, width) = x.dims2()?;
        let stride = x.stride()[0];
        if x.stride()[1] != 1 || stride < width {
            bail!("the training layer kernels need rows of contiguous elements");
        }
        Ok(stride)
    }

    fn strided_grid() -> ((usize, usize), usize) {
        ((STRIDED_CTAS, 1), FLAT_THREADS)
    }

    /// The grid of the kernels over [rows, width] by packs of up to 8 values (train_layer.cu
    /// `over_row_packs`): x over the columns, y over the rows (at most CUDA's 65,535; the
    /// kernel strides past them).
    fn row_pack_grid(rows: usize, width: usize) -> ((usize, usize), usize) {
        (
            (width.div_ceil(8 * FLAT_THREADS), rows.clamp(1, 65_535)),
            FLAT_THREADS,
        )
    }
}

impl LayerOps for TrainLayer {
    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
        let (_, y, rstd) = self.norm_forward(x, None, w, eps)?;
        Ok((y, rstd))
    }

    fn add_rms_norm(
        &self,
        a: &Tensor,
        b: &Tensor,
        w: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (sum, y, rstd) = self.norm_forward(a, Some(b), w, eps)?;
        let sum = sum.expect("a residual add returns its sum");
        Ok((sum, y, rstd))
    }

    fn rms_norm_backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
        d_residual: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let (rows, n) = self.rows(x, "the normed rows")?;
        if dy.dims() != x.dims() || rstd.dims() != [rows] || w.dims() != [n] {
            bail!("the RMSNorm backward of [{rows}, {n}] rows got mismatched shapes");
        }
        let dx = output_like(x)?;
        let residual = match d_residual {
            Some(d) if d.dims() == x.dims() => Arg::Whole(d, "the residual gradient"),
            Some(_) => bail!("the residual gradient must be [{rows}, {n}]"),
            None => Arg::Null,
        };
        self.launch(
            &self.kernels().rms_norm_backward,
            Self::norm_grid(rows, n, x.dtype()),
            &[
                Arg::Whole(x, "the normed rows"),
                Arg::Whole(w, "the norm weight"),
                Arg::Whole(rstd, "rstd"),
                Arg::Whole(dy, "the output gradient"),
                residual,
                Arg::Whole(&dx, "the input gradient"),
            ],
            &[Scalar::int(n)],
        )?;
        let chunks = rows.div_ceil(NORM_GRAD_CHUNK_ROWS);
        let partial = output((chunks, n), DType::F32, x.device())?;
        self.launch(
            &self.kernels().norm_weight_grad,
            ((n.div_ceil(FLAT_THREADS), chunks), FLAT_THREADS),
            &[
                Arg::Whole(x, "the normed rows"),
                Arg::Whole(rstd, "rstd"),
                Arg::Whole(dy, "the output gradient"),
                Arg::Whole(&partial, "the partial weight gradients"),
            ],
            &[
                Scalar::int(rows),
                Scalar::int(n),
                Scalar::int(NORM_GRAD_CHUNK_ROWS),
            ],
        )?;
        Ok((dx, partial.sum(0)?))
    }

    fn heads_forward(
        &self,
        src: &Tensor,
        norm: Option<(&Tensor, [&Tensor; 2])>,
        heads: usize,
        eps: f64,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (tokens, width) = self.rows(src, "the projection's rows")?;
        let head_dim = width / heads;
        let ld = self.row_stride(src)?;
        let out = output((1, heads, tokens, head_dim), self.dtype, src.device())?;
        let rows = tokens * heads;
        let rstd = norm
            .map(|_| output(rows, DType::F32, src.device()))
            .transpose()?;
        let (w, cos, sin, rstd_arg) = match (norm, &rstd) {
            (Some((w, [cos, sin])), Some(rstd)) => {
                self.check_norm(w, [cos, sin], tokens, head_dim)?;
                (
                    Arg::Whole(w, "the head norm weight"),
                    Arg::Whole(cos, "cos"),
                    Arg::Whole(sin, "sin"),
                    Arg::Whole(rstd, "rstd"),
                )
            }
            _ => (Arg::Null, Arg::Null, Arg::Null, Arg::Null),
        };
        self.launch(
            &self.kernels().heads_forward,
            Self::row_grid(rows),
            &[
                Arg::Rows(src, "the projection's rows", ld),
                w,
                cos,
                sin,
                Arg::Whole(&out, "the heads"),
                rstd_arg,
            ],
            &[
                Scalar::int(ld),
                Scalar::int(tokens),
                Scalar::int(heads),
                Scalar::int(head_dim),
                Scalar::F32(eps as f32),
            ],
        )?;
        Ok((out, rstd))
    }

    fn heads_gradient_rows(&self, like: &Tensor) -> Result<Tensor> {
        output_like(like)
    }

    fn heads_backward(
        &self,
        d_heads: &Tensor,
        src: &Tensor,
        norm: Option<(&Tensor, &Tensor, [&Tensor; 2])>,
        d_rows: &Tensor,
        column: usize,
    ) -> Result<Option<Tensor>> {
        let (tokens, width) = self.rows(src, "the projection's rows")?;
        let (_, heads, _, head_dim) = d_heads.dims4()?;
        let ld = self.row_stride(src)?;
        if d_heads.dims() != [1, heads, tokens, head_dim] || heads * head_dim != width {
            bail!(
                "the heads backward of [{tokens}, {width}] rows got a gradient of {:?}",
                d_heads.dims()
            );
        }
        let (_, d_ld) = self.rows(d_rows, "the gradient rows")?;
        if d_rows.dims()[0] != tokens || !d_rows.is_contiguous() || column + width > d_ld {
            bail!(
                "the heads backward writes [{tokens}, {width}] at column {column} of contiguous \
                 rows, not into {:?}",
                d_rows.dims()
            );
        }
        let d_src = d_rows.narrow(1, column, width)?;
        let partial_rows = STRIDED_CTAS * ROW_WARPS;
        let partial = norm
            .map(|_| Tensor::zeros((partial_rows, head_dim), DType::F32, src.device()))
            .transpose()?;
        let (w, rstd, cos, sin, partial_arg) = match (norm, &partial) {
            (Some((w, rstd, [cos, sin])), Some(partial)) => {
                self.check_norm(w, [cos, sin], tokens, head_dim)?;
                if rstd.dims() != [tokens * heads] {
                    bail!(
                        "the heads backward takes the forward's rstd of [{}]",
                        tokens * heads
                    );
                }
                (
                    Arg::Whole(w, "the head norm weight"),
                    Arg::Whole(rstd, "rstd"),
                    Arg::Whole(cos, "cos"),
                    Arg::Whole(sin, "sin"),
                    Arg::Whole(partial, "the partial weight gradients"),
                )
            }
            _ => (Arg::Null, Arg::Null, Arg::Null, Arg::Null, Arg::Null),
        };
        self.launch(
            &self.kernels().heads_backward,
            ((STRIDED_CTAS, 1), 32 * ROW_WARPS),
            &[
                Arg::Whole(&d_heads.contiguous()?, "the heads' gradient"),
                Arg::Rows(src, "the projection's rows", ld),
                w,
                rstd,
                cos,
                sin,
                Arg::Rows(&d_src, "the projection's gradient rows", d_ld),
                partial_arg,
            ],
            &[
                Scalar::int(ld),
                Scalar::int(d_ld),
                Scalar::int(tokens),
                Scalar::int(heads),
                Scalar::int(head_dim),
            ],
        )?;
        partial.map(|p| p.sum(0)).transpose()
    }

    fn swiglu(&self, gate_up: &Tensor) -> Result<Tensor> {
        let (rows, width) = self.rows(gate_up, "the gate and up rows")?;
        let inter = width / 2;
        let act = output((rows, inter), self.dtype, gate_up.device())?;
        self.launch(
            &self.kernels().swiglu_forward,
            Self::row_pack_grid(rows, inter),
            &[
                Arg::Whole(gate_up, "the gate and up rows"),
                Arg::Whole(&act, "the gated rows"),
            ],
            &[Scalar::int(rows), Scalar::int(inter)],
        )?;
        Ok(act)
    }

    fn swiglu_backward(&self, gate_up: &Tensor, d_act: &Tensor) -> Result<Tensor> {
        let (rows, width) = self.rows(gate_up, "the gate and up rows")?;
        let inter = width / 2;
        if d_act.dims() != [rows, inter] || d_act.dim(D::Minus1)? * 2 != width {
            bail!("the SwiGLU backward takes a gradient of [{rows}, {inter}]");
        }
        let d_gate_up = output_like(gate_up)?;
        self.launch(
            &self.kernels().swiglu_backward,
            Self::row_pack_grid(rows, inter),
            &[
                Arg::Whole(gate_up, "the gate and up rows"),
                Arg::Whole(d_act, "the gated rows' gradient"),
                Arg::Whole(&d_gate_up, "the gate and up gradient"),
            ],
            &[Scalar::int(rows), Scalar::int(inter)],
        )?;
        Ok(d_gate_up)
    }

    fn label_log_softmax(&self, logits: &Tensor, labels: &Tensor) -> Result<(Tensor, Tensor)> {
        let (rows, vocab) = self.rows(logits, "the logits")?;
        if labels.dims() != [rows] || labels.dtype() != DType::U32 {
            bail!("the label log-softmax of {rows} rows takes u32 labels of [{rows}]");
        }
        let lse = output(rows, DType::F32, logits.device())?;
        let log_prob = output_like(&lse)?;
        self.launch(
            &self.kernels().label_log_softmax,
            ((rows, 1), HEAD_THREADS),
            &[
                Arg::Whole(logits, "the logits"),
                Arg::Whole(&labels.contiguous()?, "the labels"),
                Arg::Whole(&lse, "the log-sum-exp"),
                Arg::Whole(&log_prob, "the log-probabilities"),
            ],
            &[Scalar::int(vocab)],
        )?;
        Ok((lse, log_prob))
    }

    fn label_log_softmax_backward(
        &self,
        logits: Tensor,
        labels: &Tensor,
        lse: &Tensor,
        d_log_prob: &Tensor,
    ) -> Result<Tensor> {
        let (rows, vocab) = self.rows(&logits, "the logits")?;
        if lse.dims() != [rows] || d_log_prob.dims() != [rows] || d_log_prob.dtype() != DType::F32 {
            bail!("the label log-softmax backward of {rows} rows takes f32 [{rows}] statistics");
        }
        self.launch(
            &self.kernels().label_log_softmax_backward,
            Self::strided_grid(),
            &[
                Arg::Whole(&logits, "the logits"),
                Arg::Whole(&labels.contiguous()?, "the labels"),
                Arg::Whole(lse, "the log-sum-exp"),
                Arg::Whole(&d_log_prob.contiguous()?, "the log-probabilities' gradient"),
            ],
            &[Scalar::int(rows), Scalar::int(vocab)],
        )?;
        Ok(logits)
    }

    fn embedding_backward(
        &self,
        tokens: &[u32],
        upstream: &Tensor,
        vocab: usize,
    ) -> Result<Tensor> {
        let (positions, hidden) = self.rows(upstream, "the embedding rows' gradient")?;
        if tokens.len() != positions || tokens.iter().any(|&t| t as usize >= vocab) {
            bail!("the embedding backward takes {positions} tokens below {vocab}");
        }
        let device = upstream.device();
        let dst = Tensor::zeros((vocab, hidden), DType::F32, device)?;
        if positions == 0 {
            return Ok(dst);
        }
        let groups = TokenGroups::new(tokens);
        let upload = |values: &[u32]| Tensor::new(values, device);
        self.launch(
            &self.kernels().embedding_backward,
            ((groups.unique.len(), 1), FLAT_THREADS),
            &[
                Arg::Whole(&upstream.contiguous()?, "the embedding rows' gradient"),
                Arg::Whole(&upload(&groups.order)?, "the positions by token"),
                Arg::Whole(&upload(&groups.unique)?, "the distinct tokens"),
                Arg::Whole(&upload(&groups.starts)?, "the tokens' first positions"),
                Arg::Whole(&dst, "the embedding gradient"),
            ],
            &[Scalar::int(hidden)],
        )?;
        Ok(dst)
    }

    fn accumulate_at_b(&self, sum: &mut Option<Tensor>, a: &Tensor, b: &Tensor) -> Result<()> {
        if !matches!(a.dtype(), DType::BF16 | DType::F16) {
            return crate::layer_ops::accumulate(sum, &a.t()?.matmul(b)?);
        }
        let total = match sum {
            Some(total) => total,
            None => sum.insert(Tensor::zeros(
                (a.dim(1)?, b.dim(1)?),
                DType::F32,
                a.device(),
            )?),
        };
        super::gemm::add_transposed_product(total, &a.contiguous()?, &b.contiguous()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs wherever NVRTC loads (no GPU needed): the source must compile.
    #[test]
    fn the_kernels_compile_with_nvrtc() {
        let cubin = nvrtc::compile_cubin(&SOURCE, &[], (9, 0)).unwrap();
        assert!(!cubin.is_empty());
    }
}
