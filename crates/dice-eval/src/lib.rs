//! Evaluates KernelBench candidates: builds, correctness, timing, in sandboxed PyTorch workers.
//!
//! The candidate never shares a process with the reference or the judge. A Python fork server
//! per device worker (torch imported once, CUDA untouched) forks a `reference` child per problem,
//! which computes the expected outputs and judges the outputs candidates publish (loaded as plain
//! tensors, never running candidate code), and one `candidate` child per sample. A compile stage
//! first imports candidates with CUDA hidden on all cores; the extensions they load are built by
//! sandboxed builder jobs into a content-addressed cache that only the evaluator writes
//! (build_cache.rs); the run stage takes candidates as their builds finish.
//!
//! A [`Judge`] evaluates [`Batch`]es one after another into one run store: the interpreter is
//! checked once and the fork servers stay up from one batch to the next; [`evaluate`] judges one
//! batch with a judge of its own (`dice eval`). An [`Evaluator`] is the library call of training
//! loops and curation: batches submitted at any time join one running pipeline (no batch waits
//! for the previous one to drain) and each sample's outcome streams back as it is stored. The
//! records, verdicts and the store are dice-store's, re-exported here. [`refinement_feedback`]
//! puts a stored verdict in words for the model that wrote the sample (multi-turn refinement).
//!
//! Decisions worth knowing:
//! * Seeding is symmetric (python/protocol.py): set_seed(42) before init inputs and before the
//!   model; trial and timing seeds from the run's seed, drawn when the run begins and stored with
//!   it (`--input-seed` fixes it; 42 gives KernelBench's trial seeds); set_seed(s) before each trial's
//!   inputs and again right before forward. Inputs are made inside a `torch.device(device)`
//!   context, so on CUDA they are drawn on the GPU from the CUDA generator, identically in both
//!   processes.
//! * A problem whose reference fails gets `ProblemRecord::reference_error`; its samples are not
//!   stored (no verdict, so resuming retries them) and are counted in [`Summary::skipped`]. A
//!   reference that dies or hangs reading a candidate's published output fails that candidate
//!   alone, and is replaced (SANDBOX.md).
//! * `--timeout` bounds the candidate's own run time (import, construction, correctness trials;
//!   then each timing round); build time is bounded per build by the compile timeout instead.
//! * Timing alternates rounds of candidate and baseline calls in separate processes; the
//!   evaluator's own wall time of those rounds is stored beside the reported timings, and a
//!   candidate whose clock every round contradicts is timed by the evaluator's (runtime.rs
//!   `check_clock`). Builds are stopped during timing (quiet.rs); too dispersed calls are measured
//!   again, and each speedup gets a bootstrap interval (stats.rs).
//! * Several candidates are in flight per device (`runs_per_device`): process start, imports and
//!   extension loads overlap freely, each untimed device step (a model's construction, one trial,
//!   one judgement) holds a shared pass, and timing holds the device alone (gate.rs); on CUDA machines
//!   with 8+ cores two cores are kept for the timed process. Seconds per stage are stored with
//!   each sample (`stages`). A CUDA out-of-memory beside others is retried alone. Only the timed
//!   calls and the making of their inputs run in the exclusive window.
//! * Several processes may judge one run (claims.rs): each sample is claimed before it is built
//!   or run, under a lease a heartbeat renews, and stored once by its claim's holder; timing
//!   takes the device's file lock in `RUN_DIR/locks/` (device_lock.rs) after the gate's, so it
//!   has the device to itself across those processes too. Evaluations of other runs on the same
//!   device are not excluded.
//! * Nothing is built or run for a verdict already known: a program repeated for a problem is
//!   judged once and its repeats get copies (same_program.rs, unless `judge_each_copy`), and under
//!   `strict` a program that a static rule makes deceptive whatever it runs is `rejected`.
//! * A host flag set built often (`pch_after_builds`, 8) gets a precompiled torch/extension.h in
//!   the cache, which the host compiles of its later `load_inline` builds read (build_cache.rs).
//! * Builds may run apart from judging ([`prebuild`], `dice eval --stage build`): workers on
//!   CPU-only hosts fill a build cache folder that GPU workers share, storing nothing else; the
//!   GPU workers' compile stage then finds every build (or its failure) cached.
//! * Start-up overlaps: the fork servers import torch while the interpreter is checked (the CUDA
//!   architectures for builds reach children per job). Processes that are done (a CUDA context
//!   takes ~0.5 s to die) end in the background while their slot goes on; a slot out of work
//!   takes a sample another slot took ahead and has not begun.
//! * Each batch stores its [`RunTimeline`] (`invocations` table, also in [`Summary`]): when
//!   the first sample began, and the exclusive windows, their waits and how long the gate was
//!   closed to untimed steps: the queue behind timing.
//! * On CUDA the kernel profile comes from correctness trial 1 run once more after timing, so
//!   the profiler never runs in a process before its timed calls; that output is judged too.
//! * Candidates (compile and run stage) are sandboxed: namespaces, an unprivileged user, limits
//!   (python/sandbox.py; SANDBOX.md says what is and is not isolated).
//! * Every timed call gets inputs no call has seen (the problem's `get_inputs` under a seed of
//!   its own, the same for the baseline's call), so an output cache never hits, and a sample of
//!   the timed calls' outputs is judged (stage_timing.rs).
//! * Run-time checks add dice-audit rule ids to `flags` (module `runtime`): inputs changed in
//!   place, a clock far behind the evaluator's wall time, and on CUDA the profiled
//!   kernels of one correctness trial (the candidate's own must run, on the default stream).

mod audit;
mod batch;
mod build_cache;
mod call_keys;
mod candidate;
mod child;
mod claims;
mod clock;
pub mod config;
mod device_lock;
mod device_memory;
mod evaluator;
mod excerpt;
mod feedback;
mod gate;
mod job;
mod judge;
mod lane;
mod outcome;
mod pipeline;
mod prebuild;
pub mod python;
mod quiet;
mod run_queue;
mod run_slot;
pub mod runtime;
mod same_program;
mod sandbox;
mod stage_build;
mod stage_reference;
mod stage_run;
mod stage_timing;
mod stats;
mod writer;
mod zygote;

pub use audit::StaticAudit;
pub use batch::{Batch, Ticket};
pub use config::{Audit, Baseline, Device, EvalConfig, EvalProblem, EvalSample, Precision, Timing};
/// The run store and its records, which the evaluator writes.
pub use dice_store as store;
pub use dice_store::{
    BuildRecord, KernelProfile, LaunchedKernel, ProblemRecord, RunInfo, RunTimeline, SampleExtras,
    SampleRecord, Store, TimingStats, Verdict,
};
pub use evaluator::Evaluator;
pub use excerpt::Excerpt;
pub use feedback::refinement_feedback;
pub use judge::{evaluate, Judge};
pub use outcome::{sha256_hex, Evaluated, SampleOutcome, Summary};
pub use prebuild::{prebuild, BuildSummary, Shard};
pub use runtime::Finding;
pub use stats::SplitMix64;
