//! The evaluator as a long-lived handle, for callers that produce candidates while earlier ones
//! are judged (RL rollouts, curation): batches are submitted at any time and flow into one
//! running pipeline (the judge's fork servers, build cache and the run slots' reference processes
//! stay warm), and what becomes of each sample streams back as soon as it is stored.

use crate::batch::{Batch, Submission, Ticket};
use crate::config::{Audit, EvalConfig};
use crate::judge::Judge;
use crate::outcome::{sha256_hex, Evaluated, Summary};
use crate::run_queue::ProblemKey;
use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Judges batches submitted while earlier ones still run, into the store at `cfg.db` (or the
/// PostgreSQL run of `cfg.postgres`), each sample's result stored once; outcomes come back from
/// [`Evaluator::next`] in the order samples finish.
///
/// ```no_run
/// # fn judge_all(cfg: dice_eval::EvalConfig, batches: Vec<dice_eval::Batch>) -> anyhow::Result<()> {
/// use dice_eval::{Evaluator, SampleOutcome};
/// let mut evaluator = Evaluator::start(cfg, None)?;
/// for batch in batches {
///     evaluator.submit(batch)?;
/// }
/// while let Some(evaluated) = evaluator.next()? {
///     if let SampleOutcome::Judged(record) = &evaluated.outcome {
///         println!("{:?} {:?}: {}", evaluated.ticket, evaluated.sample, record.verdict);
///     }
/// }
/// let summary = evaluator.finish()?;
/// # Ok(())
/// # }
/// ```
pub struct Evaluator {
    /// Closed by [`Evaluator::finish`]: the pipeline ends once what was submitted is judged.
    submissions: Option<Sender<Submission>>,
    results: Receiver<Evaluated>,
    pipeline: Option<JoinHandle<Result<Summary>>>,
    next_ticket: u64,
    /// Samples submitted whose outcome [`Evaluator::next`] has not returned yet.
    outstanding: usize,
    /// The digest of each submitted problem's source: a problem key names one problem.
    problems: HashMap<ProblemKey, String>,
}

impl Evaluator {
    /// Starts the judge (the interpreter checked, the fork servers importing torch; see
    /// [`Judge::start`]) and its pipeline, which waits for submissions.
    pub fn start(cfg: EvalConfig, audit: Option<Arc<dyn Audit>>) -> Result<Evaluator> {
        let judge = Judge::start(cfg, audit)?;
        let (submit, submissions) = mpsc::channel();
        let (results_tx, results) = mpsc::channel();
        let pipeline = std::thread::Builder::new()
            .name("dice-eval".to_string())
            .spawn(move || judge.serve(submissions, results_tx))
            .context("cannot start the evaluator's thread")?;
        Ok(Evaluator {
            submissions: Some(submit),
            results,
            pipeline: Some(pipeline),
            next_ticket: 0,
            outstanding: 0,
            problems: HashMap::new(),
        })
    }

    /// Adds `batch` to the work, beside what is still being judged; every one of its samples
    /// comes back once from [`Evaluator::next`] with the returned ticket. Refuses a problem
    /// submitted before with another source; once the pipeline failed, says why.
    pub fn submit(&mut self, batch: Batch) -> Result<Ticket> {
        let digests: Vec<(ProblemKey, String)> = batch
            .problems
            .iter()
            .map(|(key, problem)| (*key, sha256_hex(&problem.source)))
            .collect();
        let changed = digests
            .iter()
            .find(|(key, digest)| self.problems.get(key).is_some_and(|known| known != digest));
        if let Some(((level, problem_id), _)) = changed {
            bail!(
                "level {level} problem {problem_id} was submitted before with another source: \
                 give each problem its own id"
            );
        }
        self.problems.extend(digests);
        let ticket = Ticket(self.next_ticket);
        let samples = batch.len();
        let submission = Submission { ticket, batch };
        let sent = self
            .submissions
            .as_ref()
            .is_some_and(|submissions| submissions.send(submission).is_ok());
        if !sent {
            let why = match self.stop() {
                Ok(_) => anyhow!("the evaluator stopped"),
                Err(e) => e,
            };
            return Err(why.context("the evaluator failed: start a new one"));
        }
        self.next_ticket += 1;
        self.outstanding += samples;
        Ok(ticket)
    }

    /// The outcome of the next submitted sample to finish, waiting for it; None once every
    /// sample submitted so far has come back. When the pipeline failed, says why.
    #[allow(clippy::should_implement_trait)] // fallible, unlike Iterator::next
    pub fn next(&mut self) -> Result<Option<Evaluated>> {
        self.next_within(None)
    }

    /// Like [`Evaluator::next`], waiting at most `wait`: None also when no sample finished in
    /// that time (for callers that have new work to submit meanwhile).
    pub fn next_timeout(&mut self, wait: Duration) -> Result<Option<Evaluated>> {
        self.next_within(Some(wait))
    }

    fn next_within(&mut self, wait: Option<Duration>) -> Result<Option<Evaluated>> {
        if self.outstanding == 0 {
            return Ok(None);
        }
        let received = match wait {
            None => self
                .results
                .recv()
                .map_err(|_| RecvTimeoutError::Disconnected),
            Some(wait) => self.results.recv_timeout(wait),
        };
        match received {
            Ok(evaluated) => {
                self.outstanding -= 1;
                Ok(Some(evaluated))
            }
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(match self.stop() {
                Ok(_) => anyhow!("the evaluator stopped with samples outstanding"),
                Err(e) => e,
            }),
        }
    }

    /// Waits for everything submitted to be judged, then ends the fork servers; the summary
    /// counts every sample judged since the start (their records came from
    /// [`Evaluator::next`]; its timeline is stored with the run).
    pub fn finish(mut self) -> Result<Summary> {
        self.stop()
    }

    fn stop(&mut self) -> Result<Summary> {
        self.submissions.take();
        let pipeline = self
            .pipeline
            .take()
            .context("the evaluator has already stopped")?;
        pipeline
            .join()
            .map_err(|_| anyhow!("the evaluator's thread panicked"))?
    }
}

impl Drop for Evaluator {
    /// Like [`Evaluator::finish`], without the summary: what was submitted is judged and stored.
    fn drop(&mut self) {
        if self.pipeline.is_some() {
            let _ = self.stop();
        }
    }
}
