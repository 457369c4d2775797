//! Running the `dice` binary as a user does.

use std::path::Path;
use std::process::{Command, Output};
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The hostile programs' suite (`adversarial_eval`) starts CPU hogs, fork bombs and processes
/// that outlive their candidate: a test that judges honest programs and checks their timing or
/// findings must not run beside it (a judged program's clock check then fails on it, as when
/// each test file was a binary of its own, run one after another). The suite holds this lock
/// for writing, such tests for reading.
static HOSTILE_PROGRAMS: RwLock<()> = RwLock::new(());

/// Held by the hostile programs' suite while it runs.
pub(crate) fn hostile_programs_alone() -> RwLockWriteGuard<'static, ()> {
    HOSTILE_PROGRAMS
        .write()
        .unwrap_or_else(PoisonError::into_inner)
}

/// Held by a test that judges honest programs while it runs.
pub(crate) fn away_from_hostile_programs() -> RwLockReadGuard<'static, ()> {
    HOSTILE_PROGRAMS
        .read()
        .unwrap_or_else(PoisonError::into_inner)
}

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
