//! The GPU benchmarks' targets and anchor figures: `bench/targets.toml`, embedded in the
//! library. A benchmark's result is compared with them only where it was measured on the
//! benchmark's model shape and under every one of its settings; `dice bench` prints each result
//! beside the target it meets or misses and the anchor it is measured against.

use serde::{Deserialize, Serialize};
use std::fmt::Write;
use std::sync::OnceLock;

const TARGETS_TOML: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../bench/targets.toml"
));

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Targets {
    pub machine: Machine,
    pub benchmark: Vec<Benchmark>,
}

/// The machine the targets are set for.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Machine {
    pub name: String,
    pub memory_bandwidth_bytes_per_s: f64,
    pub source: String,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Benchmark {
    pub name: String,
    /// The command that measures it: `dice bench generate …`.
    pub command: String,
    pub metric: String,
    pub unit: String,
    pub direction: Direction,
    pub target: f64,
    pub target_why: String,
    /// The architecture the figures were measured on.
    pub model: Option<ModelShape>,
    /// The conditions under which the target and anchor hold.
    #[serde(default)]
    pub settings: toml::Table,
    pub anchor: Anchor,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    pub name: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
}

/// The figure a result is compared with.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Anchor {
    /// The short label a table prints.
    pub name: Option<String>,
    /// Absent where no such figure exists.
    pub value: Option<f64>,
    /// The top of a range whose bottom is `value`.
    pub value_high: Option<f64>,
    pub unit: Option<String>,
    /// The throughput beside a per-forward figure.
    pub tokens_per_s: Option<f64>,
    pub source: String,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    Higher,
    Lower,
}

impl Targets {
    /// The embedded `bench/targets.toml`, as it was when the library was built (a unit test
    /// parses it).
    pub fn get() -> &'static Targets {
        static TARGETS: OnceLock<Targets> = OnceLock::new();
        TARGETS.get_or_init(|| {
            toml::from_str(TARGETS_TOML).expect("bench/targets.toml parses (a unit test checks)")
        })
    }

    /// The benchmarks that `dice SUBCOMMAND` measures (e.g. `bench generate`).
    pub fn measured_by<'a>(&'a self, subcommand: &'a str) -> impl Iterator<Item = &'a Benchmark> {
        self.benchmark.iter().filter(move |b| {
            b.command
                .strip_prefix("dice ")
                .and_then(|c| c.strip_prefix(subcommand))
                .is_some_and(|rest| rest.starts_with(' '))
        })
    }
}

impl Benchmark {
    /// Whether a model of `hidden_size` and `num_hidden_layers` has the architecture the
    /// figures were measured on.
    pub fn fits_model(&self, hidden_size: usize, num_hidden_layers: usize) -> bool {
        self.model.as_ref().is_some_and(|m| {
            m.hidden_size == hidden_size && m.num_hidden_layers == num_hidden_layers
        })
    }

    /// The keys of [`Benchmark::settings`] that `run` does not have, or has with another value.
    pub fn differing<'a>(&'a self, run: &'a toml::Table) -> impl Iterator<Item = &'a str> {
        self.settings
            .iter()
            .filter(|(key, value)| run.get(*key) != Some(value))
            .map(|(key, _)| key.as_str())
    }

    pub fn met(&self, value: f64) -> bool {
        match self.direction {
            Direction::Higher => value >= self.target,
            Direction::Lower => value <= self.target,
        }
    }

    /// `<= 4.2 ms/forward`.
    pub fn describe_target(&self) -> String {
        let at = match self.direction {
            Direction::Higher => ">=",
            Direction::Lower => "<=",
        };
        format!("{at} {} {}", self.target, self.unit)
    }

    /// `reference Python …: 18.8 tok/s, 42.4 ms/forward`, or the source where there is no
    /// figure.
    pub fn describe_anchor(&self) -> String {
        let anchor = &self.anchor;
        let Some(value) = anchor.value else {
            return anchor.source.clone();
        };
        let mut text = format!("{}: ", anchor.name.as_deref().unwrap_or(&anchor.source));
        if let Some(rate) = anchor.tokens_per_s {
            let _ = write!(text, "{rate} tok/s, ");
        }
        let _ = write!(text, "{value}");
        if let Some(high) = anchor.value_high {
            let _ = write!(text, "-{high}");
        }
        if let Some(unit) = &anchor.unit {
            let _ = write!(text, " {unit}");
        }
        text
    }
}

/// `block_length = 4, dtype = "bf16"`: settings as the TOML file writes them, but for those
/// named in `except`.
pub fn describe_settings(settings: &toml::Table, except: &[&str]) -> String {
    settings
        .iter()
        .filter(|(key, _)| !except.contains(&key.as_str()))
        .map(|(key, value)| format!("{key} = {value}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_file_parses_with_unique_names() {
        let targets = Targets::get();
        assert!(targets.machine.memory_bandwidth_bytes_per_s > 0.0);
        let mut names: Vec<&str> = targets.benchmark.iter().map(|b| b.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), targets.benchmark.len(), "a name repeats");
        for b in &targets.benchmark {
            assert!(
                b.anchor.value.is_none() || b.anchor.unit.is_some(),
                "{}",
                b.name
            );
        }
        let measured_by = |subcommand| targets.measured_by(subcommand).count();
        assert_eq!(measured_by("bench golden"), 3);
        assert_eq!(
            measured_by("bench gen"),
            0,
            "a word's prefix is no subcommand"
        );
    }

    #[test]
    fn a_run_is_compared_only_under_every_setting_of_the_anchor() {
        let b = Targets::get()
            .benchmark
            .iter()
            .find(|b| b.name == "generate-4b-batch128")
            .unwrap();
        let mut run = b.settings.clone();
        assert_eq!(b.differing(&run).count(), 0);
        run.insert("batch".into(), toml::Value::Integer(1));
        assert_eq!(b.differing(&run).collect::<Vec<_>>(), ["batch"]);
        run.remove("dtype");
        assert_eq!(b.differing(&run).collect::<Vec<_>>(), ["batch", "dtype"]);
        assert!(b.met(7400.0) && !b.met(7399.9));
        assert_eq!(b.describe_target(), ">= 7400 tok/s");
        assert_eq!(b.describe_anchor(), "JetEngine: 3700 tok/s");
    }
}
