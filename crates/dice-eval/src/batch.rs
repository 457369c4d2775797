//! A batch to judge, and what the threads judging it share and tell the store writer.

use crate::config::{EvalProblem, EvalSample};
use crate::job::{Compiled, JobContext, Outcome};
use crate::python::Runtime;
use crate::run_queue::ProblemKey;
use anyhow::{bail, Result};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
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
}

/// What the compile stage, the run slots and the store writer of one batch share: the judge's
/// job context and interpreter, the batch's problems, and its samples still to evaluate.
pub(crate) struct BatchContext<'j> {
    pub ctx: &'j JobContext,
    pub rt: &'j Arc<Runtime>,
    pub problems: HashMap<ProblemKey, EvalProblem>,
    pub samples: Vec<EvalSample>,
    /// When the batch started, and how long after that its first sample began.
    pub started: Instant,
    pub first_sample: OnceLock<f64>,
}

impl BatchContext<'_> {
    /// A sample's problem key, its problem, and its code (run samples always have code).
    pub(crate) fn problem_and_code<'s>(
        &'s self,
        sample: &'s EvalSample,
    ) -> (ProblemKey, &'s EvalProblem, &'s [u8]) {
        let key = (sample.level, sample.problem_id);
        let code = sample
            .code
            .as_deref()
            .expect("only samples with code are run");
        (key, &self.problems[&key], code)
    }
}

/// What the stages tell the store writer, about the batch's sample at an index.
pub(crate) enum Report {
    Sample(usize, Box<Outcome>),
    ReferenceOk(ProblemKey),
    ReferenceFailed(usize, String),
}

/// A sample ready for the run stage, with what its compile stage left.
pub(crate) struct RunItem {
    pub sample: usize,
    pub compiled: Compiled,
}
