// Runs block_attention.cu on the CPU (cuda_emulation.h) against a direct f64 attention with the
// mask of masks.rs (cached_block_mask), for f32, bf16 and f16, with and without key splits, the
// tensor-core kernels with 1, 2 and 4 query tiles per CTA.
// Build: g++ -std=c++20 -DHEAD_DIM=<d> -DMMA_STAGES=<s> check_block_attention.cpp;
// exits non-zero on a mismatch.
#include "cuda_emulation.h"
#include "../../src/kernels/block_attention.cu"

#include <cmath>
#include <cstdio>
#include <random>
#include <type_traits>

static std::mt19937 rng(7);

template <typename T> struct Kernels;
template <> struct Kernels<float> {
    static constexpr auto attend = block_attention_f32;
    static constexpr auto combine = block_attention_combine_f32;
};
template <> struct Kernels<bf16_t> {
    static constexpr auto attend = block_attention_bf16;
    static constexpr decltype(attend) attend_mma[3] = {
        block_attention_mma_bf16, block_attention_mma2_bf16, block_attention_mma4_bf16};
    static constexpr auto combine = block_attention_combine_bf16;
};
template <> struct Kernels<f16_t> {
    static constexpr auto attend = block_attention_f16;
    static constexpr decltype(attend) attend_mma[3] = {
        block_attention_mma_f16, block_attention_mma2_f16, block_attention_mma4_f16};
    static constexpr auto combine = block_attention_combine_f16;
};

// The kernels compared: the CUDA-core one, then the tensor-core ones with 1 (each warp staging
// its own keys), 2 and 4 query tiles per CTA.
constexpr int VARIANTS = 4;
constexpr int Q_TILES[VARIANTS] = {1, 1, 2, 4};

struct Case {
    int batch, q_heads, kv_heads, tokens, block_size;
    std::vector<unsigned> lens;
    int capacity, chunk_keys;
};

// Largest |kernel - reference| / (1 + |reference|) over the outputs (NaN stays NaN).
template <typename T> double worst_error(const Case& c, int variant) {
    const int D = HEAD_DIM, B = c.batch, Hq = c.q_heads, Hkv = c.kv_heads, T_ = c.tokens;
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<T> q(B * Hq * T_ * D), k(B * Hkv * c.capacity * D), v(k.size());
    for (auto* xs : {&q, &k, &v})
        for (auto& x : *xs) x = from_float<T>(normal(rng));
    const int groups = Hq / Hkv, cta_queries = Q_TILES[variant] * QUERY_TILE,
              q_tiles = (groups * T_ + cta_queries - 1) / cta_queries;
    int max_keys = 0;
    for (unsigned len : c.lens) max_keys = std::max(max_keys, (int)len + T_);
    const int splits = (max_keys + c.chunk_keys - 1) / c.chunk_keys;
    const size_t total_q = (size_t)B * Hq * T_;
    std::vector<T> out(total_q * D, from_float<T>(NAN));
    std::vector<float> part_acc(splits * total_q * D, NAN), part_ml(splits * total_q * 2, NAN);
    const float scale = 1.f / std::sqrt((float)D);
    launch({(unsigned)(q_tiles * splits), (unsigned)Hkv, (unsigned)B}, THREADS, [&] {
        auto attend = Kernels<T>::attend;
        if constexpr (!std::is_same_v<T, float>)
            if (variant > 0) attend = Kernels<T>::attend_mma[variant - 1];
        attend(q.data(), k.data(), v.data(), c.lens.data(), out.data(), part_acc.data(),
               part_ml.data(), B, Hq, Hkv, T_, c.block_size, c.capacity, q_tiles, c.chunk_keys,
               splits, scale);
    });
    if (splits > 1)
        launch({(unsigned)total_q, 1, 1}, D, [&] {
            Kernels<T>::combine(part_acc.data(), part_ml.data(), out.data(), B, Hq, T_, splits);
        });
    double worst = 0;
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < Hq; ++h)
            for (int t = 0; t < T_; ++t) {
                const int kv = h / groups, len = c.lens[b];
                std::vector<double> p(len + T_);
                double max_score = -INFINITY, sum = 0;
                for (int s = 0; s < len + T_; ++s) {
                    double dot = 0;
                    for (int e = 0; e < D; ++e)
                        dot += (double)to_float(q[((b * Hq + h) * T_ + t) * D + e]) *
                               to_float(k[((b * Hkv + kv) * c.capacity + s) * D + e]);
                    bool visible = s < len || (s - len) / c.block_size <= t / c.block_size;
                    p[s] = visible ? dot * scale : -INFINITY;
                    max_score = std::max(max_score, p[s]);
                }
                for (double& x : p) sum += (x = std::exp(x - max_score));
                for (int e = 0; e < D; ++e) {
                    double want = 0;
                    for (int s = 0; s < len + T_; ++s)
                        want += p[s] * to_float(v[((b * Hkv + kv) * c.capacity + s) * D + e]);
                    want /= sum;
                    double got = to_float(out[((b * T_ + t) * Hq + h) * D + e]);
                    double error = std::fabs(got - want) / (1 + std::fabs(want));
                    if (!(error <= worst)) worst = error;
                }
            }
    return worst;
}

int main() {
    const std::vector<Case> cases = {
        {1, 4, 2, 4, 4, {8}, 16, 64},            // one decoding block (the tiny golden model)
        {1, 4, 2, 12, 4, {0}, 16, 64},           // block-causal prefill of three blocks
        {2, 4, 2, 8, 4, {8, 4}, 32, 64},         // unequal rows, two blocks
        {3, 8, 2, 4, 4, {120, 4, 60}, 140, 64},  // key splits, some past a short row's end
        {2, 8, 2, 12, 4, {100, 36}, 128, 64},    // several query tiles and splits
        {2, 8, 2, 12, 4, {100, 36}, 128, 128},   // several key tiles in one split
        {1, 6, 2, 4, 2, {70}, 80, 64},           // a partly filled query tile, block size 2
        {2, 8, 2, 4, 4, {250, 37}, 260, 320},    // several 16-key tiles per warp, one partial
        {1, 2, 2, 32, 4, {0}, 32, 64},           // a prefill longer than a query tile: its
        {2, 4, 2, 40, 4, {20, 0}, 64, 64},       // first tiles see only their earlier blocks
        {1, 4, 1, 24, 4, {300}, 330, 384},       // stages rotating, prefill over a cached prefix
    };
    // Rounding of the output: f32 accumulation, then bf16 (2^-8) or f16 (2^-11); the tensor-core
    // kernel also rounds the probabilities to the input dtype.
    const double tolerance[3] = {1e-5, 8e-3, 1e-3}, mma_tolerance[2] = {1.6e-2, 2e-3};
    int failures = 0;
    for (const Case& c : cases) {
        double error[3] = {worst_error<float>(c, 0), worst_error<bf16_t>(c, 0),
                           worst_error<f16_t>(c, 0)};
        std::printf("D=%d B=%d Hq=%d Hkv=%d T=%d block=%d chunk=%d: f32 %.2e bf16 %.2e f16 %.2e"
                    " | tensor cores",
                    HEAD_DIM, c.batch, c.q_heads, c.kv_heads, c.tokens, c.block_size,
                    c.chunk_keys, error[0], error[1], error[2]);
        for (int i = 0; i < 3; ++i) failures += !(error[i] <= tolerance[i]);
        for (int variant = 1; variant < VARIANTS; ++variant) {
            double mma_error[2] = {worst_error<bf16_t>(c, variant), worst_error<f16_t>(c, variant)};
            std::printf(" | x%d: bf16 %.2e f16 %.2e", Q_TILES[variant], mma_error[0],
                        mma_error[1]);
            for (int i = 0; i < 2; ++i) failures += !(mma_error[i] <= mma_tolerance[i]);
        }
        std::printf("\n");
    }
    std::printf(failures ? "FAILED\n" : "all match\n");
    return failures != 0;
}
