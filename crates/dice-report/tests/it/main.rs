//! dice-report's integration tests, one binary: the stores' records turned into reports
//! (`metrics`) and runs set side by side (`compare`).

mod common;
mod compare;
mod metrics;
