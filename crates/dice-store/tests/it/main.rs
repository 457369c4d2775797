//! The store's integration tests, one binary: SQLite (`sqlite`) and PostgreSQL (`postgres`, on a
//! server of each test's own) keep what the evaluator writes.

mod postgres;
mod records;
mod sqlite;
