// Fused element-wise steps of the decoding forward of dice's SDAR model
// (crates/dice-model/src/kernels/decode_ops.rs launches them): residual add + RMSNorm, SiLU-gate,
// qk-norm + RoPE + KV-cache write, and the greedy and sampled selections over the logits.
//
// Compiled at run time with NVRTC; bf16 and f16 are raw 16-bit values (half.cuh).
//
// The numerics are those of the candle 0.11 CUDA kernels the unfused forward runs, rounding for
// rounding, so that the fused path is a drop-in:
// - rmsnorm (reduce.cu): f32 sum of squares accumulated with fma, per thread over columns
//   tid, tid + blockDim, ..., then a butterfly over the warp and, for blocks of more than 32
//   threads, once more over the warps' sums; blockDim is 32 below 1024 columns, else 1024 (as
//   candle-nn launches it), so the f32 sum is added in the same order. Then
//   rsqrtf(sum / n + eps) and T(scale * x * w).
// - a T add or multiply (binary.cu) is one correctly rounded operation; here it is done in f32
//   and rounded to T, which gives the same value (f32 carries more than 2p + 2 bits of a bf16 or
//   f16 significand, so the double rounding is innocuous).
// - silu (unary.cu, in f32): x / (1 + expf(-x)), written as candle writes it so that NVVM
//   produces the same instruction sequence (it folds the last step of expf and the + 1 into an
//   fma).
// - rope (reduce.cu): candle writes x1 * c - x2 * s and x1 * s + x2 * c in T; ptxas contracts
//   each into one fma with the product of x2 rounded to T first (seen in the SASS of candle's
//   rope_{f32,bf16,f16} for sm_90). The same operations are spelled out here with explicit
//   rounding, so that no compiler can choose otherwise.

#include "half.cuh"
#include "warp.cuh"

// T(a * b + c), rounded once, as the fma ptxas makes of candle's T expressions.
__device__ __forceinline__ float fma_round(float a, float b, float c, float*) {
    return fmaf(a, b, c);
}
#ifdef __CUDA_ARCH__
__device__ __forceinline__ bf16_t fma_round(float a, float b, float c, bf16_t*) {
    // a, b and c are values of T, so these conversions are exact.
    unsigned short ab = from_float<bf16_t>(a).bits, bb = from_float<bf16_t>(b).bits,
                   cb = from_float<bf16_t>(c).bits;
    bf16_t r;
#if __CUDA_ARCH__ >= 800
    asm("fma.rn.bf16 %0, %1, %2, %3;" : "=h"(r.bits) : "h"(ab), "h"(bb), "h"(cb));
#else
    // No bf16 fma before sm_80 (candle's bf16 kernels take other paths there too): rounded twice.
    r = from_float<bf16_t>(fmaf(a, b, c));
#endif
    return r;
}
__device__ __forceinline__ f16_t fma_round(float a, float b, float c, f16_t*) {
    unsigned short ah = from_float<f16_t>(a).bits, bh = from_float<f16_t>(b).bits,
                   ch = from_float<f16_t>(c).bits;
    f16_t r;
    asm("fma.rn.f16 %0, %1, %2, %3;" : "=h"(r.bits) : "h"(ah), "h"(bh), "h"(ch));
    return r;
}
#else
// On the CPU: a * b is exact in double, so a * b + c is (unless c is below 2^-53 of the product,
// which test data never is); rounding it to odd at f32 precision and then to nearest even at T's
// rounds it once to T.
template <typename T> T fma_round(float a, float b, float c, T*) {
    double exact = (double)a * (double)b + (double)c;
    float f = (float)exact;
    if ((double)f != exact) {
        if (fabs((double)f) > fabs(exact)) f = nextafterf(f, 0.f);
        f = __uint_as_float(__float_as_uint(f) | 1u);
    }
    return from_float<T>(f);
}
#endif

// The second step of candle's block reduction: the butterfly over the 32 warps' sums, which
// warp_sums holds once the block has synchronised. Every thread gets the sum.
__device__ __forceinline__ float sum_of_warp_sums(const float* warp_sums) {
    __syncthreads();
    return warp_sum(warp_sums[threadIdx.x % 32]);
}

// The sum of `x` over the block, as candle's rmsnorm reduces it (see the top of the file);
// blockDim.x is 32 or 1024. Every thread gets the sum.
__device__ __forceinline__ float block_sum(float x) {
    __shared__ float warp_sums[32];
    x = warp_sum(x);
    if (blockDim.x > 32) {
        if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = x;
        x = sum_of_warp_sums(warp_sums);
    }
    return x;
}

// T(residual + delta); the normed value T(scale * x * weight) of x (that sum, or a q/k head).
template <typename T> __device__ __forceinline__ T add_rounded(T residual, T delta) {
    return from_float<T>(__fadd_rn(to_float(residual), to_float(delta)));
}

template <typename T> __device__ __forceinline__ T scaled(float scale, T x, T weight) {
    return from_float<T>(__fmul_rn(__fmul_rn(scale, to_float(x)), to_float(weight)));
}

// One row of `hidden` columns per CTA: sum = T(residual + delta); normed = rmsnorm(sum) * weight.
template <typename T>
__device__ void add_rms_norm(const T* __restrict__ residual, const T* __restrict__ delta,
                             const T* __restrict__ weight, T* __restrict__ sum_out,
                             T* __restrict__ normed_out, int hidden, float eps) {
    const size_t row = (size_t)blockIdx.x * hidden;
    float squares = 0.f;
    for (int col = threadIdx.x; col < hidden; col += blockDim.x) {
        const T sum = add_rounded(residual[row + col], delta[row + col]);
        sum_out[row + col] = sum;
        const float x = to_float(sum);
        squares = fmaf(x, x, squares);
    }
    const float mean = block_sum(squares) / hidden;
    const float scale = rsqrtf(mean + eps);
    for (int col = threadIdx.x; col < hidden; col += blockDim.x)
        normed_out[row + col] =
            scaled(scale, add_rounded(residual[row + col], delta[row + col]), weight[col]);
}

// add_rms_norm of rows of 1024 columns or more (where candle reduces with 1024 threads) with an
// eighth of the threads, adding the f32 sum of squares in candle's order all the same. Thread
// tid of WIDE_THREADS stands for candle's threads 8 tid + j (j < 8): lanes 8 (tid % 4) + j of
// candle's warp tid / 4, owning columns 8 tid + j + 1024 k, so that its columns of one k are
// contiguous (one 16-byte access of bf16/f16). candle's warp butterfly pairs lanes with masks 16
// and 8 (the same j in the other threads of tid's quad: lane masks 2 and 1), then 4, 2 and 1
// (j's of one thread); then come the 32 warps' sums, as in block_sum. Needs hidden % 8 == 0
// and every row 16-byte aligned (decode_ops.rs takes add_rms_norm otherwise).
#define WIDE_THREADS 128
#define WIDE_COLS 8
static_assert(WIDE_THREADS * WIDE_COLS == 1024 && 32 / WIDE_COLS == 4,
              "add_rms_norm_wide stands for candle's 1024 threads in quads of 8 lanes each");

template <typename T> struct alignas(16) Octet {
    T v[WIDE_COLS];
};

// The columns of WIDE_BATCH steps of WIDE_STEP (candle's 1024 threads) are loaded at once: one
// memory round trip for rows of up to 4096 columns, instead of one per step.
#define WIDE_STEP (WIDE_COLS * WIDE_THREADS)
#define WIDE_BATCH 4

template <typename T>
__device__ __forceinline__ void load_octets(const T* __restrict__ src, int col, int hidden,
                                            Octet<T> (&dst)[WIDE_BATCH]) {
    for (int b = 0; b < WIDE_BATCH; ++b)
        if (col + b * WIDE_STEP < hidden)
            dst[b] = *reinterpret_cast<const Octet<T>*>(src + col + b * WIDE_STEP);
}

template <typename T>
__device__ void add_rms_norm_wide(const T* __restrict__ residual, const T* __restrict__ delta,
                                  const T* __restrict__ weight, T* __restrict__ sum_out,
                                  T* __restrict__ normed_out, int hidden, float eps) {
    __shared__ float warp_sums[32];
    const size_t row = (size_t)blockIdx.x * hidden;
    const int first = WIDE_COLS * threadIdx.x;
    float squares[WIDE_COLS];
    for (int j = 0; j < WIDE_COLS; ++j) squares[j] = 0.f;
    for (int base = first; base < hidden; base += WIDE_BATCH * WIDE_STEP) {
        Octet<T> r[WIDE_BATCH], d[WIDE_BATCH];
        load_octets(residual + row, base, hidden, r);
        load_octets(delta + row, base, hidden, d);
        for (int b = 0; b < WIDE_BATCH && base + b * WIDE_STEP < hidden; ++b) {
            Octet<T> sum;
            for (int j = 0; j < WIDE_COLS; ++j) {
                sum.v[j] = add_rounded(r[b].v[j], d[b].v[j]);
                const float x = to_float(sum.v[j]);
                squares[j] = fmaf(x, x, squares[j]);
            }
            *reinterpret_cast<Octet<T>*>(sum_out + row + base + b * WIDE_STEP) = sum;
        }
    }
    for (int j = 0; j < WIDE_COLS; ++j) {
        squares[j] += __shfl_xor_sync(0xffffffffu, squares[j], 2);
        squares[j] += __shfl_xor_sync(0xffffffffu, squares[j], 1);
    }
    for (int mask = WIDE_COLS / 2; mask > 0; mask >>= 1)
        for (int j = 0; j < mask; ++j) squares[j] += squares[j + mask];
    if (threadIdx.x % 4 == 0) warp_sums[threadIdx.x / 4] = squares[0];
    const float mean = sum_of_warp_sums(warp_sums) / hidden;
    const float scale = rsqrtf(mean + eps);
    for (int base = first; base < hidden; base += WIDE_BATCH * WIDE_STEP) {
        Octet<T> r[WIDE_BATCH], d[WIDE_BATCH], w[WIDE_BATCH];
        load_octets(residual + row, base, hidden, r);
        load_octets(delta + row, base, hidden, d);
        load_octets(weight, base, hidden, w);
        for (int b = 0; b < WIDE_BATCH && base + b * WIDE_STEP < hidden; ++b) {
            Octet<T> normed;
            for (int j = 0; j < WIDE_COLS; ++j)
                normed.v[j] = scaled(scale, add_rounded(r[b].v[j], d[b].v[j]), w[b].v[j]);
            *reinterpret_cast<Octet<T>*>(normed_out + row + base + b * WIDE_STEP) = normed;
        }
    }
}

// out = T(silu(f32(gate))) * up, element-wise over rows x cols outputs (out contiguous); row r
// of gate and up starts at r * in_stride (cols when they are contiguous, 2 * cols when both are
// halves of one gate/up projection's rows).
// Grid: x = groups of VEC_COLS columns (16 bytes of T per thread), y = rows (striding when there
// are more than the grid's 65535). A group is read and written as one 16-byte access (half.cuh's
// Vec16) where every
// row of the three buffers starts so aligned, else element by element (same values either way).
template <typename T> __device__ __forceinline__ T silu_times(T gate, T up) {
    const float x = to_float(gate);
    const float silu = to_float(from_float<T>(x / (1.0f + expf(-x))));
    return from_float<T>(__fmul_rn(silu, to_float(up)));
}

template <typename T>
__device__ void silu_mul(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out,
                         int rows, int cols, size_t in_stride) {
    constexpr int vec = VEC_COLS(T);
    const unsigned int col = vec * (blockIdx.x * blockDim.x + threadIdx.x);
    if (col >= (unsigned int)cols) return;
    const bool vectors = cols % vec == 0 && in_stride % vec == 0 &&
                         ((size_t)gate | (size_t)up | (size_t)out) % 16 == 0;
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        const T* g = gate + row * in_stride + col;
        const T* u = up + row * in_stride + col;
        T* o = out + (size_t)row * cols + col;
        if (vectors) {
            const Vec16<T> gg = *reinterpret_cast<const Vec16<T>*>(g);
            const Vec16<T> uu = *reinterpret_cast<const Vec16<T>*>(u);
            Vec16<T> oo;
            for (int j = 0; j < vec; ++j) oo.v[j] = silu_times(gg.v[j], uu.v[j]);
            *reinterpret_cast<Vec16<T>*>(o) = oo;
        } else {
            for (int j = 0; j < vec && col + j < (unsigned int)cols; ++j)
                o[j] = silu_times(g[j], u[j]);
        }
    }
}

#define ROPE_WARPS 8
#define MAX_HEAD_DIM 128

// The step between the q/k/v projections and attention of one layer, for new token t of batch
// row b at position lens[b] + t (lens is read here, on the device, so that a captured CUDA graph
// replays with the positions of its replay):
//   q [B, T, Hq, D] -> rmsnorm(q_norm) -> rope -> q_out [B, Hq, T, D]
//   k [B, T, Hkv, D] -> rmsnorm(k_norm) -> rope -> k_cache [B, Hkv, capacity, D] at lens[b] + t
//   v [B, T, Hkv, D] -> v_cache at the same slot
// Consecutive tokens of q are q_stride elements apart, of k and v kv_stride (Hq * D and Hkv * D
// when they are contiguous, (Hq + 2 Hkv) * D when all three are parts of one q/k/v projection).
// Grid: x = the CTAs sharing one token's Hq + Hkv head vectors (a q head, or a k head with its v
// head), y = token, z = batch row; ROPE_WARPS warps per CTA, one head vector per warp at a time.
// The CTA computes the position's cos and sin once, for all its heads. The norm reduces one
// warp's 32 lanes, as candle's rmsnorm with 32 threads does for D < 1024.
template <typename T>
__device__ void qk_norm_rope_cache(const T* __restrict__ q, const T* __restrict__ k,
                                   const T* __restrict__ v, const T* __restrict__ q_norm,
                                   const T* __restrict__ k_norm, const float* __restrict__ inv_freq,
                                   const unsigned int* __restrict__ lens, T* __restrict__ q_out,
                                   T* __restrict__ k_cache, T* __restrict__ v_cache, int tokens,
                                   int q_heads, int kv_heads, int head_dim, int capacity,
                                   int q_stride, int kv_stride, float eps) {
    __shared__ float normed_s[ROPE_WARPS][MAX_HEAD_DIM];
    __shared__ float cos_s[MAX_HEAD_DIM / 2], sin_s[MAX_HEAD_DIM / 2];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = blockIdx.y, b = blockIdx.z;
    const int pos = (int)lens[b] + t;
    const int half = head_dim / 2;
    // candle's rotary tables hold cos and sin in T.
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float angle = __fmul_rn((float)pos, inv_freq[i]);
        cos_s[i] = to_float(from_float<T>(cosf(angle)));
        sin_s[i] = to_float(from_float<T>(sinf(angle)));
    }
    __syncthreads();
    const int heads = q_heads + kv_heads;
    const int cta_heads = (heads + gridDim.x - 1) / gridDim.x;
    const int last = min(heads, (int)(blockIdx.x + 1) * cta_heads);
    const size_t token = (size_t)b * tokens + t;
    float* normed = normed_s[warp];
    for (int head = blockIdx.x * cta_heads + warp; head < last; head += ROPE_WARPS) {
        const bool is_q = head < q_heads;
        const int kv_head = head - q_heads;
        // The caller checks the lengths against the capacity; past it nothing is written (the
        // heads after a k head are k heads too).
        if (!is_q && pos >= capacity) break;
        const T* src = is_q ? q + token * q_stride + (size_t)head * head_dim
                            : k + token * kv_stride + (size_t)kv_head * head_dim;
        const T* weight = is_q ? q_norm : k_norm;
        const size_t cache_slot = (((size_t)b * kv_heads + kv_head) * capacity + pos) * head_dim;
        T* dst = is_q ? q_out + (((size_t)b * q_heads + head) * tokens + t) * head_dim
                      : k_cache + cache_slot;
        if (!is_q) {
            const T* v_src = v + token * kv_stride + (size_t)kv_head * head_dim;
            for (int i = lane; i < head_dim; i += 32) v_cache[cache_slot + i] = v_src[i];
        }

        float squares = 0.f;
        for (int i = lane; i < head_dim; i += 32) {
            const float x = to_float(src[i]);
            squares = fmaf(x, x, squares);
        }
        const float mean = warp_sum(squares) / head_dim;
        const float scale = rsqrtf(mean + eps);
        for (int i = lane; i < head_dim; i += 32)
            normed[i] = to_float(scaled(scale, src[i], weight[i]));
        __syncwarp();

        for (int i = lane; i < half; i += 32) {
            const float c = cos_s[i], s = sin_s[i];
            const float x1 = normed[i], x2 = normed[i + half];
            const float x2s = to_float(from_float<T>(__fmul_rn(x2, s)));
            const float x2c = to_float(from_float<T>(__fmul_rn(x2, c)));
            dst[i] = fma_round(x1, c, -x2s, (T*)0);
            dst[i + half] = fma_round(x1, s, x2c, (T*)0);
        }
        // The next head's normed values go where these were read.
        __syncwarp();
    }
}

// Greedy selection over one row of logits per CTA (GREEDY_THREADS threads): the lowest index
// holding the row's highest value, how many entries hold it, and whether the row is unusable
// (a NaN, a +inf maximum, or only -inf). Values compare as f32, which every T widens to
// exactly, so the maximum is the one the logits' own dtype has. One pass over the row instead of
// candle's max, compare, select, min and sum over the whole [rows, vocab] tensor.
// Output [3, rows] (u32): token, ties, unusable.
#define GREEDY_THREADS 256
#define GREEDY_LOADS 4

template <typename T>
__device__ void greedy_summary(const T* __restrict__ logits, unsigned int* __restrict__ out,
                               int rows, int vocab) {
    __shared__ float best[GREEDY_THREADS];
    __shared__ unsigned int index[GREEDY_THREADS], ties[GREEDY_THREADS], nan[GREEDY_THREADS];
    const int t = threadIdx.x, row = blockIdx.x;
    const T* x = logits + (size_t)row * vocab;
    float m = 0.0f;
    unsigned int i_m = 0, n_m = 0, bad = 0;
    // Each thread sees its columns in increasing order, so its first hit of a maximum is its
    // lowest index.
    auto see = [&](float v, int i) {
        if (v != v) {
            bad = 1;
        } else if (n_m == 0 || v > m) {
            m = v;
            i_m = i;
            n_m = 1;
        } else if (v == m) {
            n_m += 1;
        }
    };
    // 16 bytes of consecutive columns per thread and load where the rows are so aligned,
    // GREEDY_LOADS of them in flight before any is compared.
    constexpr int vec = VEC_COLS(T), stride = vec * GREEDY_THREADS;
    if (vocab % vec == 0 && (size_t)logits % 16 == 0) {
        for (int i = vec * t; i < vocab; i += GREEDY_LOADS * stride) {
            Vec16<T> v[GREEDY_LOADS];
            for (int u = 0; u < GREEDY_LOADS; ++u)
                if (i + u * stride < vocab)
                    v[u] = *reinterpret_cast<const Vec16<T>*>(x + i + u * stride);
            for (int u = 0; u < GREEDY_LOADS && i + u * stride < vocab; ++u)
                for (int j = 0; j < vec; ++j) see(to_float(v[u].v[j]), i + u * stride + j);
        }
    } else {
        for (int i = t; i < vocab; i += GREEDY_THREADS) see(to_float(x[i]), i);
    }
    best[t] = m;
    index[t] = i_m;
    ties[t] = n_m;
    nan[t] = bad;
    __syncthreads();
    for (int stride = GREEDY_THREADS / 2; stride > 0; stride /= 2) {
        if (t < stride) {
            const int o = t + stride;
            nan[t] |= nan[o];
            if (ties[o] != 0) {
                if (ties[t] == 0 || best[o] > best[t]) {
                    best[t] = best[o];
                    index[t] = index[o];
                    ties[t] = ties[o];
                } else if (best[o] == best[t]) {
                    index[t] = min(index[t], index[o]);
                    ties[t] += ties[o];
                }
            }
        }
        __syncthreads();
    }
    if (t == 0) {
        const bool infinite = (__float_as_uint(best[0]) & 0x7fffffffu) == 0x7f800000u;
        out[row] = index[0];
        out[rows + row] = ties[0];
        out[2 * rows + row] = (nan[0] || ties[0] == 0 || infinite) ? 1u : 0u;
    }
}

// A sampled candidate of each row of logits (one CTA of SAMPLE_THREADS threads per row), with no
// top-k or top-p filter: the logits divided by the row's temperature, softmax weights
// w = expf(x - max), and the inverse-CDF draw of the row's uniform number u over the whole
// vocabulary in index order, as dice-engine's `sample_row` draws (the first index whose running
// sum of weights exceeds u * total). The running sums are f64, as there; the total is their f64
// sum (sample_row adds the f32 weights one after another in f32, which a parallel sum cannot
// reproduce; either is a draw from the same distribution). Only four numbers per row come back to
// the host instead of the row's logits: u32 [4, rows] holding the token, the bits of its f32
// probability w / total, of the distribution's entropy (each probability clamped at 1e-12, as the
// reference takes it; 0 unless `with_entropy`), and 1 where the row is unusable (a NaN, a +inf
// or only -inf; else 0).
#define SAMPLE_THREADS 256
#define ENTROPY_CLAMP 1e-12f

template <typename T>
__device__ void sample_summary(const T* __restrict__ logits, const float* __restrict__ temperatures,
                               const double* __restrict__ uniforms, unsigned int* __restrict__ out,
                               int rows, int vocab, int with_entropy) {
    __shared__ float reduce_f[SAMPLE_THREADS];
    __shared__ double prefix[SAMPLE_THREADS];
    __shared__ int drawer[SAMPLE_THREADS];
    const int t = threadIdx.x, row = blockIdx.x;
    const T* x = logits + (size_t)row * vocab;
    const float temperature = temperatures[row];
    // sample_row divides only when the temperature is not 1.
    auto scaled = [&](int i) {
        const float v = to_float(x[i]);
        return temperature == 1.0f ? v : v / temperature;
    };

    // The maximum, and whether a NaN or +inf makes the row unusable.
    float m = -__uint_as_float(0x7f800000u);
    int bad = 0;
    for (int i = t; i < vocab; i += SAMPLE_THREADS) {
        const float v = scaled(i);
        if (v != v || v == __uint_as_float(0x7f800000u)) bad = 1;
        else m = fmaxf(m, v);
    }
    reduce_f[t] = m;
    drawer[t] = bad;
    __syncthreads();
    for (int stride = SAMPLE_THREADS / 2; stride > 0; stride /= 2) {
        if (t < stride) {
            reduce_f[t] = fmaxf(reduce_f[t], reduce_f[t + stride]);
            drawer[t] |= drawer[t + stride];
        }
        __syncthreads();
    }
    m = reduce_f[0];
    bad = drawer[0] || m == -__uint_as_float(0x7f800000u);
    __syncthreads();
    if (bad) {
        if (t == 0) {
            out[row] = 0;
            out[rows + row] = 0;
            out[2 * rows + row] = 0;
            out[3 * rows + row] = 1;
        }
        return;
    }

    // Each thread's contiguous chunk of columns, its f64 sum of weights, and the block's
    // inclusive scan of those sums: the running sum in index order at each chunk's end.
    const int chunk = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int begin = min(vocab, t * chunk), end = min(vocab, begin + chunk);
    double own = 0.0;
    for (int i = begin; i < end; ++i) own += (double)expf(scaled(i) - m);
    prefix[t] = own;
    __syncthreads();
    for (int offset = 1; offset < SAMPLE_THREADS; offset *= 2) {
        const double add = t >= offset ? prefix[t - offset] : 0.0;
        __syncthreads();
        prefix[t] += add;
        __syncthreads();
    }
    const double total = prefix[SAMPLE_THREADS - 1];
    const double target = uniforms[row] * total;
    const double before = prefix[t] - own;
    // The draw falls in the last chunk with weight that starts at or below the target (chunks
    // without weight are skipped, and rounding that leaves the target past every sum still
    // lands in the last chunk with weight).
    drawer[t] = own > 0.0 && before <= target ? t : -1;
    __syncthreads();
    for (int stride = SAMPLE_THREADS / 2; stride > 0; stride /= 2) {
        if (t < stride) drawer[t] = max(drawer[t], drawer[t + stride]);
        __syncthreads();
    }
    const float total_f = (float)total;
    if (t == drawer[0]) {
        // Within the chunk: the first column whose running sum exceeds the target, else its last
        // column with weight (sample_row's fallback).
        double running = 0.0;
        int token = -1, last = begin;
        float weight = 0.0f;
        for (int i = begin; i < end; ++i) {
            const float w = expf(scaled(i) - m);
            if (w > 0.0f) last = i;
            running += (double)w;
            if (target - before < running) {
                token = i;
                weight = w;
                break;
            }
        }
        if (token < 0) {
            token = last;
            weight = expf(scaled(last) - m);
        }
        out[row] = (unsigned int)token;
        out[rows + row] = __float_as_uint(weight / total_f);
        out[3 * rows + row] = 0;
    }
    if (!with_entropy) {
        if (t == 0) out[2 * rows + row] = 0;
        return;
    }
    float entropy = 0.0f;
    for (int i = t; i < vocab; i += SAMPLE_THREADS) {
        const float p = fmaxf(expf(scaled(i) - m) / total_f, ENTROPY_CLAMP);
        entropy -= p * logf(p);
    }
    __syncthreads();
    reduce_f[t] = entropy;
    __syncthreads();
    for (int stride = SAMPLE_THREADS / 2; stride > 0; stride /= 2) {
        if (t < stride) reduce_f[t] += reduce_f[t + stride];
        __syncthreads();
    }
    if (t == 0) out[2 * rows + row] = __float_as_uint(reduce_f[0]);
}

#define DECODE_OPS(TYPE, SUFFIX)                                                                  \
    extern "C" __global__ void add_rms_norm_##SUFFIX(                                             \
        const TYPE* residual, const TYPE* delta, const TYPE* weight, TYPE* sum_out,               \
        TYPE* normed_out, int hidden, float eps) {                                                \
        add_rms_norm<TYPE>(residual, delta, weight, sum_out, normed_out, hidden, eps);            \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(WIDE_THREADS) add_rms_norm_wide_##SUFFIX(        \
        const TYPE* residual, const TYPE* delta, const TYPE* weight, TYPE* sum_out,               \
        TYPE* normed_out, int hidden, float eps) {                                                \
        add_rms_norm_wide<TYPE>(residual, delta, weight, sum_out, normed_out, hidden, eps);       \
    }                                                                                             \
    extern "C" __global__ void silu_mul_##SUFFIX(const TYPE* gate, const TYPE* up, TYPE* out,     \
                                                 int rows, int cols,                              \
                                                 unsigned long long in_stride) {                  \
        silu_mul<TYPE>(gate, up, out, rows, cols, (size_t)in_stride);                             \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * ROPE_WARPS) qk_norm_rope_cache_##SUFFIX(   \
        const TYPE* q, const TYPE* k, const TYPE* v, const TYPE* q_norm, const TYPE* k_norm,      \
        const float* inv_freq, const unsigned int* lens, TYPE* q_out, TYPE* k_cache,              \
        TYPE* v_cache, int tokens, int q_heads, int kv_heads, int head_dim, int capacity,         \
        int q_stride, int kv_stride, float eps) {                                                 \
        qk_norm_rope_cache<TYPE>(q, k, v, q_norm, k_norm, inv_freq, lens, q_out, k_cache,         \
                                 v_cache, tokens, q_heads, kv_heads, head_dim, capacity,          \
                                 q_stride, kv_stride, eps);                                       \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(GREEDY_THREADS) greedy_summary_##SUFFIX(         \
        const TYPE* logits, unsigned int* out, int rows, int vocab) {                             \
        greedy_summary<TYPE>(logits, out, rows, vocab);                                           \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_summary_##SUFFIX(         \
        const TYPE* logits, const float* temperatures, const double* uniforms, unsigned int* out,  \
        int rows, int vocab, int with_entropy) {                                                  \
        sample_summary<TYPE>(logits, temperatures, uniforms, out, rows, vocab, with_entropy);     \
    }

DECODE_OPS(float, f32)
DECODE_OPS(bf16_t, bf16)
DECODE_OPS(f16_t, f16)
