//! The bytes of the tensors each problem's `get_inputs()` returns, measured by Python on torch's
//! meta device: shapes and dtypes only, so a 100 GB input costs nothing.

use serde::Deserialize;
use std::path::Path;
use std::process::Command;

const SCRIPT: &str = include_str!("../python/input_sizes.py");

/// What the script reports for one problem.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum InputSize {
    Bytes(u64),
    /// Why the size could not be measured (the exception `get_inputs()` or the import raised).
    Error(String),
}

/// The command that measures `problems` (problem files) with `python`, an interpreter with
/// torch: its stdout is a JSON array of [`InputSize`], one per problem, in order; a problem's
/// own prints go to stderr.
pub fn input_sizes_command(python: &Path, problems: &[&Path]) -> Command {
    let mut command = Command::new(python);
    command.arg("-c").arg(SCRIPT).args(problems);
    command
}
