// Fused attention of training: the forward (output and log-sum-exp) and the backward (dQ, dK,
// dV) of softmax attention under a visibility given per query as two key ranges, with
// FlashAttention-2's tiling on tensor cores: no score, probability or mask tensor in memory,
// and key tiles no query of a tile sees are skipped. crates/dice-model/src/kernels/
// train_attention.rs launches it; the SFT trainer's two-stream mask (masks.rs,
// two_stream_allowed) and any mask whose rows see at most two ranges of keys fit it.
//
// Compiled at run time with NVRTC, with -DHEAD_DIM=<head dim>; bf16 and f16 (raw 16-bit values,
// half.cuh) on sm_80 and newer.
//
// Layouts (contiguous; one packed sequence of `tokens` positions, every segment in it):
//   q, dq       [Hq, T, D]      queries after RoPE, and their gradient
//   k, v, dk, dv [Hkv, T, D]
//   out, d_out  [T, Hq * D]     the attention output (what o_proj takes) and its gradient
//   lse, delta  [Hq, T] f32     log-sum-exp of each query's scaled scores (+inf for a query
//                               that sees nothing), rowsum(d_out * out)
//   spans       [T, 4] u32      query t sees key j iff s0 <= j < s1 or s2 <= j < s3
//   tile_spans  [T / 64, 8] u32 per tile of 64 queries the hull of its rows' first ranges and
//                               of their second ranges (empty ranges left out): key tiles
//                               outside both are skipped; then the keys all its rows see in
//                               their first ranges and in their second (intersections): a key
//                               tile inside one is computed without the per-key test (most
//                               tiles of a long sequence)
//   tile_order  [2, T / 64] u32 the query tile the CTAs along x take (forward, dQ), then the key
//                               tile (dK/dV): heaviest first (masks.rs tile_orders), so that a
//                               grid ends on its lightest CTAs instead of a few long ones
// Query head h reads KV head h / (Hq / Hkv). Scores are (q . k) * scale accumulated in f32 by
// mma.m16n8k16; probabilities and dS are rounded to the input dtype for their products, as
// FlashAttention does; exponentials are taken base 2 with log2(e) folded into the scale (and
// into lse where it is read): one FMA and ex2 per probability.
//
// Kernels (256 threads: two warps per 16 rows of a 64-row tile, 2 CTAs per SM; delta 128):
//   train_attention_forward_*  grid (query tiles, Hq): two warps per 16 queries over the staged
//                              key tiles (double-buffered: the next K/V tile's cp.async in flight
//                              while this one is computed), each over its own 32 keys of every
//                              64 with an online softmax of its own, the two merged at the end;
//                              out and lse
//   train_attention_delta_*    one warp per (query, head): delta
//   train_attention_dq_*       grid (query tiles, Hq), 256 threads: two warps per 16 queries
//                              over the key tiles the tile sees, one recomputing P, the other
//                              dP = dO V^T; each hands its half to the other through shared
//                              memory, and each adds dS K over its own 16 of every 32 keys to a
//                              dQ of its own, the two summed at the end
//   train_attention_dkdv_*     grid (key tiles, Hkv), 256 threads: two warps per 16 keys over
//                              every query tile (of every head of the group) that sees them,
//                              one computing S^T, P^T and dV += P^T dO, the other dP^T, dS^T
//                              (with the first one's P^T, through shared memory) and
//                              dK += dS^T Q; no atomics

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<head dim>"
#endif

#define THREADS 128
// The CTA of the forward, dQ and dK/dV kernels: two warps per 16 rows of the tile (the
// forward's each over half of the keys, the backward's in two roles), so that each holds one
// accumulator: 128 registers a thread, 16 warps an SM.
#define PAIRED_THREADS 256
#define TILE 64
// Halves per staged row: padded by 16 bytes so that the 8 rows of an ldmatrix hit 8 distinct
// bank groups.
#define STRIDE (HEAD_DIM + 8)
#define TILE_HALVES (TILE * STRIDE)
// The dK/dV kernel's staged query tile: Q and dO tiles, the queries' spans, lse and delta.
#define QUERY_BUFFER_BYTES (2 * TILE_HALVES * 2 + TILE * (4 * 4 + 4 + 4))
// Floats per row of what one role of a backward kernel hands the other (16 rows x TILE / 2 f32
// values a half tile: dK/dV's P^T, dQ's P and dP), padded so that a warp's fragment writes spread
// over the banks.
#define PT_STRIDE (TILE / 2 + 8)
// One such array for both halves of a tile and each of its four groups of 16 rows.
#define HANDED_BYTES (2 * 4 * 16 * PT_STRIDE * 4)
// Dynamic shared memory of train_attention_dkdv_* (train_attention.rs mirrors it): the key
// tile's K and V, one query tile, P^T. One query buffer, not two: with a second the CTA would
// not fit twice on an SM.
#define DKDV_SHARED_BYTES (2 * TILE_HALVES * 2 + QUERY_BUFFER_BYTES + HANDED_BYTES)
// Dynamic shared memory of train_attention_dq_* (train_attention.rs mirrors it): one key tile's K
// and V (one, as dK/dV's query tile), the query tile's Q and dO, and what the two roles hand
// each other: P and dP.
#define DQ_SHARED_BYTES (4 * TILE_HALVES * 2 + 2 * HANDED_BYTES)
// Dynamic shared memory of train_attention_forward_* (train_attention.rs mirrors it): two K and
// two V tiles of its key pipeline, and the query tile's Q.
#define FORWARD_SHARED_BYTES (5 * TILE_HALVES * 2)
// What the forward's second warps of each 16 rows hand the first at the end, through the key
// pipeline's memory: the output accumulator and the online softmax's m and l, per lane.
#define FORWARD_MERGE_FLOATS (16 * HEAD_DIM + 4 * 32)
static_assert(4 * FORWARD_MERGE_FLOATS * 4 <= 4 * TILE_HALVES * 2,
              "the forward's merge must fit the key pipeline's memory");

#define TILE_SPAN_WORDS 8
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

#define NEG_INF __uint_as_float(0xff800000u)
#define POS_INF __uint_as_float(0x7f800000u)

static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 128, "HEAD_DIM must be 16, 32, 64 or 128");

#include "half.cuh"

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#include "mma.cuh"

__device__ __forceinline__ bool in_range(unsigned int key, unsigned int begin, unsigned int end) {
    return key >= begin && key < end;
}

// Whether a query of spans `span` (4 values) sees `key`.
__device__ __forceinline__ bool sees(const unsigned int* span, unsigned int key) {
    return in_range(key, span[0], span[1]) || in_range(key, span[2], span[3]);
}

// Whether every query of a tile sees all keys first..first + TILE - 1 (its tile_spans' cores).
__device__ __forceinline__ bool tile_sees_all(const unsigned int* __restrict__ tile_span,
                                              int first) {
    const unsigned int* core = tile_span + 4;
    return ((int)core[0] <= first && first + TILE <= (int)core[1]) ||
           ((int)core[2] <= first && first + TILE <= (int)core[3]);
}

// Whether keys first..end - 1 meet either range of a query tile's tile_spans.
__device__ __forceinline__ bool tile_meets(const unsigned int* __restrict__ tile_span, int first,
                                           int end) {
    return ((int)tile_span[0] < end && (int)tile_span[1] > first) ||
           ((int)tile_span[2] < end && (int)tile_span[3] > first);
}

// Rows first..first + TILE - 1 of src (rows `row_stride` elements apart) into a staged tile by
// cp.async, by the CTA's `threads` threads; rows from `count` on are zeros. The caller commits
// and waits.
template <int threads = THREADS, typename T>
__device__ __forceinline__ void stage_rows(unsigned short* tile, const T* __restrict__ src,
                                           size_t row_stride, int first, int count) {
    constexpr int CHUNKS = HEAD_DIM / 8;
    for (int u = threadIdx.x; u < TILE * CHUNKS; u += threads) {
        const int row = u / CHUNKS, c = u % CHUNKS;
        const bool valid = row < count;
        cp_async_16(tile + row * STRIDE + 8 * c,
                    src + (size_t)(first + (valid ? row : 0)) * row_stride + 8 * c, valid);
    }
}

// The spans of this lane's two rows (first + group, + 8); nothing for rows past `count`.
__device__ __forceinline__ void load_spans(const unsigned int* __restrict__ spans, int first,
                                           int count, unsigned int (&span)[2][4]) {
    const int group = threadIdx.x % 32 / 4;
    for (int r = 0; r < 2; ++r) {
        const int row = first + group + 8 * r;
        for (int i = 0; i < 4; ++i) span[r][i] = row < count ? spans[4 * row + i] : 0u;
    }
}

// Where this lane's element e of accumulator n8 tile nt (row group + 8 (e / 2), column 8 nt +
// 2 quad_lane + (e & 1)) lies in an array one backward role hands the other (PT_STRIDE floats a
// row).
__device__ __forceinline__ int handed_at(int nt, int e) {
    const int lane = threadIdx.x % 32;
    return (lane / 4 + 8 * (e / 2)) * PT_STRIDE + 8 * nt + 2 * (lane % 4) + (e & 1);
}

// acc (+)= A B over staged rows: A the 16 staged rows a_rows (Q, K, V or dO as stored), loaded
// a k-step at a time (four registers of A live, not HEAD_DIM / 4), B^T rows (n rows of
// HEAD_DIM, STRIDE apart) by ldmatrix, `n` columns.
template <typename T, int n>
__device__ __forceinline__ void times_rows(const unsigned short* a_rows,
                                                  const unsigned short* rows,
                                                  float (&acc)[n / 8][4]) {
    const int lane = threadIdx.x % 32, matrix = lane / 8, matrix_row = lane % 8;
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
        unsigned int a[4];
        ldmatrix_x4(a, a_rows + (matrix_row + 8 * (matrix & 1)) * STRIDE + 16 * ks +
                           8 * (matrix >> 1));
        for (int np = 0; np < n / 16; ++np) {
            unsigned int b[4];
            ldmatrix_x4(b, rows + (16 * np + matrix_row + 8 * (matrix >> 1)) * STRIDE + 16 * ks +
                               8 * (matrix & 1));
            mma_m16n8k16<T>(acc[2 * np], a, b[0], b[1]);
            mma_m16n8k16<T>(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// acc += A B with A the 16 x k accumulator tiles p (rounded to T) and B k staged rows of
// HEAD_DIM (V, K, dO or Q as stored), by transposing ldmatrix.
template <typename T, int k>
__device__ __forceinline__ void accumulate_rows(const float (&p)[k / 8][4],
                                                const unsigned short* rows,
                                                float (&acc)[HEAD_DIM / 8][4]) {
    const int lane = threadIdx.x % 32, matrix = lane / 8, matrix_row = lane % 8;
    for (int kp = 0; kp < k / 16; ++kp) {
        // The accumulator layout of two n8 tiles is the A layout of one k16 tile.
        const unsigned int pa[4] = {
            pack_pair<T>(p[2 * kp][0], p[2 * kp][1]), pack_pair<T>(p[2 * kp][2], p[2 * kp][3]),
            pack_pair<T>(p[2 * kp + 1][0], p[2 * kp + 1][1]),
            pack_pair<T>(p[2 * kp + 1][2], p[2 * kp + 1][3])};
        for (int np = 0; np < HEAD_DIM / 16; ++np) {
            unsigned int b[4];
            ldmatrix_x4_trans(b, rows + (16 * kp + matrix_row + 8 * (matrix & 1)) * STRIDE +
                                     16 * np + 8 * (matrix >> 1));
            mma_m16n8k16<T>(acc[2 * np], pa, b[0], b[1]);
            mma_m16n8k16<T>(acc[2 * np + 1], pa, b[2], b[3]);
        }
    }
}

template <int n> __device__ __forceinline__ void zero(float (&acc)[n][4]) {
    for (int i = 0; i < n; ++i)
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
}

// Writes a warp's 16 x HEAD_DIM accumulator times `factor` to rows first.. of dst (rows
// `row_stride` elements apart), rows from `count` on left out.
template <typename T>
__device__ __forceinline__ void store_rows(const float (&acc)[HEAD_DIM / 8][4], const float (&factor)[2],
                                           T* __restrict__ dst, size_t row_stride, int first,
                                           int count) {
    const int lane = threadIdx.x % 32, group = lane / 4, quad_lane = lane % 4;
    for (int r = 0; r < 2; ++r) {
        const int row = first + group + 8 * r;
        if (row >= count) continue;
        unsigned int* words = reinterpret_cast<unsigned int*>(dst + (size_t)row * row_stride);
        for (int n = 0; n < HEAD_DIM / 8; ++n)
            words[4 * n + quad_lane] =
                pack_pair<T>(acc[n][2 * r] * factor[r], acc[n][2 * r + 1] * factor[r]);
    }
}

// Stages the K and V rows first..first + TILE - 1 of one KV head and waits for them.
template <int threads, typename T>
__device__ __forceinline__ void stage_kv(unsigned short* k_tile, unsigned short* v_tile,
                                         const T* __restrict__ k, const T* __restrict__ v,
                                         int first, int tokens) {
    stage_rows<threads>(k_tile, k, HEAD_DIM, first, tokens - first);
    stage_rows<threads>(v_tile, v, HEAD_DIM, first, tokens - first);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
}

// A double-buffered pipeline over the items first.. of a loop (key tiles) below `end`: next(i) is the first item from i to work on (`end` for none),
// stage(item, buffer) starts the item's copies into one of two buffers (cp.async, committed as
// one group; plain stores of small arrays too), step(item, buffer) computes on them. The next
// item's copies are in flight while the warps compute on this one.
template <typename Next, typename Stage, typename Step>
__device__ __forceinline__ void pipelined(int end, Next next, Stage stage, Step step) {
    int item = next(0);
    if (item < end) stage(item, 0);
    for (int buffer = 0; item < end; buffer ^= 1) {
        const int following = next(item + 1);
        if (following < end) {
            stage(following, buffer ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        step(item, buffer);
        // The next item stages into the buffer just read.
        __syncthreads();
        item = following;
    }
}

// Runs step(k_rows, v_rows, key, all_seen) for every key tile key.. that the query tile's
// `tile_span` meets, with its K and V rows staged in `kv` (4 tiles: two buffers of K and V);
// all_seen: every query of the tile sees every key of it.
template <int threads, typename T, typename Step>
__device__ __forceinline__ void over_key_tiles(unsigned short* kv, const T* __restrict__ k_head,
                                               const T* __restrict__ v_head,
                                               const unsigned int* __restrict__ tile_span,
                                               int tokens, Step step) {
    const int tiles = (tokens + TILE - 1) / TILE;
    pipelined(
        tiles,
        [&](int from) {
            for (int t = from; t < tiles; ++t)
                if (tile_meets(tile_span, t * TILE, min(t * TILE + TILE, tokens))) return t;
            return tiles;
        },
        [&](int t, int buffer) {
            const int key = t * TILE;
            stage_rows<threads>(kv + 2 * buffer * TILE_HALVES, k_head, HEAD_DIM, key,
                                tokens - key);
            stage_rows<threads>(kv + (2 * buffer + 1) * TILE_HALVES, v_head, HEAD_DIM, key,
                                tokens - key);
            cp_async_commit();
        },
        [&](int t, int buffer) {
            step(kv + 2 * buffer * TILE_HALVES, kv + (2 * buffer + 1) * TILE_HALVES, t * TILE,
                 tile_sees_all(tile_span, t * TILE));
        });
}

// One warp's forward step for its 16 queries (staged rows q_rows) over `keys` staged keys
// base..: S = Q K^T, masked by the rows' spans (unless every row sees every key), scaled by
// scale_log2 = scale * log2(e); the online softmax's max m and sum l (base 2, this lane's
// columns) and the output o rescaled; O += P V. The rescaling is skipped when no row's max
// moved (most steps past a row's first keys): o times 1 is o.
template <typename T, int keys>
__device__ __forceinline__ void forward_keys(bool masked, const unsigned short* q_rows,
                                             const unsigned short* k_rows,
                                             const unsigned short* v_rows, int base,
                                             const unsigned int (&span)[2][4], float scale_log2,
                                             float (&o)[HEAD_DIM / 8][4], float (&m)[2],
                                             float (&l)[2]) {
    const int quad_lane = threadIdx.x % 4;
    float s[keys / 8][4];
    zero(s);
    times_rows<T, keys>(q_rows, k_rows, s);
    for (int nt = 0; nt < keys / 8; ++nt)
        for (int e = 0; e < 4; ++e) {
            const int key = base + 8 * nt + 2 * quad_lane + (e & 1);
            s[nt][e] = !masked || sees(span[e / 2], key) ? s[nt][e] * scale_log2 : NEG_INF;
        }
    float alpha[2];
    online_softmax<keys, true>(s, m, l, alpha);
    if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f))
        for (int n = 0; n < HEAD_DIM / 8; ++n)
            for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e / 2];
    accumulate_rows<T, keys>(s, v_rows, o);
}

template <typename T>
__device__ void forward(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        const unsigned int* __restrict__ spans,
                        const unsigned int* __restrict__ tile_spans,
                        const unsigned int* __restrict__ tile_order, T* __restrict__ out,
                        float* __restrict__ lse, int tokens, int q_heads, int kv_heads,
                        float scale) {
    unsigned short* kv = reinterpret_cast<unsigned short*>(dynamic_shared_memory);
    unsigned short* q_tile_rows = kv + 4 * TILE_HALVES;
    const int q_tile = tile_order[blockIdx.x], head = blockIdx.y;
    const int kv_head = head / (q_heads / kv_heads);
    const int lane = threadIdx.x % 32, group = lane / 4, quad_lane = lane % 4;
    // Warps 0-3 take keys 0-31 of every key tile for queries 16 w.., warps 4-7 keys 32-63 for
    // the same queries.
    const int warp = threadIdx.x / 32, query_group = warp % 4, key_half = warp / 4;
    const int tile_first = q_tile * TILE, first = tile_first + 16 * query_group;
    // Committed before the first key tile's copies, so waited for with them.
    stage_rows<PAIRED_THREADS>(q_tile_rows, q + (size_t)head * tokens * HEAD_DIM, HEAD_DIM,
                               tile_first, tokens - tile_first);
    cp_async_commit();
    const unsigned short* q_rows = q_tile_rows + 16 * query_group * STRIDE;
    unsigned int span[2][4];
    load_spans(spans, first, tokens, span);
    const T* k_head = k + (size_t)kv_head * tokens * HEAD_DIM;
    const T* v_head = v + (size_t)kv_head * tokens * HEAD_DIM;
    float o[HEAD_DIM / 8][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    zero(o);
    const float scale_log2 = scale * LOG2E;
    const int offset = TILE / 2 * key_half;
    over_key_tiles<PAIRED_THREADS>(
        kv, k_head, v_head, tile_spans + TILE_SPAN_WORDS * q_tile, tokens,
        [&](const unsigned short* k_tile, const unsigned short* v_tile, int key, bool all_seen) {
            forward_keys<T, TILE / 2>(!all_seen, q_rows, k_tile + offset * STRIDE,
                                      v_tile + offset * STRIDE, key + offset, span, scale_log2,
                                      o, m, l);
        });
    // The second warps' accumulators, m and l to the first through the key pipeline's memory
    // (every copy done: a tile that meets no key tile has only its Q copy to wait for),
    // fragment-major, so that a warp's 32 lanes write 512 consecutive bytes.
    cp_async_wait<0>();
    __syncthreads();
    float* merge = reinterpret_cast<float*>(kv) + query_group * FORWARD_MERGE_FLOATS;
    if (key_half == 1) {
        for (int n = 0; n < HEAD_DIM / 8; ++n)
            for (int e = 0; e < 4; ++e) merge[(n * 32 + lane) * 4 + e] = o[n][e];
        for (int r = 0; r < 2; ++r) {
            merge[16 * HEAD_DIM + 4 * lane + r] = m[r];
            merge[16 * HEAD_DIM + 4 * lane + 2 + r] = l[r];
        }
    }
    __syncthreads();
    if (key_half == 1) return;
    // Two online softmaxes over disjoint keys merged: each side's sums and outputs rescaled to
    // the larger max (a side that saw no key has m = -inf, zeros, and a factor 0).
    float factor[2], other_factor[2];
    for (int r = 0; r < 2; ++r) {
        const float other_m = merge[16 * HEAD_DIM + 4 * lane + r];
        const float m_both = fmaxf(m[r], other_m);
        factor[r] = m_both == NEG_INF ? 0.f : exp2f(m[r] - m_both);
        other_factor[r] = m_both == NEG_INF ? 0.f : exp2f(other_m - m_both);
        l[r] = l[r] * factor[r] + merge[16 * HEAD_DIM + 4 * lane + 2 + r] * other_factor[r];
        m[r] = m_both;
    }
    for (int n = 0; n < HEAD_DIM / 8; ++n)
        for (int e = 0; e < 4; ++e)
            o[n][e] = o[n][e] * factor[e / 2] +
                      merge[(n * 32 + lane) * 4 + e] * other_factor[e / 2];
    float inverse[2];
    for (int r = 0; r < 2; ++r) {
        l[r] = quad_sum(l[r]);
        inverse[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
        const int row = first + group + 8 * r;
        // m is a base-2 exponent; lse is natural.
        if (quad_lane == 0 && row < tokens)
            lse[(size_t)head * tokens + row] = l[r] > 0.f ? m[r] * LN2 + logf(l[r]) : POS_INF;
    }
    store_rows(o, inverse, out + (size_t)head * HEAD_DIM, (size_t)q_heads * HEAD_DIM, first,
               tokens);
}

// delta of one (query, head) row per warp.
template <typename T>
__device__ void row_deltas(const T* __restrict__ out, const T* __restrict__ d_out,
                           float* __restrict__ delta, int tokens, int q_heads) {
    const int row = blockIdx.x * (THREADS / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= tokens * q_heads) return;
    // row = token * q_heads + head: the order of out's rows.
    const T* o = out + (size_t)row * HEAD_DIM;
    const T* d = d_out + (size_t)row * HEAD_DIM;
    float sum = 0.f;
    for (int e = lane; e < HEAD_DIM; e += 32) sum += to_float(o[e]) * to_float(d[e]);
    for (int mask = 16; mask > 0; mask >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, mask);
    if (lane == 0) delta[(size_t)(row % q_heads) * tokens + row / q_heads] = sum;
}

// One warp's dQ step for its 16 queries (staged rows q_rows, do_rows) over `keys` staged keys
// base.., as one of a pair: the P warp computes S = Q K^T and P from the saved lse (lse_log2 =
// lse * log2(e), scale_log2 = scale * log2(e)), masked by the rows' spans unless every row sees
// every key; the dP warp computes dP = dO V^T. Each writes its result to `mine` and, after a
// barrier of the whole CTA (both roles reach it once), reads the other's from `theirs`; both
// form dS = P (dP - delta), and each adds dS K over its own 16 keys of every 32 (the P warp the
// first, the dP warp the second) to its own dQ: split over the keys, so that each holds one
// accumulator and does half the products.
template <typename T, int keys>
__device__ __forceinline__ void dq_keys(bool p_role, bool masked, const unsigned short* q_rows,
                                        const unsigned short* do_rows,
                                        const unsigned short* k_rows,
                                        const unsigned short* v_rows, int base,
                                        const unsigned int (&span)[2][4],
                                        const float (&lse_log2)[2], const float (&delta)[2],
                                        float scale_log2, float* mine, const float* theirs,
                                        float (&dq)[HEAD_DIM / 8][4]) {
    static_assert(keys % 32 == 0, "each role takes 16 of every 32 keys");
    const int quad_lane = threadIdx.x % 4;
    float part[keys / 8][4];
    zero(part);
    if (p_role) {
        times_rows<T, keys>(q_rows, k_rows, part);
        for (int nt = 0; nt < keys / 8; ++nt)
            for (int e = 0; e < 4; ++e) {
                const int key = base + 8 * nt + 2 * quad_lane + (e & 1), r = e / 2;
                part[nt][e] = !masked || sees(span[r], key)
                                  ? exp2f(fmaf(part[nt][e], scale_log2, -lse_log2[r]))
                                  : 0.f;
            }
    } else {
        times_rows<T, keys>(do_rows, v_rows, part);
    }
    for (int nt = 0; nt < keys / 8; ++nt)
        for (int e = 0; e < 4; ++e)
            mine[handed_at(nt, e)] = part[nt][e];
    // Both roles reach this barrier once per call, so it is the whole CTA's.
    __syncthreads();
    for (int nt = 0; nt < keys / 8; ++nt)
        for (int e = 0; e < 4; ++e) {
            const float other = theirs[handed_at(nt, e)];
            const float p = p_role ? part[nt][e] : other, dp = p_role ? other : part[nt][e];
            part[nt][e] = p * (dp - delta[e / 2]);
        }
    // Indices known at compile time in each branch: a runtime one would put `part` in local
    // memory.
    for (int slice = 0; slice < keys / 32; ++slice) {
        if (p_role)
            accumulate_rows<T, 16>(reinterpret_cast<const float(&)[2][4]>(part[4 * slice]),
                                   k_rows + 32 * slice * STRIDE, dq);
        else
            accumulate_rows<T, 16>(reinterpret_cast<const float(&)[2][4]>(part[4 * slice + 2]),
                                   k_rows + (32 * slice + 16) * STRIDE, dq);
    }
}

template <typename T>
__device__ void query_gradients(const T* __restrict__ q, const T* __restrict__ k,
                                const T* __restrict__ v, const T* __restrict__ d_out,
                                const unsigned int* __restrict__ spans,
                                const unsigned int* __restrict__ tile_spans,
                                const unsigned int* __restrict__ tile_order,
                                const float* __restrict__ lse, const float* __restrict__ delta,
                                T* __restrict__ dq, int tokens, int q_heads, int kv_heads,
                                float scale) {
    unsigned short* k_tile = reinterpret_cast<unsigned short*>(dynamic_shared_memory);
    unsigned short* v_tile = k_tile + TILE_HALVES;
    unsigned short* q_tile = v_tile + TILE_HALVES;
    unsigned short* do_tile = q_tile + TILE_HALVES;
    float* handed = reinterpret_cast<float*>(do_tile + TILE_HALVES);
    const int tile_index = tile_order[blockIdx.x], head = blockIdx.y;
    const int kv_head = head / (q_heads / kv_heads);
    const int warp = threadIdx.x / 32, query_group = warp % 4, group = threadIdx.x % 32 / 4;
    // Warps 0-3 recompute P of queries 16 w.., warps 4-7 dP of the same queries.
    const bool p_role = warp < 4;
    // What the P warps (`by_p`) or the dP warps hand over in half `half` of a key tile, for
    // this warp's 16 queries.
    const auto handed_by = [&](bool by_p, int half) {
        return handed + ((half * 2 + (by_p ? 0 : 1)) * 4 + query_group) * 16 * PT_STRIDE;
    };
    const int tile_first = tile_index * TILE, first = tile_first + 16 * query_group;
    stage_rows<PAIRED_THREADS>(q_tile, q + (size_t)head * tokens * HEAD_DIM, HEAD_DIM,
                                 tile_first, tokens - tile_first);
    stage_rows<PAIRED_THREADS>(do_tile, d_out + (size_t)head * HEAD_DIM,
                                 (size_t)q_heads * HEAD_DIM, tile_first, tokens - tile_first);
    cp_async_commit();
    unsigned int span[2][4];
    load_spans(spans, first, tokens, span);
    float row_lse[2], row_delta[2];
    for (int r = 0; r < 2; ++r) {
        const int row = first + group + 8 * r;
        row_lse[r] = row < tokens ? lse[(size_t)head * tokens + row] * LOG2E : POS_INF;
        row_delta[r] = row < tokens ? delta[(size_t)head * tokens + row] : 0.f;
    }
    const T* k_head = k + (size_t)kv_head * tokens * HEAD_DIM;
    const T* v_head = v + (size_t)kv_head * tokens * HEAD_DIM;
    const unsigned int* tile_span = tile_spans + TILE_SPAN_WORDS * tile_index;
    float acc[HEAD_DIM / 8][4];
    zero(acc);
    const float scale_log2 = scale * LOG2E;
    const int tiles = (tokens + TILE - 1) / TILE;
    for (int t = 0; t < tiles; ++t) {
        const int key = t * TILE;
        if (!tile_meets(tile_span, key, min(key + TILE, tokens))) continue;
        stage_kv<PAIRED_THREADS>(k_tile, v_tile, k_head, v_head, key, tokens);
        const bool all_seen = tile_sees_all(tile_span, key);
        for (int half = 0; half < 2; ++half) {
            const int offset = TILE / 2 * half;
            dq_keys<T, TILE / 2>(p_role, !all_seen, q_tile + 16 * query_group * STRIDE,
                                 do_tile + 16 * query_group * STRIDE, k_tile + offset * STRIDE,
                                 v_tile + offset * STRIDE, key + offset, span, row_lse,
                                 row_delta, scale_log2, handed_by(p_role, half),
                                 handed_by(!p_role, half), acc);
        }
        // The next key tile is staged into the buffers just read.
        __syncthreads();
    }
    // The dP warps' dQ to the P warps, through the key tile's memory (free now, and at least
    // 4 x 16 x HEAD_DIM floats): fragment-major, so that a warp's 32 lanes write 512
    // consecutive bytes.
    cp_async_wait<0>();
    __syncthreads();
    float* partial = reinterpret_cast<float*>(k_tile) + query_group * 16 * HEAD_DIM;
    const int lane = threadIdx.x % 32;
    if (!p_role)
        for (int n = 0; n < HEAD_DIM / 8; ++n)
            for (int e = 0; e < 4; ++e) partial[(n * 32 + lane) * 4 + e] = acc[n][e];
    __syncthreads();
    if (p_role) {
        for (int n = 0; n < HEAD_DIM / 8; ++n)
            for (int e = 0; e < 4; ++e) acc[n][e] += partial[(n * 32 + lane) * 4 + e];
        const float factor[2] = {scale, scale};
        store_rows(acc, factor, dq + (size_t)head * tokens * HEAD_DIM, HEAD_DIM, first, tokens);
    }
}

// One warp's dK/dV step for its 16 keys (staged rows warp_keys.., key index key0 + row) over
// `queries` staged queries, as one of a pair: the dV warp computes S^T = K Q^T, P^T from the
// queries' lse (staged times log2(e)), masked by their spans unless every query sees every key,
// writes P^T to `pt` and adds P^T dO to its accumulator; the dK warp computes dP^T = V dO^T,
// waits (a barrier of the whole CTA) for P^T, and adds
// dS^T Q, dS^T = P^T (dP^T - delta), to its. The pair's work is the single warp's of before,
// split: each holds one 16 x HEAD_DIM accumulator instead of two.
template <typename T, int queries>
__device__ __forceinline__ void dkdv_queries(bool dv_role, bool masked,
                                             const unsigned short* k_rows,
                                             const unsigned short* v_rows,
                                             const unsigned short* q_rows,
                                             const unsigned short* do_rows,
                                             const unsigned int* q_spans, const float* q_lse_log2,
                                             const float* q_delta, int key0, float scale_log2,
                                             float* pt, float (&acc)[HEAD_DIM / 8][4]) {
    const int lane = threadIdx.x % 32, group = lane / 4, quad_lane = lane % 4;
    float part[queries / 8][4];
    zero(part);
    if (dv_role) {
        times_rows<T, queries>(k_rows, q_rows, part);
        for (int nt = 0; nt < queries / 8; ++nt)
            for (int e = 0; e < 4; ++e) {
                const int query = 8 * nt + 2 * quad_lane + (e & 1);
                const unsigned int key = key0 + group + 8 * (e / 2);
                part[nt][e] = !masked || sees(q_spans + 4 * query, key)
                                  ? exp2f(fmaf(part[nt][e], scale_log2, -q_lse_log2[query]))
                                  : 0.f;
                pt[handed_at(nt, e)] = part[nt][e];
            }
    } else {
        times_rows<T, queries>(v_rows, do_rows, part);
    }
    // Both roles reach this barrier once per call, so it is the whole CTA's.
    __syncthreads();
    if (dv_role) {
        accumulate_rows<T, queries>(part, do_rows, acc);
    } else {
        for (int nt = 0; nt < queries / 8; ++nt)
            for (int e = 0; e < 4; ++e) {
                const int query = 8 * nt + 2 * quad_lane + (e & 1);
                part[nt][e] = pt[handed_at(nt, e)] * (part[nt][e] - q_delta[query]);
            }
        accumulate_rows<T, queries>(part, q_rows, acc);
    }
}

template <typename T>
__device__ void key_gradients(const T* __restrict__ q, const T* __restrict__ k,
                              const T* __restrict__ v, const T* __restrict__ d_out,
                              const unsigned int* __restrict__ spans,
                              const unsigned int* __restrict__ tile_spans,
                              const unsigned int* __restrict__ tile_order,
                              const float* __restrict__ lse, const float* __restrict__ delta,
                              T* __restrict__ dk, T* __restrict__ dv, int tokens, int q_heads,
                              int kv_heads, float scale) {
    unsigned short* k_tile = reinterpret_cast<unsigned short*>(dynamic_shared_memory);
    unsigned short* v_tile = k_tile + TILE_HALVES;
    unsigned short* q_tile = v_tile + TILE_HALVES;
    unsigned short* do_tile = q_tile + TILE_HALVES;
    unsigned int* q_spans = reinterpret_cast<unsigned int*>(do_tile + TILE_HALVES);
    float* q_lse = reinterpret_cast<float*>(q_spans + 4 * TILE);
    float* q_delta = q_lse + TILE;
    float* pt_all = q_delta + TILE;
    // Key tiles are as many as query tiles.
    const int q_tiles = (tokens + TILE - 1) / TILE;
    const int key_first = tile_order[q_tiles + blockIdx.x] * TILE, kv_head = blockIdx.y;
    const int groups = q_heads / kv_heads;
    // Warps 0-3 take dV of keys 16 w.., warps 4-7 dK of the same keys.
    const int warp = threadIdx.x / 32, key_group = warp % 4;
    const bool dv_role = warp < 4;
    const int key_end = min(key_first + TILE, tokens), warp_first = 16 * key_group;
    const size_t kv_offset = (size_t)kv_head * tokens * HEAD_DIM;
    stage_kv<PAIRED_THREADS>(k_tile, v_tile, k + kv_offset, v + kv_offset, key_first, tokens);
    float acc[HEAD_DIM / 8][4];
    zero(acc);
    const float scale_log2 = scale * LOG2E;
    // Items: every query tile of every head of the group, head-major, that meets the key tile.
    const int items = groups * q_tiles;
    for (int i = 0; i < items; ++i) {
        if (!tile_meets(tile_spans + TILE_SPAN_WORDS * (i % q_tiles), key_first, key_end))
            continue;
        const int head = kv_head * groups + i / q_tiles, first = i % q_tiles * TILE;
        const int count = tokens - first;
        stage_rows<PAIRED_THREADS>(q_tile, q + (size_t)head * tokens * HEAD_DIM, HEAD_DIM, first,
                                 count);
        stage_rows<PAIRED_THREADS>(do_tile, d_out + (size_t)head * HEAD_DIM,
                                 (size_t)q_heads * HEAD_DIM, first, count);
        cp_async_commit();
        for (int r = threadIdx.x; r < TILE; r += PAIRED_THREADS) {
            const bool valid = r < count;
            for (int c = 0; c < 4; ++c)
                q_spans[4 * r + c] = valid ? spans[4 * (size_t)(first + r) + c] : 0u;
            q_lse[r] = valid ? lse[(size_t)head * tokens + first + r] * LOG2E : POS_INF;
            q_delta[r] = valid ? delta[(size_t)head * tokens + first + r] : 0.f;
        }
        cp_async_wait<0>();
        __syncthreads();
        const bool all_seen =
            tile_sees_all(tile_spans + TILE_SPAN_WORDS * (i % q_tiles), key_first);
        for (int half = 0; half < 2; ++half) {
            const int offset = TILE / 2 * half;
            dkdv_queries<T, TILE / 2>(
                dv_role, !all_seen, k_tile + warp_first * STRIDE, v_tile + warp_first * STRIDE,
                q_tile + offset * STRIDE, do_tile + offset * STRIDE, q_spans + 4 * offset,
                q_lse + offset, q_delta + offset, key_first + warp_first, scale_log2,
                pt_all + (half * 4 + key_group) * 16 * PT_STRIDE, acc);
        }
        // The next query tile is staged into the buffers just read.
        __syncthreads();
    }
    const float factor[2] = {dv_role ? 1.f : scale, dv_role ? 1.f : scale};
    store_rows(acc, factor, (dv_role ? dv : dk) + kv_offset, HEAD_DIM, key_first + warp_first,
               tokens);
}

#define TRAIN_ATTENTION_KERNELS(TYPE, NAME)                                                      \
    extern "C" __global__ void __launch_bounds__(PAIRED_THREADS, 2) train_attention_forward_##NAME( \
        const TYPE* q, const TYPE* k, const TYPE* v, const unsigned int* spans,                \
        const unsigned int* tile_spans, const unsigned int* tile_order, TYPE* out, float* lse, \
        int tokens, int q_heads, int kv_heads, float scale) {                                  \
        forward<TYPE>(q, k, v, spans, tile_spans, tile_order, out, lse, tokens, q_heads,       \
                      kv_heads, scale);                                                        \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) train_attention_delta_##NAME(        \
        const TYPE* out, const TYPE* d_out, float* delta, int tokens, int q_heads) {           \
        row_deltas<TYPE>(out, d_out, delta, tokens, q_heads);                                  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(PAIRED_THREADS, 2) train_attention_dq_##NAME( \
        const TYPE* q, const TYPE* k, const TYPE* v, const TYPE* d_out,                        \
        const unsigned int* spans, const unsigned int* tile_spans,                             \
        const unsigned int* tile_order, const float* lse, const float* delta, TYPE* dq,        \
        int tokens, int q_heads, int kv_heads, float scale) {                                  \
        query_gradients<TYPE>(q, k, v, d_out, spans, tile_spans, tile_order, lse, delta, dq,   \
                              tokens, q_heads, kv_heads, scale);                               \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(PAIRED_THREADS, 2) train_attention_dkdv_##NAME(  \
        const TYPE* q, const TYPE* k, const TYPE* v, const TYPE* d_out,                        \
        const unsigned int* spans, const unsigned int* tile_spans,                             \
        const unsigned int* tile_order, const float* lse, const float* delta, TYPE* dk,        \
        TYPE* dv, int tokens, int q_heads, int kv_heads, float scale) {                        \
        key_gradients<TYPE>(q, k, v, d_out, spans, tile_spans, tile_order, lse, delta, dk, dv, \
                            tokens, q_heads, kv_heads, scale);                                 \
    }

TRAIN_ATTENTION_KERNELS(bf16_t, bf16)
TRAIN_ATTENTION_KERNELS(f16_t, f16)

#endif
