// Runs decode_ops.cu on the CPU (cuda_emulation.h) against direct references that take the
// rounding steps of candle's kernels (listed at the top of decode_ops.cu), for f32, bf16 and f16.
// The references round with the host's own conversions (double -> T rounded once), not the
// kernel's, and compute fused products exactly in double; every T-rounded output must be equal
// bit for bit. Build: g++ -std=c++20 check_decode_ops.cpp; exits non-zero on a mismatch.
#include "cuda_emulation.h"
#include "../../src/kernels/decode_ops.cu"

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>

static std::mt19937 rng(11);
static int failures = 0;

// T's value as a double, and x rounded once to T (round to nearest even).
double value(float x) { return x; }
double value(bf16_t x) { return __uint_as_float((unsigned)x.bits << 16); }
double value(f16_t x) {
    _Float16 h;
    std::memcpy(&h, &x.bits, 2);
    return (double)h;
}
template <typename T> T round_to(double x);
template <> float round_to<float>(double x) { return (float)x; }
template <> f16_t round_to<f16_t>(double x) {
    _Float16 h = (_Float16)x;
    f16_t r;
    std::memcpy(&r.bits, &h, 2);
    return r;
}
template <> bf16_t round_to<bf16_t>(double x) {
    std::uint64_t u;
    std::memcpy(&u, &x, 8);
    const unsigned short sign = (unsigned short)((u >> 48) & 0x8000u);
    u &= ~(1ull << 63);
    if (u == 0) return {sign};
    const std::int64_t exponent = (std::int64_t)(u >> 52) - 1023 + 127;
    if (exponent < 1 || exponent > 254) {
        std::printf("test data left the normal bf16 range: %g\n", x);
        std::exit(2);
    }
    // The 52-bit fraction rounded to bf16's 7 bits, to nearest even; a carry bumps the exponent.
    const std::uint64_t m = (u & ((1ull << 52) - 1)) | ((std::uint64_t)exponent << 52);
    return {(unsigned short)(sign | ((m + (1ull << 44) - 1 + ((m >> 45) & 1)) >> 45))};
}
template <typename T> double rounded(double x) { return value(round_to<T>(x)); }

template <typename T> unsigned bits(T x) {
    unsigned u = 0;
    std::memcpy(&u, &x, sizeof(T));
    return u;
}

template <typename T> const char* name();
template <> const char* name<float>() { return "f32"; }
template <> const char* name<bf16_t>() { return "bf16"; }
template <> const char* name<f16_t>() { return "f16"; }

// Counts (and shows the first few of) the elements of `got` that differ from `want` in any bit.
template <typename T>
void expect_equal(const std::string& what, const std::vector<T>& got, const std::vector<T>& want) {
    int wrong = 0;
    for (size_t i = 0; i < want.size(); ++i)
        if (bits(got[i]) != bits(want[i]) && ++wrong <= 3)
            std::printf("  %s [%zu]: got %.9g (%#x), want %.9g (%#x)\n", what.c_str(), i,
                        value(got[i]), bits(got[i]), value(want[i]), bits(want[i]));
    std::printf("%s %s: %d of %zu differ\n", name<T>(), what.c_str(), wrong, want.size());
    failures += wrong != 0;
}

template <typename T> std::vector<T> random_values(size_t n, float mean, float sd) {
    std::normal_distribution<float> normal(mean, sd);
    std::vector<T> xs(n);
    for (auto& x : xs) x = round_to<T>(normal(rng));
    return xs;
}

// The f32 sum of squares of `x[0..n)` as candle's rmsnorm adds it with `threads` (32 or 1024)
// threads: fma per thread over its columns, a butterfly in each warp, then one over the warps.
template <typename T> float sum_of_squares(const T* x, int n, int threads) {
    std::vector<float> partial(threads, 0.f);
    for (int t = 0; t < threads; ++t)
        for (int i = t; i < n; i += threads) {
            const float v = (float)value(x[i]);
            partial[t] = std::fmaf(v, v, partial[t]);
        }
    auto butterfly = [](std::vector<float>& lanes) {
        for (int mask = 16; mask > 0; mask >>= 1) {
            std::vector<float> next(lanes.size());
            for (size_t l = 0; l < lanes.size(); ++l) next[l] = lanes[l] + lanes[l ^ mask];
            lanes = next;
        }
    };
    butterfly(partial);
    if (threads == 32) return partial[0];
    std::vector<float> warps(32);
    for (int w = 0; w < 32; ++w) warps[w] = partial[32 * w];
    butterfly(warps);
    return warps[0];
}

// add_rms_norm with candle's 32 or 1024 threads and, where it applies (at least 1024 columns, a
// multiple of 8), add_rms_norm_wide with WIDE_THREADS: both must give candle's bits.
template <typename T> void check_add_rms_norm(int rows, int hidden) {
    const auto residual = random_values<T>((size_t)rows * hidden, 0.f, 2.f);
    const auto delta = random_values<T>(residual.size(), 0.f, 0.5f);
    const auto weight = random_values<T>(hidden, 1.f, 0.2f);
    const float eps = 1e-6f;
    const int threads = hidden < 1024 ? 32 : 1024;
    std::vector<T> want_sum(residual.size()), want_normed(residual.size());
    for (int r = 0; r < rows; ++r) {
        const size_t row = (size_t)r * hidden;
        for (int i = 0; i < hidden; ++i)
            want_sum[row + i] = round_to<T>(value(residual[row + i]) + value(delta[row + i]));
        const float scale = rsqrtf(sum_of_squares(&want_sum[row], hidden, threads) / hidden + eps);
        for (int i = 0; i < hidden; ++i) {
            float x = scale * (float)value(want_sum[row + i]);
            x = x * (float)value(weight[i]);
            want_normed[row + i] = round_to<T>(x);
        }
    }
    const std::string shape = "[" + std::to_string(rows) + ", " + std::to_string(hidden) + "]";
    auto check = [&](const std::string& kernel, auto run, int block) {
        std::vector<T> sum(residual.size()), normed(residual.size());
        launch({(unsigned)rows, 1, 1}, block, [&] {
            run(residual.data(), delta.data(), weight.data(), sum.data(), normed.data(), hidden,
                eps);
        });
        expect_equal(kernel + " sum " + shape, sum, want_sum);
        expect_equal(kernel + " normed " + shape, normed, want_normed);
    };
    check("add_rms_norm", add_rms_norm<T>, threads);
    if (hidden >= 1024 && hidden % WIDE_COLS == 0)
        check("add_rms_norm_wide", add_rms_norm_wide<T>, WIDE_THREADS);
}

// `halves`: gate and up are the two halves of each row of one [rows, 2 * cols] buffer (a fused
// gate/up projection), else two contiguous [rows, cols] buffers. `offset` elements before the
// three buffers make them misaligned for paired accesses when odd. `grid_rows` below `rows`
// makes the grid stride over rows.
template <typename T>
void check_silu_mul(int rows, int cols, unsigned grid_rows, bool halves, int offset) {
    const size_t n = (size_t)rows * cols, in_stride = halves ? 2 * (size_t)cols : cols;
    const auto gate_up = random_values<T>(2 * n + offset, 0.f, 3.f);
    const T* gate = gate_up.data() + offset;
    const T* up = gate + (halves ? cols : n);
    std::vector<T> out_buffer(n + offset), want(n);
    T* out = out_buffer.data() + offset;
    const unsigned threads = 256, per_cta = threads * VEC_COLS(T),
                   column_ctas = (cols + per_cta - 1) / per_cta;
    launch({column_ctas, grid_rows, 1}, threads,
           [&] { silu_mul<T>(gate, up, out, rows, cols, in_stride); });
    for (size_t r = 0; r < (size_t)rows; ++r)
        for (size_t c = 0; c < (size_t)cols; ++c) {
            const float x = (float)value(gate[r * in_stride + c]);
            want[r * cols + c] =
                round_to<T>(rounded<T>(x / (1.0f + std::exp(-x))) * value(up[r * in_stride + c]));
        }
    expect_equal("silu_mul " + std::to_string(rows) + "x" + std::to_string(cols) +
                     (halves ? " (halves of one buffer)" : "") +
                     (offset % 2 ? " (misaligned)" : ""),
                 std::vector<T>(out, out + n), want);
}

struct Attention {
    int batch, tokens, q_heads, kv_heads, head_dim;
    std::vector<unsigned> lens;
    // q, k and v as the parts of each token's row of one q/k/v projection, else three buffers.
    bool one_projection = false;
    // CTAs sharing one token's head vectors (grid x).
    int head_ctas = 1;
};

// rmsnorm(x) * w (one warp, as candle's rmsnorm of D < 1024 columns) and then rotate-half RoPE
// at `pos`, each step rounded to T as candle's kernels round it.
template <typename T>
std::vector<T> norm_rope(const T* x, const std::vector<T>& w, const std::vector<float>& inv_freq,
                         int pos, float eps) {
    const int d = (int)w.size(), half = d / 2;
    const float scale = rsqrtf(sum_of_squares(x, d, 32) / d + eps);
    std::vector<double> normed(d);
    for (int i = 0; i < d; ++i) {
        float y = scale * (float)value(x[i]);
        y = y * (float)value(w[i]);
        normed[i] = rounded<T>(y);
    }
    std::vector<T> out(d);
    for (int i = 0; i < half; ++i) {
        const float angle = (float)pos * inv_freq[i];
        const double c = rounded<T>(std::cos(angle)), s = rounded<T>(std::sin(angle));
        const double x1 = normed[i], x2 = normed[i + half];
        // ptxas's contraction of candle's x1 * c - x2 * s and x1 * s + x2 * c: the x2 product
        // rounded to T, the rest fused (exact in double here).
        const double x2s = rounded<T>(x2 * s), x2c = rounded<T>(x2 * c);
        if constexpr (std::is_same_v<T, float>) {
            out[i] = std::fmaf((float)x1, (float)c, (float)-x2s);
            out[i + half] = std::fmaf((float)x1, (float)s, (float)x2c);
        } else {
            out[i] = round_to<T>(x1 * c - x2s);
            out[i + half] = round_to<T>(x1 * s + x2c);
        }
    }
    return out;
}

template <typename T> void check_qk_norm_rope_cache(const Attention& a) {
    const int B = a.batch, T_ = a.tokens, Hq = a.q_heads, Hkv = a.kv_heads, D = a.head_dim;
    int capacity = 0;
    for (unsigned len : a.lens) capacity = std::max(capacity, (int)len + T_ + 3);
    const int q_stride = a.one_projection ? (Hq + 2 * Hkv) * D : Hq * D;
    const int kv_stride = a.one_projection ? q_stride : Hkv * D;
    const size_t tokens_total = (size_t)B * T_;
    const auto qkv = random_values<T>(tokens_total * (Hq + 2 * Hkv) * D, 0.f, 1.f);
    const T* q = qkv.data();
    const T* k = a.one_projection ? q + Hq * D : q + tokens_total * Hq * D;
    const T* v = a.one_projection ? k + Hkv * D : k + tokens_total * Hkv * D;
    const auto q_norm = random_values<T>(D, 1.f, 0.2f);
    const auto k_norm = random_values<T>(D, 1.f, 0.2f);
    std::vector<float> inv_freq(D / 2);
    for (int i = 0; i < D / 2; ++i) inv_freq[i] = 1.f / std::pow(1e6f, 2.f * i / D);
    const float eps = 1e-6f;
    // Slots the kernel must leave alone hold random values, compared bit for bit afterwards.
    const auto k_cache_before = random_values<T>((size_t)B * Hkv * capacity * D, 0.f, 1.f);
    const auto v_cache_before = random_values<T>(k_cache_before.size(), 0.f, 1.f);
    auto k_cache = k_cache_before, v_cache = v_cache_before;
    std::vector<T> q_out((size_t)B * Hq * T_ * D);
    launch({(unsigned)a.head_ctas, (unsigned)T_, (unsigned)B}, 32 * ROPE_WARPS, [&] {
        qk_norm_rope_cache<T>(q, k, v, q_norm.data(), k_norm.data(), inv_freq.data(),
                              a.lens.data(), q_out.data(), k_cache.data(), v_cache.data(), T_, Hq,
                              Hkv, D, capacity, q_stride, kv_stride, eps);
    });
    std::vector<T> want_q(q_out.size());
    auto want_k = k_cache_before, want_v = v_cache_before;
    for (int b = 0; b < B; ++b)
        for (int t = 0; t < T_; ++t) {
            const int pos = (int)a.lens[b] + t;
            for (int h = 0; h < Hq; ++h) {
                const auto out = norm_rope(q + ((size_t)b * T_ + t) * q_stride + h * D, q_norm,
                                           inv_freq, pos, eps);
                std::copy(out.begin(), out.end(), &want_q[(((size_t)b * Hq + h) * T_ + t) * D]);
            }
            for (int h = 0; h < Hkv; ++h) {
                const size_t src = ((size_t)b * T_ + t) * kv_stride + h * D;
                const size_t slot = (((size_t)b * Hkv + h) * capacity + pos) * D;
                const auto out = norm_rope(k + src, k_norm, inv_freq, pos, eps);
                std::copy(out.begin(), out.end(), &want_k[slot]);
                std::copy(v + src, v + src + D, &want_v[slot]);
            }
        }
    std::string shape = "B=" + std::to_string(B) + " T=" + std::to_string(T_) +
                        " Hq=" + std::to_string(Hq) + " Hkv=" + std::to_string(Hkv) +
                        " D=" + std::to_string(D) + (a.one_projection ? " (one projection)" : "");
    expect_equal("qk_norm_rope_cache q " + shape, q_out, want_q);
    expect_equal("qk_norm_rope_cache k cache " + shape, k_cache, want_k);
    expect_equal("qk_norm_rope_cache v cache " + shape, v_cache, want_v);
}

// Greedy picks over rows of small integers (many exact ties of the maximum, at any column),
// plus the unusable rows: a NaN, a +inf maximum, only -inf; and rows shorter than the CTA.
template <typename T> void check_greedy_summary(int rows, int vocab) {
    std::uniform_int_distribution<int> small(-8, 8);
    std::vector<T> logits((size_t)rows * vocab);
    for (auto& x : logits) x = round_to<T>(small(rng));
    const float inf = __uint_as_float(0x7f800000u), nan = __uint_as_float(0x7fc00000u);
    auto row = [&](int r) { return logits.data() + (size_t)r * vocab; };
    // (round_to takes finite values only; the kernel's own conversion is exact on these.)
    if (rows >= 4) {
        row(0)[vocab / 2] = from_float<T>(nan);
        row(1)[vocab - 1] = from_float<T>(inf);
        for (int i = 0; i < vocab; i++) row(2)[i] = from_float<T>(-inf);
        row(3)[vocab - 1] = round_to<T>(100.0);
    }
    std::vector<unsigned> out(3 * (size_t)rows, 0xdeadbeefu), want(3 * (size_t)rows);
    for (int r = 0; r < rows; r++) {
        double best = 0;
        unsigned index = 0, ties = 0, bad = 0;
        for (int i = 0; i < vocab; i++) {
            const double v = value(row(r)[i]);
            if (v != v) bad = 1;
            else if (ties == 0 || v > best) best = v, index = i, ties = 1;
            else if (v == best) ties++;
        }
        want[r] = index;
        want[rows + r] = ties;
        want[2 * rows + r] = bad || ties == 0 || best == inf || best == -inf;
    }
    launch({(unsigned)rows, 1, 1}, GREEDY_THREADS,
           [&] { greedy_summary<T>(logits.data(), out.data(), rows, vocab); });
    for (size_t i = 0; i < out.size(); i++)
        if (out[i] != want[i]) {
            std::printf("%s greedy_summary rows=%d vocab=%d: entry %zu is %u, want %u\n", name<T>(),
                        rows, vocab, i, out[i], want[i]);
            failures++;
            return;
        }
    std::printf("%s greedy_summary rows=%d vocab=%d: match\n", name<T>(), rows, vocab);
}

// Sampled picks over rows of continuous logits, some -inf (weightless columns, whole weightless
// chunks of a thread), with uniforms at 0, inside and just below 1, at temperature 1 and not; plus
// the unusable rows. The kernel's total adds each thread's chunk in another order than a scan
// from the first column, so its token is checked to be where the f64 running sum of the same
// weights crosses u * total (within the two sums' rounding), its probability and entropy against
// sums taken in index order.
template <typename T> void check_sample_summary(int rows, int vocab, float temperature) {
    std::normal_distribution<double> normal(0.0, 3.0);
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    std::vector<T> logits((size_t)rows * vocab);
    for (auto& x : logits) x = round_to<T>(normal(rng));
    const float inf = __uint_as_float(0x7f800000u), nan = __uint_as_float(0x7fc00000u);
    auto row = [&](int r) { return logits.data() + (size_t)r * vocab; };
    std::vector<double> uniforms(rows);
    for (int r = 0; r < rows; r++) uniforms[r] = uniform(rng);
    std::vector<float> temperatures(rows, temperature);
    if (rows >= 8) {
        row(0)[vocab / 2] = from_float<T>(nan);
        row(1)[vocab - 1] = from_float<T>(inf);
        for (int i = 0; i < vocab; i++) row(2)[i] = from_float<T>(-inf);
        // Weight only in the last column, and in every third column past the middle.
        for (int i = 0; i + 1 < vocab; i++) row(3)[i] = from_float<T>(-inf);
        for (int i = 0; i < vocab; i++)
            if (i < vocab / 2 || i % 3) row(4)[i] = from_float<T>(-inf);
        uniforms[5] = 0.0;
        uniforms[6] = 1.0 - 1e-16;
        uniforms[7] = 0.5;
    }
    std::vector<unsigned> out(4 * (size_t)rows, 0xdeadbeefu);
    for (int with_entropy : {0, 1}) {
        launch({(unsigned)rows, 1, 1}, SAMPLE_THREADS, [&] {
            sample_summary<T>(logits.data(), temperatures.data(), uniforms.data(), out.data(), rows,
                              vocab, with_entropy);
        });
        for (int r = 0; r < rows; r++) {
            auto fail = [&](const char* what, double got, double want) {
                std::printf("%s sample_summary rows=%d vocab=%d t=%g entropy=%d row %d: %s is %.9g, "
                            "want %.9g\n",
                            name<T>(), rows, vocab, temperature, with_entropy, r, what, got, want);
                failures++;
            };
            std::vector<float> scaled(vocab);
            bool bad = false;
            float m = -inf;
            for (int i = 0; i < vocab; i++) {
                const float v = (float)value(row(r)[i]);
                scaled[i] = temperature == 1.0f ? v : v / temperature;
                if (scaled[i] != scaled[i] || scaled[i] == inf) bad = true;
                else m = std::max(m, scaled[i]);
            }
            bad = bad || m == -inf;
            if (out[3 * rows + r] != (unsigned)bad) {
                fail("the unusable flag", out[3 * rows + r], bad);
                continue;
            }
            if (bad) continue;
            std::vector<float> w(vocab);
            double total = 0;
            for (int i = 0; i < vocab; i++) total += (double)(w[i] = expf(scaled[i] - m));
            const unsigned token = out[r];
            if (token >= (unsigned)vocab || w[token] <= 0.0f) {
                fail("the token", token, -1);
                continue;
            }
            double before = 0;
            for (unsigned i = 0; i < token; i++) before += w[i];
            const double target = uniforms[r] * total, slack = 1e-12 * total;
            // u just below 1 may round past every sum: then the last column with weight.
            int last = vocab - 1;
            while (w[last] <= 0.0f) last--;
            const bool past_all = target + slack >= total && (int)token == last;
            if (!past_all && !(before <= target + slack && target < before + w[token] + slack))
                fail("the token's running sum before it", before, target);
            const double prob = __uint_as_float(out[rows + r]), want_prob = w[token] / total;
            if (std::fabs(prob - want_prob) > 1e-6 * want_prob) fail("the probability", prob, want_prob);
            double entropy = 0;
            for (int i = 0; i < vocab; i++) {
                const double p = std::max((double)w[i] / total, 1e-12);
                entropy -= p * std::log(p);
            }
            const double got_entropy = __uint_as_float(out[2 * rows + r]);
            const double want_entropy = with_entropy ? entropy : 0.0;
            if (std::fabs(got_entropy - want_entropy) > 1e-4 * std::max(1.0, want_entropy))
                fail("the entropy", got_entropy, want_entropy);
        }
    }
    std::printf("%s sample_summary rows=%d vocab=%d t=%g: checked\n", name<T>(), rows, vocab,
                temperature);
}

template <typename T> void check_all() {
    // The tiny golden model's hidden size, one below a 1024-thread block, a real model's; enough
    // rows that an f32 sum added in another order changes some rows' scale.
    check_add_rms_norm<T>(16, 64);
    check_add_rms_norm<T>(8, 1000);
    check_add_rms_norm<T>(32, 2560);
    // Columns past 1024 for the first thread only; past 4096 (a second batch of loads in
    // add_rms_norm_wide), again for the first thread only past 5120.
    check_add_rms_norm<T>(4, 1032);
    check_add_rms_norm<T>(2, 5128);
    // Odd columns (element by element), fewer grid rows than rows (the grid strides), 16-byte
    // accesses (more columns than a CTA's) and their misaligned fallback.
    check_silu_mul<T>(8, 125, 8, false, 0);
    check_silu_mul<T>(3, 2 * 512 + 77, 2, false, 0);
    check_silu_mul<T>(5, 2 * 512 + 300, 2, true, 0);
    check_silu_mul<T>(3, 4096 + 64, 2, true, 0);
    check_silu_mul<T>(4, 300, 3, true, 1);
    for (int head_dim : {16, 128})
        for (int tokens : {4, 8}) {
            // Unequal rows (one empty); 6 heads leave warps of a CTA idle, 10 and 20 give warps a
            // second and third head; 10 over 3 CTAs, 40 over 5.
            check_qk_norm_rope_cache<T>({3, tokens, 4, 2, head_dim, {0, 7, 300}});
            check_qk_norm_rope_cache<T>({2, tokens, 8, 2, head_dim, {13, 2}});
            check_qk_norm_rope_cache<T>({2, tokens, 8, 2, head_dim, {13, 2}, true});
            check_qk_norm_rope_cache<T>({1, tokens, 16, 4, head_dim, {40}, true});
            check_qk_norm_rope_cache<T>({2, tokens, 8, 2, head_dim, {13, 2}, true, 3});
            check_qk_norm_rope_cache<T>({1, tokens, 32, 8, head_dim, {5}, true, 5});
        }
    // 16-byte loads (several in flight per thread, and several rounds of them at 2 * 8 * 2048 +
    // 24 columns), then element by element (rows of 5 or 1003).
    check_greedy_summary<T>(6, 1000);
    check_greedy_summary<T>(4, 2 * 8 * 2048 + 24);
    check_greedy_summary<T>(3, 5);
    check_greedy_summary<T>(3, 1003);
    // Fewer columns than threads (most chunks empty), chunks of uneven end, and a chunk per
    // thread of a real vocabulary's size over a smaller one.
    check_sample_summary<T>(8, 100, 1.0f);
    check_sample_summary<T>(9, 1003, 0.7f);
    check_sample_summary<T>(8, 20000, 1.0f);
}

int main() {
    check_all<float>();
    check_all<bf16_t>();
    check_all<f16_t>();
    std::printf(failures ? "FAILED\n" : "all match\n");
    return failures != 0;
}
