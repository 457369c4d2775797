//! How the benchmark tables write sizes and counts.

pub(super) fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// A count, or `-` where it was not measured.
pub(super) fn count(n: Option<u64>) -> String {
    n.map_or("-".to_string(), |n| n.to_string())
}
