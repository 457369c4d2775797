//! Device addresses of tensors for our kernels' launches, each with the guard that records the
//! access on the stream once the launch is made, and a launch from tensors and scalars.

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{
    sys::CUdeviceptr, CudaFunction, CudaStream, DevicePtr, LaunchConfig, PushKernelArg, SyncOnDrop,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Device, Layout, Result, Shape, Storage, Tensor};

/// The device address of element `offset` of `slice`, with the guard that records the access
/// on `stream` when dropped (after the launch).
pub(super) fn slice_ptr<'a>(
    slice: &'a CudaStorageSlice,
    offset: usize,
    stream: &'a CudaStream,
) -> Result<(CUdeviceptr, SyncOnDrop<'a>)> {
    let ((ptr, record), element_bytes) = match slice {
        CudaStorageSlice::F32(s) => (s.device_ptr(stream), 4),
        CudaStorageSlice::BF16(s) => (s.device_ptr(stream), 2),
        CudaStorageSlice::F16(s) => (s.device_ptr(stream), 2),
        CudaStorageSlice::U32(s) => (s.device_ptr(stream), 4),
        CudaStorageSlice::F64(s) => (s.device_ptr(stream), 8),
        _ => bail!("the fused CUDA kernels take f32, bf16, f16, u32 or f64 tensors"),
    };
    Ok((ptr + (offset * element_bytes) as CUdeviceptr, record))
}

/// The device address of the first element of contiguous `tensor` (`what` names it in errors).
pub(super) fn tensor_ptr<'a>(
    (storage, layout): (&'a Storage, &Layout),
    what: &str,
    stream: &'a CudaStream,
) -> Result<(CUdeviceptr, SyncOnDrop<'a>)> {
    let Storage::Cuda(storage) = storage else {
        bail!("{what} is not on a CUDA device");
    };
    let Some((start, _)) = layout.contiguous_offsets() else {
        bail!("the fused CUDA kernels need {what} contiguous");
    };
    slice_ptr(&storage.slice, start, stream)
}

/// The device address of the first element of `tensor` and how many elements apart its rows
/// are, for a tensor whose rows (its last dim) are contiguous and evenly spaced: a contiguous
/// tensor, or a narrow of its last dim (q, k and v as parts of one projection's rows).
pub(super) fn rows_ptr<'a>(
    (storage, layout): (&'a Storage, &Layout),
    what: &str,
    stream: &'a CudaStream,
) -> Result<(CUdeviceptr, SyncOnDrop<'a>, usize)> {
    let Storage::Cuda(storage) = storage else {
        bail!("{what} is not on a CUDA device");
    };
    let (dims, strides) = (layout.dims(), layout.stride());
    let Some((&width, outer)) = dims.split_last() else {
        bail!("{what} has no rows");
    };
    let uneven = || {
        candle_core::Error::Msg(format!(
            "the fused CUDA kernels need {what} in evenly spaced contiguous rows, got dims \
             {dims:?} strides {strides:?}"
        ))
    };
    if width > 1 && strides[outer.len()] != 1 {
        return Err(uneven());
    }
    let (mut row_stride, mut rows_inside) = (None, 1);
    for (&d, &stride) in outer.iter().zip(strides).rev() {
        if d == 1 {
            continue;
        }
        let step = *row_stride.get_or_insert(stride);
        if stride != step * rows_inside {
            return Err(uneven());
        }
        rows_inside *= d;
    }
    let row_stride = row_stride.unwrap_or(width);
    if row_stride < width {
        return Err(uneven());
    }
    let (ptr, record) = slice_ptr(&storage.slice, layout.start_offset(), stream)?;
    Ok((ptr, record, row_stride))
}

/// A pointer argument of [`launch`].
#[derive(Clone, Copy)]
pub(super) enum Arg<'a> {
    /// A contiguous tensor (`what` names it in errors).
    Whole(&'a Tensor, &'static str),
    /// A tensor of evenly spaced contiguous rows ([`rows_ptr`]) that must lie `stride` elements
    /// apart, as the kernel is told.
    Rows(&'a Tensor, &'static str, usize),
    /// No tensor: a null pointer.
    Null,
}

impl Arg<'_> {
    pub(super) fn tensor(&self) -> Option<(&Tensor, &'static str)> {
        match self {
            Arg::Whole(t, what) | Arg::Rows(t, what, _) => Some((t, what)),
            Arg::Null => None,
        }
    }
}

/// A scalar argument of [`launch`], after the pointers.
pub(super) enum Scalar {
    I32(i32),
    U64(u64),
    F32(f32),
}

impl Scalar {
    /// A count or size as the kernels' `int`.
    pub(super) fn int(n: usize) -> Self {
        Scalar::I32(n as i32)
    }
}

/// Launches `function` with `config` on the stream of the tensors' device: the device addresses
/// of `tensors` (each access recorded on the stream once the launch is made), then `scalars`,
/// in order.
///
/// # Safety
/// The arguments must be the kernel's signature in order, and every tensor must have the shape
/// and dtype the kernel reads or writes through its address.
pub(super) unsafe fn launch(
    function: &CudaFunction,
    config: LaunchConfig,
    tensors: &[Arg],
    scalars: &[Scalar],
) -> Result<()> {
    let Some((first, _)) = tensors.iter().find_map(Arg::tensor) else {
        bail!("a kernel launch takes at least one tensor");
    };
    let Device::Cuda(dev) = first.device() else {
        bail!("our kernels run on CUDA devices only");
    };
    let stream = dev.cuda_stream();
    let guards: Vec<_> = tensors
        .iter()
        .map(|arg| arg.tensor().map(|(t, what)| (t.storage_and_layout(), what)))
        .collect();
    let mut ptrs: Vec<(CUdeviceptr, Option<SyncOnDrop>)> = Vec::with_capacity(guards.len());
    for (arg, guard) in tensors.iter().zip(&guards) {
        ptrs.push(match (arg, guard) {
            (Arg::Rows(_, _, want), Some(((storage, layout), what))) => {
                let (ptr, record, stride) = rows_ptr((storage, layout), what, &stream)?;
                if stride != *want {
                    bail!("{what} has rows {stride} apart, the kernel was given {want}");
                }
                (ptr, Some(record))
            }
            (_, Some(((storage, layout), what))) => {
                let (ptr, record) = tensor_ptr((storage, layout), what, &stream)?;
                (ptr, Some(record))
            }
            (_, None) => (0, None),
        });
    }
    let mut builder = stream.launch_builder(function);
    for (ptr, _) in &ptrs {
        builder.arg(ptr);
    }
    for scalar in scalars {
        match scalar {
            Scalar::I32(v) => builder.arg(v),
            Scalar::U64(v) => builder.arg(v),
            Scalar::F32(v) => builder.arg(v),
        };
    }
    // SAFETY: the caller's contract (above).
    unsafe { builder.launch(config) }.w()?;
    drop(ptrs);
    drop(guards);
    Ok(())
}

/// Uninitialised storage of `len` elements of `dtype` on `dev`, for an output that the kernel
/// given it writes whole before anything reads it.
pub(super) fn alloc(dev: &CudaDevice, dtype: DType, len: usize) -> Result<CudaStorage> {
    // SAFETY: every caller's kernel writes each element before the tensor is read.
    unsafe { dev.alloc_uninit(&Shape::from(len), dtype) }
}

/// A tensor of `shape` over freshly allocated `storage`.
pub(super) fn wrap(storage: CudaStorage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// An uninitialised contiguous tensor of `shape` and `dtype` on the CUDA `device`, for a
/// kernel's output that the kernel writes whole before anything reads it. Zeroing such an
/// output first is a pass of its own over the memory: the 1.7B training step's outputs are
/// about 1 GB a layer, ~10 ms a step at the memory's rate, and none of it shows among the
/// kernels Nsight Compute times.
pub(super) fn output(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
    let Device::Cuda(dev) = device else {
        bail!("kernel outputs are allocated on CUDA devices only");
    };
    let shape = shape.into();
    Ok(wrap(alloc(dev, dtype, shape.elem_count())?, shape))
}

/// [`output`] of `like`'s shape, dtype and device.
pub(super) fn output_like(like: &Tensor) -> Result<Tensor> {
    output(like.shape(), like.dtype(), like.device())
}
