//! Programs judged once: a sample whose program is, byte for byte, one an earlier sample brought
//! for the same problem in the same pipeline (a `dice eval` run, or an evaluator's whole life, as
//! in an RL run) is neither built nor run; it gets a copy of that judgement. An RL group's
//! samples and a pass@k batch repeat programs (a policy's low-temperature answers, an infilling
//! stage's short kernels), and every repeat would cost a build and a run for a verdict the first
//! one settles.
//!
//! The copy is the first judgement, timings included: judged again, a program would get another
//! draw of the timing noise, never a truer one. `EvalConfig::judge_each_copy` judges every sample
//! instead (to measure that noise).

use crate::batch::Report;
use crate::job::Outcome;
use crate::outcome::sha256_hex;
use crate::run_queue::ProblemKey;
use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

/// Judged programs kept for their repeats, the oldest forgotten first: an evaluator fed for a
/// whole training run keeps a few steps' worth (an RL step judges about a thousand), each a few
/// kB of outcome and log excerpt.
const JUDGED_KEPT: usize = 4096;

/// A program for a problem: the problem and the program's SHA-256.
type ProgramKey = (ProblemKey, String);

/// What a sample whose program may have been seen does next.
pub(crate) enum FirstOrCopy {
    /// The first of its program: judged.
    First,
    /// Its program's first sample is being judged: it waits for that judgement.
    Waits,
    /// Its program was judged: the report to write for it.
    Copy(Report),
}

/// The programs seen, shared by the builders that register samples and the store writer that
/// writes judgements.
#[derive(Default)]
pub(crate) struct SamePrograms(Mutex<Programs>);

impl SamePrograms {
    fn programs(&self) -> MutexGuard<'_, Programs> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers sample `index` (`origin`) for `problem`, whose program is `code`.
    pub(crate) fn first_or_copy(
        &self,
        index: usize,
        problem: ProblemKey,
        code: &[u8],
        origin: &str,
    ) -> FirstOrCopy {
        self.programs().first_or_copy(index, problem, code, origin)
    }

    /// Sample `index` ends with `report` (a judgement or its problem's failure): when it was its
    /// program's first, the reports of the samples waiting for it; later repeats get copies.
    pub(crate) fn judged(&self, report: &Report) -> Vec<Report> {
        self.programs().judged(report)
    }

    /// Samples that got a copy so far.
    pub(crate) fn copies(&self) -> usize {
        self.programs().copies
    }
}

/// How a judged program ended, for the samples that repeat it.
enum Judgement {
    Outcome(Box<Outcome>),
    ReferenceFailed(String),
}

enum Seen {
    Judging {
        first_origin: String,
        waiting: Vec<usize>,
    },
    Judged {
        first_origin: String,
        judgement: Judgement,
    },
}

#[derive(Default)]
struct Programs {
    programs: HashMap<ProgramKey, Seen>,
    /// The program of each sample judged first, until its judgement comes.
    judging: HashMap<usize, ProgramKey>,
    /// Judged programs, oldest first.
    judged: VecDeque<ProgramKey>,
    /// Samples that got a copy.
    copies: usize,
}

impl Programs {
    fn first_or_copy(
        &mut self,
        index: usize,
        problem: ProblemKey,
        code: &[u8],
        origin: &str,
    ) -> FirstOrCopy {
        let key = (problem, sha256_hex(code));
        match self.programs.get_mut(&key) {
            None => {
                self.programs.insert(
                    key.clone(),
                    Seen::Judging {
                        first_origin: origin.to_string(),
                        waiting: Vec::new(),
                    },
                );
                self.judging.insert(index, key);
                FirstOrCopy::First
            }
            Some(Seen::Judging { waiting, .. }) => {
                waiting.push(index);
                FirstOrCopy::Waits
            }
            Some(Seen::Judged {
                first_origin,
                judgement,
            }) => {
                self.copies += 1;
                FirstOrCopy::Copy(copy(judgement, index, first_origin))
            }
        }
    }

    fn judged(&mut self, report: &Report) -> Vec<Report> {
        let (index, judgement) = match report {
            Report::Sample(i, outcome) => (*i, Judgement::Outcome(outcome.clone())),
            Report::ReferenceFailed(i, why) => (*i, Judgement::ReferenceFailed(why.clone())),
            _ => return Vec::new(),
        };
        let Some(key) = self.judging.remove(&index) else {
            return Vec::new();
        };
        let Some(Seen::Judging {
            first_origin,
            waiting,
        }) = self.programs.remove(&key)
        else {
            return Vec::new();
        };
        self.copies += waiting.len();
        let copies = waiting
            .into_iter()
            .map(|i| copy(&judgement, i, &first_origin))
            .collect();
        self.programs.insert(
            key.clone(),
            Seen::Judged {
                first_origin,
                judgement,
            },
        );
        self.judged.push_back(key);
        while self.judged.len() > JUDGED_KEPT {
            if let Some(oldest) = self.judged.pop_front() {
                self.programs.remove(&oldest);
            }
        }
        copies
    }
}

/// The report of sample `index`, a repeat of the program that `first_origin` brought.
fn copy(judgement: &Judgement, index: usize, first_origin: &str) -> Report {
    match judgement {
        Judgement::Outcome(outcome) => {
            let mut outcome = outcome.clone();
            outcome.log = format!(
                "[dice-eval] the same program as {first_origin}, judged once for both\n{}",
                outcome.log
            );
            // Nothing was built or run for this sample.
            outcome.builds.clear();
            outcome.stages.clear();
            outcome.wall_s = 0.0;
            Report::Sample(index, outcome)
        }
        Judgement::ReferenceFailed(why) => Report::ReferenceFailed(index, why.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dice_store::Verdict;

    fn outcome(message: &str) -> Box<Outcome> {
        Box::new(Outcome::failed(
            Verdict::OutputMismatch,
            message.to_string(),
            "log".to_string(),
            vec![],
            1.5,
        ))
    }

    fn index_and_message(report: &Report) -> (usize, String) {
        match report {
            Report::Sample(i, o) => (*i, o.message.clone().unwrap_or_default()),
            Report::ReferenceFailed(i, why) => (*i, why.clone()),
            _ => panic!("a copy is a judgement"),
        }
    }

    #[test]
    fn repeats_wait_for_the_first_and_later_ones_get_its_judgement() {
        let same = SamePrograms::default();
        let problem = (1, 19);
        assert!(matches!(
            same.first_or_copy(0, problem, b"a", "s0"),
            FirstOrCopy::First
        ));
        assert!(matches!(
            same.first_or_copy(1, problem, b"a", "s1"),
            FirstOrCopy::Waits
        ));
        // Another program, or the same program for another problem: judged.
        for (i, problem, code) in [(2, problem, b"b"), (3, (1, 20), b"a")] {
            assert!(matches!(
                same.first_or_copy(i, problem, code, "other"),
                FirstOrCopy::First
            ));
        }
        let copies = same.judged(&Report::Sample(0, outcome("wrong")));
        assert_eq!(copies.len(), 1);
        assert_eq!(index_and_message(&copies[0]), (1, "wrong".to_string()));
        let Report::Sample(_, copied) = &copies[0] else {
            unreachable!()
        };
        assert!(copied
            .log
            .starts_with("[dice-eval] the same program as s0,"));
        assert_eq!((copied.wall_s, copied.stages.len()), (0.0, 0));
        let FirstOrCopy::Copy(later) = same.first_or_copy(5, problem, b"a", "s5") else {
            panic!("judged programs are copied");
        };
        assert_eq!(index_and_message(&later), (5, "wrong".to_string()));
        // A copy's own report frees nothing: it was no program's first.
        assert!(same.judged(&later).is_empty());
        assert_eq!(same.copies(), 2);
    }

    #[test]
    fn a_failed_reference_ends_the_waiting_repeats_alike() {
        let same = SamePrograms::default();
        same.first_or_copy(0, (1, 1), b"a", "s0");
        same.first_or_copy(1, (1, 1), b"a", "s1");
        let copies = same.judged(&Report::ReferenceFailed(0, "reference crashed".into()));
        assert!(
            matches!(&copies[..], [Report::ReferenceFailed(1, why)] if why == "reference crashed")
        );
    }

    #[test]
    fn the_oldest_judgements_are_forgotten_past_the_limit() {
        let same = SamePrograms::default();
        for i in 0..=JUDGED_KEPT {
            let code = i.to_string();
            same.first_or_copy(i, (1, 1), code.as_bytes(), "first");
            same.judged(&Report::Sample(i, outcome("wrong")));
        }
        let next = JUDGED_KEPT + 1;
        assert!(matches!(
            same.first_or_copy(next, (1, 1), b"0", "again"),
            FirstOrCopy::First
        ));
        assert!(matches!(
            same.first_or_copy(
                next + 1,
                (1, 1),
                JUDGED_KEPT.to_string().as_bytes(),
                "again"
            ),
            FirstOrCopy::Copy(_)
        ));
    }
}
