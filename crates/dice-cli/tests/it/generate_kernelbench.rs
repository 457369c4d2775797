//! `dice generate --kernelbench` writes `candidates.jsonl` lines that dice-kernelbench reads, and a
//! second run only adds what is missing.

use dice_test_support::checkpoint::formula_tiny;
use dice_test_support::test_data;
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn generate(run: &Path, samples: &str, extra: &[&str]) {
    let output = Command::new(env!("CARGO_BIN_EXE_dice"))
        .arg("generate")
        .arg("--model")
        .arg(formula_tiny())
        .arg("--kernelbench")
        .arg(test_data().join("kernelbench"))
        .args(["--level", "1", "--problems", "3,1", "--samples", samples])
        .args(["--max-new-tokens", "6", "--no-stop"])
        .arg("--run")
        .arg(run)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "dice generate failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

fn lines(run: &Path) -> Vec<Value> {
    std::fs::read_to_string(run.join("candidates.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn kernelbench_candidates_are_written_and_resumed() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    generate(&run, "1", &[]);
    let first = lines(&run);
    let keys: Vec<(u64, u64, u64)> = first
        .iter()
        .map(|l| {
            (
                l["level"].as_u64().unwrap(),
                l["problem_id"].as_u64().unwrap(),
                l["sample_id"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(keys, vec![(1, 1, 0), (1, 3, 0)]);
    for line in &first {
        assert!(line["completion"].is_string());
        let ids = line["token_ids"].as_array().unwrap();
        assert!(ids.len() >= 6);
        assert_eq!(line["trace"].as_array().unwrap().len(), ids.len());
    }
    let candidates = dice_kernelbench::load_candidates(&[run.join("candidates.jsonl")]).unwrap();
    assert_eq!(candidates.len(), 2);

    generate(&run, "2", &[]);
    let second = lines(&run);
    assert_eq!(second.len(), 4);
    assert_eq!(second[..2], first[..]);
    let added: Vec<u64> = second[2..]
        .iter()
        .map(|l| l["sample_id"].as_u64().unwrap())
        .collect();
    assert_eq!(added, vec![1, 1]);
}

/// Requests dealt to several engines (threads, each with its model) decode exactly as in one.
#[test]
fn several_engines_give_the_answers_of_one() {
    let dir = tempfile::tempdir().unwrap();
    let by_key = |run: &Path| {
        let mut all: Vec<(u64, u64, Value)> = lines(run)
            .into_iter()
            .map(|l| {
                let key = (
                    l["problem_id"].as_u64().unwrap(),
                    l["sample_id"].as_u64().unwrap(),
                );
                (key.0, key.1, l)
            })
            .collect();
        all.sort_by_key(|(p, s, _)| (*p, *s));
        all
    };
    let (one, three) = (dir.path().join("one"), dir.path().join("three"));
    generate(
        &one,
        "2",
        &["--engines", "1", "--temperature", "1.0", "--top-k", "0"],
    );
    generate(
        &three,
        "2",
        &["--engines", "3", "--temperature", "1.0", "--top-k", "0"],
    );
    let (one, three) = (by_key(&one), by_key(&three));
    assert_eq!(one.len(), 4);
    assert_ne!(
        one[0].2["token_ids"], one[1].2["token_ids"],
        "two samples of one problem decode with different seeds"
    );
    assert_eq!(one, three);
}
