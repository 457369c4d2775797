use dice_kernelbench::{load_pairs, PAIRS_LEVEL};
use dice_test_support::test_data;
use serde_json::Value;
use std::fs;

#[test]
fn dice_infilling_pairs_load_as_level_zero() {
    let path = test_data().join("dice/kernel_infilling_evaluation.json");
    let raw: Vec<Value> = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    let set = load_pairs(&path).unwrap();
    // Python's `ast` accepts every reference of this file, so the parse-tree check must too.
    assert!(set.invalid.is_empty(), "{:?}", set.invalid);
    assert_eq!(set.problems.len(), raw.len());
    assert_eq!(set.problems.len(), set.candidates.len());
    let first = raw[0]["id"].as_u64().unwrap() as u32;
    let p = set.problems.iter().find(|p| p.problem_id == first).unwrap();
    assert_eq!(p.level, PAIRS_LEVEL);
    assert_eq!(p.name, format!("pair_{first}"));
    assert_eq!(p.path, path);
    assert_eq!(
        p.source,
        raw[0]["pytorch_code"].as_str().unwrap().as_bytes()
    );
    let c = set
        .candidates
        .iter()
        .find(|c| c.problem_id == first)
        .unwrap();
    assert_eq!((c.level, c.sample_id), (PAIRS_LEVEL, 0));
    assert_eq!(
        c.code.as_deref(),
        Some(raw[0]["cuda_code"].as_str().unwrap().as_bytes())
    );
}

const PROBLEM: &str = "class Model:\n    pass\ndef get_inputs():\n    return []\ndef get_init_inputs():\n    return []\n";

#[test]
fn jsonl_pairs_without_ids_use_positions() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pairs.jsonl");
    let line =
        |cuda: &str| serde_json::json!({"pytorch_code": PROBLEM, "cuda_code": cuda}).to_string();
    let bad = serde_json::json!({"pytorch_code": "x = 1", "cuda_code": "y"}).to_string();
    fs::write(&path, [line("a"), bad, line("")].join("\n")).unwrap();
    let set = load_pairs(&path).unwrap();
    let ids: Vec<u32> = set.problems.iter().map(|p| p.problem_id).collect();
    assert_eq!(ids, vec![0, 2]);
    assert_eq!(set.candidates[0].code.as_deref(), Some(&b"a"[..]));
    assert_eq!(set.candidates[1].code, None);
    assert_eq!(set.invalid.len(), 1);
    assert!(set.invalid[0]
        .path
        .display()
        .to_string()
        .ends_with("pairs.jsonl:2"));
    assert!(set.invalid[0].reason.contains("class Model"));
}

#[test]
fn pairs_named_by_strings_are_numbered_by_position() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rl_end_to_end.json");
    let task = |id: &str| serde_json::json!({"id": id, "pytorch_code": PROBLEM, "cuda_code": ""});
    fs::write(
        &path,
        serde_json::json!([task("9f3a"), task("04bc")]).to_string(),
    )
    .unwrap();
    let set = load_pairs(&path).unwrap();
    let named: Vec<(u32, &str)> = set
        .problems
        .iter()
        .map(|p| (p.problem_id, p.name.as_str()))
        .collect();
    assert_eq!(named, [(0, "pair_9f3a"), (1, "pair_04bc")]);
    fs::write(
        &path,
        serde_json::json!([task("9f3a"), task("9f3a")]).to_string(),
    )
    .unwrap();
    let msg = format!("{:#}", load_pairs(&path).unwrap_err());
    assert!(msg.contains("pair id 9f3a is already used by"), "{msg}");
}

#[test]
fn bad_pairs_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pairs.json");
    fs::write(&path, r#"[{"id": 3, "pytorch_code": "x", "cuda_code": "y"}, {"id": 3, "pytorch_code": "x", "cuda_code": "y"}]"#).unwrap();
    let msg = format!("{:#}", load_pairs(&path).unwrap_err());
    assert!(
        msg.contains("pair id 3 is already used by") && msg.contains("pairs.json#0"),
        "{msg}"
    );
    fs::write(&path, r#"[{"id": 3, "pytorch_code": "x"}]"#).unwrap();
    let msg = format!("{:#}", load_pairs(&path).unwrap_err());
    assert!(msg.contains("pairs.json#0: missing `cuda_code`"), "{msg}");
}

#[test]
fn every_end_to_end_reference_validates() {
    let path = test_data().join("dice/end_to_end_kernel_generation_4000.json");
    let set = load_pairs(&path).unwrap();
    assert!(
        set.invalid.is_empty(),
        "{:?}",
        &set.invalid[..set.invalid.len().min(3)]
    );
    assert_eq!(set.problems.len(), 4000);
    // Their `cuda_code` is empty: no candidate code.
    assert!(set.candidates.iter().all(|c| c.code.is_none()));
}

#[test]
fn candidates_keep_the_file_order_problems_are_sorted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pairs.json");
    let pair = |id: u32| serde_json::json!({"id": id, "pytorch_code": PROBLEM, "cuda_code": "x"});
    fs::write(
        &path,
        serde_json::json!([pair(7), pair(1_000_007), pair(3)]).to_string(),
    )
    .unwrap();
    let set = load_pairs(&path).unwrap();
    let judged: Vec<u32> = set.candidates.iter().map(|c| c.problem_id).collect();
    assert_eq!(judged, [7, 1_000_007, 3]);
    let stored: Vec<u32> = set.problems.iter().map(|p| p.problem_id).collect();
    assert_eq!(stored, [3, 7, 1_000_007]);
}
