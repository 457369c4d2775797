//! KernelBench problems, candidate kernels, code extraction and prompts.
//!
//! * [`KernelBench`] opens a `levelL/ID_Name.py` tree and validates every problem file.
//! * [`load_candidates`] reads candidate kernels from KernelBench run folders or JSONL files of
//!   [`CandidateRecord`] lines (which `dice generate` writes).
//! * [`load_pairs`] reads PyTorch→CUDA pairs (DICE format) as level-0 problems and candidates.
//! * [`identity_candidate`] turns a reference into its own candidate (`Model` → `ModelNew`);
//!   [`pick_identity_problems`] chooses the problems for them among those whose inputs, measured
//!   with [`input_sizes_command`], fit a budget.
//! * [`read_records`] reads the objects of a JSON array or JSONL file, each with its origin.
//! * [`extract_first_code`] pulls the program out of a raw model answer, as KernelBench does.
//! * [`prompt`] builds the KernelBench one-shot prompt and the DICE kernel-infilling prompt.

mod candidate;
mod extract;
mod identity;
mod input_sizes;
mod pairs;
mod problem;
pub mod prompt;
mod records;
mod validate;

pub use candidate::{
    load_candidates, read_candidate_records, Candidate, CandidateBody, CandidateRecord,
};
pub use extract::extract_first_code;
pub use identity::{
    identity_candidate, identity_candidates_jsonl, pick_identity_problems, LevelPick, Skip,
};
pub use input_sizes::{input_sizes_command, InputSize};
pub use pairs::{load_pairs, PairSet, PAIRS_LEVEL};
pub use problem::{InvalidProblem, KernelBench, Problem, ProblemScan};
pub use records::{read_records, Record};
pub use validate::validate_problem_source;
