// Runs train_layer.cu on the CPU (cuda_emulation.h) for f32, bf16 and f16: every forward
// against a direct f64 reference of the same steps, every backward against central finite
// differences of that f64 forward (the gradient of a scalar Σ upstream · output), on shapes
// that leave lanes of a warp idle, pair RoPE elements across lanes and within one, read heads
// out of wider rows, and make warps and threads stride over several rows.
// Build: g++ -std=c++20 check_train_layer.cpp; exits non-zero on a mismatch.
#include "cuda_emulation.h"
#include "../../src/kernels/train_layer.cu"

#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

static std::mt19937 rng(5);
static int failures = 0;

template <typename T> struct Kernels;
#define KERNELS(TYPE, SUFFIX)                                                                     \
    template <> struct Kernels<TYPE> {                                                            \
        static constexpr const char* name = #SUFFIX;                                              \
        static constexpr double tolerance = sizeof(TYPE) == 4 ? 1e-4 : (#SUFFIX[0] == 'b' ? 1.2e-2 : 2e-3); \
        static constexpr auto norm_forward = rms_norm_forward_##SUFFIX;                          \
        static constexpr auto norm_backward = rms_norm_backward_##SUFFIX;                        \
        static constexpr auto norm_weight = norm_weight_grad_##SUFFIX;                           \
        static constexpr auto heads_fwd = heads_forward_##SUFFIX;                                \
        static constexpr auto heads_bwd = heads_backward_##SUFFIX;                               \
        static constexpr auto swiglu_fwd = swiglu_forward_##SUFFIX;                              \
        static constexpr auto swiglu_bwd = swiglu_backward_##SUFFIX;                             \
        static constexpr auto log_softmax = label_log_softmax_##SUFFIX;                          \
        static constexpr auto log_softmax_bwd = label_log_softmax_backward_##SUFFIX;             \
        static constexpr auto embedding_bwd = embedding_backward_##SUFFIX;                       \
    };
KERNELS(float, f32)
KERNELS(bf16_t, bf16)
KERNELS(f16_t, f16)

template <typename T> std::vector<T> random_values(size_t n, float scale, float offset = 0.f) {
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    std::vector<T> v(n);
    for (auto& x : v) x = from_float<T>(offset + scale * u(rng));
    return v;
}
template <typename T> std::vector<double> values(const std::vector<T>& v) {
    std::vector<double> d(v.size());
    for (size_t i = 0; i < v.size(); ++i) d[i] = to_float(v[i]);
    return d;
}
static std::vector<double> values(const std::vector<float>& v) {
    return std::vector<double>(v.begin(), v.end());
}
template <typename T> bool same_bits(T a, T b) { return std::memcmp(&a, &b, sizeof(T)) == 0; }

// max |got - want| / max |want|, reported against the dtype's tolerance.
template <typename T>
void expect_close(const char* what, const std::vector<double>& got, const std::vector<double>& want) {
    double err = 0, scale = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        err = std::max(err, std::fabs(got[i] - want[i]));
        scale = std::max(scale, std::fabs(want[i]));
    }
    const double rel = err / std::max(scale, 1e-30);
    const bool ok = rel <= Kernels<T>::tolerance && std::isfinite(rel);
    std::printf("%-5s %-44s max rel err %.3e %s\n", Kernels<T>::name, what, rel, ok ? "ok" : "FAIL");
    failures += !ok;
}

// d/dx_i of f at x by central differences, for every i.
static std::vector<double> numeric_gradient(std::vector<double> x,
                                            const std::function<double(const std::vector<double>&)>& f) {
    std::vector<double> g(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
        const double keep = x[i], h = 1e-6 * std::max(1.0, std::fabs(keep));
        x[i] = keep + h;
        const double up = f(x);
        x[i] = keep - h;
        const double down = f(x);
        x[i] = keep;
        g[i] = (up - down) / (2 * h);
    }
    return g;
}

static double dot(const std::vector<double>& a, const std::vector<double>& b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
}

// RMSNorm of rows of n in f64.
static std::vector<double> norm_ref(const std::vector<double>& x, const std::vector<double>& w, int rows,
                                    int n, double eps) {
    std::vector<double> y(x.size());
    for (int r = 0; r < rows; ++r) {
        double s = 0;
        for (int c = 0; c < n; ++c) s += x[r * n + c] * x[r * n + c];
        const double rstd = 1 / std::sqrt(s / n + eps);
        for (int c = 0; c < n; ++c) y[r * n + c] = x[r * n + c] * rstd * w[c];
    }
    return y;
}

// A CTA of `threads` per row. n a multiple of 8: 16-byte accesses; otherwise value by value. A
// row of more than NORM_HELD_PACKS packs a thread reads the rest again.
template <typename T> void check_rms_norm(int n, unsigned threads) {
    const int rows = 11;
    const float eps = 1e-6f;
    auto a = random_values<T>(rows * n, 1.f), b = random_values<T>(rows * n, 1.f);
    auto w = random_values<T>(n, 0.5f, 1.f), dy = random_values<T>(rows * n, 1.f);
    auto d_res = random_values<T>(rows * n, 1.f);
    std::vector<T> sum(rows * n), y(rows * n), dx(rows * n);
    std::vector<float> rstd(rows), partial(2 * n);
    launch({(unsigned)rows, 1, 1}, threads, [&] {
        Kernels<T>::norm_forward(a.data(), b.data(), sum.data(), w.data(), y.data(), rstd.data(),
                                 n, eps);
    });
    std::vector<double> x(rows * n);
    for (int i = 0; i < rows * n; ++i) x[i] = to_float(from_float<T>(to_float(a[i]) + to_float(b[i])));
    expect_close<T>("rms_norm forward: residual sum", values(sum), x);
    expect_close<T>("rms_norm forward: normed rows", values(y), norm_ref(x, values(w), rows, n, eps));

    launch({(unsigned)rows, 1, 1}, threads, [&] {
        Kernels<T>::norm_backward(sum.data(), w.data(), rstd.data(), dy.data(), d_res.data(),
                                  dx.data(), n);
    });
    // Two chunks of rows, the second partly filled.
    launch({(unsigned)(n + FLAT_THREADS - 1) / FLAT_THREADS, 2, 1}, FLAT_THREADS, [&] {
        Kernels<T>::norm_weight(sum.data(), rstd.data(), dy.data(), partial.data(), rows, n, 8);
    });
    const auto up = values(dy), wd = values(w);
    auto want_dx = numeric_gradient(x, [&](const std::vector<double>& xs) {
        return dot(up, norm_ref(xs, wd, rows, n, eps));
    });
    for (int i = 0; i < rows * n; ++i) want_dx[i] += to_float(d_res[i]);
    expect_close<T>("rms_norm backward: input gradient + residual", values(dx), want_dx);
    const auto want_dw = numeric_gradient(wd, [&](const std::vector<double>& ws) {
        return dot(up, norm_ref(x, ws, rows, n, eps));
    });
    std::vector<double> dw(n);
    for (int c = 0; c < n; ++c) dw[c] = (double)partial[c] + partial[n + c];
    expect_close<T>("rms_norm backward: weight gradient", dw, want_dw);
}

// heads_forward in f64 (no rounding of the normed values): out [heads, tokens, head_dim].
static std::vector<double> heads_ref(const std::vector<double>& src, int ld, const std::vector<double>& w,
                                     const std::vector<double>& cos, const std::vector<double>& sin,
                                     int tokens, int heads, int head_dim, double eps) {
    std::vector<double> out((size_t)heads * tokens * head_dim);
    const int half = head_dim / 2;
    for (int t = 0; t < tokens; ++t)
        for (int h = 0; h < heads; ++h) {
            const double* x = &src[(size_t)t * ld + h * head_dim];
            double s = 0;
            for (int e = 0; e < head_dim; ++e) s += x[e] * x[e];
            const double r = 1 / std::sqrt(s / head_dim + eps);
            double* o = &out[((size_t)h * tokens + t) * head_dim];
            for (int e = 0; e < head_dim; ++e) {
                const int i = e < half ? e : e - half;
                const double c = cos[t * half + i], sn = sin[t * half + i];
                const double v = x[e] * r * w[e];
                const double p = e < half ? x[e + half] * r * w[e + half] : x[e - half] * r * w[e - half];
                o[e] = e < half ? v * c - p * sn : v * c + p * sn;
            }
        }
    return out;
}

template <typename T> void check_heads(int head_dim) {
    const int tokens = 5, heads = 3, offset = 8, ld = heads * head_dim + 24, half = head_dim / 2;
    const float eps = 1e-6f;
    auto src = random_values<T>((size_t)tokens * ld, 1.f);
    auto w = random_values<T>(head_dim, 0.5f, 1.f);
    std::vector<T> cos(tokens * half), sin(tokens * half);
    for (int t = 0; t < tokens; ++t)
        for (int i = 0; i < half; ++i) {
            const double angle = (t + 3) * std::pow(10000.0, -2.0 * i / head_dim);
            cos[t * half + i] = from_float<T>((float)std::cos(angle));
            sin[t * half + i] = from_float<T>((float)std::sin(angle));
        }
    const int rows = tokens * heads;
    std::vector<T> out((size_t)rows * head_dim), moved((size_t)rows * head_dim);
    std::vector<float> rstd(rows);
    const T* at = src.data() + offset;
    const unsigned ctas = (rows + ROW_WARPS - 1) / ROW_WARPS;
    launch({ctas, 1, 1}, 32 * ROW_WARPS, [&] {
        Kernels<T>::heads_fwd(at, w.data(), cos.data(), sin.data(), out.data(), rstd.data(), ld,
                              tokens, heads, head_dim, eps);
    });
    launch({ctas, 1, 1}, 32 * ROW_WARPS, [&] {
        Kernels<T>::heads_fwd(at, nullptr, nullptr, nullptr, moved.data(), nullptr, ld, tokens,
                              heads, head_dim, eps);
    });
    // Source values as seen from the head rows: offset applied.
    const auto all = values(src);
    std::vector<double> x(all.begin() + offset, all.end());
    x.resize((size_t)tokens * ld);
    const auto wd = values(w), cd = values(cos), sd = values(sin);
    char what[96];
    std::snprintf(what, sizeof what, "heads forward (head dim %d): norm + rope", head_dim);
    expect_close<T>(what, values(out), heads_ref(x, ld, wd, cd, sd, tokens, heads, head_dim, eps));
    bool moved_exactly = true;
    for (int t = 0; t < tokens; ++t)
        for (int h = 0; h < heads; ++h)
            for (int e = 0; e < head_dim; ++e)
                moved_exactly &= same_bits(moved[((size_t)h * tokens + t) * head_dim + e], at[(size_t)t * ld + h * head_dim + e]);
    std::printf("%-5s heads forward (head dim %d): v moved %s\n", Kernels<T>::name, head_dim,
                moved_exactly ? "ok" : "FAIL");
    failures += !moved_exactly;

    // Backward: one CTA, so that its warps take two rows each; the input gradient's rows are
    // contiguous (d_ld = heads * head_dim), the input's wider.
    auto up = random_values<T>((size_t)rows * head_dim, 1.f);
    const int d_ld = heads * head_dim;
    std::vector<T> d_src((size_t)tokens * d_ld), d_moved((size_t)tokens * d_ld);
    std::vector<float> partial(ROW_WARPS * head_dim);
    launch({1, 1, 1}, 32 * ROW_WARPS, [&] {
        Kernels<T>::heads_bwd(up.data(), at, w.data(), rstd.data(), cos.data(), sin.data(),
                              d_src.data(), partial.data(), ld, d_ld, tokens, heads, head_dim);
    });
    launch({1, 1, 1}, 32 * ROW_WARPS, [&] {
        Kernels<T>::heads_bwd(up.data(), at, nullptr, nullptr, nullptr, nullptr, d_moved.data(),
                              nullptr, ld, d_ld, tokens, heads, head_dim);
    });
    const auto upd = values(up);
    const auto fd = numeric_gradient(x, [&](const std::vector<double>& xs) {
        return dot(upd, heads_ref(xs, ld, wd, cd, sd, tokens, heads, head_dim, eps));
    });
    // Only the head columns of each row: the rest of a row is another projection's.
    std::vector<double> got, want;
    bool moved_back = true;
    for (int t = 0; t < tokens; ++t)
        for (int c = 0; c < heads * head_dim; ++c) {
            got.push_back(to_float(d_src[(size_t)t * d_ld + c]));
            want.push_back(fd[(size_t)t * ld + c]);
            const int h = c / head_dim, e = c % head_dim;
            moved_back &= same_bits(d_moved[(size_t)t * d_ld + c], up[((size_t)h * tokens + t) * head_dim + e]);
        }
    std::snprintf(what, sizeof what, "heads backward (head dim %d): input gradient", head_dim);
    expect_close<T>(what, got, want);
    std::vector<double> dw(head_dim);
    for (int p = 0; p < ROW_WARPS; ++p)
        for (int e = 0; e < head_dim; ++e) dw[e] += partial[p * head_dim + e];
    std::snprintf(what, sizeof what, "heads backward (head dim %d): norm weight gradient", head_dim);
    expect_close<T>(what, dw, numeric_gradient(wd, [&](const std::vector<double>& ws) {
                        return dot(upd, heads_ref(x, ld, ws, cd, sd, tokens, heads, head_dim, eps));
                    }));
    std::printf("%-5s heads backward (head dim %d): v moved back %s\n", Kernels<T>::name, head_dim,
                moved_back ? "ok" : "FAIL");
    failures += !moved_back;
}

static std::vector<double> swiglu_ref(const std::vector<double>& gu, int rows, int inter) {
    std::vector<double> act((size_t)rows * inter);
    for (int t = 0; t < rows; ++t)
        for (int c = 0; c < inter; ++c) {
            const double g = gu[(size_t)t * 2 * inter + c], u = gu[(size_t)t * 2 * inter + inter + c];
            act[(size_t)t * inter + c] = g / (1 + std::exp(-g)) * u;
        }
    return act;
}

// inter a multiple of 8: 16-byte accesses, with a CTA's threads striding over the columns
// past 8 x 256 of them; otherwise value by value. Two rows of CTAs for three rows: they stride.
template <typename T> void check_swiglu(int inter) {
    const int rows = 3;
    auto gu = random_values<T>((size_t)rows * 2 * inter, 4.f);
    auto up = random_values<T>((size_t)rows * inter, 1.f);
    std::vector<T> act((size_t)rows * inter), d_gu((size_t)rows * 2 * inter);
    launch({1, 2, 1}, FLAT_THREADS, [&] { Kernels<T>::swiglu_fwd(gu.data(), act.data(), rows, inter); });
    launch({1, 2, 1}, FLAT_THREADS,
           [&] { Kernels<T>::swiglu_bwd(gu.data(), up.data(), d_gu.data(), rows, inter); });
    const auto x = values(gu), upd = values(up);
    expect_close<T>("swiglu forward", values(act), swiglu_ref(x, rows, inter));
    expect_close<T>("swiglu backward", values(d_gu), numeric_gradient(x, [&](const std::vector<double>& xs) {
                        return dot(upd, swiglu_ref(xs, rows, inter));
                    }));
}

// log p(label) of every row of logits [rows, vocab], in f64.
static std::vector<double> label_log_probs(const std::vector<double>& logits,
                                           const std::vector<unsigned>& labels, int rows, int vocab) {
    std::vector<double> out(rows);
    for (int r = 0; r < rows; ++r) {
        double m = -INFINITY, s = 0;
        for (int j = 0; j < vocab; ++j) m = std::max(m, logits[(size_t)r * vocab + j]);
        for (int j = 0; j < vocab; ++j) s += std::exp(logits[(size_t)r * vocab + j] - m);
        out[r] = logits[(size_t)r * vocab + labels[r]] - m - std::log(s);
    }
    return out;
}

template <typename T> void check_label_log_softmax() {
    // A vocabulary wider than the CTA, so that threads take several columns.
    const int rows = 3, vocab = 2500;
    auto logits = random_values<T>((size_t)rows * vocab, 6.f);
    const std::vector<unsigned> labels = {0, 1234, vocab - 1};
    const std::vector<float> d_log_prob = {1.f, -0.5f, 2.f};
    std::vector<float> lse(rows), log_prob(rows);
    launch({rows, 1, 1}, HEAD_THREADS, [&] {
        Kernels<T>::log_softmax(logits.data(), labels.data(), lse.data(), log_prob.data(), vocab);
    });
    const auto x = values(logits);
    expect_close<T>("label log-softmax: log-probabilities", values(log_prob),
                    label_log_probs(x, labels, rows, vocab));
    // One CTA: threads stride over the rows' elements.
    launch({1, 1, 1}, FLAT_THREADS, [&] {
        Kernels<T>::log_softmax_bwd(logits.data(), labels.data(), lse.data(), d_log_prob.data(),
                                    rows, vocab);
    });
    const std::vector<double> upstream(d_log_prob.begin(), d_log_prob.end());
    // The gradient of one row at a time (finite differences over the whole matrix would take
    // rows × vocab forwards of every row).
    std::vector<double> want(x.size());
    for (int r = 0; r < rows; ++r) {
        std::vector<double> row(x.begin() + (size_t)r * vocab, x.begin() + (size_t)(r + 1) * vocab);
        const std::vector<unsigned> label = {labels[r]};
        const auto g = numeric_gradient(row, [&](const std::vector<double>& xs) {
            return upstream[r] * label_log_probs(xs, label, 1, vocab)[0];
        });
        std::copy(g.begin(), g.end(), want.begin() + (size_t)r * vocab);
    }
    expect_close<T>("label log-softmax backward: logits' gradient", values(logits), want);
}

// The embedding table's gradient: tokens repeated and absent, a hidden size wider than the CTA
// (threads take several columns), rows added to what dst held; groups as layer_ops.rs
// TokenGroups makes them.
// hidden 300: value by value; 256: packs of 16 bytes. Token 5 of the longer sequence has 19
// positions: two groups of 8 loads in flight, then 3 one by one.
template <typename T> void check_embedding_backward(int hidden, const std::vector<unsigned>& tokens) {
    const int vocab = 12;
    const int positions = tokens.size();
    std::vector<unsigned> order(positions), unique, starts;
    for (int i = 0; i < positions; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](unsigned a, unsigned b) { return tokens[a] < tokens[b]; });
    for (int i = 0; i < positions; ++i)
        if (unique.empty() || unique.back() != tokens[order[i]]) {
            unique.push_back(tokens[order[i]]);
            starts.push_back(i);
        }
    starts.push_back(positions);
    auto upstream = random_values<T>((size_t)positions * hidden, 1.f);
    std::vector<float> dst((size_t)vocab * hidden);
    for (size_t i = 0; i < dst.size(); ++i) dst[i] = 0.25f * (float)(i % 7);
    std::vector<double> want(dst.begin(), dst.end());
    for (int p = 0; p < positions; ++p)
        for (int c = 0; c < hidden; ++c)
            want[(size_t)tokens[p] * hidden + c] += to_float(upstream[(size_t)p * hidden + c]);
    launch({(unsigned)unique.size(), 1, 1}, FLAT_THREADS, [&] {
        Kernels<T>::embedding_bwd(upstream.data(), order.data(), unique.data(), starts.data(),
                                  dst.data(), hidden);
    });
    expect_close<T>("embedding backward", values(dst), want);
}

template <typename T> void check_all() {
    // One pack a thread or fewer (as train_layer.rs launches them); two held; some read again.
    for (int n : {100, 96, 320}) check_rms_norm<T>(n, 64);
    check_rms_norm<T>(512, 32);
    for (int n : {328, 1000, 130}) check_rms_norm<T>(n, 32);
    // 20: halves of 10, value by value; the others in packs of 4.
    for (int head_dim : {16, 20, 64, 128, 192}) check_heads<T>(head_dim);
    for (int inter : {100, 2064}) check_swiglu<T>(inter);
    check_label_log_softmax<T>();
    const std::vector<unsigned> few = {7, 3, 7, 9, 3, 7, 0, 11, 7};
    std::vector<unsigned> many;
    for (size_t i = 0; i < 19; ++i) {
        many.push_back(5u);
        if (i < few.size()) many.push_back(few[i]);
    }
    for (int hidden : {300, 256}) {
        check_embedding_backward<T>(hidden, few);
        check_embedding_backward<T>(hidden, many);
    }
}

int main() {
    check_all<float>();
    check_all<bf16_t>();
    check_all<f16_t>();
    if (failures) std::printf("%d checks failed\n", failures);
    return failures ? 1 : 0;
}
