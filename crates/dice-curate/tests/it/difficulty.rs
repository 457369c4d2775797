//! Curriculum levels of the RL tasks: pass rates from a run's store, matched by the source's
//! hash (problems pooled, deceptive samples incorrect, tasks without samples at the hardest
//! level), and an endpoint's ratings (answers cached in the run folder, an answer without a
//! level falling back to the hardest); export orders the tasks by them and the report shows the
//! histogram.

use crate::common::verify_pairs;
use dice_curate::difficulty::{from_endpoint, from_run};
use dice_curate::{
    export, ingest, rl_tasks, write_report, Difficulty, ExportOptions, KernelPrompt, KernelWriter,
    Pair, RunDir, SftFormat,
};
use dice_eval::sha256_hex;
use dice_store::{ProblemRecord, SampleExtras, SampleRecord, Store, Verdict};
use serde_json::Value;
use std::cell::Cell;
use std::path::Path;

/// The fixture's references as problem-only records, ingested (no verify needed).
fn problem_only_run(dir: &Path) -> (RunDir, Vec<Pair>) {
    let fixture = verify_pairs();
    let records: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    let problems: Vec<Value> = records
        .iter()
        .map(|r| serde_json::json!({"pytorch_code": r["pytorch_code"], "cuda_code": ""}))
        .collect();
    let input = dir.join("problems.json");
    std::fs::write(&input, serde_json::to_string(&problems).unwrap()).unwrap();
    let run = RunDir::new(dir.join("run"));
    ingest(&run, &[input], 0.9).unwrap();
    let tasks = rl_tasks(&run).unwrap();
    (run, tasks)
}

fn sample(problem: (u32, u32), sample_id: u32, verdict: Verdict, deceptive: bool) -> SampleRecord {
    SampleRecord {
        deceptive,
        ..SampleRecord::new(problem.0, problem.1, sample_id, verdict)
    }
}

fn export_with(run: &RunDir, out: &Path, difficulty: Difficulty) -> Vec<Value> {
    let options = ExportOptions {
        out: out.to_path_buf(),
        format: SftFormat::Alpaca,
        dataset: "cuke".into(),
        difficulty,
    };
    export(run, &options).unwrap();
    let tasks = std::fs::read_to_string(out.join("rl_end_to_end.json")).unwrap();
    serde_json::from_str(&tasks).unwrap()
}

fn summary(run: &RunDir) -> Value {
    serde_json::from_str(&std::fs::read_to_string(run.difficulty_summary()).unwrap()).unwrap()
}

fn status_of(summary: &Value, id: &str) -> (u64, String) {
    let task = summary["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["id"] == id)
        .unwrap();
    (
        task["level"].as_u64().unwrap(),
        task["status"].as_str().unwrap().to_string(),
    )
}

#[test]
fn pass_rates_of_a_run_meet_tasks_by_source_hash() {
    let tmp = tempfile::tempdir().unwrap();
    let (run, tasks) = problem_only_run(tmp.path());
    assert!(tasks.len() >= 4, "{} tasks", tasks.len());
    let hash = |t: &Pair| sha256_hex(t.pytorch_code.as_bytes());

    let mut store = Store::open(&tmp.path().join("eval.db")).unwrap();
    let problem = |level, problem_id| ProblemRecord {
        level,
        problem_id,
        name: format!("p{problem_id}"),
        reference_error: None,
    };
    store
        .add_problems(&[
            // Task 0 twice (two problems of the same source are pooled), task 1 once, task 2
            // as another layout of its source (other bytes: no match), task 3 without samples.
            (problem(1, 1), hash(&tasks[0])),
            (problem(1, 2), hash(&tasks[0])),
            (problem(2, 7), hash(&tasks[1])),
            (
                problem(2, 8),
                sha256_hex(tasks[2].pytorch_code.replace('\n', "\r\n").as_bytes()),
            ),
            (problem(3, 1), hash(&tasks[3])),
        ])
        .unwrap();
    let samples = [
        sample((1, 1), 0, Verdict::Correct, false),
        sample((1, 1), 1, Verdict::Correct, true),
        sample((1, 2), 0, Verdict::Correct, false),
        sample((1, 2), 1, Verdict::CompileError, false),
        sample((2, 7), 0, Verdict::Correct, false),
        sample((2, 7), 1, Verdict::Correct, false),
        sample((2, 7), 2, Verdict::Correct, false),
        sample((2, 8), 0, Verdict::Correct, false),
    ];
    for s in &samples {
        store.put_sample(s, &SampleExtras::default()).unwrap();
    }

    let measured = from_run(&store, "eval.db", &tasks, 3).unwrap();
    let rate = |i: usize| measured.tasks[&tasks[i].id].detail["pass_rate"].as_f64();
    assert_eq!(
        rate(0),
        Some(0.5),
        "2 of 4 pooled, the deceptive one incorrect"
    );
    assert_eq!(measured.tasks[&tasks[0].id].detail["judged"], 4);
    assert_eq!(rate(1), Some(1.0));
    assert_eq!(measured.tasks.len(), 2, "tasks 2 and 3 have no samples");

    let exported = export_with(
        &run,
        &tmp.path().join("data"),
        Difficulty::Measured(measured),
    );
    let order: Vec<(&str, u64)> = exported
        .iter()
        .map(|t| (t["id"].as_str().unwrap(), t["level"].as_u64().unwrap()))
        .collect();
    assert_eq!(order[0], (tasks[1].id.as_str(), 1));
    assert_eq!(order[1], (tasks[0].id.as_str(), 2));
    assert!(order[2..].iter().all(|&(_, level)| level == 3), "{order:?}");
    let idx: Vec<u64> = exported
        .iter()
        .map(|t| t["idx"].as_u64().unwrap())
        .collect();
    assert_eq!(idx, (0..tasks.len() as u64).collect::<Vec<_>>());

    let s = summary(&run);
    assert_eq!(s["method"], "run");
    assert_eq!(s["unmeasured"], tasks.len() - 2);
    assert_eq!(status_of(&s, &tasks[2].id), (3, "unmeasured".to_string()));
    let histogram = serde_json::json!([[1, 1], [2, 1], [3, tasks.len() - 2]]);
    assert_eq!(s["histogram"], histogram);
    write_report(&run).unwrap();
    let report = std::fs::read_to_string(run.dir.join("report.md")).unwrap();
    assert!(report.contains("## Difficulty"), "{report}");
    assert!(report.contains("| 3 | "), "{report}");
}

/// Answers in turn: a level, one out of range, none, a level in words around it.
struct Rater {
    answers: [&'static str; 4],
    asked: Cell<usize>,
}

impl KernelWriter for Rater {
    fn write(
        &self,
        prompts: Vec<KernelPrompt>,
        store: &mut dyn FnMut(usize, String) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        for (k, prompt) in prompts.iter().enumerate() {
            assert!(prompt.text.contains("from 1 (easy"), "{}", prompt.text);
            let answer = self.answers[self.asked.get() % self.answers.len()];
            self.asked.set(self.asked.get() + 1);
            store(k, answer.to_string())?;
        }
        Ok(())
    }
}

#[test]
fn endpoint_ratings_are_cached_and_fall_back_to_the_hardest_level() {
    let tmp = tempfile::tempdir().unwrap();
    let (run, tasks) = problem_only_run(tmp.path());
    let rater = Rater {
        answers: ["2", "7", "hard to say", "Level: 1."],
        asked: Cell::new(0),
    };
    let measured = from_endpoint(&run, &tasks, &rater, "test", 3).unwrap();
    assert_eq!(rater.asked.get(), tasks.len());
    let levels: Vec<(u32, bool)> = tasks
        .iter()
        .map(|t| (measured.tasks[&t.id].level, measured.tasks[&t.id].fallback))
        .collect();
    assert_eq!(levels[..4], [(2, false), (3, true), (3, true), (1, false)]);

    // A rerun reads the answers back and asks nothing.
    let again = from_endpoint(&run, &tasks, &rater, "test", 3).unwrap();
    assert_eq!(rater.asked.get(), tasks.len());
    assert_eq!(again, measured);

    export_with(
        &run,
        &tmp.path().join("data"),
        Difficulty::Measured(measured),
    );
    let s = summary(&run);
    assert_eq!(s["method"], "endpoint");
    assert_eq!(status_of(&s, &tasks[1].id), (3, "fallback".to_string()));
    let fallback = s["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["id"] == tasks[1].id.as_str());
    assert_eq!(fallback.unwrap()["answer"], "7");
}
