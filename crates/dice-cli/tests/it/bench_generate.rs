//! `dice bench generate` on the formula golden's tiny config, on the CPU.

use crate::common::{dice, stderr};
use dice_test_support::test_data;
use serde_json::Value;
use std::path::PathBuf;

fn tiny_config() -> PathBuf {
    test_data().join("sdar/golden/formula/config.json")
}

#[test]
fn counts_the_forwards_of_the_static_schedule_per_batch() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let config = tiny_config();
    let (prompt, new, block, steps) = (8, 8, 4, 4);
    let out = dice(&[
        "bench",
        "generate",
        "--config",
        config.to_str().unwrap(),
        "--dtype",
        "f32",
        "--batch",
        "1,2",
        "--prompt-tokens",
        &prompt.to_string(),
        "--new-tokens",
        &new.to_string(),
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["block_length"], block);
    assert_eq!(v["steps"], steps);
    assert_eq!(v["strategy"], "low_confidence_static");
    assert_eq!(v["cuda_event_tracking"], false);
    assert!(v["model"].is_null());
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    // The whole-block prompt is one prefill forward for the batch; each generated block takes
    // `steps` denoising forwards (one token each), the first of which also stores the block
    // before (the last block is never stored), all sequences of the batch in the same forwards.
    let decode = new / block * steps;
    for (row, batch) in rows.iter().zip([1, 2]) {
        assert_eq!(row["batch"], batch);
        assert_eq!(row["generated_tokens"], batch * new);
        assert_eq!(row["forwards"]["prefill"], 1, "{row}");
        assert_eq!(row["forwards"]["decode"], decode, "{row}");
        assert_eq!(row["total_forwards"], 1 + decode);
        let wall_s = row["wall_s"].as_f64().unwrap();
        let per_forward = row["ms_per_forward"].as_f64().unwrap();
        assert!((per_forward * (1 + decode) as f64 - wall_s * 1e3).abs() < 1e-6 * wall_s * 1e3);
        assert!(row["reference"].is_null());
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let table: Vec<&str> = stdout.lines().filter(|l| l.starts_with("| ")).collect();
    assert_eq!(table.len(), 4, "{stdout}");
    for row in &table[2..] {
        assert!(row.ends_with("| - | - |"), "{stdout}");
    }
}

#[test]
fn an_empty_batch_is_one_clear_line() {
    let config = tiny_config();
    let out = dice(&[
        "bench",
        "generate",
        "--config",
        config.to_str().unwrap(),
        "--batch",
        "0",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("--batch"), "{err}");
}

/// Prompts of differing lengths (`--prompt-tokens MIN-MAX`, as a rollout's task prompts are):
/// the lengths spread over the batch, the run says so, and its sequences' block boundaries out
/// of step cost forwards that prompts of one length do not.
#[test]
fn ragged_prompts_spread_over_the_batch_and_cost_forwards() {
    let dir = tempfile::tempdir().unwrap();
    let run = |prompts: &str| -> Value {
        let json = dir.path().join(format!("{prompts}.json"));
        let out = dice(&[
            "bench",
            "generate",
            "--config",
            tiny_config().to_str().unwrap(),
            "--dtype",
            "f32",
            "--batch",
            "4",
            "--prompt-tokens",
            prompts,
            "--new-tokens",
            "16",
            "--json",
            json.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains(&format!("{prompts}-token prompts")),
            "{stdout}"
        );
        serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap()
    };
    let (equal, ragged) = (run("8"), run("5-8"));
    assert_eq!(equal["prompt_tokens"], 8);
    assert_eq!(ragged["prompt_tokens"], "5-8");
    let decode = |v: &Value| v["rows"][0]["forwards"]["decode"].as_u64().unwrap();
    // Prompts of 5, 6, 7 and 8 tokens; each sequence ends at the end of the block that holds its
    // 16th new token (the first block holds the prompt's last tokens).
    let generated =
        |prompts: &[usize]| -> usize { prompts.iter().map(|p| (p + 16).div_ceil(4) * 4 - p).sum() };
    assert_eq!(equal["rows"][0]["generated_tokens"], generated(&[8; 4]));
    assert_eq!(
        ragged["rows"][0]["generated_tokens"],
        generated(&[5, 6, 7, 8])
    );
    eprintln!(
        "decoding forwards: equal prompts {}, ragged {}",
        decode(&equal),
        decode(&ragged)
    );
    assert!(decode(&ragged) > decode(&equal), "{ragged}\n{equal}");
}
