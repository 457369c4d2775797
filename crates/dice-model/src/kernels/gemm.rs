//! A weight gradient summed over row chunks in f32 by cuBLAS itself: `sum += aᵀ b` as one
//! `cublasGemmEx` with bf16/f16 operands, an f32 output and β = 1. candle's matmul writes the
//! product in the operands' dtype, which a chunked gradient then cast to f32 and added to its
//! sum: for the loss head's `[vocab, hidden]` gradient (311M elements at 1.7B) two extra passes
//! over 1.2 GB per chunk, and a rounding of every chunk's product to bf16.

use super::device_ptr::tensor_ptr;
use candle_core::cuda_backend::cudarc::cublas::sys as cublas;
use candle_core::cuda_backend::cudarc::driver::sys::CUdeviceptr;
use candle_core::{bail, DType, Device, Result, Tensor};

/// Adds `aᵀ b` to `sum` in place: `a` `[rows, m]` and `b` `[rows, n]` contiguous, of one dtype
/// (bf16 or f16), `sum` a contiguous f32 `[m, n]` on the same device that nothing else reads
/// while the product runs (the caller's own running sum). Products in f32 (cuBLAS's
/// `CUBLAS_COMPUTE_32F`).
pub(crate) fn add_transposed_product(sum: &Tensor, a: &Tensor, b: &Tensor) -> Result<()> {
    let Device::Cuda(dev) = sum.device() else {
        bail!("the f32 gradient sum runs on CUDA devices only");
    };
    let ((rows, m), (rows_b, n)) = (a.dims2()?, b.dims2()?);
    if rows != rows_b || sum.dims() != [m, n] || sum.dtype() != DType::F32 {
        bail!(
            "a gradient sum [{m}, {n}] in f32 takes a [rows, {m}] and b [rows, {n}], got {:?}, \
             {:?} and {:?} {:?}",
            a.dims(),
            b.dims(),
            sum.dims(),
            sum.dtype()
        );
    }
    let operand_type = match (a.dtype(), b.dtype()) {
        (DType::BF16, DType::BF16) => cublas::cudaDataType::CUDA_R_16BF,
        (DType::F16, DType::F16) => cublas::cudaDataType::CUDA_R_16F,
        (x, y) => bail!(
            "the f32 gradient sum takes bf16 or f16 operands of one dtype, got {x:?} and {y:?}"
        ),
    };
    let int = |v: usize| {
        i32::try_from(v).map_err(|_| {
            candle_core::Error::Msg(format!(
                "{v} rows or columns are beyond cuBLAS's 32-bit sizes"
            ))
        })
    };
    let (rows, m, n) = (int(rows)?, int(m)?, int(n)?);
    if rows == 0 {
        return Ok(());
    }
    let stream = dev.cuda_stream();
    let (a_guard, b_guard, sum_guard) = (
        a.storage_and_layout(),
        b.storage_and_layout(),
        sum.storage_and_layout(),
    );
    let (a_ptr, _a_record) = tensor_ptr((&*a_guard.0, a_guard.1), "a", &stream)?;
    let (b_ptr, _b_record) = tensor_ptr((&*b_guard.0, b_guard.1), "b", &stream)?;
    let (sum_ptr, _sum_record) = tensor_ptr((&*sum_guard.0, sum_guard.1), "the sum", &stream)?;
    let (alpha, beta) = (1f32, 1f32);
    let ptr = |p: CUdeviceptr| p as *const std::ffi::c_void;
    let blas = dev.cublas_handle();
    // Column-major, as cuBLAS sees row-major buffers: the sum is [n, m] (ld n), b is [n, rows]
    // (ld n) and a is [m, rows] (ld m), so sumᵀ += b · aᵀ is (N, T) with k = rows.
    // SAFETY: the pointers address contiguous buffers of the dims checked above in the types
    // named; the handle runs on the tensors' stream (candle binds it there), on which the
    // guards record the accesses.
    let status = unsafe {
        cublas::cublasGemmEx(
            *blas.handle(),
            cublas::cublasOperation_t::CUBLAS_OP_N,
            cublas::cublasOperation_t::CUBLAS_OP_T,
            n,
            m,
            rows,
            (&alpha as *const f32).cast(),
            ptr(b_ptr),
            operand_type,
            n,
            ptr(a_ptr),
            operand_type,
            m,
            (&beta as *const f32).cast(),
            sum_ptr as *mut std::ffi::c_void,
            cublas::cudaDataType::CUDA_R_32F,
            n,
            cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    if status != cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        bail!("cuBLAS failed to add a gradient chunk in f32: {status:?}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunks added by cuBLAS in f32 against candle's product of the whole, in f32 from the same
    /// rounded operands: only the summation order differs.
    #[test]
    #[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored"]
    fn chunks_summed_in_f32_match_the_whole_product() {
        let device = crate::device::cuda_device(0).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let (rows, m, n) = (300, 517, 96);
            let a = Tensor::randn(0f32, 1.0, (rows, m), &device)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let b = Tensor::randn(0f32, 1.0, (rows, n), &device)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let sum = Tensor::zeros((m, n), DType::F32, &device).unwrap();
            for (start, len) in [(0, 128), (128, 128), (256, 44)] {
                let (a, b) = (
                    a.narrow(0, start, len).unwrap(),
                    b.narrow(0, start, len).unwrap(),
                );
                add_transposed_product(&sum, &a.contiguous().unwrap(), &b.contiguous().unwrap())
                    .unwrap();
            }
            let [a32, b32] = [&a, &b].map(|t| t.to_dtype(DType::F32).unwrap());
            let whole = a32.t().unwrap().matmul(&b32).unwrap();
            let error = (sum - &whole).unwrap().abs().unwrap().max_all().unwrap();
            let scale = whole.abs().unwrap().max_all().unwrap();
            let (error, scale) = (
                error.to_scalar::<f32>().unwrap(),
                scale.to_scalar::<f32>().unwrap(),
            );
            assert!(
                error <= 1e-4 * scale,
                "{dtype:?}: off by {error} of {scale}"
            );
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored"]
    fn mismatched_operands_are_refused() {
        let device = crate::device::cuda_device(0).unwrap();
        let a = Tensor::zeros((4, 3), DType::BF16, &device).unwrap();
        let b = Tensor::zeros((5, 2), DType::BF16, &device).unwrap();
        let sum = Tensor::zeros((3, 2), DType::F32, &device).unwrap();
        assert!(add_transposed_product(&sum, &a, &b).is_err());
        let b = Tensor::zeros((4, 2), DType::F16, &device).unwrap();
        assert!(add_transposed_product(&sum, &a, &b).is_err());
    }
}
