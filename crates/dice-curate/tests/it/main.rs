//! Curation's integration tests, one binary: ingestion (`ingest`), verification and export
//! through the real evaluator (`verify`), diversification (`diversify`), curriculum levels
//! (`difficulty`) and the released infilling split (`released_split`). Those that judge share
//! the suite's build cache.

mod common;
mod difficulty;
mod diversify;
mod ingest;
mod released_split;
mod verify;
