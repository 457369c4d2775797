//! The bytes of the tensors each problem's `get_inputs()` returns, measured by the project's
//! Python on torch's meta device: shapes and dtypes only, so a 100 GB input costs nothing.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::Path;
use std::process::Command;

const SCRIPT: &str = include_str!("input_sizes.py");

/// What the script reports for one problem.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum InputSize {
    Bytes(u64),
    /// Why the size could not be measured (the exception `get_inputs()` or the import raised).
    Error(String),
}

/// One [`InputSize`] per problem file, in order, from a single run of `python`.
pub fn measure(python: &Path, problems: &[&Path]) -> Result<Vec<InputSize>> {
    let hint = "pass --python or DICE_PYTHON, or run scripts/setup-python.sh";
    let out = Command::new(python)
        .arg("-c")
        .arg(SCRIPT)
        .args(problems)
        .output()
        .with_context(|| format!("cannot run {} ({hint})", python.display()))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let why = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("it failed");
        bail!(
            "{} cannot measure problem inputs: {why} ({hint})",
            python.display()
        );
    }
    let sizes: Vec<InputSize> = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "unexpected output from {}'s input measurement",
            python.display()
        )
    })?;
    if sizes.len() != problems.len() {
        bail!(
            "{} measured {} problems out of {}",
            python.display(),
            sizes.len(),
            problems.len()
        );
    }
    Ok(sizes)
}
