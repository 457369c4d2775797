// The AdamW update of dice-train's optimizer on CUDA, one pass over a tensor's elements in place:
// the f32 moments, the f32 master weights (or the weights themselves when they are f32) and the
// compute weights rounded from them; and the sums of squares of a gradient for its norm
// (crates/dice-model/src/kernels/optim.rs launches them).
//
// Every operation is rounded on its own (__f*_rn: no fused multiply-add), in the order of the
// host update in crates/dice-train/src/optim.rs (which follows torch's single-tensor AdamW,
// candle's scalar `affine` x·a + b kept with its + 0), so that the GPU's update is the CPU's
// bit for bit.

#include "half.cuh"

#define ADAMW_THREADS 256

template <typename T>
__device__ void adamw_step(T* __restrict__ weight, float* __restrict__ master,
                           float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                           const float* __restrict__ grad, unsigned long long n,
                           int scales_grad, float grad_factor, int decays, float decay,
                           float one_minus_beta1, float beta2, float one_minus_beta2,
                           float bias_correction2_sqrt, float eps, float neg_step_size) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * ADAMW_THREADS + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * ADAMW_THREADS) {
        // g ← g·c + 0 (clipping's coefficient, as the gradient is read)
        const float g = scales_grad ? __fadd_rn(__fmul_rn(grad[i], grad_factor), 0.0f) : grad[i];
        float m = exp_avg[i], v = exp_avg_sq[i];
        // m ← m + ((g − m)·(1 − β1) + 0); v ← (v·β2 + 0) + (g·(1 − β2) + 0)·g
        m = __fadd_rn(m, __fadd_rn(__fmul_rn(__fsub_rn(g, m), one_minus_beta1), 0.0f));
        v = __fadd_rn(__fadd_rn(__fmul_rn(v, beta2), 0.0f),
                      __fmul_rn(__fadd_rn(__fmul_rn(g, one_minus_beta2), 0.0f), g));
        float p = master ? master[i] : to_float(weight[i]);
        if (decays) p = __fadd_rn(__fmul_rn(p, decay), 0.0f);
        // p ← p + (m·(−step) + 0) / ((√v / bc2)·1 + ε)
        const float denom =
            __fadd_rn(__fmul_rn(__fdiv_rn(__fsqrt_rn(v), bias_correction2_sqrt), 1.0f), eps);
        p = __fadd_rn(p, __fdiv_rn(__fadd_rn(__fmul_rn(m, neg_step_size), 0.0f), denom));
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        if (master) master[i] = p;
        weight[i] = from_float<T>(p);
    }
}

#define SQUARE_SUM_THREADS 256

// Σ x² of the n elements of x in f64, one partial sum per block: each thread adds the squares
// of its elements (block b's thread t: b·256 + t, strided by the grid) in f64, in order (an f32
// value's square is exact in f64), then the block's 256 sums are added as a tree; the caller
// adds the partials in block order. One read of the gradient in its own dtype, where candle's
// ops wrote and read f64 copies of it several times.
template <typename T>
__device__ void square_sums(const T* __restrict__ x, double* __restrict__ partial,
                            unsigned long long n) {
    __shared__ double sums[SQUARE_SUM_THREADS];
    double sum = 0.0;
    for (unsigned long long i = (unsigned long long)blockIdx.x * SQUARE_SUM_THREADS + threadIdx.x;
         i < n; i += (unsigned long long)gridDim.x * SQUARE_SUM_THREADS) {
        const double value = (double)to_float(x[i]);
        sum += value * value;
    }
    sums[threadIdx.x] = sum;
    __syncthreads();
    for (int half = SQUARE_SUM_THREADS / 2; half > 0; half /= 2) {
        if ((int)threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = sums[0];
}

#define OPTIM_OPS(TYPE, SUFFIX)                                                                   \
    extern "C" __global__ void __launch_bounds__(ADAMW_THREADS) adamw_step_##SUFFIX(              \
        TYPE* weight, float* master, float* exp_avg, float* exp_avg_sq, const float* grad,        \
        unsigned long long n, int scales_grad, float grad_factor, int decays, float decay,        \
        float one_minus_beta1, float beta2, float one_minus_beta2, float bias_correction2_sqrt,   \
        float eps, float neg_step_size) {                                                         \
        adamw_step<TYPE>(weight, master, exp_avg, exp_avg_sq, grad, n, scales_grad, grad_factor,  \
                         decays, decay, one_minus_beta1, beta2, one_minus_beta2,                  \
                         bias_correction2_sqrt, eps, neg_step_size);                              \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(SQUARE_SUM_THREADS)                              \
        square_sums_##SUFFIX(const TYPE* x, double* partial, unsigned long long n) {              \
        square_sums<TYPE>(x, partial, n);                                                         \
    }

OPTIM_OPS(float, f32)
OPTIM_OPS(bf16_t, bf16)
OPTIM_OPS(f16_t, f16)
