//! End-to-end runs composed of the libraries.
//!
//! [`KernelBenchRun`] is `dice kernelbench`: a model's candidates for KernelBench problems
//! generated ([`dice_engine`]), judged ([`dice_eval::Judge`]) and reported in the DICE paper's
//! layout ([`dice_report::Comparison`]) into one run folder, resumable as a whole; with several
//! turns, each sample is answered again after the judge's feedback on its last answer, each
//! turn in a folder of its own ([`turn_dir`]), reported turn by turn ([`read_compared_run`],
//! [`read_turns_report`]).
//! [`generate_candidates`] is its first stage on its own (`dice generate --kernelbench`): a
//! [`dice_engine::Generator`]'s answers to KernelBench prompts, appended to a run folder's
//! candidates for `dice eval`, resumably.
//!
//! It is a crate of its own because it is the one place that needs both the model side and the
//! evaluator: `dice-eval` stays free of candle and the model, `dice-engine` of the sandbox and KernelBench, and
//! `dice-report` of both.

mod candidates;
mod kernelbench;
mod turns;

pub use candidates::{generate_candidates, CandidateRun, Progress, CANDIDATES_FILE, STORE_FILE};
pub use kernelbench::{Event, Finished, JudgedTurn, KernelBenchRun, GENERATION_FILE, REPORT_FILES};
pub use turns::{read_compared_run, read_turns_report, turn_dir, FEEDBACK_FILE};
