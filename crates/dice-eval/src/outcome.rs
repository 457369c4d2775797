//! What judging produces, shared by the judge, the evaluator and the pipeline that serves both:
//! the [`Summary`] of what was judged, what became of each sample an evaluator was given
//! ([`Evaluated`]), and the digest the store keys code and problems by.

use crate::batch::Ticket;
use dice_store::{RunTimeline, SampleKey, SampleRecord, Verdict};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// What judging a batch did (for an [`crate::Evaluator`], every batch it was given).
#[derive(Clone, Debug, Default)]
pub struct Summary {
    /// Samples evaluated in this batch, per verdict.
    pub verdicts: BTreeMap<Verdict, usize>,
    /// The records of the samples evaluated in this batch, as stored, by level, problem and
    /// sample id (none for an evaluator, which hands each to its caller as it is stored).
    pub records: Vec<SampleRecord>,
    /// Samples already in the store and not re-evaluated.
    pub already_done: usize,
    /// Samples another process judging the same run judged while this batch ran.
    pub judged_elsewhere: usize,
    /// Samples left without a verdict because their problem's reference failed.
    pub skipped: usize,
    /// Samples whose program an earlier sample brought for the same problem: they got its
    /// judgement, neither built nor run (counted in `verdicts` too).
    pub copies: usize,
    /// (level, problem_id, why) of problems whose reference failed.
    pub reference_errors: Vec<(u32, u32, String)>,
    /// Fork servers started while the batch was judged: none when the judge's were warm and
    /// stayed alive.
    pub fork_servers_started: usize,
    /// Where the batch's wall time went (also stored with the run).
    pub timeline: RunTimeline,
}

/// What became of one submitted sample.
#[derive(Clone, Debug)]
pub struct Evaluated {
    /// The submission the sample came in.
    pub ticket: Ticket,
    /// Its level, problem id and sample id.
    pub sample: SampleKey,
    pub outcome: SampleOutcome,
}

#[derive(Clone, Debug)]
pub enum SampleOutcome {
    /// Judged and stored: the record as stored (verdict, speedup, flags).
    Judged(Box<SampleRecord>),
    /// Its problem's reference failed (why): no verdict is stored, so a later run retries it.
    ReferenceFailed(String),
    /// Its result was in the store when it was submitted (only without `force`).
    AlreadyStored,
    /// Another process judging the same run stored its result.
    JudgedElsewhere,
}

/// SHA-256 in hex: of a sample's code (`code_hash`) and of a problem's source, as the store
/// keeps them.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}
