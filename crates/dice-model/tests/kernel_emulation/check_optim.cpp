// Runs optim.cu on the CPU (cuda_emulation.h) against the host AdamW update of
// crates/dice-train/src/optim.rs written out in plain f32 operations (ISO C++ contracts no
// multiply-add, as Rust does not): moments, masters and the rounded weights must be equal bit
// for bit, for f32 weights (their own masters) and bf16/f16 weights with f32 masters, with and
// without weight decay, with and without a gradient factor (clipping's coefficient applied as
// the gradient is read), on more elements than the grid's threads (they stride). And the square
// sums of the gradient norm: every element's square added once, in f64, for each dtype, the
// partials of a grid smaller and larger than the elements' rows (values in sixteenths, whose
// f64 sums are exact in any order, so that any element lost or counted twice shows).
// Build: g++ -std=c++20 check_optim.cpp; exits non-zero on a mismatch.
#include "cuda_emulation.h"
#include "../../src/kernels/optim.cu"

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

static std::mt19937 rng(3);
static int failures = 0;

template <typename T> struct Kernel;
template <> struct Kernel<float> {
    static constexpr auto step = adamw_step_f32;
    static constexpr auto square_sums = square_sums_f32;
    static constexpr const char* name = "f32";
};
template <> struct Kernel<bf16_t> {
    static constexpr auto step = adamw_step_bf16;
    static constexpr auto square_sums = square_sums_bf16;
    static constexpr const char* name = "bf16";
};
template <> struct Kernel<f16_t> {
    static constexpr auto step = adamw_step_f16;
    static constexpr auto square_sums = square_sums_f16;
    static constexpr const char* name = "f16";
};

struct Scalars {
    bool scales_grad;
    float grad_factor;
    bool decays;
    float decay, one_minus_beta1, beta2, one_minus_beta2, bc2, eps, neg_step;
};

template <typename T> bool same(const std::vector<T>& a, const std::vector<T>& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <typename T> void check(bool with_master, bool decays, bool scales_grad) {
    const size_t n = 1000;
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    std::vector<float> grad(n), m(n), v(n), master(n);
    std::vector<T> weight(n);
    for (size_t i = 0; i < n; ++i) {
        grad[i] = u(rng);
        m[i] = 0.1f * u(rng);
        v[i] = 0.01f * std::fabs(u(rng));
        master[i] = u(rng);
        weight[i] = from_float<T>(master[i]);
    }
    // Step 3 of lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.1: the f64 scalars rounded
    // to f32 as the optimizer hands them over.
    const double lr = 1e-3, t = 3;
    const Scalars s{scales_grad,
                    (float)(1.0 / (7.3 + 1e-6)),
                    decays,
                    (float)(1.0 - lr * 0.1),
                    (float)(1.0 - 0.9),
                    0.999f,
                    (float)(1.0 - 0.999),
                    (float)std::sqrt(1.0 - std::pow(0.999, t)),
                    1e-8f,
                    (float)(-lr / (1.0 - std::pow(0.9, t)))};
    // The host update (FirstMoment, SecondMoment, WeightUpdate of optim.rs).
    auto want_m = m, want_v = v;
    auto want_p = with_master ? master : std::vector<float>(n);
    if (!with_master)
        for (size_t i = 0; i < n; ++i) want_p[i] = to_float(weight[i]);
    std::vector<T> want_w(n);
    for (size_t i = 0; i < n; ++i) {
        // clip_sharded_grad_norm's `g.affine(coef, 0)` before the update.
        const float g = s.scales_grad ? grad[i] * s.grad_factor + 0.0f : grad[i];
        want_m[i] += (g - want_m[i]) * s.one_minus_beta1 + 0.0f;
        want_v[i] = (want_v[i] * s.beta2 + 0.0f) + (g * s.one_minus_beta2 + 0.0f) * g;
        float& p = want_p[i];
        if (s.decays) p = p * s.decay + 0.0f;
        const float denom = (std::sqrt(want_v[i]) / s.bc2) * 1.0f + s.eps;
        p += (want_m[i] * s.neg_step + 0.0f) / denom;
        want_w[i] = from_float<T>(p);
    }
    // Two CTAs of 256 threads for 1,000 elements.
    launch({2, 1, 1}, ADAMW_THREADS, [&] {
        Kernel<T>::step(weight.data(), with_master ? master.data() : nullptr, m.data(), v.data(),
                        grad.data(), n, s.scales_grad, s.grad_factor, s.decays, s.decay, s.one_minus_beta1, s.beta2,
                        s.one_minus_beta2, s.bc2, s.eps, s.neg_step);
    });
    bool ok = same(m, want_m) && same(v, want_v) && same(weight, want_w) &&
              (!with_master || same(master, want_p));
    std::printf("%-5s master %-3s decay %-3s factor %-3s %s\n", Kernel<T>::name,
                with_master ? "yes" : "no", decays ? "yes" : "no", scales_grad ? "yes" : "no",
                ok ? "bit for bit" : "FAIL");
    failures += !ok;
}

// The square sums of n elements over `blocks` CTAs against a direct sum.
template <typename T> void check_square_sums(size_t n, unsigned blocks) {
    std::vector<T> x(n);
    double want = 0.0;
    for (size_t i = 0; i < n; ++i) {
        x[i] = from_float<T>((float)((int)(i * 7 % 61) - 30) / 16.0f);
        const double v = to_float(x[i]);
        want += v * v;
    }
    std::vector<double> partial(blocks, -1.0);
    launch({blocks, 1, 1}, SQUARE_SUM_THREADS,
           [&] { Kernel<T>::square_sums(x.data(), partial.data(), n); });
    double got = 0.0;
    for (double p : partial) got += p;
    const bool ok = got == want;
    std::printf("%-5s square sums of %zu over %u CTAs: %s\n", Kernel<T>::name, n, blocks,
                ok ? "exact" : "FAIL");
    failures += !ok;
}

int main() {
    for (bool decays : {false, true})
        for (bool scales_grad : {false, true}) {
            check<float>(false, decays, scales_grad);
            check<bf16_t>(true, decays, scales_grad);
            check<f16_t>(true, decays, scales_grad);
        }
    for (auto [n, blocks] : {std::pair<size_t, unsigned>{1000, 2}, {100, 3}, {5000, 1}}) {
        check_square_sums<float>(n, blocks);
        check_square_sums<bf16_t>(n, blocks);
        check_square_sums<f16_t>(n, blocks);
    }
    return failures ? 1 : 0;
}
