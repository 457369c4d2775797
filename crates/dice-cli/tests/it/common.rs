//! Running the `dice` binary as a user does.

use std::path::Path;
use std::process::{Command, Output};

pub(crate) fn dice(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dice"))
        .args(args)
        .output()
        .expect("the dice binary runs")
}

pub(crate) fn path_arg(p: &Path) -> &str {
    p.to_str().unwrap()
}

pub(crate) fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
