//! The unbiased pass@k estimator (Chen et al. 2021), as KernelBench computes it.

/// 1 − C(n−c, k) / C(n, k): the chance that at least one of k samples drawn without
/// replacement from n (c of them successes) succeeds. Requires `k ≤ n` and `c ≤ n`.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    assert!(
        k >= 1 && k <= n && c <= n,
        "pass@k needs 1 ≤ k ≤ n and c ≤ n"
    );
    if n - c < k {
        return 1.0;
    }
    // Product form avoids huge binomials: C(n−c,k)/C(n,k) = Π_{i=n−c+1}^{n} (1 − k/i).
    1.0 - (n - c + 1..=n)
        .map(|i| 1.0 - k as f64 / i as f64)
        .product::<f64>()
}

/// The k reported for n samples per problem: 1, 5, 10, 20, 50, 100, 200, 500, … up to n.
pub fn k_values(n: usize) -> Vec<usize> {
    let mut ks = vec![1, 5];
    let mut decade = 10;
    while decade <= n {
        ks.extend([decade, 2 * decade, 5 * decade]);
        decade *= 10;
    }
    ks.retain(|&k| k <= n);
    ks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binomial(n: usize, k: usize) -> f64 {
        (0..k).map(|i| (n - i) as f64 / (i + 1) as f64).product()
    }

    #[test]
    fn matches_the_binomial_definition() {
        for n in 1..=12 {
            for c in 0..=n {
                for k in 1..=n {
                    let expected = if n - c < k {
                        1.0
                    } else {
                        1.0 - binomial(n - c, k) / binomial(n, k)
                    };
                    assert!((pass_at_k(n, c, k) - expected).abs() < 1e-12, "{n} {c} {k}");
                }
            }
        }
    }

    #[test]
    fn known_values() {
        assert_eq!(pass_at_k(10, 0, 5), 0.0);
        assert_eq!(pass_at_k(10, 10, 1), 1.0);
        assert!((pass_at_k(10, 3, 1) - 0.3).abs() < 1e-12);
        // 1 − C(5,2)/C(10,2) = 1 − 10/45
        assert!((pass_at_k(10, 5, 2) - (1.0 - 10.0 / 45.0)).abs() < 1e-12);
        assert_eq!(pass_at_k(10, 6, 5), 1.0);
    }

    #[test]
    fn k_values_follow_the_series() {
        assert_eq!(k_values(1), vec![1]);
        assert_eq!(k_values(4), vec![1]);
        assert_eq!(k_values(5), vec![1, 5]);
        assert_eq!(k_values(16), vec![1, 5, 10]);
        assert_eq!(k_values(100), vec![1, 5, 10, 20, 50, 100]);
    }
}
