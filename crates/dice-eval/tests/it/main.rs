//! The evaluator's integration tests, one binary: the examples end to end, the judge and the
//! evaluator across batches, verdicts of pure-Python candidates, resuming after a kill, the
//! sandbox, the build cache, timing and what the candidate's process cannot decide. They share
//! one build cache (`dice_test_support::shared_build_cache`) and run concurrently, each in run
//! folders of its own.

mod build_cache;
mod common;
mod examples;
mod judge;
mod python_candidates;
mod resume;
mod sandbox;
mod timing;
mod timing_methods;
mod trusted_judge;
