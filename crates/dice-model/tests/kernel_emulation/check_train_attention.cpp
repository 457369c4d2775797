// Runs train_attention.cu on the CPU (cuda_emulation.h) against a direct f64 attention and its
// gradients, for bf16, f16 and f32 (the f32 kernels without tensor cores, at f32's precision):
// packed sequences of two-stream SFT segments (masks.rs, two_stream_allowed, with the spans
// train_attention.rs derives), GQA, a last query tile only partly filled, queries that see
// nothing, and key tiles that every query of a tile sees (run without the per-key test; the
// check prints how many tile pairs took that path). Both backwards are checked: the one that
// recomputes S and dP for dQ (DICE_ATTENTION_KEEP_DS=0) and the default that keeps dS (dK/dV
// storing every dS tile, then dQ from them): its dQ against the same reference, its dK and dV
// against the other's, bit for bit (bf16 and f16; f32 has only the first).
// Build: g++ -std=c++20 -DHEAD_DIM=<d> [-DTRAIN_ATTENTION_WGMMA=1] check_train_attention.cpp
// (the second for the wgmma path); exits non-zero on a mismatch. dQ from kept dS takes two query
// heads of a GQA group a CTA where the group's size is even and one where it is odd: the cases'
// groups of 1, 2 and 3 run both.
#include "cuda_emulation.h"
#include "../../src/kernels/train_attention.cu"

#include <array>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

static std::mt19937 rng(11);

template <typename T> struct Kernels;
template <> struct Kernels<bf16_t> {
    static constexpr bool keeps_ds = true;
    static constexpr auto forward = train_attention_forward_bf16;
    static constexpr auto delta = train_attention_delta_bf16;
    static constexpr auto dq = train_attention_dq_bf16;
    static constexpr auto dkdv = train_attention_dkdv_bf16;
    static constexpr auto dkdv_keep_ds = train_attention_dkdv_keep_ds_bf16;
    static constexpr auto dq_from_ds = train_attention_dq_from_ds_bf16;
};
template <> struct Kernels<f16_t> {
    static constexpr bool keeps_ds = true;
    static constexpr auto forward = train_attention_forward_f16;
    static constexpr auto delta = train_attention_delta_f16;
    static constexpr auto dq = train_attention_dq_f16;
    static constexpr auto dkdv = train_attention_dkdv_f16;
    static constexpr auto dkdv_keep_ds = train_attention_dkdv_keep_ds_f16;
    static constexpr auto dq_from_ds = train_attention_dq_from_ds_f16;
};
template <> struct Kernels<float> {
    static constexpr bool keeps_ds = false;
    static constexpr auto forward = train_attention_forward_f32;
    static constexpr auto delta = train_attention_delta_f32;
    static constexpr auto dq = train_attention_dq_f32;
    static constexpr auto dkdv = train_attention_dkdv_f32;
};

using Span = std::array<unsigned, 4>;

// The two ranges of keys a query of a two-stream segment sees (masks.rs two_stream_allowed),
// as train_attention.rs computes them: a noisy query of block b sees its own noisy block and
// the clean blocks before b; a clean query the clean blocks up to its own.
static void two_stream_spans(std::vector<Span>& spans, unsigned n, unsigned block) {
    const unsigned start = spans.size();
    for (unsigned i = 0; i < 2 * n; ++i) {
        if (i < n) {
            const unsigned b = i / block;
            spans.push_back({start + b * block, start + std::min((b + 1) * block, n),
                             start + n, start + n + b * block});
        } else {
            const unsigned b = (i - n) / block;
            spans.push_back({start + n, start + n + std::min((b + 1) * block, n), 0, 0});
        }
    }
}

// Per tile of TILE queries, as masks.rs tile_bounds: the hulls of its rows' first and second
// ranges, then their intersections (the keys every row sees).
using TileSpan = std::array<unsigned, TILE_SPAN_WORDS>;
static std::vector<TileSpan> tile_spans_of(const std::vector<Span>& spans) {
    std::vector<TileSpan> tiles;
    for (size_t first = 0; first < spans.size(); first += TILE) {
        TileSpan bounds = {};
        for (int i = 0; i < 2; ++i) {
            bool seen = false;
            unsigned core_begin = 0, core_end = ~0u;
            for (size_t r = first; r < std::min(spans.size(), first + TILE); ++r) {
                const unsigned begin = spans[r][2 * i], end = spans[r][2 * i + 1];
                core_begin = std::max(core_begin, begin);
                core_end = std::min(core_end, end);
                if (begin >= end) continue;
                bounds[2 * i] = seen ? std::min(bounds[2 * i], begin) : begin;
                bounds[2 * i + 1] = seen ? std::max(bounds[2 * i + 1], end) : end;
                seen = true;
            }
            if (core_begin < core_end) {
                bounds[4 + 2 * i] = core_begin;
                bounds[4 + 2 * i + 1] = core_end;
            }
        }
        tiles.push_back(bounds);
    }
    return tiles;
}

// The numbers of the visible (query tile, key tile) pairs, query tile by query tile in key
// order (~0u for the others), as masks.rs tile_pairs: pairs whose key tile meets either hull
// (tile_meets with the last tile's end at the sequence's). Returns how many.
static unsigned tile_pairs_of(const std::vector<TileSpan>& tiles, unsigned tokens,
                              std::vector<unsigned>& index) {
    const size_t count = tiles.size();
    index.assign(count * count, ~0u);
    unsigned pairs = 0;
    for (size_t t = 0; t < count; ++t)
        for (size_t key_tile = 0; key_tile < count; ++key_tile) {
            const unsigned first = key_tile * TILE, end = std::min<unsigned>(first + TILE, tokens);
            const TileSpan& hull = tiles[t];
            if ((hull[0] < end && hull[1] > first) || (hull[2] < end && hull[3] > first))
                index[t * count + key_tile] = pairs++;
        }
    return pairs;
}

struct Case {
    int q_heads, kv_heads;
    std::vector<unsigned> samples;  // tokens per two-stream segment (2n positions each)
    unsigned block;
    int blind_rows;  // queries at the end that see nothing
};

struct Errors {
    double out, lse, dq, dk, dv;
    // The backward that keeps dS: dQ from the stored tiles, and whether its dK and dV are the
    // recomputing backward's bit for bit.
    double dq_from_ds;
    bool same_dk_dv;
    int all_seen_tiles;  // (query tile, key tile) pairs computed without the per-key test
};

// Largest |got - want| / (1 + |want|).
static void track(double& worst, double got, double want) {
    const double error = std::fabs(got - want) / (1 + std::fabs(want));
    if (!(error <= worst)) worst = error;
}

template <typename T> Errors run(const Case& c) {
    const int D = HEAD_DIM, Hq = c.q_heads, Hkv = c.kv_heads, groups = Hq / Hkv;
    std::vector<Span> spans;
    for (unsigned n : c.samples) two_stream_spans(spans, n, c.block);
    for (int i = 0; i < c.blind_rows; ++i) spans.push_back({0, 0, 0, 0});
    const int N = spans.size();
    const std::vector<TileSpan> tiles = tile_spans_of(spans);
    std::normal_distribution<float> normal(0.f, 1.f);
    auto random = [&](size_t count, float sigma) {
        std::vector<T> xs(count);
        for (auto& x : xs) x = from_float<T>(sigma * normal(rng));
        return xs;
    };
    // Scores of a few units, so the softmax is neither flat nor one-hot.
    const std::vector<T> q = random((size_t)Hq * N * D, 1.5f), k = random((size_t)Hkv * N * D, 1.5f),
                         v = random((size_t)Hkv * N * D, 1.f), d_out = random((size_t)N * Hq * D, 1.f);
    const float scale = 1.f / std::sqrt((float)D);
    std::vector<T> out((size_t)N * Hq * D), dq(q.size()), dk(k.size()), dv(v.size());
    std::vector<float> lse((size_t)Hq * N, NAN), delta((size_t)Hq * N, NAN);
    const unsigned q_tiles = (N + TILE - 1) / TILE;
    const unsigned* s = spans[0].data();
    const unsigned* ts = tiles[0].data();
    // The tiles in a shuffled order (the order only moves work between CTAs: any permutation
    // gives the same results): query tiles, then key tiles.
    std::vector<unsigned> order;
    for (int part = 0; part < 2; ++part) {
        std::vector<unsigned> tiles_in_order(q_tiles);
        for (unsigned t = 0; t < q_tiles; ++t) tiles_in_order[t] = t;
        std::shuffle(tiles_in_order.begin(), tiles_in_order.end(), rng);
        order.insert(order.end(), tiles_in_order.begin(), tiles_in_order.end());
    }
    const unsigned* to = order.data();
    launch({q_tiles, (unsigned)Hq, 1}, THREADS, [&] {
        Kernels<T>::forward(q.data(), k.data(), v.data(), s, ts, to, out.data(), lse.data(), N, Hq,
                            Hkv, scale);
    });
    launch({(unsigned)((N * Hq + 3) / 4), 1, 1}, THREADS,
           [&] { Kernels<T>::delta(out.data(), d_out.data(), delta.data(), N, Hq); });
    launch({q_tiles, (unsigned)Hq, 1}, THREADS, [&] {
        Kernels<T>::dq(q.data(), k.data(), v.data(), d_out.data(), s, ts, to, lse.data(),
                       delta.data(), dq.data(), N, Hq, Hkv, scale);
    });
    launch({q_tiles, (unsigned)Hkv, 1}, THREADS, [&] {
        Kernels<T>::dkdv(q.data(), k.data(), v.data(), d_out.data(), s, ts, to, lse.data(),
                         delta.data(), dk.data(), dv.data(), N, Hq, Hkv, scale);
    });
    // The backward that keeps dS: dK/dV storing dS, then dQ from it. The buffer starts as NaNs
    // (0xffff in both dtypes), so that a tile read but never written shows in dQ. f32 has none:
    // its dQ is checked once more as the recomputing one's.
    std::vector<T> kept_dq(q.size()), kept_dk(k.size()), kept_dv(v.size());
    bool same_dk_dv = true;
    if constexpr (Kernels<T>::keeps_ds) {
        std::vector<unsigned> pair_index;
        const unsigned pairs = tile_pairs_of(tiles, N, pair_index);
        std::vector<T> ds((size_t)pairs * Hq * TILE * TILE, T{0xffff});
        launch({q_tiles, (unsigned)Hkv, 1}, THREADS, [&] {
            Kernels<T>::dkdv_keep_ds(q.data(), k.data(), v.data(), d_out.data(), s, ts, to,
                                     lse.data(), delta.data(), pair_index.data(), kept_dk.data(),
                                     kept_dv.data(), ds.data(), N, Hq, Hkv, scale);
        });
        launch({q_tiles, (unsigned)(Hq / dq_from_ds_heads(Hq, Hkv)), 1}, THREADS, [&] {
            Kernels<T>::dq_from_ds(k.data(), ds.data(), ts, to, pair_index.data(), kept_dq.data(),
                                   N, Hq, Hkv, scale);
        });
        for (size_t i = 0; i < k.size(); ++i)
            same_dk_dv &= kept_dk[i].bits == dk[i].bits && kept_dv[i].bits == dv[i].bits;
    } else {
        kept_dq = dq;
    }

    auto at = [](const std::vector<T>& xs, size_t i) { return (double)to_float(xs[i]); };
    Errors worst = {0, 0, 0, 0, 0, 0, same_dk_dv, 0};
    for (unsigned t = 0; t < q_tiles; ++t)
        for (unsigned first = 0; first < (unsigned)N; first += TILE)
            worst.all_seen_tiles += tile_sees_all(tiles[t].data(), first);
    std::vector<double> want_dk(k.size(), 0.0), want_dv(v.size(), 0.0);
    for (int h = 0; h < Hq; ++h) {
        const int kv = h / groups;
        for (int i = 0; i < N; ++i) {
            auto visible = [&](int j) {
                return (spans[i][0] <= (unsigned)j && (unsigned)j < spans[i][1]) ||
                       (spans[i][2] <= (unsigned)j && (unsigned)j < spans[i][3]);
            };
            std::vector<double> p(N, 0.0), dp(N, 0.0);
            double max_score = -INFINITY;
            for (int j = 0; j < N; ++j) {
                if (!visible(j)) continue;
                double dot = 0;
                for (int e = 0; e < D; ++e)
                    dot += at(q, ((size_t)h * N + i) * D + e) * at(k, ((size_t)kv * N + j) * D + e);
                p[j] = dot * scale;
                max_score = std::max(max_score, p[j]);
            }
            double sum = 0;
            for (int j = 0; j < N; ++j) sum += visible(j) ? (p[j] = std::exp(p[j] - max_score)) : 0.0;
            for (int j = 0; j < N; ++j) p[j] = visible(j) ? p[j] / sum : 0.0;
            const size_t row = (size_t)h * N + i;
            if (sum > 0)
                track(worst.lse, lse[row], max_score + std::log(sum));
            else if (!(lse[row] == INFINITY))
                worst.lse = NAN;
            double row_delta = 0;
            for (int j = 0; j < N; ++j) {
                if (!visible(j)) continue;
                for (int e = 0; e < D; ++e)
                    dp[j] += at(d_out, ((size_t)i * Hq + h) * D + e) * at(v, ((size_t)kv * N + j) * D + e);
                row_delta += p[j] * dp[j];
            }
            for (int e = 0; e < D; ++e) {
                double o = 0, g = 0;
                for (int j = 0; j < N; ++j) {
                    o += p[j] * at(v, ((size_t)kv * N + j) * D + e);
                    g += p[j] * (dp[j] - row_delta) * at(k, ((size_t)kv * N + j) * D + e);
                }
                track(worst.out, at(out, ((size_t)i * Hq + h) * D + e), o);
                track(worst.dq, at(dq, row * D + e), g * scale);
                track(worst.dq_from_ds, at(kept_dq, row * D + e), g * scale);
            }
            for (int j = 0; j < N; ++j) {
                const double ds = p[j] * (dp[j] - row_delta);
                for (int e = 0; e < D; ++e) {
                    want_dk[((size_t)kv * N + j) * D + e] += ds * scale * at(q, row * D + e);
                    want_dv[((size_t)kv * N + j) * D + e] +=
                        p[j] * at(d_out, ((size_t)i * Hq + h) * D + e);
                }
            }
        }
    }
    for (size_t i = 0; i < k.size(); ++i) {
        track(worst.dk, at(dk, i), want_dk[i]);
        track(worst.dv, at(dv, i), want_dv[i]);
    }
    return worst;
}

int main() {
    const std::vector<Case> cases = {
        {2, 1, {8}, 4, 0},              // one short sample: a partly filled query tile
        {4, 2, {40, 12}, 4, 0},         // two samples packed, GQA: tiles across a boundary
        {4, 4, {70}, 4, 3},             // key tiles skipped, queries that see nothing
        {2, 1, {33, 20, 9}, 2, 0},      // block size 2, samples not a multiple of it
        {2, 1, {200}, 4, 0},            // key tiles every query of a tile sees (no per-key test)
        {6, 2, {30}, 4, 0},             // GQA groups of 3: dQ from kept dS a head a CTA
    };
    // Outputs: f32 accumulation, probabilities rounded to the dtype for P V, then the output
    // (bf16 2^-8, f16 2^-11). Gradients round P and dS to the dtype as well, and sum them over
    // more terms. f32 rounds nothing to a narrower type: its own sums of up to a few hundred
    // keys of D products (2.6e-6 at D=128).
    const double out_tolerance[3] = {1.6e-2, 2e-3, 1e-5}, grad_tolerance[3] = {4e-2, 6e-3, 2e-5};
    int failures = 0;
    for (const Case& c : cases) {
        const Errors e[3] = {run<bf16_t>(c), run<f16_t>(c), run<float>(c)};
        std::printf("D=%d Hq=%d Hkv=%d block=%u samples", HEAD_DIM, c.q_heads, c.kv_heads, c.block);
        for (unsigned n : c.samples) std::printf(" %u", n);
        std::printf(" blind %d (all-seen tiles %d):", c.blind_rows, e[0].all_seen_tiles);
        const char* names[3] = {"bf16", "f16", "f32"};
        for (int t = 0; t < 3; ++t) {
            std::printf(" | %s out %.2e lse %.2e dq %.2e dk %.2e dv %.2e, kept dS: dq %.2e%s",
                        names[t], e[t].out, e[t].lse, e[t].dq, e[t].dk, e[t].dv, e[t].dq_from_ds,
                        e[t].same_dk_dv ? "" : " (dk/dv differ)");
            failures += !(e[t].out <= out_tolerance[t]) + !(e[t].lse <= out_tolerance[t]);
            failures += !(e[t].dq <= grad_tolerance[t]) + !(e[t].dk <= grad_tolerance[t]) +
                        !(e[t].dv <= grad_tolerance[t]);
            failures += !(e[t].dq_from_ds <= grad_tolerance[t]) + !e[t].same_dk_dv;
        }
        std::printf("\n");
    }
    std::printf(failures ? "FAILED\n" : "all match\n");
    return failures != 0;
}
