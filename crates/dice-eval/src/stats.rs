//! Summary statistics of timings.

use dice_store::TimingStats;

/// Mean, median, population standard deviation, min and max of `ms`; None when empty.
pub(crate) fn timing_stats(ms: &[f64]) -> Option<TimingStats> {
    if ms.is_empty() {
        return None;
    }
    let n = ms.len() as f64;
    let mean = ms.iter().sum::<f64>() / n;
    let var = ms.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    let mut sorted = ms.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    let median = if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    };
    Some(TimingStats {
        mean_ms: mean,
        median_ms: median,
        std_ms: var.sqrt(),
        min_ms: sorted[0],
        max_ms: sorted[sorted.len() - 1],
        trials: ms.len() as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_of_a_small_sample() {
        let s = timing_stats(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!(
            (s.mean_ms, s.median_ms, s.min_ms, s.max_ms, s.trials),
            (2.5, 2.5, 1.0, 4.0, 4)
        );
        assert!((s.std_ms - 1.25f64.sqrt()).abs() < 1e-12);
        assert!(timing_stats(&[]).is_none());
    }
}
