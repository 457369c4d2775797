//! Summary statistics of timings.

use crate::config::{Device, Timing};
use dice_store::{SpeedupInterval, TimingStats};

/// The statistics `timing` reports: KernelBench's `get_timing_stats` rounds its mean, standard
/// deviation, minimum and maximum to 3 significant digits (`float(f"{x:.3g}")`), and its
/// speedups divide those rounded means.
pub(crate) fn reported_stats(timing: Timing, ms: &[f64]) -> Option<TimingStats> {
    let stats = timing_stats(ms)?;
    if timing.interleaves() {
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
    Some(TimingStats {
        mean_ms: mean,
        median_ms: median(ms)?,
        std_ms: var.sqrt(),
        min_ms: ms.iter().copied().fold(f64::INFINITY, f64::min),
        max_ms: ms.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        trials: ms.len() as u32,
    })
}

/// The median of `values`; None when empty.
pub(crate) fn median(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| median_in_place(&mut values.to_vec()))
}

/// The median of `values` (not empty), which it reorders: a selection, not a sort, since the
/// speedup's bootstrap takes one of each of its thousands of resamples.
fn median_in_place(values: &mut [f64]) -> f64 {
    let (mid, even) = (values.len() / 2, values.len().is_multiple_of(2));
    let (below, upper, _) = values.select_nth_unstable_by(mid, f64::total_cmp);
    let upper = *upper;
    if even {
        let lower = below.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (lower + upper) / 2.0
    } else {
        upper
    }
}

/// Which summary of a side's timed calls a speedup divides (`Statistic::of_timing`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Statistic {
    Mean,
    Median,
}

impl Statistic {
    /// The median for `--timing dice-queued` on a GPU, the mean otherwise. Queued calls time the
    /// device's work alone; what still lands in a few of them is a host stall longer than the
    /// hold (tens of microseconds to milliseconds among calls of a few), which moves a mean of
    /// 100 calls by several times a small program while its median stays within 2 % of the
    /// device's work (bench/notes/eval-h200.md, sessions 35-38). A median is safe there because
    /// every timed call on a GPU gets inputs of its own, keyed one call at a time (call_keys.rs):
    /// no program can move work from most of its calls into a few. Not on the CPU, whose rounds
    /// make their inputs, and ask their keys, before their first call: a program could compute
    /// a round's outputs in its first call and copy them out in the others, which a median
    /// would credit. Under dice's timer the host's launches are inside every call and a small
    /// program's calls mix two modes (launch-bound or not), whose mean is steadier than their
    /// median; KernelBench's methods report means.
    pub(crate) fn of_timing(timing: Timing, device: Device) -> Statistic {
        if timing.queues_launches(device) {
            Statistic::Median
        } else {
            Statistic::Mean
        }
    }

    /// The statistic of calls summarised as `stats`.
    pub(crate) fn of_stats(self, stats: &TimingStats) -> f64 {
        match self {
            Statistic::Mean => stats.mean_ms,
            Statistic::Median => stats.median_ms,
        }
    }

    /// The statistic of `calls` (not empty).
    fn of_calls(self, calls: &mut [f64]) -> f64 {
        match self {
            Statistic::Mean => calls.iter().sum::<f64>() / calls.len() as f64,
            Statistic::Median => median_in_place(calls),
        }
    }
}

/// Coefficient of variation of the calls: their standard deviation over their mean.
pub(crate) fn dispersion(stats: &TimingStats) -> f64 {
    if stats.mean_ms > 0.0 {
        stats.std_ms / stats.mean_ms
    } else {
        0.0
    }
}

/// Resamples of the speedup's bootstrap.
const RESAMPLES: usize = 2000;

/// A 95 % interval of the speedup (baseline over candidate, by `statistic`) from the calls of each
/// round, the candidate's and the baseline's rounds paired by index: a two-stage bootstrap that
/// draws rounds with replacement (a pair at once, so a load that slowed both sides of a round
/// stays together), then calls with replacement within each drawn round, and takes the 2.5th
/// and 97.5th percentiles of the resampled speedups. Rounds, not calls, are the independent
/// units under load (one build slows a whole round); with one round it is a plain bootstrap of
/// the calls. Seeded: a stored interval can be recomputed. None without calls on both sides.
pub(crate) fn speedup_interval(
    statistic: Statistic,
    candidate: &[Vec<f64>],
    baseline: &[Vec<f64>],
) -> Option<SpeedupInterval> {
    let pairs = candidate.len().min(baseline.len());
    let usable = |rounds: &[Vec<f64>]| rounds[..pairs].iter().all(|r| !r.is_empty());
    if pairs == 0 || !usable(candidate) || !usable(baseline) {
        return None;
    }
    let mut rng = SplitMix64(0x5eed_d1ce);
    let mut drawn = Vec::new();
    let mut resampled = |rounds: &[Vec<f64>], picked: &[usize], rng: &mut SplitMix64| {
        drawn.clear();
        for &r in picked {
            let round = &rounds[r];
            drawn.extend((0..round.len()).map(|_| round[rng.below(round.len())]));
        }
        statistic.of_calls(&mut drawn)
    };
    let mut speedups = Vec::with_capacity(RESAMPLES);
    let mut picked = vec![0; pairs];
    for _ in 0..RESAMPLES {
        for p in &mut picked {
            *p = rng.below(pairs);
        }
        let c = resampled(candidate, &picked, &mut rng);
        let b = resampled(baseline, &picked, &mut rng);
        if c > 0.0 {
            speedups.push(b / c);
        }
    }
    if speedups.is_empty() {
        return None;
    }
    speedups.sort_by(f64::total_cmp);
    let at = |q: f64| speedups[((speedups.len() - 1) as f64 * q).round() as usize];
    Some(SpeedupInterval {
        low: at(0.025),
        high: at(0.975),
    })
}

/// A small seeded generator (SplitMix64): the bootstrap's, and curation's draws and hashes.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0); the modulo bias is far below the bootstrap's own error.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
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
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert!((dispersion(&s) - 1.25f64.sqrt() / 2.5).abs() < 1e-12);
    }

    #[test]
    fn the_speedup_interval_holds_the_speedup_and_widens_with_dispersion() {
        let steady: Vec<Vec<f64>> = (0..10).map(|_| vec![1.0; 10]).collect();
        let twice: Vec<Vec<f64>> = (0..10).map(|_| vec![2.0; 10]).collect();
        let exact = speedup_interval(Statistic::Mean, &steady, &twice).unwrap();
        assert_eq!((exact.low, exact.high), (2.0, 2.0));
        // Candidate calls of 0.5..1.5 ms around 1 ms; one round of the baseline slowed by load.
        let noisy: Vec<Vec<f64>> = (0..10)
            .map(|r| {
                (0..10)
                    .map(|c| 0.5 + f64::from((r * 7 + c * 3) % 11) / 10.0)
                    .collect()
            })
            .collect();
        let mut loaded = twice.clone();
        loaded[4] = vec![6.0; 10];
        let wide = speedup_interval(Statistic::Mean, &noisy, &loaded).unwrap();
        let speedup = loaded.iter().flatten().sum::<f64>() / noisy.iter().flatten().sum::<f64>();
        assert!(
            wide.low < speedup && speedup < wide.high,
            "{wide:?} {speedup}"
        );
        assert!(wide.high - wide.low > 0.5, "{wide:?}");
        assert_eq!(
            speedup_interval(Statistic::Mean, &noisy, &loaded),
            Some(wide)
        );
        assert_eq!(speedup_interval(Statistic::Mean, &[], &twice), None);
    }

    #[test]
    fn a_median_speedup_ignores_rare_stalls_that_move_the_mean() {
        // 100 calls of 10 us a side; two of the candidate's held up 2 ms by the host.
        let base: Vec<Vec<f64>> = (0..4).map(|_| vec![0.010; 25]).collect();
        let mut cand = base.clone();
        cand[1][7] = 2.0;
        cand[3][20] = 2.0;
        let stats = timing_stats(&cand.concat()).unwrap();
        let (mean, median) = (Statistic::Mean, Statistic::Median);
        assert!(mean.of_stats(&stats) > 4.0 * median.of_stats(&stats));
        let by_median = speedup_interval(median, &cand, &base).unwrap();
        assert_eq!((by_median.low, by_median.high), (1.0, 1.0));
        let by_mean = speedup_interval(mean, &cand, &base).unwrap();
        assert!(by_mean.low < 0.5, "{by_mean:?}");
        // A candidate slow on most of its calls is slow by its median too.
        let slow: Vec<Vec<f64>> = (0..4)
            .map(|r| {
                (0..25)
                    .map(|c| if (r + c) % 3 == 0 { 0.010 } else { 0.030 })
                    .collect()
            })
            .collect();
        let slowed = speedup_interval(median, &slow, &base).unwrap();
        assert!(slowed.high < 0.4, "{slowed:?}");
        assert_eq!(
            Statistic::of_timing(Timing::DiceQueued, Device::Cuda),
            median
        );
        assert_eq!(Statistic::of_timing(Timing::DiceQueued, Device::Cpu), mean);
        assert_eq!(Statistic::of_timing(Timing::Dice, Device::Cuda), mean);
        assert_eq!(
            Statistic::of_timing(Timing::KernelBench, Device::Cuda),
            mean
        );
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
