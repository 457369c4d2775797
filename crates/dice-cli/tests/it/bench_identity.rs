//! `dice bench identity` on small KernelBench-like trees, and on the KernelBench of the test data.

use dice_test_support::test_data;
use serde_json::Value;
use std::fs;
use std::path::Path;
use std::process::{Command, Output};

fn identity(kernelbench: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dice"))
        .args(["bench", "identity", "--kernelbench"])
        .arg(kernelbench)
        .args(extra)
        .output()
        .expect("the dice binary runs")
}

fn lines(out: &Output) -> Vec<Value> {
    String::from_utf8(out.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn keys(rows: &[Value]) -> Vec<(u64, u64)> {
    rows.iter()
        .map(|r| {
            assert_eq!(r["sample_id"], 0);
            (
                r["level"].as_u64().unwrap(),
                r["problem_id"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// A problem whose `get_inputs()` body is `inputs` (one statement returning the list).
fn problem(inputs: &str) -> String {
    format!(
        "import torch\nimport torch.nn as nn\n\n\
         class MyModel(nn.Module):\n    pass\n\n\
         class Model(nn.Module):\n    \"\"\"Model_x stays, Model goes.\"\"\"\n    \
         def __init__(self):\n        super(Model, self).__init__()\n\n    \
         def forward(self, x):\n        return x\n\n\
         def get_inputs():\n    {inputs}\n\n\
         def get_init_inputs():\n    return []\n"
    )
}

fn write_tree(root: &Path) {
    let files = [
        ("level1/1_Small.py", problem("return [torch.rand(4, 4), 3]")),
        // 2^42 floats: 16 TiB, declared but never allocated.
        (
            "level1/2_Huge.py",
            problem("return [torch.rand(1 << 20, 1 << 22)]"),
        ),
        (
            "level1/3_Raises.py",
            problem("raise ValueError('no inputs here')"),
        ),
        (
            "level1/4_Half.py",
            problem("return [torch.rand(8, dtype=torch.float16)]"),
        ),
        ("level1/5_Unused.py", problem("return [torch.rand(2)]")),
        ("level2/1_Other.py", problem("return [torch.rand(1)]")),
    ];
    for (path, text) in files {
        let path = root.join(path);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    }
}

#[test]
fn takes_the_first_problems_that_fit_and_lists_the_skipped() {
    let dir = tempfile::tempdir().unwrap();
    write_tree(dir.path());
    let out_file = dir.path().join("identity.jsonl");
    let out = identity(
        dir.path(),
        &[
            "--levels",
            "2,1",
            "--first",
            "2",
            "--max-input-gib",
            "1",
            "--out",
            out_file.to_str().unwrap(),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(out.stdout.is_empty());
    let rows: Vec<Value> = fs::read_to_string(&out_file)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(keys(&rows), [(1, 1), (1, 4), (2, 1)]);

    let source = fs::read_to_string(dir.path().join("level1/1_Small.py")).unwrap();
    let code = rows[0]["code"].as_str().unwrap();
    let renamed = source
        .replace("class Model(", "class ModelNew(")
        .replace("super(Model,", "super(ModelNew,")
        .replace("Model goes", "ModelNew goes");
    assert_ne!(renamed, source);
    assert_eq!(code, renamed);

    assert!(stderr.contains("level 1: 2 taken: 1, 4\n"), "{stderr}");
    assert!(
        stderr.contains("level 2: 1 taken (only 1 of 2 fit): 1\n"),
        "{stderr}"
    );
    assert!(
        stderr.contains("skipped 2_Huge: inputs take 16384.00 GiB (17592186044416 bytes)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("skipped 3_Raises: inputs cannot be measured: ValueError: no inputs here"),
        "{stderr}"
    );
    assert!(!stderr.contains("5_Unused"), "{stderr}");
}

#[test]
fn a_larger_budget_takes_the_huge_problem_and_stdout_is_the_default() {
    let dir = tempfile::tempdir().unwrap();
    write_tree(dir.path());
    let out = identity(
        dir.path(),
        &["--levels", "1", "--first", "3", "--max-input-gib", "16384"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(keys(&lines(&out)), [(1, 1), (1, 2), (1, 4)]);
}

#[test]
fn a_missing_folder_is_one_clear_line() {
    let out = identity(Path::new("/nonexistent/kernelbench"), &[]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("/nonexistent/kernelbench` does not exist"),
        "{stderr}"
    );
}

/// The benchmark's own set on level 1: problem 4 (an 8 GiB matrix and a vector) does not fit.
#[test]
fn kernelbench_level_one_skips_the_matrix_vector_problem() {
    let out = identity(
        &test_data().join("kernelbench"),
        &["--levels", "1", "--first", "4"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(keys(&lines(&out)), [(1, 1), (1, 2), (1, 3), (1, 5)]);
    assert!(
        stderr.contains("skipped 4_Matrix_vector_multiplication_: inputs take 8.00 GiB"),
        "{stderr}"
    );
}
