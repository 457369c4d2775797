// Fused attention of training: the forward (output and log-sum-exp) and the backward (dQ, dK,
// dV) of softmax attention under a visibility given per query as two key ranges, with
// FlashAttention-2's tiling on tensor cores: no score, probability or mask tensor in memory,
// and key tiles no query of a tile sees are skipped. crates/dice-model/src/kernels/
// train_attention.rs launches it; the SFT trainer's two-stream mask (masks.rs,
// two_stream_allowed) and any mask whose rows see at most two ranges of keys fit it.
//
// Compiled at run time with NVRTC, with -DHEAD_DIM=<head dim>; bf16 and f16 (raw 16-bit values,
// half.cuh) on sm_80 and newer, and f32 (without tensor cores: the `_f32` kernels at the end,
// for the fused path at f32's precision).
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
// Kernels (128 threads, 4 warps of 16 rows: one warpgroup, whose products on Hopper are wgmmas
// of 64 rows; the forward held to 3 CTAs per SM, as it ran before its key pipeline took more
// registers):
//   train_attention_forward_*  grid (query tiles, Hq): a warp's 16 queries over the staged key
//                              tiles (double-buffered: the next K/V tile's cp.async in flight
//                              while this one is computed), online softmax, out and lse
//   train_attention_delta_*    one warp per (query, head): delta
//   train_attention_dq_*       grid (query tiles, Hq): recomputes P and dP = dO V^T per key
//                              tile (double-buffered as the forward's), dQ += dS K
//   train_attention_dkdv_*     grid (key tiles, Hkv): a warp's 16 keys over every query tile
//                              (of every head of the group) that sees them, double-buffered:
//                              S^T, dP^T, dV += P^T dO, dK += dS^T Q; no atomics
// and the backward that keeps dS (ds, pair_index: see kept_ds_offset), train_attention.rs's
// default (DICE_ATTENTION_KEEP_DS=0 takes the two above), in place of the dQ kernel and after
// its dK/dV kernel:
//   train_attention_dkdv_keep_ds_*  train_attention_dkdv_* that also stores every dS tile
//   train_attention_dq_from_ds_*    grid (query tiles, Hq / heads): dQ += dS K from the stored
//                                   tiles, for `heads` query heads of one GQA group at once
//                                   (dq_from_ds_heads)

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<head dim>"
#endif

#define THREADS 128
#define TILE 64

#define TILE_SPAN_WORDS 8
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

#define NEG_INF __uint_as_float(0xff800000u)
#define POS_INF __uint_as_float(0x7f800000u)

static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 128, "HEAD_DIM must be 16, 32, 64 or 128");

#include "half.cuh"

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#include "mma.cuh"
// On sm_90a (the arch-specific target NVRTC builds for a Hopper device, nvrtc.rs), with head
// dims of whole 128-byte rows (64, 128), the products run as warpgroup wgmmas with B read from
// shared memory by the tensor cores; elsewhere as per-warp mma.sync with B through ldmatrix.
// The CPU emulation builds both (-DTRAIN_ATTENTION_WGMMA=1 for the first).
#ifndef TRAIN_ATTENTION_WGMMA
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && HEAD_DIM % 64 == 0
#define TRAIN_ATTENTION_WGMMA 1
#else
#define TRAIN_ATTENTION_WGMMA 0
#endif
#endif
#if TRAIN_ATTENTION_WGMMA
#include "wgmma.cuh"
static_assert(HEAD_DIM % 64 == 0, "the wgmma path stages rows of 128-byte swizzled atoms");

// A staged tile of TILE rows of HEAD_DIM halves: per 64 columns, TILE rows of 128 bytes whose
// 16-byte chunks are swizzled (chunk ^ row % 8), Hopper's 128-byte swizzle (wgmma.cuh); a
// warp's copies of whole rows store without bank conflicts, and so do ldmatrix's 8 rows.
#define TILE_HALVES (TILE * HEAD_DIM)
__device__ __forceinline__ int staged_offset(int row, int chunk) {
    return chunk / 8 * (TILE * 64) + row * 64 + ((chunk % 8) ^ (row % 8)) * 8;
}
#else
// A staged tile of TILE rows of HEAD_DIM halves, each row padded by 16 bytes so that the 8 rows
// of an ldmatrix hit 8 distinct bank groups.
#define STRIDE (HEAD_DIM + 8)
#define TILE_HALVES (TILE * STRIDE)
__device__ __forceinline__ int staged_offset(int row, int chunk) {
    return row * STRIDE + 8 * chunk;
}
#endif
// Dynamic shared memory of the kernels (train_attention.rs reserves the larger, portable
// layout's). One buffer of the dK/dV kernel's query pipeline: Q and dO tiles, the queries'
// spans, lse and delta, rounded up to 1,024 bytes (the swizzle's period, where the next tile
// starts).
#define QUERY_BUFFER_BYTES ((2 * TILE_HALVES * 2 + TILE * (4 * 4 + 4 + 4) + 1023) / 1024 * 1024)
// The dK/dV kernel's key tile (K and V), and two query buffers.
#define DKDV_SHARED_BYTES (2 * TILE_HALVES * 2 + 2 * QUERY_BUFFER_BYTES)
// Two K and two V tiles of the forward and dQ kernels' key pipeline.
#define KEY_PIPELINE_SHARED_BYTES (4 * TILE_HALVES * 2)
// Query heads of one GQA group that a CTA of the dQ kernel from kept dS takes at once, when
// the group's size is a multiple of it (else 1; dq_from_ds_heads): their K tile, the same for
// all, is staged once instead of once a head (the kernel is bound by its reads). Each head
// takes a dQ accumulator (64 registers a thread at head dim 128): 2 take 196 registers on
// sm_90a at head dim 128 against 121 for 1, no spills (2 CTAs an SM instead of 4; held to 3,
// it spills and ptxas serializes the wgmmas). On an H100, 2 took the 1.7B step's attention
// backward 129.7 -> 125.1 ms (4B: no change; bench/notes/train-h200.md, session 30).
#define DQ_FROM_DS_MAX_HEADS 2
// Two buffers of the dQ kernel from kept dS (train_attention_dq_from_ds), each a K tile and
// DQ_FROM_DS_MAX_HEADS dS^T tiles.
#define DQ_FROM_DS_SHARED_BYTES (2 * (TILE_HALVES + DQ_FROM_DS_MAX_HEADS * TILE * TILE) * 2)

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

// The first key tile from `from` on that meets either range of a query tile's tile_spans, or
// the number of tiles: the pairs of tiles that the forward and dQ kernels compute and dK/dV's,
// and whose dS the backward keeps (train_attention.rs numbers them alike,
// KeySpans::tile_pairs).
__device__ __forceinline__ int next_visible_key_tile(const unsigned int* __restrict__ tile_span,
                                                     int from, int tokens) {
    const int tiles = (tokens + TILE - 1) / TILE;
    for (int t = from; t < tiles; ++t)
        if (tile_meets(tile_span, t * TILE, min(t * TILE + TILE, tokens))) return t;
    return tiles;
}

// Rows first..first + TILE - 1 of src (rows `row_stride` elements apart) into a staged tile by
// cp.async; rows from `count` on are zeros. The caller commits and waits. A warp copies whole
// rows (whole 128-byte lines of memory), each line's 8 lanes into one 128-byte stretch. A thread
// copies the same 16-byte chunk of every ROWS_A_PASS-th row: its addresses are computed once and
// step by constants (a multiple of 8 rows keeps the swizzle's row % 8), instead of a division
// per copy.
template <typename T>
__device__ __forceinline__ void stage_rows(unsigned short* tile, const T* __restrict__ src,
                                           size_t row_stride, int first, int count) {
    constexpr int CHUNKS = HEAD_DIM / 8, ROWS_A_PASS = THREADS / CHUNKS;
    static_assert(THREADS % CHUNKS == 0 && ROWS_A_PASS % 8 == 0 && TILE % ROWS_A_PASS == 0,
                  "a pass copies whole rows, a multiple of 8 of them");
    const int row = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
    unsigned short* to = tile + staged_offset(row, c);
    const T* from = src + (size_t)(first + row) * row_stride + 8 * c;
    const T* first_row = src + (size_t)first * row_stride + 8 * c;
#pragma unroll
    for (int pass = 0; pass < TILE / ROWS_A_PASS; ++pass) {
        const bool valid = row + pass * ROWS_A_PASS < count;
        cp_async_16(to + staged_offset(pass * ROWS_A_PASS, 0),
                    valid ? from + (size_t)pass * ROWS_A_PASS * row_stride : first_row, valid);
    }
}

// The A fragments of 16 rows first.. of src (rows `row_stride` elements apart; this lane's rows
// are group and group + 8); rows from `count` on are zeros.
template <typename T>
__device__ __forceinline__ void load_a_rows(const T* __restrict__ src, size_t row_stride,
                                            int first, int count,
                                            unsigned int (&a)[HEAD_DIM / 16][4]) {
    const int lane = threadIdx.x % 32, group = lane / 4, quad_lane = lane % 4;
    for (int r = 0; r < 2; ++r) {
        const int row = first + group + 8 * r;
        const bool valid = row < count;
        const unsigned int* words =
            reinterpret_cast<const unsigned int*>(src + (size_t)(valid ? row : 0) * row_stride);
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
            a[ks][r] = valid ? words[8 * ks + quad_lane] : 0u;
            a[ks][2 + r] = valid ? words[8 * ks + 4 + quad_lane] : 0u;
        }
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

#if TRAIN_ATTENTION_WGMMA
// K-major staged rows (k along their HEAD_DIM columns) as a wgmma operand for k16 step ks: 32
// bytes into a row's 128-byte atom (the next atom's rows from ks = 4), 8-row groups 1,024 bytes
// apart.
__device__ __forceinline__ unsigned long long k_step(const unsigned short* rows, int ks) {
    return swizzled_descriptor(rows + staged_offset(0, 2 * ks), 1024);
}

// A's operand for k16 step ks: this warp's fragment, or the warpgroup's 64 staged rows.
__device__ __forceinline__ const auto& k_step(const unsigned int (&a)[HEAD_DIM / 16][4], int ks) {
    return a[ks];
}
#else
// acc's n8 tiles 2 np and 2 np + 1 += A times the two n8 halves of an ldmatrix_x4's B (its
// matrices 0, 1 and 2, 3).
template <typename T, int n>
__device__ __forceinline__ void mma_n16(float (&acc)[n][4], int np, const unsigned int (&a)[4],
                                        const unsigned int (&b)[4]) {
    mma_m16n8k16<T>(acc[2 * np], a, b[0], b[1]);
    mma_m16n8k16<T>(acc[2 * np + 1], a, b[2], b[3]);
}
#endif

// Products are issued, then settled: as wgmmas each issue is one committed group that runs
// while the warpgroup goes on, and settle<pending>(operands...) waits until at most `pending`
// groups are still in flight (groups complete in the order issued), then lets the code touch
// the operands named (the accumulators read next, and the A fragments of products waited for).
// On the mma.sync path a product is done when issued and settling does nothing.
template <int pending, typename... Operands>
__device__ __forceinline__ void settle(Operands&... operands) {
#if TRAIN_ATTENTION_WGMMA
    wgmma_wait<pending>();
    (pin(operands), ...);
#endif
}

template <int n> __device__ __forceinline__ void zero(float (&acc)[n][4]) {
    for (int i = 0; i < n; ++i)
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
}

// Issues acc = A B over the staged rows: A from registers (this warp's 16 rows) or, as wgmmas
// only, 64 staged rows (K-major as B), B^T the n staged rows (K or V as stored: k along their
// HEAD_DIM columns), `n` columns. As wgmmas, the warpgroup's 64 rows at once, every warp
// calling; the first k step does not accumulate (wgmma's scale-d), so acc needs no zeroing.
template <typename T, int n, typename A>
__device__ __forceinline__ void issue_times_rows(const A& a, const unsigned short* rows,
                                                 float (&acc)[n / 8][4]) {
#if TRAIN_ATTENTION_WGMMA
    wgmma_begin(acc);
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
        wgmma_m64k16<T, false, n>(acc, k_step(a, ks), k_step(rows, ks), ks > 0);
    wgmma_commit();
#else
    zero(acc);
    const int lane = threadIdx.x % 32, matrix = lane / 8, matrix_row = lane % 8;
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
        for (int np = 0; np < n / 16; ++np) {
            unsigned int b[4];
            ldmatrix_x4(b, rows + staged_offset(16 * np + matrix_row + 8 * (matrix >> 1),
                                                2 * ks + (matrix & 1)));
            mma_n16<T>(acc, np, a[ks], b);
        }
#endif
}

// acc = A B (issue_times_rows's product), waited for.
template <typename T, int n, typename A>
__device__ __forceinline__ void times_rows(const A& a, const unsigned short* rows,
                                           float (&acc)[n / 8][4]) {
    issue_times_rows<T, n>(a, rows, acc);
    settle<0>(acc);
}

// The 16 x k accumulator tiles p rounded to T as the A fragments of a product over k (the
// accumulator layout of two n8 tiles is the A layout of one k16 tile).
template <typename T, int k>
__device__ __forceinline__ void pack_rows(const float (&p)[k / 8][4], unsigned int (&pa)[k / 16][4]) {
    for (int kp = 0; kp < k / 16; ++kp) {
        pa[kp][0] = pack_pair<T>(p[2 * kp][0], p[2 * kp][1]);
        pa[kp][1] = pack_pair<T>(p[2 * kp][2], p[2 * kp][3]);
        pa[kp][2] = pack_pair<T>(p[2 * kp + 1][0], p[2 * kp + 1][1]);
        pa[kp][3] = pack_pair<T>(p[2 * kp + 1][2], p[2 * kp + 1][3]);
    }
}

// Issues acc += A B with A the packed fragments pa (pack_rows) and B k staged rows of HEAD_DIM
// (V, K, dO or Q as stored: k along the rows), by transposing ldmatrix or as wgmmas reading B
// MN-major. pa stays untouched until the product is settled.
template <typename T, int k>
__device__ __forceinline__ void issue_accumulate_rows(unsigned int (&pa)[k / 16][4],
                                                      const unsigned short* rows,
                                                      float (&acc)[HEAD_DIM / 8][4]) {
#if TRAIN_ATTENTION_WGMMA
    // The fragments settled before the fence that orders them for the tensor cores.
    pin(pa);
    wgmma_begin(acc);
    // B MN-major, one 64-column atom a wgmma (so that no wgmma's B spans two atoms along its
    // contiguous dimension): rows 16 kp.. of columns 64 h..; its 8-row groups 1,024 bytes apart.
    for (int kp = 0; kp < k / 16; ++kp)
        for (int h = 0; h < HEAD_DIM / 64; ++h)
            wgmma_m64k16<T, true, 64>(
                *reinterpret_cast<float(*)[8][4]>(&acc[8 * h]), pa[kp],
                swizzled_descriptor(rows + staged_offset(16 * kp, 8 * h), 1024));
    wgmma_commit();
#else
    const int lane = threadIdx.x % 32, matrix = lane / 8, matrix_row = lane % 8;
    for (int kp = 0; kp < k / 16; ++kp)
        for (int np = 0; np < HEAD_DIM / 16; ++np) {
            unsigned int b[4];
            ldmatrix_x4_trans(b, rows + staged_offset(16 * kp + matrix_row + 8 * (matrix & 1),
                                                      2 * np + (matrix >> 1)));
            mma_n16<T>(acc, np, pa[kp], b);
        }
#endif
}

// acc += A B with A the 16 x k accumulator tiles p rounded to T (issue_accumulate_rows's
// product), waited for.
template <typename T, int k>
__device__ __forceinline__ void accumulate_rows(const float (&p)[k / 8][4],
                                                const unsigned short* rows,
                                                float (&acc)[HEAD_DIM / 8][4]) {
    unsigned int pa[k / 16][4];
    pack_rows<T, k>(p, pa);
    issue_accumulate_rows<T, k>(pa, rows, acc);
    settle<0>(acc, pa);
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
template <typename T>
__device__ __forceinline__ void stage_kv(unsigned short* k_tile, unsigned short* v_tile,
                                         const T* __restrict__ k, const T* __restrict__ v,
                                         int first, int tokens) {
    stage_rows(k_tile, k, HEAD_DIM, first, tokens - first);
    stage_rows(v_tile, v, HEAD_DIM, first, tokens - first);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
}

// A double-buffered pipeline over the items first.. of a loop (key tiles, or a key tile's query
// tiles) below `end`: next(i) is the first item from i to work on (`end` for none),
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
#if TRAIN_ATTENTION_WGMMA
        // The tensor cores read the staged rows through the async proxy.
        fence_async_shared();
#endif
        __syncthreads();
        step(item, buffer);
        // The next item stages into the buffer just read.
        __syncthreads();
        item = following;
    }
}

// Runs step(k_rows, v_rows, key, masked) for each part of `keys` keys (key..) of every key tile
// that the query tile's `tile_span` meets, with its K and V rows staged in `kv` (4 tiles: two
// buffers of K and V); masked: not every query of the tile sees every key of it.
template <int keys, typename T, typename Step>
__device__ __forceinline__ void over_key_tiles(unsigned short* kv, const T* __restrict__ k_head,
                                               const T* __restrict__ v_head,
                                               const unsigned int* __restrict__ tile_span,
                                               int tokens, Step step) {
    const int tiles = (tokens + TILE - 1) / TILE;
    pipelined(
        tiles,
        [&](int from) { return next_visible_key_tile(tile_span, from, tokens); },
        [&](int t, int buffer) {
            const int key = t * TILE;
            stage_rows(kv + 2 * buffer * TILE_HALVES, k_head, HEAD_DIM, key, tokens - key);
            stage_rows(kv + (2 * buffer + 1) * TILE_HALVES, v_head, HEAD_DIM, key, tokens - key);
            cp_async_commit();
        },
        [&](int t, int buffer) {
            const bool masked = !tile_sees_all(tile_span, t * TILE);
            for (int offset = 0; offset < TILE; offset += keys) {
                step(kv + 2 * buffer * TILE_HALVES + staged_offset(offset, 0),
                     kv + (2 * buffer + 1) * TILE_HALVES + staged_offset(offset, 0),
                     t * TILE + offset, masked);
            }
        });
}

// Entries of a warp's accumulator tile x (16 rows by n columns) that visible(nt, e) rejects set
// to `value`: -inf for scores, 0 for probabilities. Called only for the tiles that not every row
// sees whole (a few per query tile: most of a long sequence's tiles skip the per-key test).
template <int n, typename Visible>
__device__ __forceinline__ void mask_tile(float (&x)[n / 8][4], float value, Visible visible) {
    for (int nt = 0; nt < n / 8; ++nt)
        for (int e = 0; e < 4; ++e)
            if (!visible(nt, e)) x[nt][e] = value;
}

// The online softmax's step (mma.cuh's online_softmax) over a warp's raw scores s (16 rows x
// `keys`, -inf where masked) with the scale folded into each exponential: base 2, scale_log2 =
// scale * log2(e), m in base-2 units of scaled scores (the max is taken on raw scores: scaling
// by a positive factor keeps it), so that a probability costs one FMA and one ex2. A row that
// has seen nothing yet keeps m = -inf and alpha 1; its scores, -inf, give exponentials of 0.
template <int keys>
__device__ __forceinline__ void online_softmax_scaled(float (&s)[keys / 8][4], float scale_log2,
                                                      float (&m)[2], float (&l)[2],
                                                      float (&alpha)[2]) {
    for (int r = 0; r < 2; ++r) {
        float tile_max = NEG_INF;
        for (int nt = 0; nt < keys / 8; ++nt)
            tile_max = fmaxf(tile_max, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
        const float m_new = fmaxf(m[r], quad_max(tile_max) * scale_log2);
        const bool empty = m_new == NEG_INF;
        const float subtracted = empty ? 0.f : m_new;
        alpha[r] = empty ? 1.f : exp2_approx(m[r] - m_new);
        float sum = 0.f;
        for (int nt = 0; nt < keys / 8; ++nt)
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
                s[nt][e] = exp2_approx(fmaf(s[nt][e], scale_log2, -subtracted));
                sum += s[nt][e];
            }
        l[r] = l[r] * alpha[r] + sum;
        m[r] = m_new;
    }
}

// The output rescaled by the online softmax's alpha, skipped when no row of the warp moved its
// max (most steps past a row's first keys): o times 1 is o.
__device__ __forceinline__ void rescale(float (&o)[HEAD_DIM / 8][4], const float (&alpha)[2]) {
    if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f))
        for (int n = 0; n < HEAD_DIM / 8; ++n)
            for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e / 2];
}

// One warp's forward step over `keys` staged keys base..: S = Q K^T, masked by the rows' spans
// (unless every row sees every key); the online softmax (scale_log2 = scale * log2(e)): its max
// m and sum l (base 2, this lane's columns) and the output o rescaled; O += P V.
template <typename T, int keys>
__device__ __forceinline__ void forward_keys(bool masked,
                                             const unsigned int (&qa)[HEAD_DIM / 16][4],
                                             const unsigned short* k_rows,
                                             const unsigned short* v_rows, int base,
                                             const unsigned int (&span)[2][4], float scale_log2,
                                             float (&o)[HEAD_DIM / 8][4], float (&m)[2],
                                             float (&l)[2]) {
    float s[keys / 8][4];
    times_rows<T, keys>(qa, k_rows, s);
    if (masked) {
        const int quad_lane = threadIdx.x % 4;
        mask_tile<keys>(s, NEG_INF, [&](int nt, int e) {
            return sees(span[e / 2], base + 8 * nt + 2 * quad_lane + (e & 1));
        });
    }
    float alpha[2];
    online_softmax_scaled<keys>(s, scale_log2, m, l, alpha);
    rescale(o, alpha);
    accumulate_rows<T, keys>(s, v_rows, o);
}

template <typename T>
__device__ void forward(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        const unsigned int* __restrict__ spans,
                        const unsigned int* __restrict__ tile_spans,
                        const unsigned int* __restrict__ tile_order, T* __restrict__ out,
                        float* __restrict__ lse, int tokens, int q_heads, int kv_heads,
                        float scale) {
    const int q_tile = tile_order[blockIdx.x], head = blockIdx.y;
    const int kv_head = head / (q_heads / kv_heads);
    const int lane = threadIdx.x % 32, group = lane / 4, quad_lane = lane % 4;
    const int first = q_tile * TILE + 16 * (threadIdx.x / 32);
    unsigned int qa[HEAD_DIM / 16][4];
    load_a_rows(q + (size_t)head * tokens * HEAD_DIM, HEAD_DIM, first, tokens, qa);
    unsigned int span[2][4];
    load_spans(spans, first, tokens, span);
    const T* k_head = k + (size_t)kv_head * tokens * HEAD_DIM;
    const T* v_head = v + (size_t)kv_head * tokens * HEAD_DIM;
    float o[HEAD_DIM / 8][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    zero(o);
    const float scale_log2 = scale * LOG2E;
    // A step's scores take 4 registers a thread per 8 keys: as wgmmas (no B fragments held) a
    // whole tile's fit.
    constexpr int keys = TRAIN_ATTENTION_WGMMA ? TILE : TILE / 2;
    over_key_tiles<keys>(reinterpret_cast<unsigned short*>(dynamic_shared_memory), k_head, v_head,
                         tile_spans + TILE_SPAN_WORDS * q_tile, tokens,
                         [&](const unsigned short* k_rows, const unsigned short* v_rows, int key,
                             bool masked) {
                             forward_keys<T, keys>(masked, qa, k_rows, v_rows, key, span,
                                                   scale_log2, o, m, l);
                         });
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

// The two products both backward steps begin with, over `n` staged rows each: scores s = A B^T
// (Q K^T, or K Q^T for dK/dV) and their gradients dp = dA dB^T (dO V^T, or V dO^T); A and dA as
// times_rows takes them. s is settled on return; dp may still be in flight, its product running
// while the caller recomputes the probabilities (settle<0>(dp) before reading it): measured on
// an H100, the backward 4-9 ms a 1.7B or 4B step faster than waiting for each product as it is
// issued (bench/notes/train-h200.md, session 28).
template <typename T, int n, typename A>
__device__ __forceinline__ void scores_and_their_gradients(const A& a, const unsigned short* rows,
                                                           const A& da,
                                                           const unsigned short* d_rows,
                                                           float (&s)[n / 8][4],
                                                           float (&dp)[n / 8][4]) {
    issue_times_rows<T, n>(a, rows, s);
    issue_times_rows<T, n>(da, d_rows, dp);
    settle<1>(s);
}

// A probability recomputed from its score and its query's saved log-sum-exp (base 2: lse_log2 =
// lse * log2(e), scale_log2 = scale * log2(e)); masked tiles then zero the keys not seen
// (mask_tile).
__device__ __forceinline__ float recomputed_p(float score, float scale_log2, float lse_log2) {
    return exp2_approx(fmaf(score, scale_log2, -lse_log2));
}

// One warp's dQ step over `keys` staged keys base..: S = Q K^T and dP = dO V^T, P from the
// saved lse (lse_log2 = lse * log2(e), scale_log2 = scale * log2(e)), masked by the rows' spans
// unless every row sees every key, dS = P (dP - delta), dQ += dS K.
template <typename T, int keys>
__device__ __forceinline__ void dq_keys(bool masked,
                                        const unsigned int (&qa)[HEAD_DIM / 16][4],
                                        const unsigned int (&doa)[HEAD_DIM / 16][4],
                                        const unsigned short* k_rows,
                                        const unsigned short* v_rows, int base,
                                        const unsigned int (&span)[2][4],
                                        const float (&lse_log2)[2], const float (&delta)[2],
                                        float scale_log2, float (&dq)[HEAD_DIM / 8][4]) {
    const int quad_lane = threadIdx.x % 4;
    float s[keys / 8][4], dp[keys / 8][4];
    scores_and_their_gradients<T, keys>(qa, k_rows, doa, v_rows, s, dp);
    for (int nt = 0; nt < keys / 8; ++nt)
        for (int e = 0; e < 4; ++e) s[nt][e] = recomputed_p(s[nt][e], scale_log2, lse_log2[e / 2]);
    if (masked)
        mask_tile<keys>(s, 0.f, [&](int nt, int e) {
            return sees(span[e / 2], base + 8 * nt + 2 * quad_lane + (e & 1));
        });
    settle<0>(dp);
    for (int nt = 0; nt < keys / 8; ++nt)
        for (int e = 0; e < 4; ++e) s[nt][e] *= dp[nt][e] - delta[e / 2];
    accumulate_rows<T, keys>(s, k_rows, dq);
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
    const int q_tile = tile_order[blockIdx.x], head = blockIdx.y;
    const int kv_head = head / (q_heads / kv_heads);
    const int group = threadIdx.x % 32 / 4;
    const int first = q_tile * TILE + 16 * (threadIdx.x / 32);
    unsigned int qa[HEAD_DIM / 16][4], doa[HEAD_DIM / 16][4];
    load_a_rows(q + (size_t)head * tokens * HEAD_DIM, HEAD_DIM, first, tokens, qa);
    load_a_rows(d_out + (size_t)head * HEAD_DIM, (size_t)q_heads * HEAD_DIM, first, tokens, doa);
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
    float acc[HEAD_DIM / 8][4];
    zero(acc);
    const float scale_log2 = scale * LOG2E;
    // As the forward's; a step's scores and their gradients take 8 registers a thread per 8 keys.
    constexpr int keys = TRAIN_ATTENTION_WGMMA ? TILE : TILE / 2;
    over_key_tiles<keys>(reinterpret_cast<unsigned short*>(dynamic_shared_memory), k_head, v_head,
                         tile_spans + TILE_SPAN_WORDS * q_tile, tokens,
                         [&](const unsigned short* k_rows, const unsigned short* v_rows, int key,
                             bool masked) {
                             dq_keys<T, keys>(masked, qa, doa, k_rows, v_rows, key, span, row_lse,
                                              row_delta, scale_log2, acc);
                         });
    const float factor[2] = {scale, scale};
    store_rows(acc, factor, dq + (size_t)head * tokens * HEAD_DIM, HEAD_DIM, first, tokens);
}

// The backward that keeps dS (unless DICE_ATTENTION_KEEP_DS=0): the dK/dV kernel stores each
// dS tile it computes, rounded to the dtype as its dK product takes it, and
// train_attention_dq_from_ds then makes dQ in one product a tile pair (dQ += dS K) instead of
// recomputing S and dP. ds [pairs,
// Hq, TILE * TILE] holds, per visible (query tile, key tile) pair (numbered by pair_index
// [T / 64, T / 64] u32, KeySpans::tile_pairs) and query head, the unscaled dS^T of the pair,
// rows keys and columns queries, as 32-bit words of two queries in the order the dK/dV warps
// hold them: word ((w * TILE / 16 + s) * 4 + r) * 32 + lane is A fragment register r (mma.cuh)
// of warp w's 16 keys by queries 16 s.. at `lane`, so that each of a warp's stores writes one
// whole 128-byte line.

// The halves from ds to the dS tile of pair `pair` and query head `head`.
__device__ __forceinline__ size_t kept_ds_offset(unsigned int pair, int head, int q_heads) {
    return ((size_t)pair * q_heads + head) * TILE * TILE;
}

// Words of a stored dS tile per 16 queries of a warp (its 4 fragment registers of 32 lanes).
#define KEPT_DS_STEP_WORDS (4 * 32)

// Stores this warp's dS^T fragments over `queries` queries (pack_rows) to a stored tile's words
// from those of the step's first queries.
template <int queries>
__device__ __forceinline__ void store_ds(const unsigned int (&dsa)[queries / 16][4],
                                         unsigned int* __restrict__ words) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int kp = 0; kp < queries / 16; ++kp)
        for (int r = 0; r < 4; ++r)
            words[(warp * (TILE / 16) + kp) * KEPT_DS_STEP_WORDS + 32 * r + lane] = dsa[kp][r];
}

// One warp's dK/dV step for its 16 keys (rows 16 w.. of the staged key tile, key index key0 +
// row) over `queries` staged queries: S^T = K Q^T and dP^T = V dO^T, P^T from the queries' lse,
// masked by their spans unless every query sees every key, dS^T = P^T (dP^T - delta), dV +=
// P^T dO, dK += dS^T Q; with keep_ds, dS^T also stored to the tile pair's words from
// `ds_words` (store_ds).
template <typename T, int queries, bool keep_ds>
__device__ __forceinline__ void dkdv_queries(bool masked, const unsigned short* k_tile,
                                             const unsigned short* v_tile,
                                             const unsigned short* q_rows,
                                             const unsigned short* do_rows,
                                             const unsigned int* q_spans, const float* q_lse,
                                             const float* q_delta, int key0, float scale_log2,
                                             float (&dk)[HEAD_DIM / 8][4],
                                             float (&dv)[HEAD_DIM / 8][4],
                                             unsigned int* __restrict__ ds_words) {
    const int lane = threadIdx.x % 32, group = lane / 4, quad_lane = lane % 4;
    float st[queries / 8][4], dpt[queries / 8][4];
#if TRAIN_ATTENTION_WGMMA
    // The key tile's K and V rows are A, read by the tensor cores.
    scores_and_their_gradients<T, queries>(k_tile, q_rows, v_tile, do_rows, st, dpt);
#else
    // The warp's K and V rows as A fragments (rows = keys, k = dims).
    const int matrix = lane / 8, matrix_row = lane % 8, warp_first = 16 * (threadIdx.x / 32);
    unsigned int ka[HEAD_DIM / 16][4], va[HEAD_DIM / 16][4];
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
        const int offset =
            staged_offset(warp_first + matrix_row + 8 * (matrix & 1), 2 * ks + (matrix >> 1));
        ldmatrix_x4(ka[ks], k_tile + offset);
        ldmatrix_x4(va[ks], v_tile + offset);
    }
    scores_and_their_gradients<T, queries>(ka, q_rows, va, do_rows, st, dpt);
#endif
    for (int nt = 0; nt < queries / 8; ++nt)
        for (int e = 0; e < 4; ++e)
            st[nt][e] =
                recomputed_p(st[nt][e], scale_log2, q_lse[8 * nt + 2 * quad_lane + (e & 1)] * LOG2E);
    if (masked)
        mask_tile<queries>(st, 0.f, [&](int nt, int e) {
            return sees(q_spans + 4 * (8 * nt + 2 * quad_lane + (e & 1)),
                        key0 + group + 8 * (e / 2));
        });
    // dV += P^T dO runs while dS^T is computed.
    unsigned int pa[queries / 16][4], dsa[queries / 16][4];
    pack_rows<T, queries>(st, pa);
    issue_accumulate_rows<T, queries>(pa, do_rows, dv);
    settle<1>(dpt);
    for (int nt = 0; nt < queries / 8; ++nt)
        for (int e = 0; e < 4; ++e) {
            const int query = 8 * nt + 2 * quad_lane + (e & 1);
            dpt[nt][e] = st[nt][e] * (dpt[nt][e] - q_delta[query]);
        }
    pack_rows<T, queries>(dpt, dsa);
    // Before the product: a wgmma's A registers may not be read while it is in flight.
    if constexpr (keep_ds) store_ds<queries>(dsa, ds_words);
    issue_accumulate_rows<T, queries>(dsa, q_rows, dk);
    settle<0>(dv, dk, pa, dsa);
}

// Queries of one dK/dV step (dkdv_queries): as wgmmas a whole tile, in half as many wgmmas of
// twice the width as half tiles took (248 registers a thread instead of 213 at head dim 128, no
// spills; the backward 4-5 % faster on an H100: bench/notes/train-h200.md, session 28); the
// mma.sync path's fragments would spill, so it takes half tiles.
#define DKDV_QUERY_STEP (TRAIN_ATTENTION_WGMMA ? TILE : TILE / 2)

template <typename T, bool keep_ds>
__device__ void key_gradients(const T* __restrict__ q, const T* __restrict__ k,
                              const T* __restrict__ v, const T* __restrict__ d_out,
                              const unsigned int* __restrict__ spans,
                              const unsigned int* __restrict__ tile_spans,
                              const unsigned int* __restrict__ tile_order,
                              const float* __restrict__ lse, const float* __restrict__ delta,
                              const unsigned int* __restrict__ pair_index, T* __restrict__ dk,
                              T* __restrict__ dv, T* __restrict__ ds, int tokens, int q_heads,
                              int kv_heads, float scale) {
    unsigned short* k_tile = reinterpret_cast<unsigned short*>(dynamic_shared_memory);
    unsigned short* v_tile = k_tile + TILE_HALVES;
    unsigned char* query_buffers = reinterpret_cast<unsigned char*>(v_tile + TILE_HALVES);
    // The parts of query buffer `buffer`.
    const auto q_tile = [&](int buffer) {
        return reinterpret_cast<unsigned short*>(query_buffers + buffer * QUERY_BUFFER_BYTES);
    };
    const auto do_tile = [&](int buffer) { return q_tile(buffer) + TILE_HALVES; };
    const auto q_spans = [&](int buffer) {
        return reinterpret_cast<unsigned int*>(do_tile(buffer) + TILE_HALVES);
    };
    const auto q_lse = [&](int buffer) {
        return reinterpret_cast<float*>(q_spans(buffer) + 4 * TILE);
    };
    const auto q_delta = [&](int buffer) { return q_lse(buffer) + TILE; };
    // Key tiles are as many as query tiles.
    const int q_tiles = (tokens + TILE - 1) / TILE;
    const int key_tile = tile_order[q_tiles + blockIdx.x], kv_head = blockIdx.y;
    const int key_first = key_tile * TILE, groups = q_heads / kv_heads;
    const int key_end = min(key_first + TILE, tokens), warp_first = 16 * (threadIdx.x / 32);
    const size_t kv_offset = (size_t)kv_head * tokens * HEAD_DIM;
    stage_kv(k_tile, v_tile, k + kv_offset, v + kv_offset, key_first, tokens);
    float dk_acc[HEAD_DIM / 8][4], dv_acc[HEAD_DIM / 8][4];
    zero(dk_acc);
    zero(dv_acc);
    // Items: every query tile of every head of the group, head-major.
    const int items = groups * q_tiles;
    const float scale_log2 = scale * LOG2E;
    pipelined(
        items,
        [&](int from) {
            // next_visible_key_tile's test, the key tile's bounds computed once.
            for (int i = from; i < items; ++i)
                if (tile_meets(tile_spans + TILE_SPAN_WORDS * (i % q_tiles), key_first, key_end))
                    return i;
            return items;
        },
        [&](int i, int buffer) {
            const int head = kv_head * groups + i / q_tiles, first = i % q_tiles * TILE;
            const int count = tokens - first;
            stage_rows(q_tile(buffer), q + (size_t)head * tokens * HEAD_DIM, HEAD_DIM, first,
                       count);
            stage_rows(do_tile(buffer), d_out + (size_t)head * HEAD_DIM,
                       (size_t)q_heads * HEAD_DIM, first, count);
            // Rows past the sequence are zeros: spans that see nothing (masked tiles), and in a
            // tile every row sees, zero Q and dO rows whose dV and dK terms are zero.
            static_assert(THREADS >= TILE, "a thread copies one query's spans, lse and delta");
            if (const int r = threadIdx.x; r < TILE) {
                const bool valid = r < count;
                const size_t row = first + (valid ? r : 0);
                cp_async_16(q_spans(buffer) + 4 * r, spans + 4 * row, valid);
                cp_async_4(q_lse(buffer) + r, lse + (size_t)head * tokens + row, valid);
                cp_async_4(q_delta(buffer) + r, delta + (size_t)head * tokens + row, valid);
            }
            cp_async_commit();
        },
        [&](int i, int buffer) {
            const bool all_seen =
                tile_sees_all(tile_spans + TILE_SPAN_WORDS * (i % q_tiles), key_first);
            unsigned int* ds_words = nullptr;
            if constexpr (keep_ds)
                ds_words = reinterpret_cast<unsigned int*>(
                    ds + kept_ds_offset(pair_index[i % q_tiles * q_tiles + key_tile],
                                        kv_head * groups + i / q_tiles, q_heads));
            for (int offset = 0; offset < TILE; offset += DKDV_QUERY_STEP)
                dkdv_queries<T, DKDV_QUERY_STEP, keep_ds>(
                    !all_seen, k_tile, v_tile, q_tile(buffer) + staged_offset(offset, 0),
                    do_tile(buffer) + staged_offset(offset, 0), q_spans(buffer) + 4 * offset,
                    q_lse(buffer) + offset, q_delta(buffer) + offset, key_first + warp_first,
                    scale_log2, dk_acc, dv_acc,
                    keep_ds ? ds_words + offset / 16 * KEPT_DS_STEP_WORDS : nullptr);
        });
    const float dk_factor[2] = {scale, scale}, dv_factor[2] = {1.f, 1.f};
    store_rows(dk_acc, dk_factor, dk + kv_offset, HEAD_DIM, key_first + warp_first, tokens);
    store_rows(dv_acc, dv_factor, dv + kv_offset, HEAD_DIM, key_first + warp_first, tokens);
}

// A staged dS^T tile (the dQ kernel from kept dS): TILE rows (keys) of TILE queries, 128 bytes
// a row whose 16-byte chunks are swizzled (chunk ^ row % 8), so that the copies of 8 rows'
// chunks and ldmatrix's 8 rows hit 8 distinct bank groups.
__device__ __forceinline__ int staged_ds_offset(int row, int chunk) {
    return row * TILE + (chunk ^ (row % 8)) * 8;
}

// Starts the copies of a stored dS tile (from ds + kept_ds_offset) into a staged one; the caller
// commits and waits. Stored chunk c (16 bytes: 8 queries of a key, one fragment row of 4 lanes)
// is row group c % 8 of register r of warp w's step s (store_ds).
template <typename T>
__device__ __forceinline__ void stage_kept_ds(unsigned short* tile, const T* __restrict__ src) {
    // Thread t copies chunks t + THREADS p: the same group, register and step, warp p (THREADS
    // = 4 warps' 32 chunks of a step), so its row steps by 16 and its column stays.
    static_assert(THREADS == 32 * (TILE / 16), "a pass of the threads copies one warp's steps");
    const int c = threadIdx.x, group = c % 8, r = c / 8 % 4, s = c / 32;
    const int offset = staged_ds_offset(group + 8 * (r & 1), 2 * s + (r >> 1));
#pragma unroll
    for (int w = 0; w < TILE / 16; ++w)
        cp_async_16(tile + offset + 16 * w * TILE, src + 8 * (c + THREADS * w), true);
}

// This warp's A fragments of dS (its 16 queries by the tile's keys) from a staged dS^T tile,
// each 8 x 8 matrix transposed by ldmatrix.
__device__ __forceinline__ void load_ds_rows(const unsigned short* tile,
                                             unsigned int (&dsa)[TILE / 16][4]) {
    const int lane = threadIdx.x % 32, matrix = lane / 8, matrix_row = lane % 8;
    const int warp = threadIdx.x / 32;
    for (int kp = 0; kp < TILE / 16; ++kp)
        ldmatrix_x4_trans(dsa[kp], tile + staged_ds_offset(16 * kp + matrix_row + 8 * (matrix >> 1),
                                                           2 * warp + (matrix & 1)));
}

// Query heads a CTA of the dQ kernel from kept dS takes: DQ_FROM_DS_MAX_HEADS when the GQA
// group's size is a multiple of it, else 1 (train_attention.rs launches Hq / heads CTAs along y).
__device__ __forceinline__ int dq_from_ds_heads(int q_heads, int kv_heads) {
    return q_heads / kv_heads % DQ_FROM_DS_MAX_HEADS == 0 ? DQ_FROM_DS_MAX_HEADS : 1;
}

// dQ from kept dS (after its dK/dV kernel): per query tile and `heads` query heads of one GQA
// group (dq_from_ds_heads), dQ += dS K over the visible key tiles, the K tile (staged once for
// the heads, which share it) and the heads' stored dS tiles double-buffered, written as
// query_gradients writes it. A single product per head: dS as A fragments (so that both paths
// share it), K as B. `heads` is a template argument: the accumulators are register arrays, and
// wgmmas issued under a run-time condition make ptxas wait on each one (C7517).
template <typename T, int heads>
__device__ void query_gradients_from_ds(const T* __restrict__ k, const T* __restrict__ ds,
                                        const unsigned int* __restrict__ tile_spans,
                                        const unsigned int* __restrict__ tile_order,
                                        const unsigned int* __restrict__ pair_index,
                                        T* __restrict__ dq, int tokens, int q_heads,
                                        int kv_heads, float scale) {
    const int q_tile = tile_order[blockIdx.x], first_head = blockIdx.y * heads;
    const int kv_head = first_head / (q_heads / kv_heads);
    const int tiles = (tokens + TILE - 1) / TILE;
    const unsigned int* tile_span = tile_spans + TILE_SPAN_WORDS * q_tile;
    const T* k_head = k + (size_t)kv_head * tokens * HEAD_DIM;
    // Buffer b: a K tile, then a dS^T tile per head (on the wgmma path 1,024-byte aligned, as B
    // is).
    const auto k_tile = [&](int buffer) {
        return reinterpret_cast<unsigned short*>(dynamic_shared_memory) +
               buffer * (TILE_HALVES + heads * TILE * TILE);
    };
    const auto ds_tile = [&](int buffer, int h) {
        return k_tile(buffer) + TILE_HALVES + h * TILE * TILE;
    };
    // The loops over heads unrolled, or the per-head arrays go to local memory.
    float acc[heads][HEAD_DIM / 8][4];
#pragma unroll
    for (auto& head_acc : acc) zero(head_acc);
    pipelined(
        tiles,
        [&](int from) { return next_visible_key_tile(tile_span, from, tokens); },
        [&](int t, int buffer) {
            stage_rows(k_tile(buffer), k_head, HEAD_DIM, t * TILE, tokens - t * TILE);
            const unsigned int pair = pair_index[q_tile * tiles + t];
            for (int h = 0; h < heads; ++h)
                stage_kept_ds(ds_tile(buffer, h),
                              ds + kept_ds_offset(pair, first_head + h, q_heads));
            cp_async_commit();
        },
        [&](int, int buffer) {
            // The heads' products in flight together, each on its own accumulator.
            unsigned int dsa[heads][TILE / 16][4];
#pragma unroll
            for (int h = 0; h < heads; ++h) {
                load_ds_rows(ds_tile(buffer, h), dsa[h]);
                issue_accumulate_rows<T, TILE>(dsa[h], k_tile(buffer), acc[h]);
            }
            settle<0>(acc, dsa);
        });
    const float factor[2] = {scale, scale};
#pragma unroll
    for (int h = 0; h < heads; ++h)
        store_rows(acc[h], factor, dq + (size_t)(first_head + h) * tokens * HEAD_DIM, HEAD_DIM,
                   q_tile * TILE + 16 * (threadIdx.x / 32), tokens);
}

#define TRAIN_ATTENTION_KERNELS(TYPE, NAME)                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS, 3) train_attention_forward_##NAME(    \
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
    extern "C" __global__ void __launch_bounds__(THREADS) train_attention_dq_##NAME(           \
        const TYPE* q, const TYPE* k, const TYPE* v, const TYPE* d_out,                        \
        const unsigned int* spans, const unsigned int* tile_spans,                             \
        const unsigned int* tile_order, const float* lse, const float* delta, TYPE* dq,        \
        int tokens, int q_heads, int kv_heads, float scale) {                                  \
        query_gradients<TYPE>(q, k, v, d_out, spans, tile_spans, tile_order, lse, delta, dq,   \
                              tokens, q_heads, kv_heads, scale);                               \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) train_attention_dkdv_##NAME(         \
        const TYPE* q, const TYPE* k, const TYPE* v, const TYPE* d_out,                        \
        const unsigned int* spans, const unsigned int* tile_spans,                             \
        const unsigned int* tile_order, const float* lse, const float* delta, TYPE* dk,        \
        TYPE* dv, int tokens, int q_heads, int kv_heads, float scale) {                        \
        key_gradients<TYPE, false>(q, k, v, d_out, spans, tile_spans, tile_order, lse, delta,   \
                                   nullptr, dk, dv, nullptr, tokens, q_heads, kv_heads, scale);  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) train_attention_dkdv_keep_ds_##NAME( \
        const TYPE* q, const TYPE* k, const TYPE* v, const TYPE* d_out,                        \
        const unsigned int* spans, const unsigned int* tile_spans,                             \
        const unsigned int* tile_order, const float* lse, const float* delta,                  \
        const unsigned int* pair_index, TYPE* dk, TYPE* dv, TYPE* ds, int tokens, int q_heads, \
        int kv_heads, float scale) {                                                           \
        key_gradients<TYPE, true>(q, k, v, d_out, spans, tile_spans, tile_order, lse, delta,    \
                                  pair_index, dk, dv, ds, tokens, q_heads, kv_heads, scale);    \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) train_attention_dq_from_ds_##NAME(   \
        const TYPE* k, const TYPE* ds, const unsigned int* tile_spans,                         \
        const unsigned int* tile_order, const unsigned int* pair_index, TYPE* dq, int tokens,  \
        int q_heads, int kv_heads, float scale) {                                              \
        if (dq_from_ds_heads(q_heads, kv_heads) == DQ_FROM_DS_MAX_HEADS)                       \
            query_gradients_from_ds<TYPE, DQ_FROM_DS_MAX_HEADS>(                               \
                k, ds, tile_spans, tile_order, pair_index, dq, tokens, q_heads, kv_heads,      \
                scale);                                                                        \
        else                                                                                   \
            query_gradients_from_ds<TYPE, 1>(k, ds, tile_spans, tile_order, pair_index, dq,    \
                                             tokens, q_heads, kv_heads, scale);                \
    }

TRAIN_ATTENTION_KERNELS(bf16_t, bf16)
TRAIN_ATTENTION_KERNELS(f16_t, f16)

// f32: the forward, delta, dQ and dK/dV kernels with the signatures and grids above, without
// tensor cores, for the fused training path at f32's precision (the formula golden's f32 rule
// on the GPU, the step in f32) rather than for speed. A thread takes one row of its CTA's tile
// (a query for the forward and dQ; a key for dK/dV, whose CTA's two halves make dK and dV) and
// works alone, with no shuffle or barrier; every product sums in f32 with nothing rounded between
// (no rounding of P or dS to a 16-bit type), the softmax online as above but base e. dK/dV visits
// the query tiles whose hulls meet the key and tests each query's spans, summing the GQA group's
// heads in order: no atomics, the results do not depend on scheduling. No shared memory
// (train_attention.rs launches them with none).

__device__ __forceinline__ float dot_rows(const float* __restrict__ a, const float* __restrict__ b) {
    float sum = 0.f;
    for (int e = 0; e < HEAD_DIM; ++e) sum += a[e] * b[e];
    return sum;
}

__device__ __forceinline__ void add_scaled_row(float (&acc)[HEAD_DIM], float w,
                                               const float* __restrict__ row) {
    for (int e = 0; e < HEAD_DIM; ++e) acc[e] += w * row[e];
}

__device__ __forceinline__ void store_row(float* __restrict__ row, const float (&acc)[HEAD_DIM],
                                          float factor) {
    for (int e = 0; e < HEAD_DIM; ++e) row[e] = acc[e] * factor;
}

// Calls visit(key) for every key a query of spans `span` sees, in key order within each range;
// a key of the second range inside the first is visited once.
template <typename Visit>
__device__ __forceinline__ void for_each_visible_key(const unsigned int* span, Visit visit) {
    for (unsigned int j = span[0]; j < span[1]; ++j) visit(j);
    for (unsigned int j = span[2]; j < span[3]; ++j)
        if (!in_range(j, span[0], span[1])) visit(j);
}

// This thread's row of its CTA's tile of TILE rows (the tile `tile_order` gives the CTA; both
// halves of the CTA take the same rows), or -1 past the sequence.
__device__ __forceinline__ int thread_row(const unsigned int* tile_order, int tokens) {
    const int row = (int)tile_order[blockIdx.x] * TILE + threadIdx.x % TILE;
    return row < tokens ? row : -1;
}

extern "C" __global__ void __launch_bounds__(THREADS) train_attention_forward_f32(
    const float* q, const float* k, const float* v, const unsigned int* spans,
    const unsigned int* tile_spans, const unsigned int* tile_order, float* out, float* lse,
    int tokens, int q_heads, int kv_heads, float scale) {
    const int i = thread_row(tile_order, tokens), h = blockIdx.y, g = h / (q_heads / kv_heads);
    if (i < 0 || threadIdx.x >= TILE) return;
    const float* qi = q + ((size_t)h * tokens + i) * HEAD_DIM;
    float acc[HEAD_DIM] = {};
    float max_score = NEG_INF, sum = 0.f;
    for_each_visible_key(spans + 4 * (size_t)i, [&](unsigned int j) {
        const size_t key = ((size_t)g * tokens + j) * HEAD_DIM;
        const float s = dot_rows(qi, k + key) * scale;
        const float new_max = fmaxf(max_score, s);
        const float rescale = expf(max_score - new_max), p = expf(s - new_max);
        sum = sum * rescale + p;
        for (int e = 0; e < HEAD_DIM; ++e) acc[e] *= rescale;
        add_scaled_row(acc, p, v + key);
        max_score = new_max;
    });
    // A query that sees nothing: output 0, lse +inf (its probabilities are then all 0).
    store_row(out + ((size_t)i * q_heads + h) * HEAD_DIM, acc, sum > 0.f ? 1.f / sum : 0.f);
    lse[(size_t)h * tokens + i] = sum > 0.f ? max_score + logf(sum) : POS_INF;
}

extern "C" __global__ void __launch_bounds__(THREADS) train_attention_delta_f32(
    const float* out, const float* d_out, float* delta, int tokens, int q_heads) {
    row_deltas<float>(out, d_out, delta, tokens, q_heads);
}

extern "C" __global__ void __launch_bounds__(THREADS) train_attention_dq_f32(
    const float* q, const float* k, const float* v, const float* d_out, const unsigned int* spans,
    const unsigned int* tile_spans, const unsigned int* tile_order, const float* lse,
    const float* delta, float* dq, int tokens, int q_heads, int kv_heads, float scale) {
    const int i = thread_row(tile_order, tokens), h = blockIdx.y, g = h / (q_heads / kv_heads);
    if (i < 0 || threadIdx.x >= TILE) return;
    const size_t row = (size_t)h * tokens + i;
    const float *qi = q + row * HEAD_DIM, *doi = d_out + ((size_t)i * q_heads + h) * HEAD_DIM;
    const float row_lse = lse[row], row_delta = delta[row];
    float acc[HEAD_DIM] = {};
    for_each_visible_key(spans + 4 * (size_t)i, [&](unsigned int j) {
        const size_t key = ((size_t)g * tokens + j) * HEAD_DIM;
        const float p = expf(dot_rows(qi, k + key) * scale - row_lse);
        add_scaled_row(acc, p * (dot_rows(doi, v + key) - row_delta), k + key);
    });
    store_row(dq + row * HEAD_DIM, acc, scale);
}

// The first TILE threads make dK of their key row, the others dV.
extern "C" __global__ void __launch_bounds__(THREADS) train_attention_dkdv_f32(
    const float* q, const float* k, const float* v, const float* d_out, const unsigned int* spans,
    const unsigned int* tile_spans, const unsigned int* tile_order, const float* lse,
    const float* delta, float* dk, float* dv, int tokens, int q_heads, int kv_heads, float scale) {
    const int q_tiles = gridDim.x, g = blockIdx.y, group = q_heads / kv_heads;
    const int j = thread_row(tile_order + q_tiles, tokens);
    if (j < 0) return;
    const bool makes_dk = threadIdx.x < TILE;
    const size_t key = ((size_t)g * tokens + j) * HEAD_DIM;
    float acc[HEAD_DIM] = {};
    for (int h = g * group; h < (g + 1) * group; ++h)
        for (int t = 0; t < q_tiles; ++t) {
            if (!tile_meets(tile_spans + TILE_SPAN_WORDS * t, j, j + 1)) continue;
            for (int i = t * TILE; i < min(t * TILE + TILE, tokens); ++i) {
                if (!sees(spans + 4 * (size_t)i, j)) continue;
                const size_t row = (size_t)h * tokens + i;
                const float *qi = q + row * HEAD_DIM,
                            *doi = d_out + ((size_t)i * q_heads + h) * HEAD_DIM;
                const float p = expf(dot_rows(k + key, qi) * scale - lse[row]);
                if (makes_dk)
                    add_scaled_row(acc, p * (dot_rows(v + key, doi) - delta[row]), qi);
                else
                    add_scaled_row(acc, p, doi);
            }
        }
    store_row((makes_dk ? dk : dv) + key, acc, makes_dk ? scale : 1.f);
}

#endif
