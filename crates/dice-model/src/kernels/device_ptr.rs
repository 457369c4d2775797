//! Device addresses of tensors for our kernels' launches, each with the guard that records the
//! access on the stream once the launch is made.

use candle_core::cuda_backend::cudarc::driver::{
    sys::CUdeviceptr, CudaStream, DevicePtr, SyncOnDrop,
};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{bail, Layout, Result, Storage};

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
