//! Identity candidates: a reference program submitted as its own solution, the floor a timing
//! benchmark measures against (its speedup is 1 up to the timer's noise), and the choice of
//! problems for them among those whose inputs fit a budget.

use crate::input_sizes::InputSize;
use crate::problem::Problem;
use anyhow::{ensure, Result};

const REFERENCE_CLASS: &str = "Model";
const CANDIDATE_CLASS: &str = "ModelNew";

/// The reference `source` as a candidate: every identifier `Model` renamed `ModelNew`
/// (`class Model(nn.Module)`, `super(Model, self)`, and the word in comments alike). Only whole
/// identifiers are renamed: `MyModel`, `Model_x`, `Model2` and `ModelNew` stay as they are.
pub fn identity_candidate(source: &str) -> String {
    let mut out = String::with_capacity(source.len() + 16);
    let mut copied = 0;
    for (at, _) in source.match_indices(REFERENCE_CLASS) {
        let end = at + REFERENCE_CLASS.len();
        let before = source[..at].chars().next_back();
        let after = source[end..].chars().next();
        if !before.is_some_and(is_identifier_char) && !after.is_some_and(is_identifier_char) {
            out.push_str(&source[copied..at]);
            out.push_str(CANDIDATE_CLASS);
            copied = end;
        }
    }
    out.push_str(&source[copied..]);
    out
}

/// Why a problem was passed over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Skip {
    /// Its inputs take this many bytes, over the budget.
    TooLarge(u64),
    /// Its inputs cannot be measured: why.
    Unmeasured(String),
}

/// One level's problems for identity candidates: those taken, and those skipped before the last
/// one taken.
#[derive(Clone, Debug)]
pub struct LevelPick {
    pub level: u32,
    pub taken: Vec<Problem>,
    pub skipped: Vec<(Problem, Skip)>,
}

/// For each level (its problems in id order), the first `first` problems whose inputs take at
/// most `max_bytes`; a problem over the budget, or whose inputs could not be measured, is
/// skipped and the next one taken instead. `sizes` holds one entry per problem of `levels`, in
/// order.
pub fn pick_identity_problems(
    levels: Vec<(u32, Vec<Problem>)>,
    sizes: Vec<InputSize>,
    first: usize,
    max_bytes: u64,
) -> Result<Vec<LevelPick>> {
    let problems: usize = levels.iter().map(|(_, ps)| ps.len()).sum();
    ensure!(
        sizes.len() == problems,
        "{} input sizes were measured for {problems} problems",
        sizes.len()
    );
    let mut sizes = sizes.into_iter();
    Ok(levels
        .into_iter()
        .map(|(level, problems)| {
            let level_sizes: Vec<InputSize> = sizes.by_ref().take(problems.len()).collect();
            pick_level(level, problems, level_sizes, first, max_bytes)
        })
        .collect())
}

fn pick_level(
    level: u32,
    problems: Vec<Problem>,
    sizes: Vec<InputSize>,
    first: usize,
    max_bytes: u64,
) -> LevelPick {
    let mut pick = LevelPick {
        level,
        taken: Vec::new(),
        skipped: Vec::new(),
    };
    for (problem, size) in problems.into_iter().zip(sizes) {
        if pick.taken.len() == first {
            break;
        }
        match size {
            InputSize::Bytes(bytes) if bytes <= max_bytes => pick.taken.push(problem),
            InputSize::Bytes(bytes) => pick.skipped.push((problem, Skip::TooLarge(bytes))),
            InputSize::Error(why) => pick.skipped.push((problem, Skip::Unmeasured(why))),
        }
    }
    pick
}

/// The identity candidates of the problems taken, as the JSONL lines `dice eval` reads:
/// `{level, problem_id, sample_id: 0, code}`.
pub fn identity_candidates_jsonl(picks: &[LevelPick]) -> Result<String> {
    let mut jsonl = String::new();
    for problem in picks.iter().flat_map(|p| &p.taken) {
        let line = serde_json::json!({
            "level": problem.level,
            "problem_id": problem.problem_id,
            "sample_id": 0,
            "code": identity_candidate(problem.source_text()?),
        });
        jsonl.push_str(&format!("{line}\n"));
    }
    Ok(jsonl)
}

/// Python identifiers continue with letters, digits and `_` (Unicode letters included).
fn is_identifier_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renames_whole_identifiers_only() {
        let source = "class Model(nn.Module):\n    def __init__(self):\n        \
                      super(Model, self).__init__()\n# Model: MyModel Model_x Model2 ModelNew \
                      xModel éModel Model\n";
        assert_eq!(
            identity_candidate(source),
            "class ModelNew(nn.Module):\n    def __init__(self):\n        \
             super(ModelNew, self).__init__()\n# ModelNew: MyModel Model_x Model2 ModelNew \
             xModel éModel ModelNew\n"
        );
    }

    fn problem(id: u32) -> Problem {
        Problem {
            level: 1,
            problem_id: id,
            name: format!("{id}_P"),
            path: format!("level1/{id}_P.py").into(),
            source: b"class Model:\n    pass\n".to_vec(),
        }
    }

    #[test]
    fn takes_the_first_that_fit_and_stops_skipping_once_enough_are_taken() {
        let levels = vec![(1, (1..=5).map(problem).collect())];
        let sizes = vec![
            InputSize::Bytes(10),
            InputSize::Bytes(11),
            InputSize::Error("ValueError".into()),
            InputSize::Bytes(10),
            InputSize::Bytes(99),
        ];
        let picks = pick_identity_problems(levels, sizes, 2, 10).unwrap();
        let ids = |ps: &[Problem]| ps.iter().map(|p| p.problem_id).collect::<Vec<_>>();
        assert_eq!(ids(&picks[0].taken), [1, 4]);
        let skipped: Vec<(u32, Skip)> = picks[0]
            .skipped
            .iter()
            .map(|(p, why)| (p.problem_id, why.clone()))
            .collect();
        assert_eq!(
            skipped,
            [
                (2, Skip::TooLarge(11)),
                (3, Skip::Unmeasured("ValueError".into()))
            ]
        );
        let jsonl = identity_candidates_jsonl(&picks).unwrap();
        assert_eq!(jsonl.lines().count(), 2);
        assert!(jsonl.contains("class ModelNew:"), "{jsonl}");
    }

    #[test]
    fn sizes_must_cover_every_problem() {
        let levels = vec![(1, vec![problem(1), problem(2)])];
        assert!(pick_identity_problems(levels, vec![InputSize::Bytes(1)], 1, 1).is_err());
    }

    #[test]
    fn text_without_the_class_is_unchanged() {
        assert_eq!(identity_candidate(""), "");
        assert_eq!(identity_candidate("Models = MyModel"), "Models = MyModel");
    }
}
