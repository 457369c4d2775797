//! fast_p thresholds, keyed in reports exactly as the user wrote them.

use anyhow::{bail, Result};

/// KernelBench's thresholds (`scripts/benchmark_eval_analysis.py`).
pub const DEFAULT_FAST_P: &str = "0,0.5,0.8,1,1.5,2";

#[derive(Clone, Debug, PartialEq)]
pub struct Threshold {
    /// The text given (`"1.5"`), used as the report key.
    pub label: String,
    pub value: f64,
}

/// Parses a comma-separated list of non-negative speedup thresholds, e.g. `0,1,2`.
pub fn parse_thresholds(list: &str) -> Result<Vec<Threshold>> {
    let mut out: Vec<Threshold> = Vec::new();
    for label in list.split(',').map(str::trim) {
        let value: f64 = match label.parse() {
            Ok(v) if f64::is_finite(v) && v >= 0.0 => v,
            _ => bail!(
                "fast_p threshold `{label}` is not a non-negative number (expected e.g. `0,1,1.5,2`)"
            ),
        };
        if out.iter().any(|t| t.value == value) {
            bail!("fast_p threshold {label} is given twice");
        }
        out.push(Threshold {
            label: label.to_string(),
            value,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_kept_as_written() {
        let t = parse_thresholds("0, 1.5,2").unwrap();
        let labels: Vec<&str> = t.iter().map(|t| t.label.as_str()).collect();
        assert_eq!(labels, ["0", "1.5", "2"]);
        assert_eq!(t[1].value, 1.5);
        assert_eq!(parse_thresholds(DEFAULT_FAST_P).unwrap().len(), 6);
    }

    #[test]
    fn rejects_bad_lists() {
        for bad in ["", "1,,2", "-1", "fast", "nan", "1,1.0"] {
            assert!(parse_thresholds(bad).is_err(), "{bad}");
        }
    }
}
