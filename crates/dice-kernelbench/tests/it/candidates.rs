use dice_kernelbench::{load_candidates, Candidate};
use std::fs;
use std::path::{Path, PathBuf};

fn load(paths: &[&Path]) -> anyhow::Result<Vec<Candidate>> {
    load_candidates(
        &paths
            .iter()
            .map(|p| p.to_path_buf())
            .collect::<Vec<PathBuf>>(),
    )
}

#[test]
fn run_folder_files_are_read_as_bytes_and_others_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let crlf = b"import torch\r\nclass ModelNew: pass\r\n\r\n".to_vec();
    fs::write(
        dir.path().join("level_1_problem_12_sample_0_kernel.py"),
        &crlf,
    )
    .unwrap();
    fs::write(dir.path().join("level_1_problem_3_sample_1_kernel.py"), "b").unwrap();
    fs::write(dir.path().join("eval_results.json"), "{}").unwrap();
    fs::write(dir.path().join("level_1_problem_3_sample_1.py"), "x").unwrap();
    let cands = load(&[dir.path()]).unwrap();
    let keys: Vec<_> = cands.iter().map(Candidate::key).collect();
    assert_eq!(keys, vec![(1, 3, 1), (1, 12, 0)]);
    assert_eq!(cands[1].code.as_deref(), Some(&crlf[..]));
    assert!(cands[1]
        .origin
        .ends_with("level_1_problem_12_sample_0_kernel.py"));
    assert_eq!(cands[1].raw_answer, None);
}

#[test]
fn a_folder_without_candidates_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("notes.txt"), "x").unwrap();
    let msg = format!("{:#}", load(&[dir.path()]).unwrap_err());
    assert!(
        msg.contains("holds no `level_L_problem_ID_sample_S_kernel.py`"),
        "{msg}"
    );
}

#[test]
fn jsonl_code_and_completions() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.jsonl");
    let lines = [
        r#"{"level": 2, "problem_id": 5, "sample_id": 0, "code": "x = 1\n"}"#,
        "",
        r#"{"level": 2, "problem_id": 5, "sample_id": 1, "completion": "Sure:\n```python\nx = 2\n```"}"#,
        r#"{"level": 2, "problem_id": 5, "sample_id": 2, "completion": "no fence here"}"#,
    ];
    fs::write(&path, lines.join("\n")).unwrap();
    let cands = load(&[&path]).unwrap();
    assert_eq!(cands.len(), 3);
    assert_eq!(cands[0].code.as_deref(), Some(&b"x = 1\n"[..]));
    assert_eq!(cands[0].origin, format!("{}:1", path.display()));
    assert_eq!(cands[1].code.as_deref(), Some(&b"x = 2"[..]));
    assert_eq!(cands[1].origin, format!("{}:3", path.display()));
    assert!(cands[1].raw_answer.as_deref().unwrap().starts_with("Sure:"));
    assert_eq!(cands[2].code, None);
    assert_eq!(cands[2].raw_answer.as_deref(), Some("no fence here"));
}

#[test]
fn malformed_jsonl_lines_name_file_line_and_problem() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.jsonl");
    let good = r#"{"level": 1, "problem_id": 1, "sample_id": 0, "code": "x"}"#;
    for (bad, expected) in [
        (
            r#"{"level": 1, "problem_id": 1, "sample_id": 0"#,
            "not valid JSON",
        ),
        (
            r#"{"level": 1, "sample_id": 0, "code": "x"}"#,
            "missing `problem_id`",
        ),
        (
            r#"{"level": -1, "problem_id": 1, "sample_id": 0, "code": "x"}"#,
            "`level` must be a non-negative integer",
        ),
        (
            r#"{"level": 1, "problem_id": 1, "sample_id": 0, "code": 3}"#,
            "`code` must be a string",
        ),
        (
            r#"{"level": 1, "problem_id": 1, "sample_id": 0}"#,
            "missing `code`",
        ),
        (
            r#"{"level": 1, "problem_id": 1, "sample_id": 0, "code": "x", "completion": "y"}"#,
            "both `code` and `completion`",
        ),
        ("[1, 2]", "expected a JSON object"),
    ] {
        fs::write(&path, format!("{good}\n{bad}\n")).unwrap();
        let msg = format!("{:#}", load(&[&path]).unwrap_err());
        assert!(msg.contains(&format!("{}:2", path.display())), "{msg}");
        assert!(msg.contains(expected), "{msg}");
        assert!(!msg.contains('\n'), "{msg}");
    }
}

#[test]
fn duplicates_name_both_origins() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("level_1_problem_4_sample_0_kernel.py");
    fs::write(&file, "x").unwrap();
    let jsonl = dir.path().join("more.jsonl");
    fs::write(
        &jsonl,
        r#"{"level": 1, "problem_id": 4, "sample_id": 0, "code": "y"}"#,
    )
    .unwrap();
    let msg = format!("{:#}", load(&[&file, &jsonl]).unwrap_err());
    assert!(msg.contains("level 1 problem 4 sample 0"), "{msg}");
    assert!(msg.contains(&file.display().to_string()), "{msg}");
    assert!(msg.contains(&format!("{}:1", jsonl.display())), "{msg}");
}

#[test]
fn unknown_paths_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("kernel.py");
    fs::write(&other, "x").unwrap();
    let msg = format!("{:#}", load(&[&other]).unwrap_err());
    assert!(msg.contains("kernel.py") && msg.contains(".jsonl"), "{msg}");
    let msg = format!("{:#}", load(&[&dir.path().join("nope")]).unwrap_err());
    assert!(msg.contains("does not exist"), "{msg}");
}
