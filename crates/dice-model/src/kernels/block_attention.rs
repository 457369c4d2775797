//! The fused attention of a cached forward (`block_attention.cu`): each row's new tokens (a
//! decoding block, or a prefill's blocks) over that row's KV cache, in one kernel (plus a small
//! merge when a row's keys are split over several CTAs), instead of matmul, f32 scores, mask,
//! softmax and matmul.
//!
//! The kernel is compiled with NVRTC (`nvrtc.rs`) once per device and head dim. Its semantics
//! are those of the matmul path with
//! [`crate::masks::cached_block_mask`]: every new token sees the cached prefix of its row and
//! the new tokens of its own and earlier blocks, scale `1/sqrt(head_dim)`, f32 softmax.
//!
//! bf16 and f16 run a tensor-core variant (mma.sync, sm_80 and newer); f32, and every dtype on
//! older GPUs, the CUDA-core one. `DICE_FUSED_ATTENTION=cuda-cores` takes the CUDA-core kernel
//! for every dtype; `DICE_FUSED_ATTENTION=0` turns the whole fused decoding forward off (candle's
//! ops only). Checked on the CPU against an emulation of CUDA (tests/block_attention_emulated.rs)
//! and on an H200 (golden generations token for token in f32, `tests/cuda.rs`).

use super::device_ptr::tensor_ptr;
use super::nvrtc::{self, dtype_index, PerDevice, Source};
use crate::config::SdarConfig;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    sys::{CUdevice_attribute, CUfunction_attribute},
    CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice, WrapErr};
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};
use std::sync::{Arc, OnceLock};

pub(super) const SOURCE: Source = Source {
    text: include_str!("block_attention.cu"),
    file_name: c"block_attention.cu",
    what: "the block attention kernel",
    arch_specific: false,
};

/// Threads per CTA, keys per tile (of the CUDA-core kernel, and per stage of the tensor-core one:
/// a key split is a whole number of them) and query rows per tile, as `block_attention.cu`
/// defines them.
const THREADS: u32 = 128;
const KEY_TILE: usize = 64;
const QUERY_TILE: usize = 16;

/// Head dims the kernel is built for (it keeps a whole key tile of f32 rows in shared memory).
const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// CTAs per SM the key split aims at: about one full wave (at head dim 128 on an H100 or H200,
/// the CUDA-core kernel's shared memory, 46.5 KiB, lets 4 run at once; the decoding tensor-core
/// kernel's registers, 3; the staged tensor-core kernels' 102 KiB, 2).
const CTAS_PER_SM: usize = 4;

/// Stages of 64 K and 64 V rows `block_attention_mma{2,4}_*` rotate through (`MMA_STAGES`):
/// with three, two are in flight while one is computed, and two CTAs fit an H100/H200 SM.
const MMA_STAGES: usize = 3;

/// Query tiles per CTA of the staged tensor-core kernels (`block_attention_mma{2,4}_*`); one
/// query tile takes `block_attention_mma_*`.
const MMA_Q_TILES: [usize; 2] = [2, 4];

/// Warps per CTA of the tensor-core kernels.
const WARPS: usize = THREADS as usize / 32;

/// Bytes of `keys` staged K and V rows of bf16/f16, each padded by 8 elements.
fn staged_kv_bytes(keys: usize, head_dim: usize) -> usize {
    2 * keys * (head_dim + 8) * 2
}

/// Dynamic shared memory of a tensor-core kernel staging `stage_bytes`: the stages, or, when
/// larger, the warps' f32 outputs for their merge, which reuses them.
fn with_merge(stage_bytes: usize, head_dim: usize) -> usize {
    stage_bytes.max(WARPS * QUERY_TILE * head_dim * 4)
}

/// Dynamic shared memory of `block_attention_mma{2,4}_*` (`MMA_SHARED_BYTES` in
/// `block_attention.cu`): [`MMA_STAGES`] stages of 64 K and 64 V rows.
fn mma_shared_bytes(head_dim: usize) -> usize {
    with_merge(MMA_STAGES * staged_kv_bytes(64, head_dim), head_dim)
}

/// Dynamic shared memory of `block_attention_mma_*` (`WARP_SHARED_BYTES`): per warp, two
/// stages of 16 K and 16 V rows.
fn warp_staged_shared_bytes(head_dim: usize) -> usize {
    with_merge(WARPS * 2 * staged_kv_bytes(16, head_dim), head_dim)
}

/// Query tiles per CTA of the tensor-core kernel for `queries` query rows per KV head (the
/// group's heads times the new tokens): the K/V stages are shared by as many tiles as the
/// forward has, up to four (a prefill).
fn mma_q_tiles(queries: usize) -> usize {
    let tiles = queries.div_ceil(QUERY_TILE);
    MMA_Q_TILES
        .into_iter()
        .rev()
        .find(|&t| t <= tiles)
        .unwrap_or(1)
}

/// The environment variable that selects the kernels (see the module docs).
const SWITCH: &str = "DICE_FUSED_ATTENTION";

/// Which attention kernels the process uses, from [`SWITCH`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The matmul path.
    Off,
    /// The CUDA-core kernel for every dtype.
    CudaCores,
    /// Tensor cores for bf16/f16 where the GPU has them, else the CUDA-core kernel.
    TensorCores,
}

fn mode() -> Mode {
    static MODE: OnceLock<Mode> = OnceLock::new();
    *MODE.get_or_init(|| match std::env::var(SWITCH).as_deref().map(str::trim) {
        Ok("0") => Mode::Off,
        Ok("cuda-cores") => Mode::CudaCores,
        _ => Mode::TensorCores,
    })
}

/// Whether the fused attention kernels (decoding's and training's) may run: not under
/// `DICE_FUSED_ATTENTION=0`.
pub(super) fn fused_attention_enabled() -> bool {
    mode() != Mode::Off
}

/// Compute capability from which the `block_attention_mma*` kernels exist (mma.sync with bf16).
const TENSOR_CORE_ARCH: (i32, i32) = (8, 0);

/// The kernels of one head dim, loaded on one device.
struct Loaded {
    /// `block_attention_{f32,bf16,f16}`, in the order of [`dtype_index`].
    attend: [CudaFunction; 3],
    /// The tensor-core kernels, on GPUs from [`TENSOR_CORE_ARCH`].
    attend_mma: Option<TensorCoreKernels>,
    /// `block_attention_combine_{f32,bf16,f16}`.
    combine: [CudaFunction; 3],
    multiprocessors: usize,
}

/// One tensor-core kernel in its two dtypes (bf16, f16), with the dynamic shared memory it is
/// launched with (and was allowed at load).
struct TensorCoreKernel {
    by_dtype: [CudaFunction; 2],
    shared_bytes: u32,
}

/// The tensor-core kernels.
struct TensorCoreKernels {
    /// `block_attention_mma_*`: one query tile per CTA, each warp streaming its own keys.
    decoding: TensorCoreKernel,
    /// `block_attention_mma{2,4}_*` with their query tiles per CTA ([`MMA_Q_TILES`]): query
    /// tiles sharing staged keys.
    staged: [(usize, TensorCoreKernel); 2],
}

impl TensorCoreKernels {
    /// The kernel for `queries` query rows per KV head ([`mma_q_tiles`]) and its query rows
    /// per CTA.
    fn for_queries(&self, queries: usize) -> (&TensorCoreKernel, usize) {
        let q_tiles = mma_q_tiles(queries);
        match self.staged.iter().find(|&&(t, _)| t == q_tiles) {
            Some((_, kernel)) => (kernel, q_tiles * QUERY_TILE),
            None => (&self.decoding, QUERY_TILE),
        }
    }
}

/// Kernels by device and head dim.
static LOADED: PerDevice<usize, Loaded> = PerDevice::new();

/// The kernels for `head_dim` on `dev`, compiled and loaded on first use. When NVRTC or the
/// driver cannot provide them, attention keeps running as matmuls, with one warning.
fn loaded(dev: &CudaDevice, head_dim: usize) -> Option<Arc<Loaded>> {
    LOADED.get(
        dev,
        head_dim,
        "fused attention unavailable, attention runs as matmuls",
        || load(dev, head_dim),
    )
}

pub(super) fn compile_options(head_dim: usize) -> [String; 2] {
    [
        format!("-DHEAD_DIM={head_dim}"),
        format!("-DMMA_STAGES={MMA_STAGES}"),
    ]
}

fn load(dev: &CudaDevice, head_dim: usize) -> anyhow::Result<Loaded> {
    let driver = nvrtc::driver_error(SOURCE.what);
    let arch = nvrtc::arch(dev, SOURCE.what)?;
    let module = nvrtc::load_module(dev, &SOURCE, &compile_options(head_dim))?;
    let function = |name: &str| module.load_function(name).map_err(&driver);
    let stream = dev.cuda_stream();
    let context = stream.context();
    Ok(Loaded {
        attend: nvrtc::by_dtype(&module, &SOURCE, "block_attention")?,
        attend_mma: if arch >= TENSOR_CORE_ARCH {
            // Past 48 KiB a kernel takes dynamic shared memory only once allowed to (a call on
            // the module's context, which cudarc does not make current for it).
            context.bind_to_thread().map_err(&driver)?;
            let kernel = |name: &str, shared_bytes: usize| -> anyhow::Result<TensorCoreKernel> {
                let by_dtype = [
                    function(&format!("{name}_bf16"))?,
                    function(&format!("{name}_f16"))?,
                ];
                for f in &by_dtype {
                    f.set_attribute(
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        shared_bytes as i32,
                    )
                    .map_err(&driver)?;
                }
                Ok(TensorCoreKernel {
                    by_dtype,
                    shared_bytes: shared_bytes as u32,
                })
            };
            let staged = |q_tiles: usize| -> anyhow::Result<(usize, TensorCoreKernel)> {
                let name = format!("block_attention_mma{q_tiles}");
                Ok((q_tiles, kernel(&name, mma_shared_bytes(head_dim))?))
            };
            Some(TensorCoreKernels {
                decoding: kernel("block_attention_mma", warp_staged_shared_bytes(head_dim))?,
                staged: [staged(MMA_Q_TILES[0])?, staged(MMA_Q_TILES[1])?],
            })
        } else {
            None
        },
        combine: nvrtc::by_dtype(&module, &SOURCE, "block_attention_combine")?,
        multiprocessors: context
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(&driver)? as usize,
    })
}

/// `(keys per chunk, chunks)` splitting the keys of a row so that `units` (row, KV head, query
/// tile) CTAs times the chunks fill `multiprocessors`; a chunk is a whole number of key tiles and
/// the longest row's last chunk is never empty.
fn split_keys(units: usize, max_keys: usize, multiprocessors: usize) -> (usize, usize) {
    let tiles = max_keys.div_ceil(KEY_TILE).max(1);
    let wanted = (CTAS_PER_SM * multiprocessors)
        .div_ceil(units.max(1))
        .clamp(1, tiles);
    let chunk_tiles = tiles.div_ceil(wanted);
    (chunk_tiles * KEY_TILE, tiles.div_ceil(chunk_tiles))
}

/// The fused attention of one cached forward: per-row lengths on the device and the launch
/// geometry, shared by every layer.
pub(crate) struct BlockAttention {
    /// The attention kernel of the planned dtype and kind, launched with `shared_mem_bytes` of
    /// dynamic shared memory, and the merge of a row's key splits.
    attend: CudaFunction,
    shared_mem_bytes: u32,
    combine: CudaFunction,
    /// The dtype of q, k and v the kernels were chosen for.
    dtype: DType,
    /// Committed length of each row, u32 `[B]` on the device: read by the kernel at launch,
    /// so a captured launch follows the lengths of each replay.
    lens: Tensor,
    /// Key slots of the longest row (at most): its cached length plus the new tokens.
    max_keys: usize,
    batch: usize,
    tokens: usize,
    block_size: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    q_tiles: usize,
    chunk_keys: usize,
    splits: usize,
}

impl BlockAttention {
    /// The fused kernel for a forward of `tokens` new tokens per row over rows of lengths `lens`
    /// (u32 `[B]` on the device, read at every launch) holding at most `max_keys` keys with the
    /// new tokens, or `None` when that forward takes the matmul path (not CUDA, an
    /// unsupported dtype or head dim, kernels that failed to build, `DICE_FUSED_ATTENTION=0`).
    pub(crate) fn plan(
        device: &Device,
        dtype: DType,
        cfg: &SdarConfig,
        lens: &Tensor,
        max_keys: usize,
        tokens: usize,
    ) -> anyhow::Result<Option<Self>> {
        let Device::Cuda(dev) = device else {
            return Ok(None);
        };
        anyhow::ensure!(
            lens.dtype() == DType::U32 && lens.rank() == 1,
            "block attention takes the rows' lengths as a u32 vector, got {:?} {:?}",
            lens.dtype(),
            lens.dims()
        );
        let batch = lens.dim(0)?;
        let supported = HEAD_DIMS.contains(&cfg.head_dim)
            && batch > 0
            && cfg
                .num_attention_heads
                .is_multiple_of(cfg.num_key_value_heads);
        let mode = mode();
        if !supported || mode == Mode::Off {
            return Ok(None);
        }
        let Some(index) = dtype_index(dtype) else {
            return Ok(None);
        };
        let Some(kernels) = loaded(dev, cfg.head_dim) else {
            return Ok(None);
        };
        let queries = cfg.num_attention_heads / cfg.num_key_value_heads * tokens;
        let (attend, shared_mem_bytes, tile_queries) = match &kernels.attend_mma {
            // `mma` has no f32 kernel: bf16 and f16 sit one place earlier than in `dtype_index`.
            Some(mma) if mode == Mode::TensorCores && dtype != DType::F32 => {
                let (kernel, tile_queries) = mma.for_queries(queries);
                (
                    kernel.by_dtype[index - 1].clone(),
                    kernel.shared_bytes,
                    tile_queries,
                )
            }
            _ => (kernels.attend[index].clone(), 0, QUERY_TILE),
        };
        let q_tiles = queries.div_ceil(tile_queries);
        let units = batch * cfg.num_key_value_heads * q_tiles;
        let (chunk_keys, splits) = split_keys(units, max_keys, kernels.multiprocessors);
        Ok(Some(Self {
            attend,
            shared_mem_bytes,
            combine: kernels.combine[index].clone(),
            dtype,
            lens: lens.clone(),
            max_keys,
            batch,
            tokens,
            block_size: cfg.block_size,
            q_heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            q_tiles,
            chunk_keys,
            splits,
        }))
    }

    /// The rows' lengths the kernels read (u32 `[B]` on the device).
    pub(crate) fn lens(&self) -> &Tensor {
        &self.lens
    }

    /// Attention of `q` `[B, Hq, T, Dh]` over one layer's cache `k`, `v` `[B, Hkv, capacity, Dh]`
    /// (the new tokens' K/V already written): `[B, T, Hq * Dh]`, as the matmul path returns.
    pub(crate) fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        q.contiguous()?.apply_op3_no_bwd(k, v, self)
    }

    /// Runs the planned kernels on q, k and v.
    fn launch<T: DeviceRepr>(
        &self,
        dev: &CudaDevice,
        (q, lq): (&CudaSlice<T>, &Layout),
        (k, lk): (&CudaSlice<T>, &Layout),
        (v, lv): (&CudaSlice<T>, &Layout),
        capacity: usize,
    ) -> Result<CudaSlice<T>> {
        let (q, k, v) = (view(q, lq, "q")?, view(k, lk, "k")?, view(v, lv, "v")?);
        let total_q = self.batch * self.q_heads * self.tokens;
        let partials = if self.splits > 1 {
            self.splits * total_q
        } else {
            1
        };
        // SAFETY: the kernels write every output element (and every partial the combine reads)
        // before anything reads it.
        let (out, part_acc, part_ml) = unsafe {
            (
                dev.alloc::<T>(total_q * self.head_dim)?,
                dev.alloc::<f32>(partials * self.head_dim)?,
                dev.alloc::<f32>(partials * 2)?,
            )
        };
        let int = |x: usize| x as i32;
        let (batch, q_heads, kv_heads, tokens) = (
            int(self.batch),
            int(self.q_heads),
            int(self.kv_heads),
            int(self.tokens),
        );
        let (block_size, capacity, q_tiles, chunk_keys, splits) = (
            int(self.block_size),
            int(capacity),
            int(self.q_tiles),
            int(self.chunk_keys),
            int(self.splits),
        );
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        let stream = dev.cuda_stream();
        let (lens_storage, lens_layout) = self.lens.storage_and_layout();
        let lens = tensor_ptr((&lens_storage, lens_layout), "lens", &stream)?;
        let mut attend = stream.launch_builder(&self.attend);
        attend
            .arg(&q)
            .arg(&k)
            .arg(&v)
            .arg(&lens.0)
            .arg(&out)
            .arg(&part_acc)
            .arg(&part_ml)
            .arg(&batch)
            .arg(&q_heads)
            .arg(&kv_heads)
            .arg(&tokens)
            .arg(&block_size)
            .arg(&capacity)
            .arg(&q_tiles)
            .arg(&chunk_keys)
            .arg(&splits)
            .arg(&scale);
        let grid = (
            (self.q_tiles * self.splits) as u32,
            self.kv_heads as u32,
            self.batch as u32,
        );
        // SAFETY: the arguments match the kernel's signature; the views cover every element the
        // kernel reads (checked by the caller against the shapes).
        unsafe {
            attend.launch(LaunchConfig {
                grid_dim: grid,
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: self.shared_mem_bytes,
            })
        }
        .w()?;
        if self.splits > 1 {
            let mut combine = stream.launch_builder(&self.combine);
            combine
                .arg(&part_acc)
                .arg(&part_ml)
                .arg(&out)
                .arg(&batch)
                .arg(&q_heads)
                .arg(&tokens)
                .arg(&splits);
            // SAFETY: as above; one CTA of head_dim threads per query row.
            unsafe {
                combine.launch(LaunchConfig {
                    grid_dim: (total_q as u32, 1, 1),
                    block_dim: (self.head_dim as u32, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .w()?;
        }
        Ok(out)
    }

    /// Checks q `[B, Hq, T, Dh]` and the cache `[B, Hkv, capacity, Dh]` against the plan (the
    /// longest row's keys must fit the capacity); returns the capacity.
    fn check_shapes(&self, q: &Layout, k: &Layout, v: &Layout) -> Result<usize> {
        let want_q = [self.batch, self.q_heads, self.tokens, self.head_dim];
        let (b, h, capacity, d) = k.shape().dims4()?;
        if q.dims() != want_q
            || [b, h, d] != [self.batch, self.kv_heads, self.head_dim]
            || v.dims() != k.dims()
            || capacity < self.max_keys
        {
            candle_core::bail!(
                "block attention planned for q {want_q:?} got q {:?}, k {:?}, v {:?}",
                q.dims(),
                k.dims(),
                v.dims()
            );
        }
        Ok(capacity)
    }
}

/// A contiguous view of a tensor's elements that starts on an 8-element boundary (the kernels
/// read up to 8 elements at a time).
fn view<'a, T>(slice: &'a CudaSlice<T>, layout: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    match layout.contiguous_offsets() {
        Some((start, end)) if start % 8 == 0 => Ok(slice.slice(start..end)),
        _ => candle_core::bail!("block attention needs {what} contiguous and 8-element aligned"),
    }
}

impl CustomOp3 for BlockAttention {
    fn name(&self) -> &'static str {
        "block-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the fused block attention runs on CUDA devices only")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        lq: &Layout,
        k: &CudaStorage,
        lk: &Layout,
        v: &CudaStorage,
        lv: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let capacity = self.check_shapes(lq, lk, lv)?;
        if q.dtype() != self.dtype {
            candle_core::bail!(
                "block attention planned for {:?} got q of {:?}",
                self.dtype,
                q.dtype()
            );
        }
        let dev = q.device();
        let slice = match (&q.slice, &k.slice, &v.slice) {
            (CudaStorageSlice::F32(q), CudaStorageSlice::F32(k), CudaStorageSlice::F32(v)) => {
                CudaStorageSlice::F32(self.launch(dev, (q, lq), (k, lk), (v, lv), capacity)?)
            }
            (CudaStorageSlice::BF16(q), CudaStorageSlice::BF16(k), CudaStorageSlice::BF16(v)) => {
                CudaStorageSlice::BF16(self.launch(dev, (q, lq), (k, lk), (v, lv), capacity)?)
            }
            (CudaStorageSlice::F16(q), CudaStorageSlice::F16(k), CudaStorageSlice::F16(v)) => {
                CudaStorageSlice::F16(self.launch(dev, (q, lq), (k, lk), (v, lv), capacity)?)
            }
            _ => candle_core::bail!(
                "block attention takes f32, bf16 or f16 q, k and v of one dtype, got {:?}, {:?}, {:?}",
                q.dtype(),
                k.dtype(),
                v.dtype()
            ),
        };
        let shape = Shape::from((self.batch, self.tokens, self.q_heads * self.head_dim));
        Ok((
            CudaStorage {
                slice,
                device: dev.clone(),
            },
            shape,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_row_splits_its_keys_over_the_gpu_and_a_full_batch_does_not() {
        // SDAR-4B decoding on an H200 (132 SMs): 8 KV heads, one query tile, 772 keys.
        assert_eq!(split_keys(8, 772, 132), (64, 13));
        assert_eq!(split_keys(128 * 8, 772, 132), (832, 1));
        for (units, keys) in [(8, 772), (64, 772), (200, 4096), (3, 1), (1000, 65)] {
            let (chunk, splits) = split_keys(units, keys, 132);
            assert_eq!(chunk % KEY_TILE, 0);
            assert!(chunk * splits >= keys && chunk * (splits - 1) < keys);
        }
    }

    #[test]
    fn the_tensor_core_ctas_fit_the_shared_memory_of_an_h200_sm() {
        // 228 KiB per SM, of which the driver reserves 1 KiB per CTA; the kernels' static
        // shared memory (the warps' running max and sum) is 512 bytes. Two staged CTAs per SM,
        // three decoding ones (as many as their registers allow).
        for (bytes, ctas) in [
            (mma_shared_bytes(128), 2),
            (warp_staged_shared_bytes(128), 3),
        ] {
            let per_cta = bytes + 512 + 1024;
            assert!(ctas * per_cta <= 228 * 1024, "{per_cta} bytes per CTA");
        }
    }

    #[test]
    fn a_cta_shares_its_stages_among_the_query_tiles_of_a_forward() {
        // SDAR-4B: 4 query heads per KV head; a decoding block, a store pass riding along, a
        // prefill.
        assert_eq!(mma_q_tiles(4 * 4), 1);
        assert_eq!(mma_q_tiles(4 * 8), 2);
        assert_eq!(mma_q_tiles(4 * 12), 2);
        assert_eq!(mma_q_tiles(4 * 512), 4);
        assert_eq!(mma_q_tiles(1), 1);
    }

    /// Runs wherever NVRTC loads (no GPU needed): the source must compile for every head dim.
    #[test]
    fn the_kernel_compiles_with_nvrtc_for_every_head_dim() {
        for head_dim in HEAD_DIMS {
            let cubin = nvrtc::compile_cubin(&SOURCE, &compile_options(head_dim), (9, 0)).unwrap();
            assert!(!cubin.is_empty(), "empty cubin for head dim {head_dim}");
        }
    }
}
