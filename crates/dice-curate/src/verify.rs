//! `verify`: every pair judged by the evaluator in strict mode, kept only when it is correct,
//! not deceptive, and faster than its reference with confidence: the lower end of the 95 %
//! bootstrap interval of its speedup (dice-eval resamples the timed rounds, then the calls
//! within each round, of candidate and baseline together) is at least the threshold.
//!
//! The verdicts live in the evaluator's store (`RUN/dice.db`), which skips what it has judged:
//! an interrupted verify (kill -9 included) continues where it stopped, and `verified.jsonl` is
//! written anew from the store at the end, so a rerun changes nothing already judged.

use crate::run::{write_json, write_jsonl, RunDir};
use crate::Pair;
use anyhow::Result;
use dice_eval::{
    Batch, EvalConfig, EvalProblem, EvalSample, Evaluator, SampleRecord, StaticAudit, Store,
    Verdict,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// DICE keeps pairs at least twice as fast as their reference.
pub const DEFAULT_MIN_SPEEDUP: f64 = 2.0;

/// The evaluator's level for curated pairs (as for `dice eval --pairs`).
const PAIRS_LEVEL: u32 = 0;

/// One pair's outcome, as `verified.jsonl` holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VerifiedPair {
    pub id: String,
    /// The evaluator's verdict (`None` when the reference itself failed).
    pub verdict: Option<String>,
    /// The evaluator's stored speedup (baseline over candidate by its timing statistic), for
    /// correct pairs.
    pub speedup: Option<f64>,
    /// The 95 % interval of the speedup.
    pub speedup_low: Option<f64>,
    pub speedup_high: Option<f64>,
    /// Reward-hack rules that fired.
    pub flags: Vec<String>,
    pub kept: bool,
    /// Why the pair was dropped: the first check it failed.
    pub reason: Option<String>,
}

impl VerifiedPair {
    /// A pair dropped without a verdict: its problem's reference failed (`why`).
    pub fn reference_failed(id: String, why: &str) -> VerifiedPair {
        VerifiedPair {
            id,
            verdict: None,
            speedup: None,
            speedup_low: None,
            speedup_high: None,
            flags: Vec::new(),
            kept: false,
            reason: Some(format!("reference failed: {why}")),
        }
    }
}

/// What verify found, as `verify.json` holds it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct VerifySummary {
    pub min_speedup: f64,
    /// Pairs with a kernel (problem-only records are not judged).
    pub pairs: usize,
    pub kept: usize,
    /// Dropped pairs per reason category (`verdict: output_mismatch`, `deceptive`, `speedup
    /// below threshold`, …).
    pub dropped: BTreeMap<String, usize>,
    /// The speedups of every correct pair, and of the kept ones.
    pub speedups_correct: Vec<f64>,
    pub speedups_kept: Vec<f64>,
}

/// Judges the run's pairs (those not judged yet) with `judging` in strict mode into the run's
/// store, then writes `verified.jsonl` and `verify.json`. `judging`'s device, trials, timing
/// rounds and tolerances are the caller's; its store, source and strictness are set here.
pub fn verify(run: &RunDir, mut judging: EvalConfig, min_speedup: f64) -> Result<VerifySummary> {
    let pairs = run.read_pairs()?;
    let judged: Vec<(u32, &Pair)> = pairs
        .iter()
        .enumerate()
        .filter(|(_, p)| p.cuda_code.is_some())
        .map(|(i, p)| Ok((u32::try_from(i)?, p)))
        .collect::<Result<_>>()?;
    judging.db = run.judge_store();
    judging.strict = true;
    // The problem ids are positions in pairs.jsonl: a store judged for other pairs is refused.
    judging.source = format!("dice curate pairs {}", pairs_digest(&pairs));
    let problems = judged
        .iter()
        .map(|&(problem_id, pair)| EvalProblem {
            level: PAIRS_LEVEL,
            problem_id,
            name: format!("pair_{}", pair.id),
            source: pair.pytorch_code.clone().into_bytes(),
            defect: None,
        })
        .collect();
    let samples = judged
        .iter()
        .map(|&(problem_id, pair)| EvalSample {
            level: PAIRS_LEVEL,
            problem_id,
            sample_id: 0,
            code: pair.cuda_code.clone().map(String::into_bytes),
            origin: pair.origin.clone(),
        })
        .collect();
    let audit = Arc::new(StaticAudit { strict: true });
    let mut evaluator = Evaluator::start(judging.clone(), Some(audit))?;
    evaluator.submit(Batch::new(problems, samples)?)?;
    evaluator.finish()?;

    let store = Store::open(&judging.db)?;
    let records: HashMap<u32, SampleRecord> = store
        .samples()?
        .into_iter()
        .map(|r| (r.problem_id, r))
        .collect();
    let reference_errors: HashMap<u32, String> = store
        .problems()?
        .into_iter()
        .filter_map(|p| Some((p.problem_id, p.reference_error?)))
        .collect();
    let mut summary = VerifySummary {
        min_speedup,
        pairs: judged.len(),
        ..VerifySummary::default()
    };
    let mut verified = Vec::new();
    for (problem_id, pair) in judged {
        let outcome = match records.get(&problem_id) {
            Some(record) => decide(&pair.id, record, min_speedup),
            None => {
                let why = reference_errors
                    .get(&problem_id)
                    .map_or("not judged", String::as_str);
                VerifiedPair::reference_failed(pair.id.clone(), why)
            }
        };
        if let (Some(speedup), Some("correct")) = (outcome.speedup, outcome.verdict.as_deref()) {
            summary.speedups_correct.push(speedup);
            if outcome.kept {
                summary.speedups_kept.push(speedup);
            }
        }
        match &outcome.reason {
            None => summary.kept += 1,
            Some(reason) => *summary.dropped.entry(category(reason)).or_default() += 1,
        }
        verified.push(outcome);
    }
    write_jsonl(&run.verified(), &verified)?;
    write_json(&run.verify_summary(), &summary)?;
    Ok(summary)
}

/// Keeps the pair or says why not: the verdict, then deception, then the speedup's lower bound.
/// A program rejected before it ran (a static rule made it deceptive whatever it runs) is
/// dropped for its deception.
pub(crate) fn decide(id: &str, record: &SampleRecord, min_speedup: f64) -> VerifiedPair {
    let interval = record.speedup_interval;
    let deceptive =
        record.verdict == Verdict::Rejected || (record.verdict.is_correct() && record.deceptive);
    let reason = if deceptive {
        Some(format!("deceptive: {}", record.flags.join(", ")))
    } else if !record.verdict.is_correct() {
        let message = record.message.as_deref().unwrap_or("");
        Some(format!("verdict: {}: {message}", record.verdict))
    } else {
        match interval {
            None => Some("speedup: no confidence interval (timing not trusted)".to_string()),
            Some(i) if i.low < min_speedup => Some(format!(
                "speedup below threshold: lower bound {:.2}x < {min_speedup}x (speedup {:.2}x)",
                i.low,
                record.speedup.unwrap_or(f64::NAN)
            )),
            Some(_) => None,
        }
    };
    VerifiedPair {
        id: id.to_string(),
        verdict: Some(record.verdict.to_string()),
        speedup: record.speedup,
        speedup_low: interval.map(|i| i.low),
        speedup_high: interval.map(|i| i.high),
        flags: record.flags.clone(),
        kept: reason.is_none(),
        reason,
    }
}

/// The category of a drop reason: its text up to the first detail (`verdict: output_mismatch`).
pub(crate) fn category(reason: &str) -> String {
    let mut parts = reason.splitn(3, ": ");
    match (parts.next(), parts.next()) {
        (Some("verdict"), Some(verdict)) => format!("verdict: {verdict}"),
        (Some(head), _) => head.to_string(),
        _ => reason.to_string(),
    }
}

fn pairs_digest(pairs: &[Pair]) -> String {
    let mut hasher = Sha256::new();
    for pair in pairs {
        hasher.update(pair.id.as_bytes());
        hasher.update([b'\n']);
    }
    hex::encode(hasher.finalize())[..16].to_string()
}
