//! dice-report's integration tests, one binary: the stores' records turned into reports
//! (`metrics`), runs set side by side (`compare`) and runs of several turns (`turns`).

mod common;
mod compare;
mod metrics;
mod turns;
