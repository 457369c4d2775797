//! `dice bench generate --profile` on the formula golden's tiny config, on the CPU.

use dice_test_support::test_data;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn tiny_config() -> PathBuf {
    test_data().join("sdar/golden/formula/config.json")
}

/// Runs the benchmark at batch 1 and 2 (8-token prompts, 8 new tokens); stdout and the JSON.
fn bench(json: &Path, extra: &[&str]) -> (String, Value) {
    let config = tiny_config();
    let out = Command::new(env!("CARGO_BIN_EXE_dice"))
        .args(["bench", "generate", "--config", config.to_str().unwrap()])
        .args(["--dtype", "f32", "--batch", "1,2"])
        .args(["--prompt-tokens", "8", "--new-tokens", "8"])
        .args(["--json", json.to_str().unwrap()])
        .args(extra)
        .output()
        .expect("the dice binary runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let value = serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap();
    (String::from_utf8_lossy(&out.stdout).into_owned(), value)
}

#[test]
fn profiles_one_decoding_forward_per_batch_size_and_a_prefill_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");

    let (_, plain) = bench(&json, &[]);
    assert!(plain.get("profile").is_none(), "{plain}");
    assert!(plain["rows"][0].get("steps").is_none(), "{plain}");

    let (stdout, v) = bench(&json, &["--profile"]);
    let profiles = v["profile"].as_array().unwrap();
    assert_eq!(profiles.len(), 3);
    for (p, batch) in profiles.iter().zip([1, 2]) {
        assert_eq!(p["batch"], batch);
        // Halfway through: the 8-token prompt and 4 of the 8 new tokens.
        assert_eq!(p["cached_tokens"], 12);
        assert_eq!(p["tokens"], 4);
        assert!(p["forward_ms"].as_f64().unwrap() > 0.0);
        let components = p["components"].as_array().unwrap();
        assert_eq!(components.len(), 17);
        for c in components {
            assert!(c["ms"].as_f64().unwrap() > 0.0, "{c}");
            assert!(c["floor_ms"].as_f64().unwrap() >= 0.0, "{c}");
        }
    }
    // The prefill of the largest batch: both 8-token prompts in one forward over empty caches.
    let prefill = &profiles[2];
    assert_eq!(prefill["batch"], 2);
    assert_eq!(prefill["cached_tokens"], 0);
    assert_eq!(prefill["tokens"], 8);
    assert!(prefill["forward_ms"].as_f64().unwrap() > 0.0);
    let prefill_stages = prefill["components"].as_array().unwrap().len();
    // Every engine step timed: the first (prefill + a forward), the other 7 forwards of the two
    // blocks, and a last step that only commits the final block.
    for (row, batch) in v["rows"].as_array().unwrap().iter().zip([1, 2]) {
        assert!(row["steps"]["first_ms"].as_f64().unwrap() > 0.0, "{row}");
        assert_eq!(
            row["steps"]["later_ms"].as_array().unwrap().len(),
            8,
            "{row}"
        );
        assert!(
            stdout.contains(&format!("engine steps at batch {batch} ")),
            "{stdout}"
        );
    }
    // The throughput table (2 rows) and one table of stages per profile.
    let table_lines = stdout.lines().filter(|l| l.starts_with("| ")).count();
    assert_eq!(
        table_lines,
        (2 + 2) + 2 * (2 + 17) + (2 + prefill_stages),
        "{stdout}"
    );
    assert_eq!(stdout.matches("| lm_head |").count(), 3, "{stdout}");
}
