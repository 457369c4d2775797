//! The outcome of evaluating one candidate.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// What happened to a candidate, from the first stage that failed to full success.
/// The strings are a public contract (reports, JSON, the SQLite store).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// No code could be extracted from a raw model answer.
    NoCode,
    /// Under `--strict`, deceptive by a static rule that nothing the program does when it runs
    /// can outweigh: neither built nor run (so whether it compiles is not known).
    Rejected,
    /// The program fails at import time (syntax error, module-level exception, no `ModelNew`).
    LoadError,
    /// The C++/CUDA extension build failed.
    CompileError,
    /// The extension build ran out of time.
    CompileTimeout,
    /// An exception while constructing `ModelNew` or running `forward`.
    RuntimeError,
    /// A run exceeded the per-candidate timeout.
    Timeout,
    /// Killed by a signal, abort, illegal memory access or an evaluator resource limit.
    Crashed,
    /// Output shape differs from the reference.
    ShapeMismatch,
    /// Output values differ beyond tolerance.
    OutputMismatch,
    /// Non-finite values where the reference is finite.
    NanOrInf,
    /// All correctness trials passed.
    Correct,
}

impl Verdict {
    pub const ALL: [Verdict; 12] = [
        Verdict::NoCode,
        Verdict::Rejected,
        Verdict::LoadError,
        Verdict::CompileError,
        Verdict::CompileTimeout,
        Verdict::RuntimeError,
        Verdict::Timeout,
        Verdict::Crashed,
        Verdict::ShapeMismatch,
        Verdict::OutputMismatch,
        Verdict::NanOrInf,
        Verdict::Correct,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::NoCode => "no_code",
            Verdict::Rejected => "rejected",
            Verdict::LoadError => "load_error",
            Verdict::CompileError => "compile_error",
            Verdict::CompileTimeout => "compile_timeout",
            Verdict::RuntimeError => "runtime_error",
            Verdict::Timeout => "timeout",
            Verdict::Crashed => "crashed",
            Verdict::ShapeMismatch => "shape_mismatch",
            Verdict::OutputMismatch => "output_mismatch",
            Verdict::NanOrInf => "nan_or_inf",
            Verdict::Correct => "correct",
        }
    }

    /// KernelBench's "compiled": the program imported and its extensions built (not known of a
    /// rejected one, which counts as not compiled: a strict run's rates say what it accepted).
    pub fn compiled(self) -> bool {
        !matches!(
            self,
            Verdict::NoCode
                | Verdict::Rejected
                | Verdict::LoadError
                | Verdict::CompileError
                | Verdict::CompileTimeout
        )
    }

    pub fn is_correct(self) -> bool {
        self == Verdict::Correct
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Verdict {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Verdict::ALL
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or_else(|| format!("unknown verdict `{s}`"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_round_trip() {
        for v in Verdict::ALL {
            assert_eq!(v.as_str().parse::<Verdict>().unwrap(), v);
            assert_eq!(
                serde_json::to_string(&v).unwrap(),
                format!("\"{}\"", v.as_str())
            );
        }
        assert!("compiled".parse::<Verdict>().is_err());
    }
}
