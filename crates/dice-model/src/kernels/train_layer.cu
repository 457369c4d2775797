// Fused element-wise steps of a training decoder layer and of the loss head, forward and
// backward (crates/dice-model/src/kernels/train_layer.rs launches them; the GEMMs between them
// are cuBLAS's, through candle): RMSNorm with its optional residual add, the q/k heads' RMSNorm
// and RoPE with the move to head-major order, SwiGLU, the label log-softmax over the
// vocabulary, and the embedding table's gradient.
//
// Compiled at run time with NVRTC; bf16 and f16 are raw 16-bit values (half.cuh). Every step
// computes in f32 and rounds its outputs to T once; the normed and gated values are rounded to
// T where the composite forward (crates/dice-model/src/sdar.rs) rounds them, so that the
// backward differentiates the forward the GEMMs saw. RMSNorm's reciprocal RMS per row is kept
// in f32 for the backward. Weight gradients of the norms are written as per-CTA (or per-chunk)
// partial sums in f32, reduced by the caller in a fixed order: no atomics, so a step gives the
// same gradients on every run.

#include "half.cuh"
#include "warp.cuh"

// NVRTC has no math.h, hence no INFINITY.
#define NEG_INF __uint_as_float(0xff800000u)
// Warps per CTA of the heads kernels: one warp per (token, head) row.
#define ROW_WARPS 8
// Threads per CTA of the column and element-wise kernels.
#define FLAT_THREADS 256
// Threads per CTA of label_log_softmax: one CTA per row of the vocabulary's logits.
#define HEAD_THREADS 1024

// The RMSNorm kernels take one CTA per row, thread t the packs of V values t, t + blockDim.x, …
// (train_layer.rs `norm_grid`: the row's 16-byte packs rounded up to warps, at most
// NORM_MAX_THREADS threads), and keep their first NORM_HELD_PACKS packs in registers between the
// row's reduction and its outputs: the row is read from memory once. A warp per row that read its row
// again after the reduction ran at 29-35 % of the H100's memory rate in a 1.7B step: all 6,144
// rows in flight at once, 75 MB of them, so the second pass missed the 50 MB L2, and every warp
// of the one wave loaded, reduced and wrote in step (bench/notes/train-h200.md, session 33).
#define NORM_MAX_THREADS 1024
#define NORM_HELD_PACKS 2

// The sum of `x` over the CTA's threads (blockDim.x a multiple of 32): each warp's butterfly,
// then the warps' sums in order. Every thread gets it; one use per kernel.
__device__ __forceinline__ float cta_sum(float x) {
    __shared__ float warp_sums[NORM_MAX_THREADS / 32];
    x = warp_sum(x);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = x;
    __syncthreads();
    float sum = 0.0f;
    for (int w = 0; w < (int)blockDim.x / 32; ++w) sum += warp_sums[w];
    return sum;
}

// The normed input's pack at offset i: x = a (+ b, rounded to T and written to sum_out), its
// squares added to `squares`.
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> norm_input_pack(const T* __restrict__ a,
                                                      const T* __restrict__ b,
                                                      T* __restrict__ sum_out, size_t i,
                                                      float& squares) {
    Pack<T, V> x = load_pack<T, V>(a + i);
    if (b) {
        const Pack<T, V> d = load_pack<T, V>(b + i);
        for (int k = 0; k < V; ++k) x.v[k] = from_float<T>(to_float(x.v[k]) + to_float(d.v[k]));
        store_pack(sum_out + i, x);
    }
    for (int k = 0; k < V; ++k) squares += to_float(x.v[k]) * to_float(x.v[k]);
    return x;
}

// y = T(x * r * w) for the pack x at column c.
template <typename T, int V>
__device__ __forceinline__ void normed_pack(const Pack<T, V>& x, const T* __restrict__ w, float r,
                                            T* __restrict__ y) {
    float wv[V], out[V];
    load_floats(w, wv);
    for (int k = 0; k < V; ++k) out[k] = to_float(x.v[k]) * r * wv[k];
    store_floats(y, out);
}

// Row blockIdx.x of the RMSNorm forward: x = a (+ b, rounded to T and written to sum_out), then
// y = T(x * rstd * w) and rstd = 1 / sqrt(mean(x^2) + eps).
template <typename T, int V>
__device__ void rms_norm_forward_row(const T* __restrict__ a, const T* __restrict__ b,
                                     T* __restrict__ sum_out, const T* __restrict__ w,
                                     T* __restrict__ y, float* __restrict__ rstd, int n,
                                     float eps) {
    const size_t base = (size_t)blockIdx.x * n;
    const int first = V * threadIdx.x, stride = V * blockDim.x;
    const int beyond = first + NORM_HELD_PACKS * stride;
    Pack<T, V> held[NORM_HELD_PACKS];
    float squares = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_HELD_PACKS; ++j) {
        const int c = first + j * stride;
        if (c < n) held[j] = norm_input_pack<T, V>(a, b, sum_out, base + c, squares);
    }
    for (int c = beyond; c < n; c += stride)
        norm_input_pack<T, V>(a, b, sum_out, base + c, squares);
    const float r = rsqrtf(cta_sum(squares) / (float)n + eps);
#pragma unroll
    for (int j = 0; j < NORM_HELD_PACKS; ++j) {
        const int c = first + j * stride;
        if (c < n) normed_pack(held[j], w + c, r, y + base + c);
    }
    // A row longer than the held packs: the rest read again (the sums this thread wrote).
    const T* x = b ? sum_out : a;
    for (int c = beyond; c < n; c += stride)
        normed_pack(load_pack<T, V>(x + base + c), w + c, r, y + base + c);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

template <typename T>
__device__ void rms_norm_forward(const T* __restrict__ a, const T* __restrict__ b,
                                 T* __restrict__ sum_out, const T* __restrict__ w,
                                 T* __restrict__ y, float* __restrict__ rstd, int n, float eps) {
    if (n % VEC_COLS(T) == 0 && aligned(a, 16) && aligned(b, 16) && aligned(sum_out, 16) &&
        aligned(w, 16) && aligned(y, 16))
        rms_norm_forward_row<T, VEC_COLS(T)>(a, b, sum_out, w, y, rstd, n, eps);
    else
        rms_norm_forward_row<T, 1>(a, b, sum_out, w, y, rstd, n, eps);
}

// dy and x's packs at offset i (column c): dot += sum(dy * w * x).
template <typename T, int V>
__device__ __forceinline__ void norm_grad_packs(const T* __restrict__ x, const T* __restrict__ w,
                                                const T* __restrict__ dy, size_t i, int c,
                                                Pack<T, V>& dy_pack, Pack<T, V>& x_pack,
                                                float& dot) {
    float wv[V];
    dy_pack = load_pack<T, V>(dy + i);
    x_pack = load_pack<T, V>(x + i);
    load_floats(w + c, wv);
    for (int k = 0; k < V; ++k) dot += to_float(dy_pack.v[k]) * wv[k] * to_float(x_pack.v[k]);
}

// dx = T(r * dy * w - x * coef + d_residual) for the packs at offset i (column c).
template <typename T, int V>
__device__ __forceinline__ void norm_input_grad(const Pack<T, V>& dy_pack, const Pack<T, V>& x_pack,
                                                const T* __restrict__ w,
                                                const T* __restrict__ d_residual,
                                                T* __restrict__ dx, size_t i, int c, float r,
                                                float coef) {
    float wv[V], g[V];
    load_floats(w + c, wv);
    for (int k = 0; k < V; ++k)
        g[k] = r * to_float(dy_pack.v[k]) * wv[k] - to_float(x_pack.v[k]) * coef;
    if (d_residual) {
        float dr[V];
        load_floats(d_residual + i, dr);
        for (int k = 0; k < V; ++k) g[k] += dr[k];
    }
    store_floats(dx + i, g);
}

// Row blockIdx.x of the RMSNorm backward for the input gradient:
// dx = T(r * g - x * r^3 * mean(g * x) + d_residual), g = dy * w, with the forward's x and r.
template <typename T, int V>
__device__ void rms_norm_backward_row(const T* __restrict__ x, const T* __restrict__ w,
                                      const float* __restrict__ rstd, const T* __restrict__ dy,
                                      const T* __restrict__ d_residual, T* __restrict__ dx,
                                      int n) {
    const size_t base = (size_t)blockIdx.x * n;
    const int first = V * threadIdx.x, stride = V * blockDim.x;
    const int beyond = first + NORM_HELD_PACKS * stride;
    const float r = rstd[blockIdx.x];
    Pack<T, V> held_dy[NORM_HELD_PACKS], held_x[NORM_HELD_PACKS], dy_pack, x_pack;
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_HELD_PACKS; ++j) {
        const int c = first + j * stride;
        if (c < n) norm_grad_packs<T, V>(x, w, dy, base + c, c, held_dy[j], held_x[j], dot);
    }
    for (int c = beyond; c < n; c += stride)
        norm_grad_packs<T, V>(x, w, dy, base + c, c, dy_pack, x_pack, dot);
    const float coef = cta_sum(dot) * r * r * r / (float)n;
#pragma unroll
    for (int j = 0; j < NORM_HELD_PACKS; ++j) {
        const int c = first + j * stride;
        if (c < n) norm_input_grad(held_dy[j], held_x[j], w, d_residual, dx, base + c, c, r, coef);
    }
    for (int c = beyond; c < n; c += stride) {
        dy_pack = load_pack<T, V>(dy + base + c);
        x_pack = load_pack<T, V>(x + base + c);
        norm_input_grad(dy_pack, x_pack, w, d_residual, dx, base + c, c, r, coef);
    }
}

template <typename T>
__device__ void rms_norm_backward(const T* __restrict__ x, const T* __restrict__ w,
                                  const float* __restrict__ rstd, const T* __restrict__ dy,
                                  const T* __restrict__ d_residual, T* __restrict__ dx, int n) {
    if (n % VEC_COLS(T) == 0 && aligned(x, 16) && aligned(w, 16) && aligned(dy, 16) &&
        aligned(d_residual, 16) && aligned(dx, 16))
        rms_norm_backward_row<T, VEC_COLS(T)>(x, w, rstd, dy, d_residual, dx, n);
    else
        rms_norm_backward_row<T, 1>(x, w, rstd, dy, d_residual, dx, n);
}

// The RMSNorm weight's gradient, Σ_rows dy * x * r, as partial sums over chunks of
// `chunk_rows` rows: partial[blockIdx.y * n + c]. One thread per column, so the reads of a
// row are coalesced.
template <typename T>
__device__ void norm_weight_grad(const T* __restrict__ x, const float* __restrict__ rstd,
                                 const T* __restrict__ dy, float* __restrict__ partial, int rows,
                                 int n, int chunk_rows) {
    const int c = blockIdx.x * FLAT_THREADS + threadIdx.x;
    if (c >= n) return;
    const int first = blockIdx.y * chunk_rows, last = min(rows, first + chunk_rows);
    float sum = 0.0f;
    for (int r = first; r < last; ++r) {
        const size_t i = (size_t)r * n + c;
        sum += to_float(dy[i]) * to_float(x[i]) * rstd[r];
    }
    partial[(size_t)blockIdx.y * n + c] = sum;
}

// Values a lane moves in one access in the heads kernels: a 128-wide head is one pack of 4 a
// lane (8 bytes of bf16), where rows and halves allow it (heads_packable); one value otherwise.
#define HEAD_PACK 4

// Whether the heads kernels' rows (src `ld` apart, the other rows per head `head_dim` or
// `other_ld` apart, cos and sin `head_dim / 2`) and the pointers allow HEAD_PACK values an access,
// with no pack across the two halves RoPE pairs.
template <typename T>
__device__ __forceinline__ bool heads_packable(int head_dim, int ld, int other_ld,
                                               const void* const (&pointers)[6]) {
    bool packable = head_dim % (2 * HEAD_PACK) == 0 && ld % HEAD_PACK == 0 &&
                    other_ld % HEAD_PACK == 0;
    for (const void* p : pointers) packable = packable && aligned(p, HEAD_PACK * sizeof(T));
    return packable;
}

// Rotate-half RoPE of one element: `mine` in the head's first half (`low`) pairs with `partner`
// half a head later, and the other way round.
__device__ __forceinline__ float rope(bool low, float mine, float partner, float c, float s) {
    return low ? mine * c - partner * s : mine * c + partner * s;
}

// RoPE's transpose (the rotation by -angle), which takes the backward's gradients back.
__device__ __forceinline__ float rope_transposed(bool low, float mine, float partner, float c,
                                                 float s) {
    return rope(!low, mine, partner, c, s);
}

// Pack e of a head row (`row`) and RoPE's partner pack (e +- head_dim / 2) as f32, and the cos
// and sin of their angles; whether e is in the first half.
template <typename T, int V>
__device__ __forceinline__ bool rope_pack(const T* row, const T* c_row, const T* s_row, int e,
                                          int half, float (&mine)[V], float (&partner)[V],
                                          float (&c)[V], float (&s)[V]) {
    const bool low = e < half;
    const int angle = low ? e : e - half;
    load_floats(row + e, mine);
    load_floats(row + (low ? e + half : e - half), partner);
    load_floats(c_row + angle, c);
    load_floats(s_row + angle, s);
    return low;
}

// Heads out of a projection's rows, into head-major order: src holds `tokens` rows `ld`
// elements apart, each `heads` heads of `head_dim`; out is [heads, tokens, head_dim]. With
// norm_w (q and k): each head row is RMS-normed (rounded to T, as the composite forward rounds
// it) and rotated by rotate-half RoPE with cos and sin [tokens, head_dim / 2], and its rstd kept;
// without (v): copied. One warp per (token, head) row, V values a lane an access.
template <typename T, int V>
__device__ void heads_forward_row(const T* __restrict__ src, const T* __restrict__ norm_w,
                                  const T* __restrict__ cos, const T* __restrict__ sin,
                                  T* __restrict__ out, float* __restrict__ rstd, int ld,
                                  int tokens, int heads, int head_dim, float eps, int row) {
    const int lane = threadIdx.x % 32;
    const int t = row / heads, h = row % heads;
    const T* x = src + (size_t)t * ld + (size_t)h * head_dim;
    T* o = out + ((size_t)h * tokens + t) * head_dim;
    if (!norm_w) {
        for (int e = V * lane; e < head_dim; e += 32 * V) copy_pack<T, V>(o + e, x + e);
        return;
    }
    float squares = 0.0f;
    for (int e = V * lane; e < head_dim; e += 32 * V) {
        float v[V];
        load_floats(x + e, v);
        for (int i = 0; i < V; ++i) squares += v[i] * v[i];
    }
    const float r = rsqrtf(warp_sum(squares) / (float)head_dim + eps);
    const int half = head_dim / 2;
    const T* c_row = cos + (size_t)t * half;
    const T* s_row = sin + (size_t)t * half;
    // A lane norms the elements RoPE pairs with its own itself, so no lane waits on another.
    for (int e = V * lane; e < head_dim; e += 32 * V) {
        float xv[V], xp[V], wv[V], wp[V], c[V], sn[V], rotated[V];
        const bool low = rope_pack(x, c_row, s_row, e, half, xv, xp, c, sn);
        load_floats(norm_w + e, wv);
        load_floats(norm_w + (low ? e + half : e - half), wp);
        for (int i = 0; i < V; ++i) {
            const float mine = to_float(from_float<T>(xv[i] * r * wv[i]));
            const float other = to_float(from_float<T>(xp[i] * r * wp[i]));
            rotated[i] = rope(low, mine, other, c[i], sn[i]);
        }
        store_floats(o + e, rotated);
    }
    if (lane == 0) rstd[row] = r;
}

// Where a head row is one pack a lane (head_dim == 32 V, the models' 128 at HEAD_PACK): lane l
// holds elements V l .. V l + V - 1, and RoPE's partner pack (e +- head_dim / 2) is lane l ^ 16's,
// taken by a shuffle instead of loaded again. Every load is issued before the row's reduction.
// The general kernels above read each row twice and both packs of a pair, at 29-32 % of the
// H100's memory rate (bench/notes/train-h200.md, session 34).
template <typename T, int V>
__device__ void heads_forward_one_pack(const T* __restrict__ src, const T* __restrict__ norm_w,
                                       const T* __restrict__ cos, const T* __restrict__ sin,
                                       T* __restrict__ out, float* __restrict__ rstd, int ld,
                                       int tokens, int heads, float eps, int row) {
    constexpr int head_dim = 32 * V, half = 16 * V;
    const int lane = threadIdx.x % 32, e = V * lane;
    const int t = row / heads, h = row % heads;
    const T* x = src + (size_t)t * ld + (size_t)h * head_dim;
    T* o = out + ((size_t)h * tokens + t) * head_dim;
    if (!norm_w) {
        copy_pack<T, V>(o + e, x + e);
        return;
    }
    const bool low = lane < 16;
    const int angle = low ? e : e - half;
    float xv[V], wv[V], c[V], sn[V];
    load_floats(x + e, xv);
    load_floats(norm_w + e, wv);
    load_floats(cos + (size_t)t * half + angle, c);
    load_floats(sin + (size_t)t * half + angle, sn);
    float squares = 0.0f;
    for (int i = 0; i < V; ++i) squares += xv[i] * xv[i];
    const float r = rsqrtf(warp_sum(squares) / (float)head_dim + eps);
    float rotated[V];
    for (int i = 0; i < V; ++i) {
        const float mine = to_float(from_float<T>(xv[i] * r * wv[i]));
        const float other = __shfl_xor_sync(0xffffffffu, mine, 16);
        rotated[i] = rope(low, mine, other, c[i], sn[i]);
    }
    store_floats(o + e, rotated);
    if (lane == 0) rstd[row] = r;
}

template <typename T>
__device__ void heads_forward(const T* __restrict__ src, const T* __restrict__ norm_w,
                              const T* __restrict__ cos, const T* __restrict__ sin,
                              T* __restrict__ out, float* __restrict__ rstd, int ld, int tokens,
                              int heads, int head_dim, float eps) {
    const int row = blockIdx.x * ROW_WARPS + threadIdx.x / 32;
    if (row >= tokens * heads) return;
    const bool packable =
        heads_packable<T>(head_dim, ld, head_dim, {src, norm_w, cos, sin, out, nullptr});
    if (packable && head_dim == 32 * HEAD_PACK)
        heads_forward_one_pack<T, HEAD_PACK>(src, norm_w, cos, sin, out, rstd, ld, tokens, heads,
                                             eps, row);
    else if (packable)
        heads_forward_row<T, HEAD_PACK>(src, norm_w, cos, sin, out, rstd, ld, tokens, heads,
                                        head_dim, eps, row);
    else
        heads_forward_row<T, 1>(src, norm_w, cos, sin, out, rstd, ld, tokens, heads, head_dim,
                                eps, row);
}

// The backward of heads_forward: d_heads [heads, tokens, head_dim] back into d_src's rows
// (`d_ld` apart; src's are `ld` apart). With norm_w: RoPE undone (its transpose), then the
// RMSNorm backward with the forward's src and rstd, and the norm weight's gradient summed per
// warp over the rows it takes, into dw_partial[(blockIdx.x * ROW_WARPS + warp) * head_dim + e]
// (zeroed by the caller; each warp's row its own). Warps stride over the rows. A row is read
// twice, its RoPE'd gradient made again in the second pass: nothing of a row is held in
// registers, so any head dim fits, and the kernel that also holds heads_backward_one_pack (the
// models' head dim) keeps that path's few registers.
template <typename T, int V>
__device__ void heads_backward_rows(const T* __restrict__ d_heads, const T* __restrict__ src,
                                    const T* __restrict__ norm_w, const float* __restrict__ rstd,
                                    const T* __restrict__ cos, const T* __restrict__ sin,
                                    T* __restrict__ d_src, float* __restrict__ dw_partial, int ld,
                                    int d_ld, int tokens, int heads, int head_dim) {
    const int lane = threadIdx.x % 32, first = blockIdx.x * ROW_WARPS + threadIdx.x / 32;
    const int stride = gridDim.x * ROW_WARPS, half = head_dim / 2;
    float* partial = dw_partial ? dw_partial + (size_t)first * head_dim : nullptr;
    for (int row = first; row < tokens * heads; row += stride) {
        const int t = row / heads, h = row % heads;
        const T* d = d_heads + ((size_t)h * tokens + t) * head_dim;
        const T* x = src + (size_t)t * ld + (size_t)h * head_dim;
        T* dx = d_src + (size_t)t * d_ld + (size_t)h * head_dim;
        if (!norm_w) {
            for (int e = V * lane; e < head_dim; e += 32 * V) copy_pack<T, V>(dx + e, d + e);
            continue;
        }
        const T* c_row = cos + (size_t)t * half;
        const T* s_row = sin + (size_t)t * half;
        const float r = rstd[row];
        // RoPE's transpose of pack e, with the norm weight's and the input's pack there.
        const auto unrotated = [&](int e, float (&dn)[V], float (&wv)[V], float (&xv)[V]) {
            float dv[V], dp[V], c[V], sn[V];
            const bool low = rope_pack(d, c_row, s_row, e, half, dv, dp, c, sn);
            load_floats(norm_w + e, wv);
            load_floats(x + e, xv);
            for (int i = 0; i < V; ++i) dn[i] = rope_transposed(low, dv[i], dp[i], c[i], sn[i]);
        };
        float dot = 0.0f;
        for (int e = V * lane; e < head_dim; e += 32 * V) {
            float dn[V], wv[V], xv[V];
            unrotated(e, dn, wv, xv);
            for (int i = 0; i < V; ++i) dot += dn[i] * wv[i] * xv[i];
        }
        const float coef = warp_sum(dot) * r * r * r / (float)head_dim;
        for (int e = V * lane; e < head_dim; e += 32 * V) {
            float dn[V], wv[V], xv[V], g[V];
            unrotated(e, dn, wv, xv);
            for (int i = 0; i < V; ++i) {
                g[i] = r * dn[i] * wv[i] - xv[i] * coef;
                partial[e + i] += dn[i] * xv[i] * r;
            }
            store_floats(dx + e, g);
        }
    }
}

// heads_backward_rows where a head row is one pack a lane (heads_forward_one_pack): the norm
// weight's pack loaded once per warp, each row's values once, the partner's gradient by a shuffle;
// a lane's registers hold one pack of each (the general kernel held a 256-wide row's gradients:
// 112 registers, 24 % occupancy on the H100, session 34), and the partial sums stay in registers
// until the warp's last row.
template <typename T, int V>
__device__ void heads_backward_one_pack(const T* __restrict__ d_heads, const T* __restrict__ src,
                                        const T* __restrict__ norm_w,
                                        const float* __restrict__ rstd,
                                        const T* __restrict__ cos, const T* __restrict__ sin,
                                        T* __restrict__ d_src, float* __restrict__ dw_partial,
                                        int ld, int d_ld, int tokens, int heads) {
    constexpr int head_dim = 32 * V, half = 16 * V;
    const int lane = threadIdx.x % 32, e = V * lane;
    const int first = blockIdx.x * ROW_WARPS + threadIdx.x / 32, stride = gridDim.x * ROW_WARPS;
    const bool low = lane < 16;
    const int angle = low ? e : e - half;
    float wv[V], dw[V];
    if (norm_w) load_floats(norm_w + e, wv);
    for (int i = 0; i < V; ++i) dw[i] = 0.0f;
    for (int row = first; row < tokens * heads; row += stride) {
        const int t = row / heads, h = row % heads;
        const T* d = d_heads + ((size_t)h * tokens + t) * head_dim;
        T* dx = d_src + (size_t)t * d_ld + (size_t)h * head_dim;
        if (!norm_w) {
            copy_pack<T, V>(dx + e, d + e);
            continue;
        }
        float dv[V], xv[V], c[V], sn[V];
        load_floats(d + e, dv);
        load_floats(src + (size_t)t * ld + (size_t)h * head_dim + e, xv);
        load_floats(cos + (size_t)t * half + angle, c);
        load_floats(sin + (size_t)t * half + angle, sn);
        const float r = rstd[row];
        // RoPE's transpose, then the norm's backward.
        float d_normed[V], dot = 0.0f;
        for (int i = 0; i < V; ++i) {
            const float dp = __shfl_xor_sync(0xffffffffu, dv[i], 16);
            d_normed[i] = rope_transposed(low, dv[i], dp, c[i], sn[i]);
            dot += d_normed[i] * wv[i] * xv[i];
        }
        const float coef = warp_sum(dot) * r * r * r / (float)head_dim;
        float g[V];
        for (int i = 0; i < V; ++i) {
            g[i] = r * d_normed[i] * wv[i] - xv[i] * coef;
            dw[i] += d_normed[i] * xv[i] * r;
        }
        store_floats(dx + e, g);
    }
    if (!norm_w) return;
    float* partial = dw_partial + (size_t)first * head_dim;
    for (int i = 0; i < V; ++i) partial[e + i] = dw[i];
}

template <typename T>
__device__ void heads_backward(const T* __restrict__ d_heads, const T* __restrict__ src,
                               const T* __restrict__ norm_w, const float* __restrict__ rstd,
                               const T* __restrict__ cos, const T* __restrict__ sin,
                               T* __restrict__ d_src, float* __restrict__ dw_partial, int ld,
                               int d_ld, int tokens, int heads, int head_dim) {
    const bool packable =
        heads_packable<T>(head_dim, ld, d_ld, {d_heads, src, norm_w, cos, sin, d_src});
    if (packable && head_dim == 32 * HEAD_PACK)
        heads_backward_one_pack<T, HEAD_PACK>(d_heads, src, norm_w, rstd, cos, sin, d_src,
                                              dw_partial, ld, d_ld, tokens, heads);
    else if (packable)
        heads_backward_rows<T, HEAD_PACK>(d_heads, src, norm_w, rstd, cos, sin, d_src,
                                          dw_partial, ld, d_ld, tokens, heads, head_dim);
    else
        heads_backward_rows<T, 1>(d_heads, src, norm_w, rstd, cos, sin, d_src, dw_partial, ld,
                                  d_ld, tokens, heads, head_dim);
}

// Whether SwiGLU's rows (gate_up's of 2 * inter, the others' of inter) move in 16-byte accesses.
template <typename T>
__device__ __forceinline__ bool swiglu_packable(const void* a, const void* b, const void* c,
                                                int inter) {
    return inter % VEC_COLS(T) == 0 && aligned(a, 16) && aligned(b, 16) && aligned(c, 16);
}

// Runs step(t, c) for every row t and every V-th column c of [rows, inter]: grid x over the
// columns (8 x FLAT_THREADS of them a CTA, train_layer.rs), y over the rows (striding past the
// grid's 65535), no division by the row length.
template <int V, typename Step>
__device__ __forceinline__ void over_row_packs(int rows, int inter, Step step) {
    for (int t = blockIdx.y; t < rows; t += gridDim.y)
        for (int c = V * (blockIdx.x * FLAT_THREADS + threadIdx.x); c < inter;
             c += V * FLAT_THREADS * gridDim.x)
            step(t, c);
}

// SwiGLU on [gate | up] rows of 2 * inter: act = T(T(silu(gate)) * up), as the composite
// forward rounds it.
template <typename T, int V>
__device__ void swiglu_forward_packs(const T* __restrict__ gate_up, T* __restrict__ act,
                                     int rows, int inter) {
    over_row_packs<V>(rows, inter, [&](int t, int c) {
        const T* row = gate_up + (size_t)t * 2 * inter + c;
        float g[V], u[V], out[V];
        load_floats(row, g);
        load_floats(row + inter, u);
        for (int i = 0; i < V; ++i)
            out[i] = to_float(from_float<T>(g[i] / (1.0f + expf(-g[i])))) * u[i];
        store_floats(act + (size_t)t * inter + c, out);
    });
}

template <typename T>
__device__ void swiglu_forward(const T* __restrict__ gate_up, T* __restrict__ act, int rows,
                               int inter) {
    if (swiglu_packable<T>(gate_up, act, nullptr, inter))
        swiglu_forward_packs<T, VEC_COLS(T)>(gate_up, act, rows, inter);
    else
        swiglu_forward_packs<T, 1>(gate_up, act, rows, inter);
}

// The backward of swiglu_forward: d_gate_up's rows [d gate | d up] from d_act.
template <typename T, int V>
__device__ void swiglu_backward_packs(const T* __restrict__ gate_up, const T* __restrict__ d_act,
                                      T* __restrict__ d_gate_up, int rows, int inter) {
    over_row_packs<V>(rows, inter, [&](int t, int c) {
        const size_t at = (size_t)t * 2 * inter + c;
        float g[V], u[V], da[V], dg[V], du[V];
        load_floats(gate_up + at, g);
        load_floats(gate_up + at + inter, u);
        load_floats(d_act + (size_t)t * inter + c, da);
        for (int i = 0; i < V; ++i) {
            const float sigmoid = 1.0f / (1.0f + expf(-g[i]));
            dg[i] = da[i] * u[i] * sigmoid * (1.0f + g[i] * (1.0f - sigmoid));
            du[i] = da[i] * g[i] * sigmoid;
        }
        store_floats(d_gate_up + at, dg);
        store_floats(d_gate_up + at + inter, du);
    });
}

template <typename T>
__device__ void swiglu_backward(const T* __restrict__ gate_up, const T* __restrict__ d_act,
                                T* __restrict__ d_gate_up, int rows, int inter) {
    if (swiglu_packable<T>(gate_up, d_act, d_gate_up, inter))
        swiglu_backward_packs<T, VEC_COLS(T)>(gate_up, d_act, d_gate_up, rows, inter);
    else
        swiglu_backward_packs<T, 1>(gate_up, d_act, d_gate_up, rows, inter);
}

// Merges a running (max, sum of exp(x - max)) pair with another.
__device__ __forceinline__ void merge_exp_sums(float& m, float& s, float other_m, float other_s) {
    const float top = fmaxf(m, other_m);
    if (top == NEG_INF) return;
    s = s * expf(m - top) + other_s * expf(other_m - top);
    m = top;
}

// Row blockIdx.x of logits [rows, vocab]: its log-sum-exp (f32 of the T logits) and the
// log-probability of its label, log_prob = logit[label] - lse.
template <typename T>
__device__ void label_log_softmax(const T* __restrict__ logits,
                                  const unsigned int* __restrict__ labels, float* __restrict__ lse,
                                  float* __restrict__ log_prob, int vocab) {
    __shared__ float warp_m[HEAD_THREADS / 32], warp_s[HEAD_THREADS / 32];
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const T* l = logits + (size_t)row * vocab;
    float m = NEG_INF, s = 0.0f;
    for (int j = tid; j < vocab; j += HEAD_THREADS) merge_exp_sums(m, s, to_float(l[j]), 1.0f);
    for (int mask = 16; mask > 0; mask >>= 1) {
        const float other_m = __shfl_xor_sync(0xffffffffu, m, mask);
        const float other_s = __shfl_xor_sync(0xffffffffu, s, mask);
        merge_exp_sums(m, s, other_m, other_s);
    }
    if (lane == 0) {
        warp_m[warp] = m;
        warp_s[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        m = warp_m[lane];
        s = warp_s[lane];
        for (int mask = 16; mask > 0; mask >>= 1) {
            const float other_m = __shfl_xor_sync(0xffffffffu, m, mask);
            const float other_s = __shfl_xor_sync(0xffffffffu, s, mask);
            merge_exp_sums(m, s, other_m, other_s);
        }
        if (lane == 0) {
            const float total = m + logf(s);
            lse[row] = total;
            log_prob[row] = to_float(l[labels[row]]) - total;
        }
    }
}

// The backward of label_log_softmax for d_log_prob (f32 [rows]): the logits' gradient
// d_log_prob * (onehot(label) - softmax), written over the logits in place.
template <typename T>
__device__ void label_log_softmax_backward(T* __restrict__ logits,
                                           const unsigned int* __restrict__ labels,
                                           const float* __restrict__ lse,
                                           const float* __restrict__ d_log_prob, int rows,
                                           int vocab) {
    const size_t total = (size_t)rows * vocab;
    for (size_t i = (size_t)blockIdx.x * FLAT_THREADS + threadIdx.x; i < total;
         i += (size_t)gridDim.x * FLAT_THREADS) {
        const size_t row = i / vocab, j = i - row * vocab;
        const float p = expf(to_float(logits[i]) - lse[row]);
        logits[i] = from_float<T>(d_log_prob[row] * ((j == labels[row] ? 1.0f : 0.0f) - p));
    }
}

// The embedding table's gradient, one CTA per distinct token u: the rows of `upstream`
// [T, hidden] at its positions (order[starts[u]..starts[u + 1]], ascending) summed in f32 in
// that order and added to row unique[u] of dst (f32 [vocab, hidden]). Every token's rows are
// one CTA's, summed in a fixed order: no atomics, the same gradient on every run, and the
// threads of a CTA read whole rows (candle's index_add gives each column one thread that walks
// every position).
// A thread takes V columns a pack and keeps EMBEDDING_AHEAD positions' loads in flight at once:
// a frequent token's CTA walks thousands of positions, and one dependent load after another made
// it the kernel's whole time (4.1 ms of a 1.7B step at one 2-byte load each). The sums are still
// added in position order.
#define EMBEDDING_AHEAD 8

template <typename T, int V>
__device__ void embedding_backward_packs(const T* __restrict__ upstream,
                                         const unsigned int* __restrict__ order,
                                         const unsigned int* __restrict__ unique,
                                         const unsigned int* __restrict__ starts,
                                         float* __restrict__ dst, int hidden) {
    const unsigned int begin = starts[blockIdx.x], end = starts[blockIdx.x + 1];
    float* row = dst + (size_t)unique[blockIdx.x] * hidden;
    for (int c = V * threadIdx.x; c < hidden; c += V * FLAT_THREADS) {
        float sum[V];
        for (int k = 0; k < V; ++k) sum[k] = 0.0f;
        unsigned int i = begin;
        for (; i + EMBEDDING_AHEAD <= end; i += EMBEDDING_AHEAD) {
            float v[EMBEDDING_AHEAD][V];
            for (int a = 0; a < EMBEDDING_AHEAD; ++a)
                load_floats(upstream + (size_t)order[i + a] * hidden + c, v[a]);
            for (int a = 0; a < EMBEDDING_AHEAD; ++a)
                for (int k = 0; k < V; ++k) sum[k] += v[a][k];
        }
        for (; i < end; ++i) {
            float v[V];
            load_floats(upstream + (size_t)order[i] * hidden + c, v);
            for (int k = 0; k < V; ++k) sum[k] += v[k];
        }
        for (int k = 0; k < V; ++k) row[c + k] += sum[k];
    }
}

template <typename T>
__device__ void embedding_backward(const T* __restrict__ upstream,
                                   const unsigned int* __restrict__ order,
                                   const unsigned int* __restrict__ unique,
                                   const unsigned int* __restrict__ starts, float* __restrict__ dst,
                                   int hidden) {
    if (hidden % VEC_COLS(T) == 0 && aligned(upstream, 16))
        embedding_backward_packs<T, VEC_COLS(T)>(upstream, order, unique, starts, dst, hidden);
    else
        embedding_backward_packs<T, 1>(upstream, order, unique, starts, dst, hidden);
}

#define TRAIN_LAYER_OPS(TYPE, SUFFIX)                                                             \
    extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS) rms_norm_forward_##SUFFIX(     \
        const TYPE* a, const TYPE* b, TYPE* sum_out, const TYPE* w, TYPE* y, float* rstd, int n,  \
        float eps) {                                                                              \
        rms_norm_forward<TYPE>(a, b, sum_out, w, y, rstd, n, eps);                                \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS) rms_norm_backward_##SUFFIX(    \
        const TYPE* x, const TYPE* w, const float* rstd, const TYPE* dy, const TYPE* d_residual,  \
        TYPE* dx, int n) {                                                                        \
        rms_norm_backward<TYPE>(x, w, rstd, dy, d_residual, dx, n);                               \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FLAT_THREADS) norm_weight_grad_##SUFFIX(         \
        const TYPE* x, const float* rstd, const TYPE* dy, float* partial, int rows, int n,        \
        int chunk_rows) {                                                                         \
        norm_weight_grad<TYPE>(x, rstd, dy, partial, rows, n, chunk_rows);                        \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * ROW_WARPS) heads_forward_##SUFFIX(          \
        const TYPE* src, const TYPE* norm_w, const TYPE* cos, const TYPE* sin, TYPE* out,         \
        float* rstd, int ld, int tokens, int heads, int head_dim, float eps) {                    \
        heads_forward<TYPE>(src, norm_w, cos, sin, out, rstd, ld, tokens, heads, head_dim, eps);  \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * ROW_WARPS) heads_backward_##SUFFIX(         \
        const TYPE* d_heads, const TYPE* src, const TYPE* norm_w, const float* rstd,              \
        const TYPE* cos, const TYPE* sin, TYPE* d_src, float* dw_partial, int ld, int d_ld,       \
        int tokens, int heads, int head_dim) {                                                    \
        heads_backward<TYPE>(d_heads, src, norm_w, rstd, cos, sin, d_src, dw_partial, ld, d_ld,   \
                             tokens, heads, head_dim);                                            \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FLAT_THREADS) swiglu_forward_##SUFFIX(           \
        const TYPE* gate_up, TYPE* act, int rows, int inter) {                                    \
        swiglu_forward<TYPE>(gate_up, act, rows, inter);                                          \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FLAT_THREADS) swiglu_backward_##SUFFIX(          \
        const TYPE* gate_up, const TYPE* d_act, TYPE* d_gate_up, int rows, int inter) {           \
        swiglu_backward<TYPE>(gate_up, d_act, d_gate_up, rows, inter);                            \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(HEAD_THREADS) label_log_softmax_##SUFFIX(        \
        const TYPE* logits, const unsigned int* labels, float* lse, float* log_prob, int vocab) { \
        label_log_softmax<TYPE>(logits, labels, lse, log_prob, vocab);                            \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FLAT_THREADS)                                    \
        label_log_softmax_backward_##SUFFIX(TYPE* logits, const unsigned int* labels,             \
                                            const float* lse, const float* d_log_prob, int rows,  \
                                            int vocab) {                                          \
        label_log_softmax_backward<TYPE>(logits, labels, lse, d_log_prob, rows, vocab);           \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FLAT_THREADS) embedding_backward_##SUFFIX(       \
        const TYPE* upstream, const unsigned int* order, const unsigned int* unique,              \
        const unsigned int* starts, float* dst, int hidden) {                                     \
        embedding_backward<TYPE>(upstream, order, unique, starts, dst, hidden);                   \
    }

TRAIN_LAYER_OPS(float, f32)
TRAIN_LAYER_OPS(bf16_t, bf16)
TRAIN_LAYER_OPS(f16_t, f16)
