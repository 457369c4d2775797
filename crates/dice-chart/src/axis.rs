//! Axes: what a quantity is (real, integer, share, ratio, category), where its ticks go and how
//! its values read.

/// One axis of a chart: its title, the kind of quantity it measures, and optionally a fixed
/// range or values its range must include.
#[derive(Clone, Debug)]
pub struct Axis {
    pub(crate) title: String,
    pub(crate) kind: Kind,
    /// A fixed range in data units; data outside it is drawn on its edge.
    range: Option<(f64, f64)>,
    /// Values the range reaches whatever the data (0 under bars, 1× beside speedups).
    include: Vec<f64>,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Kind {
    Real,
    Integer,
    /// Shares from 0 to 1, read as percentages.
    Percent,
    /// Ratios such as speedups, on a log2 scale, read as 1/4×, 1×, 4×.
    Ratio,
    /// Named slots at 0, 1, 2, …
    Categories(Vec<String>),
}

/// Where an axis runs and what is written along it, in axis units (log2 of a ratio).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Resolved {
    pub lo: f64,
    pub hi: f64,
    pub ticks: Vec<(f64, String)>,
}

/// How many ticks an axis aims at: enough to read a value off, few enough to read at a glance.
const TARGET_TICKS: f64 = 5.0;

impl Axis {
    fn new(title: &str, kind: Kind) -> Self {
        Self {
            title: title.to_string(),
            kind,
            range: None,
            include: Vec::new(),
        }
    }

    /// A real quantity (loss, seconds, learning rate).
    pub fn real(title: &str) -> Self {
        Self::new(title, Kind::Real)
    }

    /// A count or an index (steps, problems, samples): ticks on whole numbers only.
    pub fn integer(title: &str) -> Self {
        Self::new(title, Kind::Integer)
    }

    /// A share from 0 to 1, labelled in percent.
    pub fn percent(title: &str) -> Self {
        Self::new(title, Kind::Percent)
    }

    /// A ratio such as a speedup on a log2 scale, labelled 1/4×, 1×, 4×; values ≤ 0 are not
    /// drawn.
    pub fn ratio(title: &str) -> Self {
        Self::new(title, Kind::Ratio)
    }

    /// Named slots (runs, levels), the first at 0.
    pub fn categories(title: &str, names: Vec<String>) -> Self {
        Self::new(title, Kind::Categories(names))
    }

    /// Fixes the range to `lo..=hi` (data units); values outside are drawn on its edge.
    #[must_use]
    pub fn with_range(mut self, lo: f64, hi: f64) -> Self {
        self.range = Some((lo, hi));
        self
    }

    /// Makes the range reach `value` whatever the data.
    #[must_use]
    pub fn including(mut self, value: f64) -> Self {
        self.include.push(value);
        self
    }

    /// A value's position in axis units: log2 for ratios (`None` when it has none), the value
    /// itself otherwise.
    pub(crate) fn unit(&self, value: f64) -> Option<f64> {
        match self.kind {
            Kind::Ratio if value > 0.0 => Some(value.log2()),
            Kind::Ratio => None,
            _ if value.is_finite() => Some(value),
            _ => None,
        }
    }

    /// A value as a reader wants it in a tooltip or beside a bar.
    pub fn format(&self, value: f64) -> String {
        match &self.kind {
            Kind::Real => format_number(value),
            Kind::Integer => format!("{value:.0}"),
            Kind::Percent => format!("{:.1}%", 100.0 * value),
            Kind::Ratio => format!("{value:.3}×"),
            Kind::Categories(names) => names
                .get(value.round().max(0.0) as usize)
                .cloned()
                .unwrap_or_default(),
        }
    }

    /// A value in few characters, to write beside a bar: shares in whole percent.
    pub(crate) fn format_short(&self, value: f64) -> String {
        match self.kind {
            Kind::Percent => format!("{:.0}%", 100.0 * value),
            _ => self.format(value),
        }
    }

    /// The range and ticks for `data` (axis units). `spread` puts the ends at the data's
    /// own ends, labelled (an x axis of steps runs from the first step to the last); otherwise
    /// the ends are widened to the ticks around the data (a y axis).
    pub(crate) fn resolve(&self, data: &[f64], spread: bool) -> Resolved {
        if let Kind::Categories(names) = &self.kind {
            return Resolved {
                lo: -0.5,
                hi: names.len().max(1) as f64 - 0.5,
                ticks: names
                    .iter()
                    .enumerate()
                    .map(|(i, n)| (i as f64, n.clone()))
                    .collect(),
            };
        }
        let fixed = self.range.map(|(lo, hi)| (self.unit(lo), self.unit(hi)));
        let included = self.include.iter().filter_map(|v| self.unit(*v));
        let (lo, hi) = match fixed {
            Some((Some(lo), Some(hi))) => (lo, hi),
            _ => extent(data.iter().copied().chain(included)),
        };
        match self.kind {
            Kind::Ratio => self.ratio_ticks(lo, hi, fixed.is_some()),
            Kind::Integer if spread => self.spread_integer_ticks(lo, hi),
            _ if fixed.is_some() => {
                let step = self.step(hi - lo);
                Resolved {
                    lo,
                    hi,
                    ticks: self.labelled(multiples(lo, hi, step), step),
                }
            }
            _ => self.nice_ticks(lo, hi),
        }
    }

    fn step(&self, span: f64) -> f64 {
        let step = nice_step(span / TARGET_TICKS);
        if self.kind == Kind::Integer {
            step.max(1.0)
        } else {
            step
        }
    }

    fn labelled(&self, ticks: Vec<f64>, step: f64) -> Vec<(f64, String)> {
        let largest = ticks.iter().fold(0.0f64, |m, t| m.max(t.abs()));
        ticks
            .into_iter()
            .map(|t| (t, self.tick_label(t, step, largest)))
            .collect()
    }

    fn tick_label(&self, value: f64, step: f64, largest: f64) -> String {
        match self.kind {
            Kind::Percent => {
                let decimals = decimals(100.0 * step);
                format!("{:.*}%", decimals, 100.0 * value)
            }
            Kind::Integer if largest < 1e4 => format!("{value:.0}"),
            _ => real_tick(value, step, largest),
        }
    }

    /// The data's range widened to the ticks around it; a single value gets room either side.
    fn nice_ticks(&self, lo: f64, hi: f64) -> Resolved {
        let (lo, hi) = if hi > lo {
            (lo, hi)
        } else {
            let room = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
            let room = if self.kind == Kind::Integer {
                room.max(1.0)
            } else {
                room
            };
            (lo - room, hi + room)
        };
        let step = self.step(hi - lo);
        let (lo, hi) = (
            (lo / step + 1e-9).floor() * step,
            (hi / step - 1e-9).ceil() * step,
        );
        Resolved {
            lo,
            hi,
            ticks: self.labelled(multiples(lo, hi, step), step),
        }
    }

    /// Ticks from the first value to the last: both ends, and the round values between them
    /// not crowding an end (`1, 10, 20, 30, 40` for steps 1 to 40).
    fn spread_integer_ticks(&self, lo: f64, hi: f64) -> Resolved {
        let (lo, hi) = (lo.round(), hi.round());
        if hi <= lo {
            return Resolved {
                lo: lo - 0.5,
                hi: hi + 0.5,
                ticks: vec![(lo, format!("{lo:.0}"))],
            };
        }
        let step = self.step(hi - lo);
        let mut ticks = vec![lo];
        ticks.extend(
            multiples(lo, hi, step)
                .into_iter()
                .filter(|t| t - lo >= step / 2.0 && hi - t >= step / 2.0),
        );
        ticks.push(hi);
        Resolved {
            lo,
            hi,
            ticks: self.labelled(ticks, step),
        }
    }

    /// Powers of two (every octave, or every other one over a wide range) on a log2 axis.
    fn ratio_ticks(&self, lo: f64, hi: f64, fixed: bool) -> Resolved {
        let (lo, hi) = if fixed {
            (lo, hi)
        } else {
            let (lo, hi) = (lo.floor(), hi.ceil());
            if hi > lo {
                (lo, hi)
            } else {
                (lo - 1.0, hi + 1.0)
            }
        };
        let every = ((hi - lo) / 8.0).ceil().max(1.0) as i32;
        let ticks = (lo.ceil() as i32..=hi.floor() as i32)
            .filter(|e| e.rem_euclid(every) == 0)
            .map(|e| (f64::from(e), power_of_two(e)))
            .collect();
        Resolved { lo, hi, ticks }
    }
}

/// `2^e` as a ratio: `4×`, `1×`, `1/4×`.
fn power_of_two(e: i32) -> String {
    if e >= 0 {
        format!("{}×", 1u64 << e.min(62))
    } else {
        format!("1/{}×", 1u64 << (-e).min(62))
    }
}

/// The smallest and largest finite value (0 to 1 when there is none).
fn extent(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if lo > hi {
        (0.0, 1.0)
    } else {
        (lo, hi)
    }
}

/// 1, 2 or 5 times a power of ten: the first such step at least `raw`.
fn nice_step(raw: f64) -> f64 {
    if raw.is_nan() || raw <= 0.0 || raw.is_infinite() {
        return 1.0;
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    let norm = raw / magnitude;
    let mantissa = if norm <= 1.0 + 1e-9 {
        1.0
    } else if norm <= 2.0 + 1e-9 {
        2.0
    } else if norm <= 5.0 + 1e-9 {
        5.0
    } else {
        10.0
    };
    mantissa * magnitude
}

/// The multiples of `step` in `lo..=hi`, computed from whole multiples so they print exactly.
fn multiples(lo: f64, hi: f64, step: f64) -> Vec<f64> {
    let first = (lo / step - 1e-9).ceil() as i64;
    let last = (hi / step + 1e-9).floor() as i64;
    (first..=last).map(|k| k as f64 * step).collect()
}

/// Decimals that tell ticks `step` apart (steps are 1, 2 or 5 times a power of ten).
fn decimals(step: f64) -> usize {
    (-(step.log10() + 1e-9).floor()).max(0.0) as usize
}

/// A real tick: thousands as k, M, G; tiny values in exponent notation; else as many
/// decimals as the step needs.
fn real_tick(value: f64, step: f64, largest: f64) -> String {
    if value == 0.0 && !(1e-2..1e4).contains(&largest) {
        return "0".into();
    }
    if largest >= 1e4 {
        let (divisor, suffix) = if largest >= 1e9 {
            (1e9, "G")
        } else if largest >= 1e6 {
            (1e6, "M")
        } else {
            (1e3, "k")
        };
        return format!("{:.*}{suffix}", decimals(step / divisor), value / divisor);
    }
    if largest < 1e-2 {
        let exponent = value.abs().log10().floor();
        let digits = (exponent - step.log10().floor()).max(0.0) as usize;
        return trim_exponent(&format!("{value:.digits$e}"));
    }
    format!("{:.*}", decimals(step), value)
}

/// `2.50e-5` → `2.5e-5`, `3.0e-5` → `3e-5`.
fn trim_exponent(text: &str) -> String {
    match text.split_once('e') {
        Some((mantissa, exponent)) if mantissa.contains('.') => {
            let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
            format!("{mantissa}e{exponent}")
        }
        _ => text.to_string(),
    }
}

/// A number in four significant digits, without trailing zeros: `0.4231`, `12346`, `3e-5`.
pub fn format_number(value: f64) -> String {
    if !value.is_finite() {
        return value.to_string();
    }
    let magnitude = value.abs();
    if magnitude == 0.0 {
        return "0".into();
    }
    if !(1e-3..1e9).contains(&magnitude) {
        return trim_exponent(&format!("{value:.3e}"));
    }
    let decimals = (3.0 - magnitude.log10().floor()).max(0.0) as usize;
    let text = format!("{value:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(axis: &Axis, data: &[f64], spread: bool) -> Vec<String> {
        axis.resolve(data, spread)
            .ticks
            .into_iter()
            .map(|(_, l)| l)
            .collect()
    }

    #[test]
    fn steps_tick_on_whole_numbers_from_the_first_to_the_last() {
        let steps: Vec<f64> = (1..=40).map(f64::from).collect();
        let axis = Axis::integer("step");
        assert_eq!(labels(&axis, &steps, true), ["1", "10", "20", "30", "40"]);
        let resolved = axis.resolve(&steps, true);
        assert_eq!((resolved.lo, resolved.hi), (1.0, 40.0));
        // A round value crowding the last end gives way to it.
        assert_eq!(
            labels(&axis, &[1.0, 41.0], true),
            ["1", "10", "20", "30", "41"]
        );
        assert_eq!(labels(&axis, &[1.0, 3.0], true), ["1", "2", "3"]);
        // One step: one tick, never a fraction of a step.
        assert_eq!(labels(&axis, &[7.0], true), ["7"]);
        for data in [&[1.0, 2.0][..], &[0.0, 5.0], &[3.0, 1000.0], &[1.0, 40.0]] {
            for label in labels(&axis, data, true) {
                assert!(!label.contains('.'), "{label} in {data:?}");
            }
        }
    }

    #[test]
    fn counts_widen_to_round_values() {
        let axis = Axis::integer("samples").including(0.0);
        assert_eq!(labels(&axis, &[7.0], false), ["0", "2", "4", "6", "8"]);
        assert_eq!(labels(&axis, &[0.0, 1.0], false), ["0", "1"]);
        assert_eq!(
            labels(&axis, &[131_072.0], false),
            ["0", "50k", "100k", "150k"]
        );
    }

    #[test]
    fn real_ticks_are_round_and_read_at_their_scale() {
        let axis = Axis::real("loss");
        assert_eq!(
            labels(&axis, &[0.42, 2.31], false),
            ["0.0", "0.5", "1.0", "1.5", "2.0", "2.5"]
        );
        assert_eq!(
            labels(&axis, &[0.0, 3e-4], false),
            ["0", "1e-4", "2e-4", "3e-4"]
        );
        assert_eq!(
            labels(&axis, &[11_000.0, 14_500.0], false),
            ["11k", "12k", "13k", "14k", "15k"]
        );
        assert_eq!(labels(&axis, &[2.0e10, 6.0e10], false)[0], "20G");
        // A flat series still gets an axis around its value.
        let flat = axis.resolve(&[0.5, 0.5], false);
        assert!(flat.lo < 0.5 && flat.hi > 0.5, "{flat:?}");
    }

    #[test]
    fn shares_read_in_percent_and_ratios_in_powers_of_two() {
        let share = Axis::percent("rate").with_range(0.0, 1.0);
        assert_eq!(
            labels(&share, &[], false),
            ["0%", "20%", "40%", "60%", "80%", "100%"]
        );
        assert_eq!(share.format(0.5), "50.0%");
        let ratio = Axis::ratio("speedup").including(1.0);
        assert_eq!(
            labels(&ratio, &[0.3f64.log2(), 3.0f64.log2()], false),
            ["1/4×", "1/2×", "1×", "2×", "4×"]
        );
        let wide = Axis::ratio("speedup").with_range(1.0 / 64.0, 64.0);
        assert_eq!(
            labels(&wide, &[], false),
            ["1/64×", "1/16×", "1/4×", "1×", "4×", "16×", "64×"]
        );
        assert_eq!(ratio.unit(-1.0), None);
    }

    #[test]
    fn numbers_keep_four_significant_digits() {
        assert_eq!(format_number(0.42312), "0.4231");
        assert_eq!(format_number(12345.6), "12346");
        assert_eq!(format_number(3e-5), "3e-5");
        assert_eq!(format_number(0.5), "0.5");
        assert_eq!(format_number(40.0), "40");
        assert_eq!(format_number(0.0), "0");
    }
}
