//! The KernelBench crate's integration tests, one binary: candidates' files (`candidates`), the
//! KernelBench tree (`kernelbench_tree`), DICE's pairs (`pairs`) and the prompts (`prompts`).

mod candidates;
mod kernelbench_tree;
mod pairs;
mod prompts;
