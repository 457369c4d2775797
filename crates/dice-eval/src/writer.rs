//! The store writer of the pipeline: each finished sample audited, stored in its own transaction,
//! counted into the [`Summary`] with a progress bar, and told to the evaluator's caller.

use crate::batch::{BatchContext, Report, Ticket};
use crate::claims::Claims;
use crate::config::{Audit, EvalSample};
use crate::job::Outcome;
use crate::outcome::{sha256_hex, Evaluated, SampleOutcome, Summary};
use crate::run_queue::ProblemKey;
use crate::same_program::SamePrograms;
use anyhow::{Context, Result};
use dice_store::{SampleExtras, SampleRecord, Verdict};
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, Sender};

pub(crate) fn progress_bar(show: bool, len: usize) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

/// Stores each outcome the stages report, in its own transaction that also ends the sample's
/// claim, after the audit; counts them into the summary and on the progress bar, and sends
/// what became of each sample to `results`. The samples that repeat a program judged once
/// (`same`) are written with its judgement.
pub(crate) fn write_reports(
    claims: &Claims<'_>,
    shared: &BatchContext<'_>,
    same: &SamePrograms,
    reports: Receiver<Report>,
    audit: Option<&dyn Audit>,
    bar: ProgressBar,
    results: Option<Sender<Evaluated>>,
) -> Result<Summary> {
    let mut writer = StoreWriter {
        claims,
        shared,
        audit,
        bar,
        results,
        summary: Summary::default(),
        failed_problems: BTreeMap::new(),
    };
    for report in reports {
        let copies = same.judged(&report);
        for report in std::iter::once(report).chain(copies) {
            writer.write(report)?;
        }
        writer.bar.set_message(progress_message(&writer.summary));
    }
    writer.bar.finish();
    let mut summary = writer.summary;
    summary
        .records
        .sort_by_key(|r| (r.level, r.problem_id, r.sample_id));
    summary.reference_errors = writer
        .failed_problems
        .into_iter()
        .map(|((l, p), why)| (l, p, why))
        .collect();
    Ok(summary)
}

struct StoreWriter<'a, 'c, 'j> {
    claims: &'a Claims<'c>,
    shared: &'a BatchContext<'j>,
    audit: Option<&'a dyn Audit>,
    bar: ProgressBar,
    results: Option<Sender<Evaluated>>,
    summary: Summary,
    failed_problems: BTreeMap<ProblemKey, String>,
}

impl StoreWriter<'_, '_, '_> {
    fn tell(&self, ticket: Ticket, s: &EvalSample, outcome: SampleOutcome) {
        if let Some(results) = &self.results {
            let _ = results.send(Evaluated {
                ticket,
                sample: (s.level, s.problem_id, s.sample_id),
                outcome,
            });
        }
    }

    fn write(&mut self, report: Report) -> Result<()> {
        let (claims, shared) = (self.claims, self.shared);
        match report {
            Report::ReferenceOk(key) => {
                claims.store().set_reference_error(key.0, key.1, None)?;
                self.failed_problems.remove(&key);
            }
            Report::ReferenceFailed(i, why) => {
                let (ticket, s) = shared.forget(i);
                claims
                    .store()
                    .set_reference_error(s.level, s.problem_id, Some(&why))?;
                claims.release((s.level, s.problem_id, s.sample_id))?;
                self.failed_problems
                    .insert((s.level, s.problem_id), why.clone());
                self.summary.skipped += 1;
                self.bar.inc(1);
                self.tell(ticket, &s, SampleOutcome::ReferenceFailed(why));
            }
            Report::AlreadyStored(i) => {
                let (ticket, s) = shared.forget(i);
                self.tell(ticket, &s, SampleOutcome::AlreadyStored);
            }
            Report::JudgedElsewhere(i) => {
                let (ticket, s) = shared.forget(i);
                self.tell(ticket, &s, SampleOutcome::JudgedElsewhere);
            }
            Report::Sample(i, outcome) => {
                let (ticket, sample) = shared.forget(i);
                let problem = shared.problem((sample.level, sample.problem_id));
                let (mut record, extras) = into_record(&sample, *outcome);
                if let Some(audit) = self.audit {
                    audit.audit(&problem, &sample, extras.kernels.as_ref(), &mut record);
                }
                let stored = claims
                    .put(&record, &extras)
                    .with_context(|| format!("storing the result of {}", sample.origin))?;
                self.bar.inc(1);
                if !stored {
                    tracing::warn!(
                        "{}: judged here, but another worker took it over after this one's \
                         lease expired; its result is that worker's",
                        sample.origin
                    );
                    self.tell(ticket, &sample, SampleOutcome::JudgedElsewhere);
                    return Ok(());
                }
                *self.summary.verdicts.entry(record.verdict).or_default() += 1;
                self.summary.timeline.last_outcome_s = Some(shared.started.elapsed().as_secs_f64());
                // An evaluator's records go to its caller instead of piling up for a whole run.
                if self.results.is_some() {
                    self.tell(ticket, &sample, SampleOutcome::Judged(Box::new(record)));
                } else {
                    self.summary.records.push(record);
                }
            }
        }
        Ok(())
    }
}

fn progress_message(summary: &Summary) -> String {
    let mut parts: Vec<String> = summary
        .verdicts
        .iter()
        .map(|(v, n)| format!("{v} {n}"))
        .collect();
    if summary.skipped > 0 {
        parts.push(format!("skipped {}", summary.skipped));
    }
    parts.join(" · ")
}

fn into_record(sample: &EvalSample, o: Outcome) -> (SampleRecord, SampleExtras) {
    let speedup = o.speedup.filter(|_| o.verdict == Verdict::Correct);
    let mut flags: Vec<String> = o.findings.iter().map(|f| f.rule.id().to_string()).collect();
    flags.sort();
    flags.dedup();
    let deceptive = o
        .findings
        .iter()
        .any(|f| f.severity == dice_audit::Severity::Error);
    let mut log = o.log;
    for f in &o.findings {
        log.push_str(&format!("\n[dice-eval] {}: {}", f.rule.id(), f.message));
    }
    let record = SampleRecord {
        level: sample.level,
        problem_id: sample.problem_id,
        sample_id: sample.sample_id,
        code_hash: sample.code.as_deref().map(sha256_hex),
        verdict: o.verdict,
        message: o.message,
        max_abs_error: o.max_abs_error,
        max_rel_error: o.max_rel_error,
        trials_passed: o.trials_passed,
        candidate_timing: o.candidate_timing,
        baseline_timing: o.baseline_timing,
        speedup,
        speedup_interval: o.speedup_interval.filter(|_| speedup.is_some()),
        timing_remeasures: o.timing_remeasures,
        flags,
        deceptive,
        log_excerpt: log,
        wall_s: o.wall_s,
        stages: o.stages,
    };
    let extras = SampleExtras {
        origin: sample.origin.clone(),
        candidate_wall_ms: o.candidate_wall_ms,
        baseline_wall_ms: o.baseline_wall_ms,
        builds: o.builds,
        kernels: o.kernels,
    };
    (record, extras)
}
