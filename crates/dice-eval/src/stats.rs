//! Summary statistics of timings.

use crate::config::Timing;
use dice_store::TimingStats;

/// The statistics `timing` reports: KernelBench's `get_timing_stats` rounds its mean, standard
/// deviation, minimum and maximum to 3 significant digits (`float(f"{x:.3g}")`), and its
/// speedups divide those rounded means.
pub(crate) fn reported_stats(timing: Timing, ms: &[f64]) -> Option<TimingStats> {
    let stats = timing_stats(ms)?;
    if timing == Timing::Dice {
        return Some(stats);
    }
    Some(TimingStats {
        mean_ms: three_significant(stats.mean_ms),
        std_ms: three_significant(stats.std_ms),
        min_ms: three_significant(stats.min_ms),
        max_ms: three_significant(stats.max_ms),
        ..stats
    })
}

/// `x` rounded to 3 significant digits, as Python's `f"{x:.3g}"` does.
fn three_significant(x: f64) -> f64 {
    format!("{:.2e}", x).parse().unwrap_or(x)
}

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

    #[test]
    fn kernelbench_reports_three_significant_digits() {
        let ms = [0.123_456, 0.123_456];
        let kb = reported_stats(Timing::KernelBench, &ms).unwrap();
        assert_eq!((kb.mean_ms, kb.min_ms, kb.std_ms), (0.123, 0.123, 0.0));
        assert_eq!(kb.median_ms, 0.123_456);
        let dice = reported_stats(Timing::Dice, &ms).unwrap();
        assert_eq!(dice.mean_ms, 0.123_456);
        assert_eq!(three_significant(2_664.9), 2_660.0);
        assert_eq!(three_significant(0.000_999_96), 0.001);
    }
}
