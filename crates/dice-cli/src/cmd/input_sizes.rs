//! The bytes of the tensors each problem's `get_inputs()` returns, measured by the project's
//! Python on torch's meta device: shapes and dtypes only, so a 100 GB input costs nothing.

use anyhow::{bail, Result};
use dice_eval::python::json_output;
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
    let mut script = Command::new(python);
    script.arg("-c").arg(SCRIPT).args(problems);
    let sizes: Vec<InputSize> = json_output(&mut script, python, "measure problem inputs")?;
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
