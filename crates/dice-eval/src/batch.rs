//! A batch to judge, and what the threads judging submitted batches share and tell the store
//! writer.

use crate::config::{EvalProblem, EvalSample};
use crate::job::{Compiled, JobContext, Outcome};
use crate::python::Runtime;
use crate::run_queue::ProblemKey;
use anyhow::{bail, Result};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

/// Candidates and the problems they are for, checked to belong together.
#[derive(Clone, Debug)]
pub struct Batch {
    pub(crate) problems: HashMap<ProblemKey, EvalProblem>,
    pub(crate) samples: Vec<EvalSample>,
}

impl Batch {
    /// Refuses a sample whose problem is not among `problems`.
    pub fn new(problems: Vec<EvalProblem>, samples: Vec<EvalSample>) -> Result<Batch> {
        let problems: HashMap<ProblemKey, EvalProblem> = problems
            .into_iter()
            .map(|p| ((p.level, p.problem_id), p))
            .collect();
        if let Some(s) = samples
            .iter()
            .find(|s| !problems.contains_key(&(s.level, s.problem_id)))
        {
            bail!(
                "{}: level {} problem {} is not among the problems given",
                s.origin,
                s.level,
                s.problem_id
            );
        }
        Ok(Batch { problems, samples })
    }

    /// Its samples.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

/// Which submission a sample came in: [`Batch`]es submitted to an evaluator are numbered from 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket(pub u64);

/// A batch on its way into a running pipeline.
pub(crate) struct Submission {
    pub ticket: Ticket,
    pub batch: Batch,
}

/// What the compile stage, the run slots and the store writer share while the pipeline runs:
/// the judge's job context and interpreter, and the samples submitted and not yet told to the
/// writer, with their problems. A sample's index names it for the whole run; the writer forgets
/// it once it is done with it, so that an evaluator fed for a whole training run holds only the
/// samples in flight.
pub(crate) struct BatchContext<'j> {
    pub ctx: &'j JobContext,
    pub rt: &'j Arc<Runtime>,
    submitted: Mutex<Submitted>,
    /// When the pipeline started, and how long after that its first sample began.
    pub started: Instant,
    pub first_sample: OnceLock<f64>,
}

#[derive(Default)]
struct Submitted {
    problems: HashMap<ProblemKey, Arc<EvalProblem>>,
    samples: HashMap<usize, (Ticket, Arc<EvalSample>)>,
    /// Samples submitted so far: the next one's index.
    count: usize,
}

impl<'j> BatchContext<'j> {
    pub(crate) fn new(ctx: &'j JobContext, rt: &'j Arc<Runtime>, started: Instant) -> Self {
        BatchContext {
            ctx,
            rt,
            submitted: Mutex::default(),
            started,
            first_sample: OnceLock::new(),
        }
    }

    fn submitted(&self) -> MutexGuard<'_, Submitted> {
        self.submitted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds `batch`'s samples and the problems not known yet; returns the indices its samples
    /// got.
    pub(crate) fn add(&self, ticket: Ticket, batch: Batch) -> Range<usize> {
        let mut submitted = self.submitted();
        for (key, problem) in batch.problems {
            submitted
                .problems
                .entry(key)
                .or_insert_with(|| Arc::new(problem));
        }
        let first = submitted.count;
        for sample in batch.samples {
            let index = submitted.count;
            submitted.samples.insert(index, (ticket, Arc::new(sample)));
            submitted.count += 1;
        }
        first..submitted.count
    }

    pub(crate) fn sample(&self, index: usize) -> Arc<EvalSample> {
        self.submitted().samples[&index].1.clone()
    }

    /// The writer is done with sample `index`: its ticket and the sample.
    pub(crate) fn forget(&self, index: usize) -> (Ticket, Arc<EvalSample>) {
        self.submitted()
            .samples
            .remove(&index)
            .expect("each sample is told to the writer once")
    }

    pub(crate) fn problem(&self, key: ProblemKey) -> Arc<EvalProblem> {
        self.submitted().problems[&key].clone()
    }

    /// Samples submitted so far.
    pub(crate) fn len(&self) -> usize {
        self.submitted().count
    }

    /// A sample's problem key, its problem, and its code (run samples always have code).
    pub(crate) fn problem_and_code<'s>(
        &self,
        sample: &'s EvalSample,
    ) -> (ProblemKey, Arc<EvalProblem>, &'s [u8]) {
        let key = (sample.level, sample.problem_id);
        let code = sample
            .code
            .as_deref()
            .expect("only samples with code are run");
        (key, self.problem(key), code)
    }
}

/// What the stages tell the store writer, about the batch's sample at an index.
pub(crate) enum Report {
    Sample(usize, Box<Outcome>),
    ReferenceOk(ProblemKey),
    ReferenceFailed(usize, String),
    /// Its result was in the store when it was submitted.
    AlreadyStored(usize),
    /// Another process judging the run stored its result.
    JudgedElsewhere(usize),
}

/// A sample ready for the run stage, with what its compile stage left.
pub(crate) struct RunItem {
    pub sample: usize,
    pub compiled: Compiled,
    /// To run with the device to itself: it ran out of device memory beside others even with
    /// `device_memory` reserved.
    pub alone: bool,
    /// Device memory its problem is to have reserved (its reference and it): it ran out of memory
    /// in its own work beside others with less reserved; what its process held and asked for, as
    /// torch's message said (run_slot.rs `retry_reservation`).
    pub device_memory: Option<u64>,
    /// Times one of its processes could not make its CUDA context beside the others in flight
    /// (run_slot.rs `MemoryShortage::AtSetup`).
    pub crowded_out: u32,
}

impl RunItem {
    pub(crate) fn new(sample: usize, compiled: Compiled) -> Self {
        RunItem {
            sample,
            compiled,
            alone: false,
            device_memory: None,
            crowded_out: 0,
        }
    }
}
