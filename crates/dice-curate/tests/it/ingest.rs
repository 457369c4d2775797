//! `ingest` on every input format, with exact and near duplicates of released pairs.

use dice_curate::{ingest, RunDir};
use dice_kernelbench::prompt::one_shot_prompt;
use dice_test_support::test_data;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

fn data(name: &str) -> PathBuf {
    test_data().join("dice").join(name)
}

fn released() -> Vec<Value> {
    serde_json::from_str(
        &std::fs::read_to_string(data("kernel_infilling_evaluation.json")).unwrap(),
    )
    .unwrap()
}

fn write_jsonl(path: &Path, records: &[Value]) {
    let lines: Vec<String> = records.iter().map(Value::to_string).collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

#[test]
fn every_format_is_read_and_duplicates_are_dropped() {
    let tmp = tempfile::tempdir().unwrap();
    let pairs = released();
    let problem = |i: usize| pairs[i]["pytorch_code"].as_str().unwrap().to_string();
    let kernel = |i: usize| pairs[i]["cuda_code"].as_str().unwrap().to_string();

    // Alpaca: pair 0 again (an exact duplicate once normalised: other layout and comments),
    // and a new pair (pair 1's problem, pair 5's kernel: ingest does not judge).
    let relaid = kernel(0)
        .replace('\n', "  \r\n")
        .replace("import torch\n", "import torch  # torch\n");
    let alpaca = tmp.path().join("alpaca.json");
    let records = [
        json!({"instruction": one_shot_prompt(&problem(0)), "input": "", "output": format!("```python\n{relaid}\n```")}),
        json!({"instruction": one_shot_prompt(&problem(1)), "input": "", "output": format!("Sure.\n```python\n{}\n```", kernel(5))}),
        json!({"instruction": "no reference here", "input": "", "output": "```python\nclass ModelNew: pass\n```"}),
    ];
    std::fs::write(&alpaca, serde_json::to_string(&records).unwrap()).unwrap();

    // Sharegpt: pair 2 with one line of its kernel changed (a near duplicate).
    let edited = kernel(2)
        .replacen("return", "return  (", 1)
        .replacen(";\n", ");\n", 1);
    let sharegpt = tmp.path().join("sharegpt.jsonl");
    write_jsonl(
        &sharegpt,
        &[json!({"conversations": [
            {"from": "human", "value": one_shot_prompt(&problem(2))},
            {"from": "gpt", "value": format!("```python\n{edited}\n```")},
        ]})],
    );

    // A folder: a problem with a kernel beside it (pair 3) and a problem alone.
    let folder = tmp.path().join("kernels");
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(folder.join("7_Gemm.py"), problem(3)).unwrap();
    std::fs::write(folder.join("7_Gemm_new.py"), kernel(3)).unwrap();
    std::fs::write(folder.join("8_Alone.py"), problem(4)).unwrap();

    let run = RunDir::new(tmp.path().join("run"));
    let inputs = [
        data("kernel_infilling_evaluation.json"),
        alpaca,
        sharegpt,
        folder,
        data("end_to_end_kernel_generation_4000.json"),
    ];
    let summary = ingest(&run, &inputs, dice_curate::dedup::DEFAULT_THRESHOLD).unwrap();
    println!("{}", serde_json::to_string_pretty(&json!({
        "read": summary.read, "rejected": summary.rejected, "exact": summary.exact_duplicates,
        "near": summary.near_duplicates, "kept": summary.kept, "problem_only": summary.problem_only,
        "clusters": summary.clusters.len(),
    })).unwrap());
    assert_eq!(summary.read["pairs"], 99 + 4000);
    assert_eq!(summary.read["alpaca"], 3);
    assert_eq!(summary.read["sharegpt"], 1);
    assert_eq!(summary.read["folder"], 2);
    assert_eq!(summary.rejected, 1, "the alpaca record without a reference");
    let dropped: Vec<Value> = std::fs::read_to_string(run.ingest_dropped())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let reason_of = |origin_part: &str| -> Vec<String> {
        dropped
            .iter()
            .filter(|d| d["origin"].as_str().unwrap().contains(origin_part))
            .map(|d| d["reason"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(reason_of("alpaca.json#0"), ["exact duplicate"]);
    assert_eq!(reason_of("sharegpt.jsonl:1"), ["near duplicate"]);
    assert_eq!(reason_of("7_Gemm_new.py"), ["exact duplicate"]);
    assert!(reason_of("alpaca.json#1").is_empty());
    assert!(
        reason_of("8_Alone.py").is_empty(),
        "a problem-only record of a new problem"
    );
    let near = dropped
        .iter()
        .find(|d| d["reason"] == "near duplicate")
        .unwrap();
    assert_eq!(near["duplicate_of"].as_str().unwrap().len(), 16);
    assert!(near["similarity"].as_f64().unwrap() >= 0.9);

    // Ingesting again gives the same files.
    let first = std::fs::read(run.pairs()).unwrap();
    ingest(&run, &inputs, dice_curate::dedup::DEFAULT_THRESHOLD).unwrap();
    assert_eq!(std::fs::read(run.pairs()).unwrap(), first);
    let kept = run.read_pairs().unwrap();
    assert_eq!(kept.len(), summary.kept);
    assert_eq!(kept.len(), summary.problem_only + 99 + 1);
    assert!(kept
        .iter()
        .any(|p| p.origin.ends_with("8_Alone.py") && p.cuda_code.is_none()));
    assert_eq!(kept[0].label, None);
    assert!(kept
        .iter()
        .filter(|p| p.cuda_code.is_none())
        .all(|p| p.label.is_some() || p.origin.ends_with(".py")));
}
