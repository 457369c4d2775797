// Fused attention of each row's new tokens (a decoding block, or a prefill's blocks) over that
// row's KV cache: the cached forward of dice's SDAR model (crates/dice-model/src/kernels/
// block_attention.rs launches it).
//
// Compiled at run time with NVRTC, with -DHEAD_DIM=<head dim>; bf16 and f16 are raw 16-bit
// values (half.cuh).
//
// Layouts (all contiguous):
//   q    [B, Hq, T, D]            the new tokens' queries (after RoPE)
//   k, v [B, Hkv, capacity, D]    the KV cache; row b's keys live in slots 0..lens[b] + T
//   out  [B, T, Hq * D]           what o_proj takes
// Query token t of row b sees key slot s iff s < lens[b] + (t / block_size + 1) * block_size:
// the cached prefix plus the new tokens of its own and earlier blocks (masks.rs,
// cached_block_mask). Query head h reads KV head h / (Hq / Hkv). Scores are (q . k) / sqrt(D),
// accumulated in f32, with an online (streaming) softmax in f32.
//
// Grid: x = query tile + q_tiles * key split, y = KV head, z = batch row. A CTA takes a tile of
// query rows (group head, token) of one KV head (QUERY_TILE rows, or 2 or 4 times as many for
// the staged tensor-core kernels) and one chunk of that row's keys, so each K/V element is read
// from memory once per query tile. With more than one split per row
// (small batches, to fill the GPU) every CTA writes its unnormalised f32 output with its running
// max and sum, and block_attention_combine_* merges the splits.
//
// The kernels sharing that grid: block_attention_* on CUDA cores (any dtype; K/V tiles converted
// to f32 in shared memory) and, below, on tensor cores (bf16/f16, sm_80+) block_attention_mma2_*
// and block_attention_mma4_* (2 or 4 query tiles sharing staged keys: the forwards of two blocks,
// prefills) and block_attention_mma_* (one query tile: decoding).

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<head dim>"
#endif

#define THREADS 128
#define KEY_TILE 64
#define QUERY_TILE 16
// Rows of the shared tiles are padded by 4 floats: float4 reads of 8 consecutive rows then hit
// 32 distinct banks.
#define ROW_PAD 4
#define KV_STRIDE (HEAD_DIM + ROW_PAD)
#define P_STRIDE (QUERY_TILE + ROW_PAD)
#define COLS (HEAD_DIM / 4)

// Scores: 16 threads along keys x 8 along queries, each computing 2 queries x 4 keys.
#define SCORE_KEY_THREADS 16
#define SCORE_KEYS (KEY_TILE / SCORE_KEY_THREADS)
#define SCORE_QUERIES (QUERY_TILE / (THREADS / SCORE_KEY_THREADS))
// Softmax: 8 consecutive lanes per query row.
#define SOFTMAX_LANES (THREADS / QUERY_TILE)
#define SOFTMAX_KEYS (KEY_TILE / SOFTMAX_LANES)
// P.V: each thread owns 4 consecutive dims of PV_QUERIES query rows.
#define PV_ITEMS (QUERY_TILE * COLS)
#define PV_QUERIES (PV_ITEMS >= THREADS ? PV_ITEMS / THREADS : 1)
#define PV_THREADS (PV_ITEMS / PV_QUERIES)

// NVRTC has no math.h, hence no INFINITY.
#define NEG_INF __uint_as_float(0xff800000u)

static_assert(HEAD_DIM % 4 == 0 && HEAD_DIM <= 128,
              "HEAD_DIM must be a multiple of 4, at most 128");
static_assert(PV_ITEMS % THREADS == 0 || THREADS % PV_ITEMS == 0, "unsupported HEAD_DIM");
static_assert(SOFTMAX_LANES == 8, "softmax reductions assume 8 lanes per query row");

#include "half.cuh"

__device__ __forceinline__ float4 load4(const float* p) {
    return *reinterpret_cast<const float4*>(p);
}

template <typename T> __device__ __forceinline__ float4 load4(const T* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    return make_float4(low_half<T>(u.x), high_half<T>(u.x), low_half<T>(u.y), high_half<T>(u.y));
}

__device__ __forceinline__ void store4(float* p, float4 x) {
    *reinterpret_cast<float4*>(p) = x;
}

template <typename T> __device__ __forceinline__ void store4(T* p, float4 x) {
    const uint2 u = {pack_pair<T>(x.x, x.y), pack_pair<T>(x.z, x.w)};
    *reinterpret_cast<uint2*>(p) = u;
}

__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc);
    return fmaf(a.w, b.w, acc);
}

// Max / sum over the 8 lanes of a softmax row group (lanes 8i..8i+7 of a warp).
__device__ __forceinline__ float row_max(float x) {
    for (int offset = SOFTMAX_LANES / 2; offset > 0; offset /= 2)
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

__device__ __forceinline__ float row_sum(float x) {
    for (int offset = SOFTMAX_LANES / 2; offset > 0; offset /= 2)
        x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// Keys (or values) of slots first..first + count of one (row, KV head) into tile as f32; the
// rest of the tile is zero, so that masked slots never carry stale non-finite values into P.V.
template <typename T>
__device__ __forceinline__ void load_kv_tile(const T* __restrict__ src, int first, int count,
                                             float (*tile)[KV_STRIDE]) {
    for (int u = threadIdx.x; u < KEY_TILE * COLS; u += THREADS) {
        int key = u / COLS, c = u % COLS;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (key < count) x = load4(src + (size_t)(first + key) * HEAD_DIM + 4 * c);
        *reinterpret_cast<float4*>(&tile[key][4 * c]) = x;
    }
}

// Where one CTA of the grid works: its query tile of `tile_queries` rows and key split (x), KV
// head (y) and batch row (z); the keys its queries may see and this split's range of them. Keys
// past the last block any query of the tile sees are left out (a prefill's later blocks): every
// query masks them, so skipping them changes no bit of the result.
struct Tile {
    int q_tile, split, kv_head, row, groups, queries, q_first, q_count, len, keys, key_begin,
        key_end;
    size_t total_q;
    // Index of query row 0 of this KV head in the [B, Hq, T] order of q.
    size_t q_row0;
    // Index of this row and KV head's first key (and value) in the cache.
    size_t kv_base;
};

__device__ __forceinline__ Tile locate_tile(const unsigned int* __restrict__ lens, int batch,
                                            int q_heads, int kv_heads, int tokens,
                                            int block_size, int capacity, int q_tiles,
                                            int chunk_keys, int tile_queries) {
    Tile t;
    t.q_tile = blockIdx.x % q_tiles;
    t.split = blockIdx.x / q_tiles;
    t.kv_head = blockIdx.y;
    t.row = blockIdx.z;
    t.groups = q_heads / kv_heads;
    t.queries = t.groups * tokens;
    t.q_first = t.q_tile * tile_queries;
    t.q_count = min(tile_queries, t.queries - t.q_first);
    t.len = (int)lens[t.row];
    // The tile's queries are consecutive (group head, token) pairs: the last token it holds is
    // its last query's when the tile stays within one head, else the head's last token.
    const int q_last = t.q_first + t.q_count - 1;
    const int last_token = t.q_first / tokens == q_last / tokens ? q_last % tokens : tokens - 1;
    t.keys = t.len + min(tokens, (last_token / block_size + 1) * block_size);
    t.key_begin = t.split * chunk_keys;
    t.key_end = min(t.keys, t.key_begin + chunk_keys);
    t.total_q = (size_t)batch * q_heads * tokens;
    t.q_row0 = ((size_t)t.row * q_heads + (size_t)t.kv_head * t.groups) * tokens;
    t.kv_base = ((size_t)t.row * kv_heads + t.kv_head) * (size_t)capacity * HEAD_DIM;
    return t;
}

// The key slots query qi (of a row of committed length len) sees: the cached prefix and the new
// tokens of its own and earlier blocks.
__device__ __forceinline__ int visible_keys(int qi, int len, int tokens, int block_size) {
    return len + ((qi % tokens) / block_size + 1) * block_size;
}

// A split past its row's keys leaves an empty partial result for the combine to skip; true then.
__device__ __forceinline__ bool past_the_keys(const Tile& t, float* __restrict__ part_ml) {
    if (t.key_begin < t.keys) return false;
    for (int r = threadIdx.x; r < t.q_count; r += THREADS) {
        float* ml = part_ml + ((size_t)t.split * t.total_q + t.q_row0 + t.q_first + r) * 2;
        ml[0] = NEG_INF;
        ml[1] = 0.f;
    }
    return true;
}

template <typename T>
__device__ void attend(const T* __restrict__ q, const T* __restrict__ k,
                       const T* __restrict__ v, const unsigned int* __restrict__ lens,
                       T* __restrict__ out, float* __restrict__ part_acc,
                       float* __restrict__ part_ml, int batch, int q_heads, int kv_heads,
                       int tokens, int block_size, int capacity, int q_tiles, int chunk_keys,
                       int splits, float scale) {
    __shared__ __align__(16) float q_s[QUERY_TILE][KV_STRIDE];
    __shared__ __align__(16) float kv_s[KEY_TILE][KV_STRIDE];
    __shared__ __align__(16) float p_s[KEY_TILE][P_STRIDE];
    __shared__ float m_s[QUERY_TILE], l_s[QUERY_TILE], alpha_s[QUERY_TILE];
    __shared__ int limit_s[QUERY_TILE];

    const int tid = threadIdx.x;
    const Tile tile = locate_tile(lens, batch, q_heads, kv_heads, tokens, block_size, capacity,
                                  q_tiles, chunk_keys, QUERY_TILE);
    const auto [q_tile, split, kv_head, row, groups, queries, q_first, q_count, len, keys,
                key_begin, key_end, total_q, q_row0, kv_base] = tile;
    if (past_the_keys(tile, part_ml)) return;

    if (tid < QUERY_TILE) {
        int qi = q_first + tid;
        // Rows past the last query see nothing and are never written.
        limit_s[tid] = qi < queries ? visible_keys(qi, len, tokens, block_size) : 0;
        m_s[tid] = NEG_INF;
        l_s[tid] = 0.f;
    }
    for (int u = tid; u < QUERY_TILE * COLS; u += THREADS) {
        int r = u / COLS, c = u % COLS;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (q_first + r < queries) x = load4(q + (q_row0 + q_first + r) * HEAD_DIM + 4 * c);
        *reinterpret_cast<float4*>(&q_s[r][4 * c]) = x;
    }

    const int score_key = tid % SCORE_KEY_THREADS;
    const int score_query = tid / SCORE_KEY_THREADS;
    const int soft_row = tid / SOFTMAX_LANES;
    const int soft_lane = tid % SOFTMAX_LANES;
    const int pv_col = tid % COLS;
    const int pv_query = (tid / COLS) * PV_QUERIES;
    const bool pv_thread = tid < PV_THREADS;

    float acc[PV_QUERIES][4];
    for (int i = 0; i < PV_QUERIES; ++i)
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;

    for (int tile = key_begin; tile < key_end; tile += KEY_TILE) {
        const int tile_keys = min(KEY_TILE, key_end - tile);
        load_kv_tile(k + kv_base, tile, tile_keys, kv_s);
        __syncthreads();

        float s[SCORE_QUERIES][SCORE_KEYS];
        for (int i = 0; i < SCORE_QUERIES; ++i)
            for (int j = 0; j < SCORE_KEYS; ++j) s[i][j] = 0.f;
#pragma unroll 4
        for (int c = 0; c < COLS; ++c) {
            float4 kk[SCORE_KEYS];
            for (int j = 0; j < SCORE_KEYS; ++j)
                kk[j] = *reinterpret_cast<const float4*>(
                    &kv_s[score_key + SCORE_KEY_THREADS * j][4 * c]);
            for (int i = 0; i < SCORE_QUERIES; ++i) {
                float4 qq = *reinterpret_cast<const float4*>(
                    &q_s[score_query + (THREADS / SCORE_KEY_THREADS) * i][4 * c]);
                for (int j = 0; j < SCORE_KEYS; ++j) s[i][j] = dot4(qq, kk[j], s[i][j]);
            }
        }
        for (int i = 0; i < SCORE_QUERIES; ++i) {
            int qt = score_query + (THREADS / SCORE_KEY_THREADS) * i;
            for (int j = 0; j < SCORE_KEYS; ++j) {
                int key = score_key + SCORE_KEY_THREADS * j;
                bool visible = key < tile_keys && tile + key < limit_s[qt];
                p_s[key][qt] = visible ? s[i][j] * scale : NEG_INF;
            }
        }
        __syncthreads();

        // K is consumed: values go into the same tile while the softmax runs on the scores.
        load_kv_tile(v + kv_base, tile, tile_keys, kv_s);
        {
            const float m_old = m_s[soft_row];
            float x[SOFTMAX_KEYS];
            float tile_max = NEG_INF;
            for (int j = 0; j < SOFTMAX_KEYS; ++j) {
                x[j] = p_s[soft_lane + SOFTMAX_LANES * j][soft_row];
                tile_max = fmaxf(tile_max, x[j]);
            }
            const float m_new = fmaxf(m_old, row_max(tile_max));
            // A row that has seen no visible key yet keeps m = -inf, l = 0 and a zero output.
            const bool empty = m_new == NEG_INF;
            const float alpha = empty ? 1.f : expf(m_old - m_new);
            float sum = 0.f;
            for (int j = 0; j < SOFTMAX_KEYS; ++j) {
                float p = empty ? 0.f : expf(x[j] - m_new);
                p_s[soft_lane + SOFTMAX_LANES * j][soft_row] = p;
                sum += p;
            }
            sum = row_sum(sum);
            if (soft_lane == 0) {
                m_s[soft_row] = m_new;
                l_s[soft_row] = l_s[soft_row] * alpha + sum;
                alpha_s[soft_row] = alpha;
            }
        }
        __syncthreads();

        if (pv_thread) {
            for (int i = 0; i < PV_QUERIES; ++i) {
                float a = alpha_s[pv_query + i];
                for (int e = 0; e < 4; ++e) acc[i][e] *= a;
            }
#pragma unroll 8
            for (int key = 0; key < KEY_TILE; ++key) {
                float4 vv = *reinterpret_cast<const float4*>(&kv_s[key][4 * pv_col]);
                for (int i = 0; i < PV_QUERIES; ++i) {
                    float p = p_s[key][pv_query + i];
                    acc[i][0] = fmaf(p, vv.x, acc[i][0]);
                    acc[i][1] = fmaf(p, vv.y, acc[i][1]);
                    acc[i][2] = fmaf(p, vv.z, acc[i][2]);
                    acc[i][3] = fmaf(p, vv.w, acc[i][3]);
                }
            }
        }
        __syncthreads();
    }

    if (pv_thread) {
        for (int i = 0; i < PV_QUERIES; ++i) {
            int qt = pv_query + i, qi = q_first + qt;
            if (qi >= queries) continue;
            size_t q_row = q_row0 + qi;
            if (splits == 1) {
                int head = kv_head * groups + qi / tokens, t = qi % tokens;
                float inv = 1.f / l_s[qt];
                T* dst = out + (((size_t)row * tokens + t) * q_heads + head) * HEAD_DIM;
                store4(dst + 4 * pv_col, make_float4(acc[i][0] * inv, acc[i][1] * inv,
                                                     acc[i][2] * inv, acc[i][3] * inv));
            } else {
                float* dst = part_acc + ((size_t)split * total_q + q_row) * HEAD_DIM;
                store4(dst + 4 * pv_col, make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
            }
        }
    }
    if (splits > 1 && tid < QUERY_TILE && q_first + tid < queries) {
        float* ml = part_ml + ((size_t)split * total_q + q_row0 + q_first + tid) * 2;
        ml[0] = m_s[tid];
        ml[1] = l_s[tid];
    }
}

// One CTA of HEAD_DIM threads per query row (in q's [B, Hq, T] order): merges the splits.
template <typename T>
__device__ void combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                        T* __restrict__ out, int batch, int q_heads, int tokens, int splits) {
    const size_t total_q = (size_t)batch * q_heads * tokens;
    const size_t q_row = blockIdx.x;
    const int d = threadIdx.x;
    float m_max = NEG_INF;
    for (int s = 0; s < splits; ++s) m_max = fmaxf(m_max, part_ml[(s * total_q + q_row) * 2]);
    float num = 0.f, den = 0.f;
    for (int s = 0; s < splits; ++s) {
        const float* ml = part_ml + (s * total_q + q_row) * 2;
        if (ml[0] == NEG_INF) continue;
        float w = expf(ml[0] - m_max);
        den = fmaf(w, ml[1], den);
        num = fmaf(w, part_acc[(s * total_q + q_row) * HEAD_DIM + d], num);
    }
    const int t = (int)(q_row % tokens);
    const int head = (int)((q_row / tokens) % q_heads);
    const size_t row = q_row / ((size_t)tokens * q_heads);
    out[((row * tokens + t) * q_heads + head) * HEAD_DIM + d] = from_float<T>(num / den);
}

#define DEFINE_KERNELS(TYPE, NAME)                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS) block_attention_##NAME(              \
        const TYPE* q, const TYPE* k, const TYPE* v, const unsigned int* lens, TYPE* out,       \
        float* part_acc, float* part_ml, int batch, int q_heads, int kv_heads, int tokens,     \
        int block_size, int capacity, int q_tiles, int chunk_keys, int splits, float scale) {  \
        attend<TYPE>(q, k, v, lens, out, part_acc, part_ml, batch, q_heads, kv_heads, tokens,  \
                     block_size, capacity, q_tiles, chunk_keys, splits, scale);                \
    }                                                                                          \
    extern "C" __global__ void block_attention_combine_##NAME(                                 \
        const float* part_acc, const float* part_ml, TYPE* out, int batch, int q_heads,        \
        int tokens, int splits) {                                                              \
        combine<TYPE>(part_acc, part_ml, out, batch, q_heads, tokens, splits);                 \
    }

DEFINE_KERNELS(float, f32)
DEFINE_KERNELS(bf16_t, bf16)
DEFINE_KERNELS(f16_t, f16)
// ---------------------------------------------------------------------------------------------
// Tensor-core variant for bf16 / f16 (sm_80 and newer): the same grid, the same results up to
// rounding (the probabilities enter P.V rounded to the input dtype, as in the matmul path).
// A CTA of block_attention_mma{2,4}_* takes Q_TILES query tiles of 16 rows (2: the two blocks of
// a forward that also stores; 4: a prefill) and streams its keys through shared memory in stages of
// 64 K and 64 V rows, copied by cp.async (coalesced 16 bytes per thread, no registers) and read
// into fragments by ldmatrix (transposing V). MMA_STAGES stages rotate, so MMA_STAGES - 1 of
// them are in flight while one is computed: a CTA keeps enough bytes in flight on its own that
// the last, partial wave of CTAs still draws the memory's bandwidth. Warp w takes query tile
// w % Q_TILES and a 64 * Q_TILES / 4 key share of every stage, keeping its own online softmax:
// S = Q K^T and O += P V are mma.m16n8k16 (f32 accumulation) with Q in registers. The warps of
// one query tile are merged through the same shared memory at the end. It is dynamic shared
// memory (more than the 48 KiB of static shared memory): block_attention.rs launches with
// mma_shared_bytes, which mirrors MMA_SHARED_BYTES, and sets MMA_STAGES. A decoding block (one
// query tile) takes block_attention_mma_*, at the end of this file.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

#ifndef MMA_STAGES
#error "compile with -DMMA_STAGES=<stages> (block_attention.rs sets it)"
#endif
#define MMA_WARPS (THREADS / 32)
#define MMA_STAGE_KEYS 64
// Halves per staged K or V row: padded by 16 bytes so that the 8 rows of an ldmatrix hit 8
// distinct bank groups.
#define MMA_STRIDE (HEAD_DIM + 8)
// Halves of one stage (64 K rows, then 64 V rows).
#define MMA_STAGE_HALVES (2 * MMA_STAGE_KEYS * MMA_STRIDE)
#define MMA_STAGE_BYTES (MMA_STAGES * MMA_STAGE_HALVES * 2)
#define MMA_MERGE_BYTES (MMA_WARPS * QUERY_TILE * HEAD_DIM * 4)
#define MMA_SHARED_BYTES (MMA_MERGE_BYTES > MMA_STAGE_BYTES ? MMA_MERGE_BYTES : MMA_STAGE_BYTES)

static_assert(HEAD_DIM % 16 == 0, "the tensor-core kernel needs HEAD_DIM % 16 == 0");
static_assert(MMA_STAGES >= 2, "the tensor-core kernel needs at least two stages");
static_assert(MMA_SHARED_BYTES <= 227 * 1024, "more shared memory than a CTA may have on sm_90");

#include "mma.cuh"

// The A fragments of a warp's query tile (rows first..first + 15; this lane's rows are group
// and group + 8) and the key slots each of this lane's rows sees. Rows past the last query are
// zero, see nothing and are never written.
template <typename T>
__device__ __forceinline__ void load_queries(const T* __restrict__ q, const Tile& tile, int first,
                                             int tokens, int block_size,
                                             unsigned int (&qa)[HEAD_DIM / 16][4],
                                             int (&limit)[2]) {
    const int lane = threadIdx.x % 32, group = lane / 4, quad_lane = lane % 4;
    for (int r = 0; r < 2; ++r) {
        const int qi = first + group + 8 * r;
        const bool valid = qi < tile.queries;
        limit[r] = valid ? visible_keys(qi, tile.len, tokens, block_size) : 0;
        const unsigned int* src = reinterpret_cast<const unsigned int*>(q) +
                                  (tile.q_row0 + (valid ? qi : 0)) * (HEAD_DIM / 2);
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
            qa[ks][r] = valid ? src[8 * ks + quad_lane] : 0u;
            qa[ks][2 + r] = valid ? src[8 * ks + 4 + quad_lane] : 0u;
        }
    }
}

// One warp's step (this thread is lane `lane`) over `keys` keys (base..base + keys - 1) staged at
// k_stage and v_stage (rows MMA_STRIDE apart): S = Q K^T by mma, masked (keys from key_end on,
// and past each row's limit) and scaled; the online softmax's max m, sum l (this lane's columns)
// and the output o rescaled; then O += P V, P rounded to T.
template <typename T, int keys>
__device__ __forceinline__ void attend_keys(int lane, const unsigned int (&qa)[HEAD_DIM / 16][4],
                                            const unsigned short* k_stage,
                                            const unsigned short* v_stage, int base, int key_end,
                                            const int (&limit)[2], float scale,
                                            float (&o)[HEAD_DIM / 8][4], float (&m)[2],
                                            float (&l)[2]) {
    const int quad_lane = lane % 4;
    // The row of the 8x8 matrix whose address this lane gives to ldmatrix.
    const int matrix = lane / 8, matrix_row = lane % 8;
    // Matrices (keys 0-7 | 8-15 of each 16) x (dims 16ks..+7 | +8..+15) give the B fragments of
    // the n8 key tiles.
    float s[keys / 8][4];
    for (int nt = 0; nt < keys / 8; ++nt)
        for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
        for (int kp = 0; kp < keys / 16; ++kp) {
            unsigned int b[4];
            ldmatrix_x4(b, k_stage + (16 * kp + matrix_row + 8 * (matrix >> 1)) * MMA_STRIDE +
                               16 * ks + 8 * (matrix & 1));
            mma_m16n8k16<T>(s[2 * kp], qa[ks], b[0], b[1]);
            mma_m16n8k16<T>(s[2 * kp + 1], qa[ks], b[2], b[3]);
        }
    for (int nt = 0; nt < keys / 8; ++nt)
        for (int e = 0; e < 4; ++e) {
            const int key = base + 8 * nt + 2 * quad_lane + (e & 1);
            s[nt][e] = key < key_end && key < limit[e / 2] ? s[nt][e] * scale : NEG_INF;
        }
    float alpha[2];
    online_softmax<keys>(s, m, l, alpha);
    for (int n = 0; n < HEAD_DIM / 8; ++n) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
    }
    for (int kp = 0; kp < keys / 16; ++kp) {
        // The S accumulator layout of two n8 tiles is the A layout of one k16 tile.
        const unsigned int pa[4] = {
            pack_pair<T>(s[2 * kp][0], s[2 * kp][1]), pack_pair<T>(s[2 * kp][2], s[2 * kp][3]),
            pack_pair<T>(s[2 * kp + 1][0], s[2 * kp + 1][1]),
            pack_pair<T>(s[2 * kp + 1][2], s[2 * kp + 1][3])};
        // Transposed matrices (keys 0-7 | 8-15) x (dims 16np..+7 | +8..+15) give the B
        // fragments of two n8 dim tiles.
        for (int np = 0; np < HEAD_DIM / 16; ++np) {
            unsigned int b[4];
            ldmatrix_x4_trans(b, v_stage + (16 * kp + matrix_row + 8 * (matrix & 1)) * MMA_STRIDE +
                                     16 * np + 8 * (matrix >> 1));
            mma_m16n8k16<T>(o[2 * np], pa, b[0], b[1]);
            mma_m16n8k16<T>(o[2 * np + 1], pa, b[2], b[3]);
        }
    }
}

// The end of a tensor-core kernel: the warps' unnormalised outputs o, with their running max m
// and sum l (of this lane's rows group and group + 8), merged through shared memory (which the
// staged K/V leave free by then) per query row and written to out, or to this split's partials.
// Query row r of the CTA is row r % 16 of the warps w with w % Q_TILES == r / 16.
template <typename T, int Q_TILES>
__device__ __forceinline__ void merge_warps(const Tile& tile, const float (&o)[HEAD_DIM / 8][4],
                                            const float (&m)[2], const float (&l)[2],
                                            T* __restrict__ out, float* __restrict__ part_acc,
                                            float* __restrict__ part_ml, int q_heads, int tokens,
                                            int splits) {
    __shared__ float warp_m[MMA_WARPS][QUERY_TILE], warp_l[MMA_WARPS][QUERY_TILE];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int group = lane / 4, quad_lane = lane % 4;
    // No copy may still be landing in the stages, and no warp still reading them.
    cp_async_wait<0>();
    __syncthreads();
    float* merge = reinterpret_cast<float*>(dynamic_shared_memory);
    for (int n = 0; n < HEAD_DIM / 8; ++n)
        for (int e = 0; e < 4; ++e) {
            const int r = group + 8 * (e / 2), dim = 8 * n + 2 * quad_lane + (e & 1);
            merge[(warp * QUERY_TILE + r) * HEAD_DIM + dim] = o[n][e];
        }
    if (quad_lane == 0) {
        warp_m[warp][group] = m[0];
        warp_m[warp][group + 8] = m[1];
        warp_l[warp][group] = l[0];
        warp_l[warp][group + 8] = l[1];
    }
    __syncthreads();

    // Loops of constant trip counts, which the compiler unrolls.
    constexpr int row_warps = MMA_WARPS / Q_TILES;
    for (int u = tid; u < Q_TILES * QUERY_TILE * HEAD_DIM; u += THREADS) {
        const int cta_r = u / HEAD_DIM, dim = u % HEAD_DIM, qi = tile.q_first + cta_r;
        if (cta_r >= tile.q_count) continue;
        const int r = cta_r % QUERY_TILE, first_warp = cta_r / QUERY_TILE;
        const size_t q_row = tile.q_row0 + qi;
        float m_max = NEG_INF;
        for (int j = 0; j < row_warps; ++j)
            m_max = fmaxf(m_max, warp_m[first_warp + Q_TILES * j][r]);
        float num = 0.f, den = 0.f;
        if (m_max != NEG_INF)
            for (int j = 0; j < row_warps; ++j) {
                const int w = first_warp + Q_TILES * j;
                if (warp_m[w][r] == NEG_INF) continue;
                const float weight = expf(warp_m[w][r] - m_max);
                den = fmaf(weight, warp_l[w][r], den);
                num = fmaf(weight, merge[(w * QUERY_TILE + r) * HEAD_DIM + dim], num);
            }
        if (splits == 1) {
            const int head = tile.kv_head * tile.groups + qi / tokens, t = qi % tokens;
            out[(((size_t)tile.row * tokens + t) * q_heads + head) * HEAD_DIM + dim] =
                from_float<T>(num / den);
        } else {
            part_acc[((size_t)tile.split * tile.total_q + q_row) * HEAD_DIM + dim] = num;
            if (dim == 0) {
                float* ml = part_ml + ((size_t)tile.split * tile.total_q + q_row) * 2;
                ml[0] = m_max;
                ml[1] = den;
            }
        }
    }
}

// Starts the copy of the K and V rows base..base + 63 of one (row, KV head) into a stage (K rows,
// then V rows), every thread of the CTA taking its share; rows from key_end on are zero, so that
// their scores, masked, and P (0) times V never meet stale non-finite values.
template <typename T>
__device__ __forceinline__ void stage_kv(const T* __restrict__ k_rows, const T* __restrict__ v_rows,
                                         int base, int key_end, unsigned short* stage) {
    // A thread copies the same 16-byte chunk of every KEYS_A_PASS-th key: its addresses are
    // computed once and step by constants, instead of a division per copy.
    constexpr int CHUNKS = HEAD_DIM / 8, KEYS_A_PASS = THREADS / CHUNKS;
    static_assert(THREADS % CHUNKS == 0 && MMA_STAGE_KEYS % KEYS_A_PASS == 0,
                  "a pass copies whole keys");
    const int key = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
    unsigned short* dst = stage + key * MMA_STRIDE + 8 * c;
    const size_t first = (size_t)(base + key) * HEAD_DIM + 8 * c;
#pragma unroll
    for (int pass = 0; pass < MMA_STAGE_KEYS / KEYS_A_PASS; ++pass) {
        const bool valid = base + key + pass * KEYS_A_PASS < key_end;
        const size_t offset = valid ? first + (size_t)pass * KEYS_A_PASS * HEAD_DIM : 0;
        unsigned short* to = dst + pass * KEYS_A_PASS * MMA_STRIDE;
        cp_async_16(to, k_rows + offset, valid);
        cp_async_16(to + MMA_STAGE_KEYS * MMA_STRIDE, v_rows + offset, valid);
    }
}

template <typename T, int Q_TILES>
__device__ void attend_mma(const T* __restrict__ q, const T* __restrict__ k,
                           const T* __restrict__ v, const unsigned int* __restrict__ lens,
                           T* __restrict__ out, float* __restrict__ part_acc,
                           float* __restrict__ part_ml, int batch, int q_heads, int kv_heads,
                           int tokens, int block_size, int capacity, int q_tiles, int chunk_keys,
                           int splits, float scale) {
    static_assert(MMA_WARPS % Q_TILES == 0, "every query tile needs the same number of warps");
    // Warps sharing one query tile, and the keys of a stage each of them takes.
    constexpr int key_warps = MMA_WARPS / Q_TILES;
    constexpr int warp_keys = MMA_STAGE_KEYS / key_warps;
    // Staged K and V while the warps run, their unnormalised outputs for the merge afterwards.
    unsigned char* smem = dynamic_shared_memory;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int group = lane / 4, quad_lane = lane % 4;
    const Tile tile = locate_tile(lens, batch, q_heads, kv_heads, tokens, block_size, capacity,
                                  q_tiles, chunk_keys, Q_TILES * QUERY_TILE);
    const auto [q_tile, split, kv_head, row, groups, queries, q_first, q_count, len, keys,
                key_begin, key_end, total_q, q_row0, kv_base] = tile;
    if (past_the_keys(tile, part_ml)) return;

    const T* k_rows = k + kv_base;
    const T* v_rows = v + kv_base;
    unsigned short* stages = reinterpret_cast<unsigned short*>(smem);
    const int stage_count = (key_end - key_begin + MMA_STAGE_KEYS - 1) / MMA_STAGE_KEYS;
    // The first stages stream in while Q is read; every stage is one commit group, empty or not,
    // so that waiting for all but the newest MMA_STAGES - 2 groups means this stage's copies.
    for (int s = 0; s < MMA_STAGES - 1; ++s) {
        if (s < stage_count)
            stage_kv(k_rows, v_rows, key_begin + s * MMA_STAGE_KEYS, key_end,
                     stages + s * MMA_STAGE_HALVES);
        cp_async_commit();
    }

    // This warp's query tile and key share; this lane's query rows in the fragments: group and
    // group + 8.
    const int q_part = warp % Q_TILES, key_part = warp / Q_TILES;
    const int warp_q_first = q_first + QUERY_TILE * q_part;
    int limit[2];
    unsigned int qa[HEAD_DIM / 16][4];
    load_queries(q, tile, warp_q_first, tokens, block_size, qa, limit);
    // Keys from here on are masked for every row of the warp (in a prefill, the later blocks of
    // the CTA's other tiles): the warp skips them. (Key counts are far below 2^24: exact in f32.)
    const int warp_limit = min(key_end, (int)warp_max((float)max(limit[0], limit[1])));

    float o[HEAD_DIM / 8][4];
    for (int n = 0; n < HEAD_DIM / 8; ++n)
        for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

    for (int i = 0; i < stage_count; ++i) {
        // This stage's copies have landed, for every thread; and every warp is done with the
        // stage refilled next, the one computed in the previous iteration.
        cp_async_wait<MMA_STAGES - 2>();
        __syncthreads();
        const int next = i + MMA_STAGES - 1;
        if (next < stage_count)
            stage_kv(k_rows, v_rows, key_begin + next * MMA_STAGE_KEYS, key_end,
                     stages + (next % MMA_STAGES) * MMA_STAGE_HALVES);
        cp_async_commit();

        const int base = key_begin + i * MMA_STAGE_KEYS + key_part * warp_keys;
        if (base >= warp_limit) continue;
        const unsigned short* k_stage =
            stages + (i % MMA_STAGES) * MMA_STAGE_HALVES + key_part * warp_keys * MMA_STRIDE;
        const unsigned short* v_stage = k_stage + MMA_STAGE_KEYS * MMA_STRIDE;
        attend_keys<T, warp_keys>(lane, qa, k_stage, v_stage, base, key_end, limit, scale, o, m,
                                  l);
    }

    l[0] = quad_sum(l[0]);
    l[1] = quad_sum(l[1]);
    if constexpr (key_warps == 1) {
        // Each warp saw all its rows' keys: no merge, the fragments go straight out (two
        // adjacent dims per store).
        for (int r = 0; r < 2; ++r) {
            const int qi = warp_q_first + group + 8 * r;
            if (qi >= queries) continue;
            const size_t q_row = q_row0 + qi;
            if (splits == 1) {
                const int head = kv_head * groups + qi / tokens, t = qi % tokens;
                unsigned int* dst = reinterpret_cast<unsigned int*>(
                    out + (((size_t)row * tokens + t) * q_heads + head) * HEAD_DIM);
                const float inv = 1.f / l[r];
                for (int n = 0; n < HEAD_DIM / 8; ++n)
                    dst[4 * n + quad_lane] =
                        pack_pair<T>(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
            } else {
                float* dst = part_acc + ((size_t)split * total_q + q_row) * HEAD_DIM;
                for (int n = 0; n < HEAD_DIM / 8; ++n) {
                    dst[8 * n + 2 * quad_lane] = o[n][2 * r];
                    dst[8 * n + 2 * quad_lane + 1] = o[n][2 * r + 1];
                }
                if (quad_lane == 0) {
                    float* ml = part_ml + ((size_t)split * total_q + q_row) * 2;
                    ml[0] = m[r];
                    ml[1] = l[r];
                }
            }
        }
        return;
    }
    merge_warps<T, Q_TILES>(tile, o, m, l, out, part_acc, part_ml, q_heads, tokens, splits);
}

// block_attention_mma{2,4}_{bf16,f16}: Q_TILES query tiles per CTA.
#define DEFINE_MMA_KERNEL(TYPE, NAME, Q_TILES)                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS, 2)                                   \
        block_attention_mma##Q_TILES##_##NAME(                                                 \
        const TYPE* q, const TYPE* k, const TYPE* v, const unsigned int* lens, TYPE* out,       \
        float* part_acc, float* part_ml, int batch, int q_heads, int kv_heads, int tokens,     \
        int block_size, int capacity, int q_tiles, int chunk_keys, int splits, float scale) {  \
        attend_mma<TYPE, Q_TILES>(q, k, v, lens, out, part_acc, part_ml, batch, q_heads,       \
                                  kv_heads, tokens, block_size, capacity, q_tiles, chunk_keys, \
                                  splits, scale);                                              \
    }

DEFINE_MMA_KERNEL(bf16_t, bf16, 2)
DEFINE_MMA_KERNEL(bf16_t, bf16, 4)
DEFINE_MMA_KERNEL(f16_t, f16, 2)
DEFINE_MMA_KERNEL(f16_t, f16, 4)

// The decoding variant (one query tile per CTA): each warp streams its own 16-key tiles through
// WARP_STAGES stages of its own, with no barrier between warps until the merge. Its 35 KiB of
// shared memory and at most 170 registers let three CTAs share an SM: on an H200 it draws more
// of the memory's bandwidth than the staged kernel with one query tile (fewer warps per SM) and
// than with four CTAs per SM (at most 128 registers, which spills).
#define WARP_MIN_CTAS 3
#define WARP_KEYS 16
// 16-byte pieces of 16 rows, per lane.
#define WARP_CHUNKS (WARP_KEYS * HEAD_DIM / 8 / 32)
#define WARP_STAGE_HALVES (2 * WARP_KEYS * MMA_STRIDE)
#define WARP_STAGES 2
#define WARP_STAGE_BYTES (MMA_WARPS * WARP_STAGES * WARP_STAGE_HALVES * 2)
#define WARP_SHARED_BYTES (MMA_MERGE_BYTES > WARP_STAGE_BYTES ? MMA_MERGE_BYTES : WARP_STAGE_BYTES)
static_assert(WARP_SHARED_BYTES <= 227 * 1024, "more shared memory than a CTA may have on sm_90");

// Starts the copy of the K and V rows base..base + 15 of one (row, KV head) into a warp's stage
// (K rows, then V rows); rows from key_end on are zero, so that their scores, masked, and P (0)
// times V never meet stale non-finite values.
template <typename T>
__device__ __forceinline__ void stage_kv_tile(const T* __restrict__ k_rows,
                                              const T* __restrict__ v_rows, int base, int key_end,
                                              unsigned short* stage, int lane) {
    for (int i = 0; i < WARP_CHUNKS; ++i) {
        const int u = lane + 32 * i, key = u / (HEAD_DIM / 8), c = u % (HEAD_DIM / 8);
        const bool valid = base + key < key_end;
        const size_t offset = valid ? (size_t)(base + key) * HEAD_DIM + 8 * c : 0;
        unsigned short* dst = stage + key * MMA_STRIDE + 8 * c;
        cp_async_16(dst, k_rows + offset, valid);
        cp_async_16(dst + WARP_KEYS * MMA_STRIDE, v_rows + offset, valid);
    }
}

template <typename T>
__device__ void attend_mma_warp_staged(const T* __restrict__ q, const T* __restrict__ k,
                                       const T* __restrict__ v,
                                       const unsigned int* __restrict__ lens, T* __restrict__ out,
                                       float* __restrict__ part_acc, float* __restrict__ part_ml,
                                       int batch, int q_heads, int kv_heads, int tokens,
                                       int block_size, int capacity, int q_tiles, int chunk_keys,
                                       int splits, float scale) {
    // Staged K and V while the warps run, their unnormalised outputs for the merge afterwards.
    unsigned char* smem = dynamic_shared_memory;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const Tile tile = locate_tile(lens, batch, q_heads, kv_heads, tokens, block_size, capacity,
                                  q_tiles, chunk_keys, QUERY_TILE);
    const auto [q_tile, split, kv_head, row, groups, queries, q_first, q_count, len, keys,
                key_begin, key_end, total_q, q_row0, kv_base] = tile;
    if (past_the_keys(tile, part_ml)) return;

    const T* k_rows = k + kv_base;
    const T* v_rows = v + kv_base;
    unsigned short* stages =
        reinterpret_cast<unsigned short*>(smem) + warp * WARP_STAGES * WARP_STAGE_HALVES;
    const int first_base = key_begin + WARP_KEYS * warp, step = WARP_KEYS * MMA_WARPS;
    // The first tile streams in while Q is read.
    if (first_base < key_end) stage_kv_tile(k_rows, v_rows, first_base, key_end, stages, lane);
    cp_async_commit();

    // This lane's query rows in the fragments: group and group + 8.
    int limit[2];
    unsigned int qa[HEAD_DIM / 16][4];
    load_queries(q, tile, q_first, tokens, block_size, qa, limit);

    float o[HEAD_DIM / 8][4];
    for (int n = 0; n < HEAD_DIM / 8; ++n)
        for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

    for (int base = first_base, stage = 0; base < key_end; base += step, stage ^= 1) {
        // The stage refilled here was last read in the previous iteration, which every lane
        // has finished (the __syncwarp at its end).
        if (base + step < key_end)
            stage_kv_tile(k_rows, v_rows, base + step, key_end,
                          stages + (stage ^ 1) * WARP_STAGE_HALVES, lane);
        cp_async_commit();
        // This tile's copies (all groups but the one just committed) have landed, for every lane.
        cp_async_wait<1>();
        __syncwarp();
        const unsigned short* k_stage = stages + stage * WARP_STAGE_HALVES;
        attend_keys<T, WARP_KEYS>(lane, qa, k_stage, k_stage + WARP_KEYS * MMA_STRIDE, base,
                                  key_end, limit, scale, o, m, l);
        __syncwarp();
    }

    l[0] = quad_sum(l[0]);
    l[1] = quad_sum(l[1]);
    merge_warps<T, 1>(tile, o, m, l, out, part_acc, part_ml, q_heads, tokens, splits);
}
#define DEFINE_WARP_STAGED_KERNEL(TYPE, NAME)                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS, WARP_MIN_CTAS)                       \
        block_attention_mma_##NAME(                                                            \
        const TYPE* q, const TYPE* k, const TYPE* v, const unsigned int* lens, TYPE* out,       \
        float* part_acc, float* part_ml, int batch, int q_heads, int kv_heads, int tokens,     \
        int block_size, int capacity, int q_tiles, int chunk_keys, int splits, float scale) {  \
        attend_mma_warp_staged<TYPE>(q, k, v, lens, out, part_acc, part_ml, batch, q_heads,    \
                                     kv_heads, tokens, block_size, capacity, q_tiles,          \
                                     chunk_keys, splits, scale);                               \
    }

DEFINE_WARP_STAGED_KERNEL(bf16_t, bf16)
DEFINE_WARP_STAGED_KERNEL(f16_t, f16)

#endif
