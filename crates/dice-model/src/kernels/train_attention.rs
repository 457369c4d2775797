//! The fused attention of training (`train_attention.cu`): forward with the log-sum-exp kept,
//! and backward (dQ, dK, dV), FlashAttention-2 style on tensor cores, for one packed sequence
//! whose every query sees at most two ranges of keys ([`KeySpans`]: the two-stream SFT mask
//! of every packed sample at once). No score, probability or mask tensor exists in device
//! memory, and key tiles that no query of a tile sees are skipped, which halves the work of the
//! two-stream mask's dense form.
//!
//! bf16 and f16 on sm_80 and newer, and f32 there by kernels without tensor cores (for the
//! fused path at f32's precision, not for speed: the formula golden's f32 rule on the GPU);
//! other GPUs and `DICE_FUSED_ATTENTION=0` keep the composite path ([`TrainAttention::plan`]
//! gives `None`). The backward keeps dS for dQ unless `DICE_ATTENTION_KEEP_DS=0`
//! ([`KEEP_DS_SWITCH`]). Checked on the CPU against an f64 attention and its gradients through
//! the CUDA emulation (tests/it/train_attention_emulated.rs) and on the GPU against the golden
//! and the composite path (`dice bench golden`'s `sft-step/…`, tests/it/cuda.rs).

use super::block_attention::fused_attention_enabled;
use super::device_ptr::{launch, output, output_like, Arg, Scalar};
use super::nvrtc::{self, PerDevice, Source};
use crate::config::SdarConfig;
use crate::masks::KeySpans;
use candle_core::cuda_backend::cudarc::driver::{
    sys::CUfunction_attribute, CudaFunction, LaunchConfig,
};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Result, Tensor};
use std::sync::{Arc, OnceLock};

pub(super) const SOURCE: Source = Source {
    text: include_str!("train_attention.cu"),
    file_name: c"train_attention.cu",
    what: "the training attention kernels",
    arch_specific: true,
};

/// Threads per CTA, as `train_attention.cu` defines them.
const THREADS: u32 = 128;
/// Rows per tile (`TILE`).
const TILE: usize = KeySpans::TILE;

/// Head dims the kernels are built for.
const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Compute capability from which the kernels exist (mma.sync with bf16).
const TENSOR_CORE_ARCH: (i32, i32) = (8, 0);

/// Halves of one staged tile of 64 rows (`TILE_HALVES`), in the larger of the kernels' two
/// layouts (rows padded by 8 halves; the wgmma path's swizzled rows are not padded).
fn tile_halves(head_dim: usize) -> usize {
    TILE * (head_dim + 8)
}

/// Dynamic shared memory of `train_attention_dkdv_*` (`DKDV_SHARED_BYTES`): the key tile's K and
/// V, and two buffers of a query tile's Q, dO, spans, lse and delta (the next one's copy in
/// flight while the warps compute on the other), each rounded up to 1,024 bytes.
fn dkdv_shared_bytes(head_dim: usize) -> usize {
    let query_buffer =
        (2 * tile_halves(head_dim) * 2 + TILE * (4 * 4 + 4 + 4)).next_multiple_of(1024);
    2 * tile_halves(head_dim) * 2 + 2 * query_buffer
}

/// Dynamic shared memory of `train_attention_forward_*` and `train_attention_dq_*`
/// (`KEY_PIPELINE_SHARED_BYTES`): two K and two V tiles, the next pair's copy in flight while the
/// warps compute on the other.
fn key_pipeline_shared_bytes(head_dim: usize) -> usize {
    4 * tile_halves(head_dim) * 2
}

/// Query heads of one GQA group that a CTA of `train_attention_dq_from_ds_*` takes at once when
/// the group's size is a multiple of it, as `train_attention.cu` defines `DQ_FROM_DS_MAX_HEADS`
/// (the grid and the shared memory below follow it): their K tile is staged once.
const DQ_FROM_DS_MAX_HEADS: usize = 2;

/// Query heads a CTA of `train_attention_dq_from_ds_*` takes (`dq_from_ds_heads`): its grid is
/// (query tiles, Hq / this).
fn dq_from_ds_heads(q_heads: usize, kv_heads: usize) -> usize {
    if (q_heads / kv_heads).is_multiple_of(DQ_FROM_DS_MAX_HEADS) {
        DQ_FROM_DS_MAX_HEADS
    } else {
        1
    }
}

/// Dynamic shared memory of `train_attention_dq_from_ds_*` (`DQ_FROM_DS_SHARED_BYTES`): two
/// buffers of a K tile and a 64 × 64 dS tile per query head it takes at most, the next pair's
/// copy in flight while the warps compute on the other.
fn dq_from_ds_shared_bytes(head_dim: usize) -> usize {
    2 * (tile_halves(head_dim) + DQ_FROM_DS_MAX_HEADS * TILE * TILE) * 2
}

/// The environment variable that chooses how the backward makes dQ. By default the dK/dV kernel
/// also stores every dS tile it computes (`train_attention_dkdv_keep_ds_*`, in a buffer of
/// [`TilePairs::ds_elements`] allocated by each backward call) and dQ is then one product a tile
/// pair from them (`train_attention_dq_from_ds_*`): on an H100 the 1.7B step's attention backward
/// took 143.6 -> 128.7 ms, 4B's 365.3 -> 328.2 (bench/notes/train-h200.md, session 29). At `0`
/// the dQ kernel recomputes S and dP instead (`train_attention_dq_*`, before dK/dV), which needs
/// no dS buffer: 8 KiB a visible tile pair and query head, about 1.2 GB a layer's backward at
/// 1.7B and 6,144-token rows, growing with the square of the row. Read once, when the kernels are
/// first loaded.
const KEEP_DS_SWITCH: &str = "DICE_ATTENTION_KEEP_DS";

fn keep_ds() -> bool {
    static KEEP_DS: OnceLock<bool> = OnceLock::new();
    *KEEP_DS.get_or_init(|| std::env::var(KEEP_DS_SWITCH).map_or(true, |v| v.trim() != "0"))
}

/// The four kernels of one dtype, and the two that keep dS unless [`KEEP_DS_SWITCH`] turns them
/// off (bf16 and f16; f32 has none).
struct DtypeKernels {
    forward: CudaFunction,
    delta: CudaFunction,
    dq: CudaFunction,
    dkdv: CudaFunction,
    keep_ds: Option<KeepDsKernels>,
}

/// The backward that keeps dS: dK/dV storing dS, then dQ from it.
struct KeepDsKernels {
    dkdv: CudaFunction,
    dq: CudaFunction,
}

/// The kernels of one head dim on one device: bf16, f16, then f32.
struct Loaded([DtypeKernels; 3]);

static LOADED: PerDevice<usize, Loaded> = PerDevice::new();

pub(super) fn compile_options(head_dim: usize) -> [String; 1] {
    [format!("-DHEAD_DIM={head_dim}")]
}

fn load(dev: &CudaDevice, head_dim: usize) -> anyhow::Result<Loaded> {
    let driver = nvrtc::driver_error(SOURCE.what);
    let module = nvrtc::load_module(dev, &SOURCE, &compile_options(head_dim))?;
    // Past 48 KiB a kernel takes dynamic shared memory only once allowed to (a call on the
    // module's context, which cudarc does not make current for it).
    dev.cuda_stream()
        .context()
        .bind_to_thread()
        .map_err(&driver)?;
    // f32's kernels are loaded as the others (their allowance of dynamic shared memory goes
    // unused: `TrainAttention::launch` gives them none).
    let kernels = |dtype: &str, keeps_ds: bool| -> anyhow::Result<DtypeKernels> {
        let function = |name: &str| {
            module
                .load_function(&format!("train_attention_{name}_{dtype}"))
                .map_err(&driver)
        };
        let with_shared = |name: &str, bytes: usize| -> anyhow::Result<CudaFunction> {
            let kernel = function(name)?;
            kernel
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
                .map_err(&driver)?;
            Ok(kernel)
        };
        Ok(DtypeKernels {
            forward: with_shared("forward", key_pipeline_shared_bytes(head_dim))?,
            delta: function("delta")?,
            dq: with_shared("dq", key_pipeline_shared_bytes(head_dim))?,
            dkdv: with_shared("dkdv", dkdv_shared_bytes(head_dim))?,
            keep_ds: if keeps_ds && keep_ds() {
                Some(KeepDsKernels {
                    dkdv: with_shared("dkdv_keep_ds", dkdv_shared_bytes(head_dim))?,
                    dq: with_shared("dq_from_ds", dq_from_ds_shared_bytes(head_dim))?,
                })
            } else {
                None
            },
        })
    };
    Ok(Loaded([
        kernels("bf16", true)?,
        kernels("f16", true)?,
        kernels("f32", false)?,
    ]))
}

/// The fused training attention of one packed sequence: its spans on the device and the
/// kernels of its dtype, shared by every layer.
pub(crate) struct TrainAttention {
    kernels: Arc<Loaded>,
    /// 0 for bf16, 1 for f16, 2 for f32.
    dtype_slot: usize,
    dtype: DType,
    /// u32 `[T, 4]`, `[T / 64, 8]` (`KeySpans::tile_bounds`) and `[2, T / 64]`
    /// (`KeySpans::tile_orders`) on the device.
    spans: Tensor,
    tile_spans: Tensor,
    tile_order: Tensor,
    /// Where the backward keeps dS (its kernels loaded, some tile pair visible).
    tile_pairs: Option<TilePairs>,
    tokens: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// The numbered tile pairs of a sequence ([`KeySpans::tile_pairs`]), where the backward that
/// keeps dS stores each pair's dS.
struct TilePairs {
    /// u32 `[T / 64, T / 64]` on the device.
    index: Tensor,
    count: usize,
}

impl TilePairs {
    /// The pairs of tile bounds `bounds` of `tokens` queries, on `device`; `None` where no pair
    /// is visible (no dS to keep: the default kernels take the sequence).
    fn new(bounds: &[[u32; 8]], tokens: usize, device: &Device) -> Result<Option<Self>> {
        let (index, count) = KeySpans::tile_pairs(bounds, tokens);
        if count == 0 {
            return Ok(None);
        }
        let tiles = bounds.len();
        Ok(Some(Self {
            index: Tensor::from_vec(index, (tiles, tiles), device)?,
            count,
        }))
    }

    /// Elements of the dS buffer `[pairs, Hq, 64, 64]` (16-bit) for `q_heads` query heads.
    fn ds_elements(&self, q_heads: usize) -> usize {
        self.count * q_heads * TILE * TILE
    }
}

impl TrainAttention {
    /// The fused kernels for a sequence of `spans` in `dtype` on `device`, or `None` where
    /// attention keeps the composite path (not CUDA, a GPU before sm_80, an unsupported
    /// head dim, kernels that failed to build, `DICE_FUSED_ATTENTION=0`).
    pub(crate) fn plan(
        device: &Device,
        dtype: DType,
        cfg: &SdarConfig,
        spans: &KeySpans,
    ) -> anyhow::Result<Option<Self>> {
        if spans.tokens() == 0 {
            return Ok(None);
        }
        let Some((kernels, dtype_slot)) = Self::kernels_for(device, dtype, cfg)? else {
            return Ok(None);
        };
        fn flat<const N: usize>(rows: &[[u32; N]], device: &Device) -> Result<Tensor> {
            Tensor::from_iter(rows.iter().flatten().copied(), device)?.reshape((rows.len(), N))
        }
        let bounds = spans.tile_bounds();
        let [query_order, key_order] = KeySpans::tile_orders(&bounds);
        let tiles = bounds.len();
        let tile_pairs = match kernels.0[dtype_slot].keep_ds {
            Some(_) => TilePairs::new(&bounds, spans.tokens(), device)?,
            None => None,
        };
        Ok(Some(Self {
            kernels,
            dtype_slot,
            dtype,
            spans: flat(spans.rows(), device)?,
            tile_spans: flat(&bounds, device)?,
            tile_order: Tensor::from_iter(query_order.into_iter().chain(key_order), device)?
                .reshape((2, tiles))?,
            tile_pairs,
            tokens: spans.tokens(),
            q_heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        }))
    }

    /// Whether [`TrainAttention::plan`] takes sequences of key spans on `device` in `dtype`
    /// for a model of `cfg` (the kernels are built on first use).
    pub(crate) fn available(
        device: &Device,
        dtype: DType,
        cfg: &SdarConfig,
    ) -> anyhow::Result<bool> {
        Ok(Self::kernels_for(device, dtype, cfg)?.is_some())
    }

    /// The kernels and their dtype's slot where the device, dtype and config have them.
    fn kernels_for(
        device: &Device,
        dtype: DType,
        cfg: &SdarConfig,
    ) -> anyhow::Result<Option<(Arc<Loaded>, usize)>> {
        let Device::Cuda(dev) = device else {
            return Ok(None);
        };
        let dtype_slot = match dtype {
            DType::BF16 => 0,
            DType::F16 => 1,
            DType::F32 => 2,
            _ => return Ok(None),
        };
        let supported = HEAD_DIMS.contains(&cfg.head_dim)
            && cfg
                .num_attention_heads
                .is_multiple_of(cfg.num_key_value_heads)
            && fused_attention_enabled();
        if !supported || nvrtc::arch(dev, SOURCE.what)? < TENSOR_CORE_ARCH {
            return Ok(None);
        }
        let kernels = LOADED.get(
            dev,
            cfg.head_dim,
            "fused training attention unavailable, training attention runs as matmuls",
            || load(dev, cfg.head_dim),
        );
        Ok(kernels.map(|kernels| (kernels, dtype_slot)))
    }

    fn kernels(&self) -> &DtypeKernels {
        &self.kernels.0[self.dtype_slot]
    }

    /// `x` contiguous, checked to have the planned dtype and the dims `want`.
    fn check(&self, what: &str, x: &Tensor, want: &[usize]) -> Result<Tensor> {
        if x.dims() != want || x.dtype() != self.dtype {
            candle_core::bail!(
                "the training attention planned {what} as {:?} {want:?}, got {:?} {:?}",
                self.dtype,
                x.dtype(),
                x.dims()
            );
        }
        x.contiguous()
    }

    /// q, k and v contiguous, checked against the plan.
    fn check_qkv(&self, [q, k, v]: [&Tensor; 3]) -> Result<[Tensor; 3]> {
        let heads = |h: usize| [1, h, self.tokens, self.head_dim];
        Ok([
            self.check("q", q, &heads(self.q_heads))?,
            self.check("k", k, &heads(self.kv_heads))?,
            self.check("v", v, &heads(self.kv_heads))?,
        ])
    }

    /// The scalars that end the kernels' signatures: `tokens, q_heads` (all four), then
    /// `kv_heads, scale` (all but the delta kernel).
    fn sizes(&self) -> [Scalar; 4] {
        [
            Scalar::int(self.tokens),
            Scalar::int(self.q_heads),
            Scalar::int(self.kv_heads),
            Scalar::F32(1.0 / (self.head_dim as f32).sqrt()),
        ]
    }

    /// Launches `function` on `grid` CTAs of [`THREADS`] with `shared_mem_bytes` of dynamic
    /// shared memory, taking the addresses of `tensors` (contiguous), then `scalars`.
    ///
    /// # Safety
    /// The arguments must be the kernel's signature in order, for tensors of the shapes it reads
    /// and writes, and `shared_mem_bytes` no more than was allowed at load.
    unsafe fn launch(
        &self,
        function: &CudaFunction,
        (grid, shared_mem_bytes): ((usize, usize), usize),
        tensors: &[Arg],
        scalars: &[Scalar],
    ) -> Result<()> {
        // f32's kernels use no shared memory: reserving the tensor-core kernels' for them would
        // only cut how many of their CTAs an SM holds.
        let shared_mem_bytes = if self.dtype == DType::F32 {
            0
        } else {
            shared_mem_bytes
        };
        let config = LaunchConfig {
            grid_dim: (grid.0 as u32, grid.1 as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: shared_mem_bytes as u32,
        };
        // SAFETY: the caller's contract.
        unsafe { launch(function, config, tensors, scalars) }
    }

    /// Attention of `q` `[1, Hq, T, Dh]` over `k`, `v` `[1, Hkv, T, Dh]`: the output
    /// `[1, T, Hq * Dh]` (as the composite path returns it) and the log-sum-exp of every
    /// query's scaled scores, f32 `[Hq, T]`, which [`TrainAttention::backward`] takes.
    pub(crate) fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let [q, k, v] = self.check_qkv([q, k, v])?;
        let device = q.device();
        let out = output(
            (1, self.tokens, self.q_heads * self.head_dim),
            self.dtype,
            device,
        )?;
        let lse = output((self.q_heads, self.tokens), DType::F32, device)?;
        // SAFETY: q, k, v, out and lse have the planned shapes (checked above) and are
        // contiguous, spans cover the T queries; the dynamic shared memory was allowed at load.
        unsafe {
            self.launch(
                &self.kernels().forward,
                (
                    (self.tokens.div_ceil(TILE), self.q_heads),
                    key_pipeline_shared_bytes(self.head_dim),
                ),
                &[
                    Arg::Whole(&q, "q"),
                    Arg::Whole(&k, "k"),
                    Arg::Whole(&v, "v"),
                    Arg::Whole(&self.spans, "spans"),
                    Arg::Whole(&self.tile_spans, "tile spans"),
                    Arg::Whole(&self.tile_order, "tile order"),
                    Arg::Whole(&out, "out"),
                    Arg::Whole(&lse, "lse"),
                ],
                &self.sizes(),
            )
        }?;
        Ok((out, lse))
    }

    /// Gradients of [`TrainAttention::forward`] with respect to q, k and v, for its output
    /// `out` and log-sum-exp `lse` and the output gradient `d_out` `[1, T, Hq * Dh]`.
    pub(crate) fn backward(
        &self,
        [q, k, v]: [&Tensor; 3],
        out: &Tensor,
        lse: &Tensor,
        d_out: &Tensor,
    ) -> Result<[Tensor; 3]> {
        let [q, k, v] = self.check_qkv([q, k, v])?;
        let rows = [1, self.tokens, self.q_heads * self.head_dim];
        let (out, d_out) = (
            self.check("the output", out, &rows)?,
            self.check("the output gradient", d_out, &rows)?,
        );
        if lse.dims() != [self.q_heads, self.tokens] || lse.dtype() != DType::F32 {
            candle_core::bail!(
                "the training attention's log-sum-exp must be f32 [{}, {}], got {:?} {:?}",
                self.q_heads,
                self.tokens,
                lse.dtype(),
                lse.dims()
            );
        }
        let device = q.device();
        let delta = output((self.q_heads, self.tokens), DType::F32, device)?;
        let (dq, dk, dv) = (output_like(&q)?, output_like(&k)?, output_like(&v)?);
        let lse = lse.contiguous()?;
        let kernels = self.kernels();
        let q_tiles = self.tokens.div_ceil(TILE);
        let warps = (THREADS / 32) as usize;
        // SAFETY: one warp per (query, head) row of out and d_out, both [T, Hq * Dh]; delta
        // holds Hq * T floats.
        unsafe {
            self.launch(
                &kernels.delta,
                (((self.tokens * self.q_heads).div_ceil(warps), 1), 0),
                &[
                    Arg::Whole(&out, "the output"),
                    Arg::Whole(&d_out, "the output gradient"),
                    Arg::Whole(&delta, "delta"),
                ],
                &self.sizes()[..2],
            )
        }?;
        // dQ and dK/dV read the same tensors, then write their gradients.
        let inputs = [
            Arg::Whole(&q, "q"),
            Arg::Whole(&k, "k"),
            Arg::Whole(&v, "v"),
            Arg::Whole(&d_out, "the output gradient"),
            Arg::Whole(&self.spans, "spans"),
            Arg::Whole(&self.tile_spans, "tile spans"),
            Arg::Whole(&self.tile_order, "tile order"),
            Arg::Whole(&lse, "lse"),
            Arg::Whole(&delta, "delta"),
        ];
        if let (Some(keep_ds), Some(pairs)) = (&kernels.keep_ds, &self.tile_pairs) {
            self.gradients_keeping_ds(keep_ds, pairs, &inputs, &k, [&dq, &dk, &dv])?;
            return Ok([dq, dk, dv]);
        }
        // SAFETY: the arguments match the kernels' signatures and the checked shapes; the
        // dynamic shared memory was allowed at load.
        unsafe {
            self.launch(
                &kernels.dq,
                (
                    (q_tiles, self.q_heads),
                    key_pipeline_shared_bytes(self.head_dim),
                ),
                &[&inputs[..], &[Arg::Whole(&dq, "dq")]].concat(),
                &self.sizes(),
            )?;
            self.launch(
                &kernels.dkdv,
                ((q_tiles, self.kv_heads), dkdv_shared_bytes(self.head_dim)),
                &[&inputs[..], &[Arg::Whole(&dk, "dk"), Arg::Whole(&dv, "dv")]].concat(),
                &self.sizes(),
            )
        }?;
        Ok([dq, dk, dv])
    }

    /// The backward that keeps dS ([`KEEP_DS_SWITCH`]): dK/dV, storing every dS tile
    /// in a buffer of this call, then dQ from the stored tiles and `k`. `inputs` are the default
    /// kernels'.
    fn gradients_keeping_ds(
        &self,
        kernels: &KeepDsKernels,
        pairs: &TilePairs,
        inputs: &[Arg],
        k: &Tensor,
        [dq, dk, dv]: [&Tensor; 3],
    ) -> Result<()> {
        let len = pairs.ds_elements(self.q_heads);
        // Left uninitialised: the dK/dV kernel writes every tile that the dQ kernel reads (those
        // of the numbered pairs, for every query head).
        let ds = output(len, self.dtype, dq.device())?;
        let q_tiles = self.tokens.div_ceil(TILE);
        // SAFETY: the arguments match the kernels' signatures and the checked shapes; ds holds
        // a 64 × 64 tile per numbered pair and query head; the dynamic shared memory was allowed
        // at load. dQ runs after dK/dV, on the same stream.
        unsafe {
            self.launch(
                &kernels.dkdv,
                ((q_tiles, self.kv_heads), dkdv_shared_bytes(self.head_dim)),
                &[
                    inputs,
                    &[
                        Arg::Whole(&pairs.index, "tile pairs"),
                        Arg::Whole(dk, "dk"),
                        Arg::Whole(dv, "dv"),
                        Arg::Whole(&ds, "dS"),
                    ],
                ]
                .concat(),
                &self.sizes(),
            )?;
            self.launch(
                &kernels.dq,
                (
                    (
                        q_tiles,
                        self.q_heads / dq_from_ds_heads(self.q_heads, self.kv_heads),
                    ),
                    dq_from_ds_shared_bytes(self.head_dim),
                ),
                &[
                    Arg::Whole(k, "k"),
                    Arg::Whole(&ds, "dS"),
                    Arg::Whole(&self.tile_spans, "tile spans"),
                    Arg::Whole(&self.tile_order, "tile order"),
                    Arg::Whole(&pairs.index, "tile pairs"),
                    Arg::Whole(dq, "dq"),
                ],
                &self.sizes(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs wherever NVRTC loads (no GPU needed): the source must compile for every head dim.
    #[test]
    fn the_kernels_compile_with_nvrtc_for_every_head_dim() {
        for head_dim in HEAD_DIMS {
            let cubin = nvrtc::compile_cubin(&SOURCE, &compile_options(head_dim), (9, 0)).unwrap();
            assert!(!cubin.is_empty(), "empty cubin for head dim {head_dim}");
        }
    }
}
