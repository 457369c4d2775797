//! `ingest` then `verify` through the real evaluator on C++ CPU pairs: a fast pair, a slow one, a
//! wrong one, a deceptive one, an exact duplicate and a problem without a kernel, each landing
//! where it should; verifying again changes nothing.

use crate::common::{judging, verify_pairs};
use dice_curate::{
    export, ingest, verify, write_report, Difficulty, ExportOptions, RunDir, SftFormat,
    DEFAULT_MIN_SPEEDUP,
};
use serde_json::{json, Value};
use std::collections::BTreeMap;

#[test]
fn each_fixture_pair_lands_where_it_should() {
    let fixture = verify_pairs();
    let tmp = tempfile::tempdir().unwrap();
    let run = RunDir::new(tmp.path().join("run"));
    let ingested = ingest(&run, &[fixture], dice_curate::dedup::DEFAULT_THRESHOLD).unwrap();
    assert_eq!(
        (
            ingested.kept,
            ingested.exact_duplicates,
            ingested.near_duplicates
        ),
        (5, 1, 0)
    );
    assert_eq!(ingested.problem_only, 1);

    let summary = verify(&run, judging(3, 48, 8), DEFAULT_MIN_SPEEDUP).unwrap();
    let pairs = run.read_pairs().unwrap();
    let verified = run.read_verified().unwrap();
    let by_origin: BTreeMap<String, &dice_curate::VerifiedPair> = verified
        .iter()
        .map(|v| {
            let pair = pairs.iter().find(|p| p.id == v.id).unwrap();
            (pair.origin.rsplit('#').next().unwrap().to_string(), v)
        })
        .collect();
    for (origin, v) in &by_origin {
        println!(
            "pair #{origin}: {:?} {:?} [{:?}, {:?}] {:?}",
            v.verdict, v.speedup, v.speedup_low, v.speedup_high, v.reason
        );
    }
    assert_eq!(
        summary.pairs, 4,
        "the problem without a kernel is not judged"
    );
    let fast = by_origin["0"];
    assert!(fast.kept, "{fast:?}");
    assert!(fast.speedup_low.unwrap() >= DEFAULT_MIN_SPEEDUP);
    let slow = by_origin["1"];
    assert_eq!(slow.verdict.as_deref(), Some("correct"));
    assert!(
        slow.reason
            .as_deref()
            .unwrap()
            .starts_with("speedup below threshold"),
        "{slow:?}"
    );
    let wrong = by_origin["2"];
    assert!(
        wrong
            .reason
            .as_deref()
            .unwrap()
            .starts_with("verdict: output_mismatch"),
        "{wrong:?}"
    );
    // Strict judging rejects it before it runs: a static rule makes it deceptive whatever it
    // computes.
    let deceptive = by_origin["3"];
    assert_eq!(deceptive.verdict.as_deref(), Some("rejected"));
    assert!(
        deceptive
            .reason
            .as_deref()
            .unwrap()
            .starts_with("deceptive"),
        "{deceptive:?}"
    );
    assert_eq!(summary.kept, 1);
    // The fast and the slow pair: the rejected one was never timed.
    assert_eq!(summary.speedups_correct.len(), 2);
    assert_eq!(summary.speedups_kept.len(), 1);

    // Export: the fast pair is the only SFT record and infilling task; the end-to-end tasks
    // are its reference and the problem without a kernel.
    let out = tmp.path().join("export");
    let exported = export(
        &run,
        &ExportOptions {
            out: out.clone(),
            format: SftFormat::Alpaca,
            dataset: "cuke".into(),
            difficulty: Difficulty::Label,
        },
    )
    .unwrap();
    assert_eq!(
        (exported.sft, exported.infilling, exported.end_to_end),
        (1, 1, 2)
    );
    let read = |name: &str| -> Vec<Value> {
        serde_json::from_str(&std::fs::read_to_string(out.join(name)).unwrap()).unwrap()
    };
    let fast_pair = pairs.iter().find(|p| p.id == fast.id).unwrap();
    let sft = read("sft.json");
    assert!(sft[0]["output"]
        .as_str()
        .unwrap()
        .contains("ext.affine_chain(x, 200)"));
    let infilling = &read("rl_kernel_infilling.json")[0];
    let program = ["prefix", "middle", "suffix"]
        .map(|k| infilling[k].as_str().unwrap())
        .concat();
    assert_eq!(Some(program.as_str()), fast_pair.cuda_code.as_deref());
    assert!(infilling["middle"]
        .as_str()
        .unwrap()
        .starts_with("cpp_source = r\"\"\""));
    let end_to_end = read("rl_end_to_end.json");
    assert_eq!(end_to_end[0]["pytorch_code"], json!(fast_pair.pytorch_code));
    assert_eq!(
        (
            end_to_end[1]["idx"].clone(),
            end_to_end[1]["cuda_code"].clone()
        ),
        (json!(1), json!(""))
    );

    // The report: the funnel down to the one kept pair, the threshold, every drop reason.
    let reports = write_report(&run).unwrap();
    let md = std::fs::read_to_string(&reports[0]).unwrap();
    for line in [
        "| records read | 6 |",
        "| without exact duplicates | 5 |",
        "| with a kernel | 4 |",
        "| correct and timed | 2 |",
        "| kept: not deceptive, speedup ≥ 2x with 95 % confidence | 1 |",
        "| deceptive | 1 |",
        "| speedup below threshold | 1 |",
        "| verdict: output_mismatch | 1 |",
    ] {
        assert!(md.lines().any(|l| l == line), "no line {line:?} in:\n{md}");
    }
    let html = std::fs::read_to_string(&reports[1]).unwrap();
    assert!(html.contains("<svg") && html.contains("stroke=\"#c33\""));

    // Every pair is in the store: verifying again judges nothing and writes the same file.
    let first = std::fs::read(run.verified()).unwrap();
    assert_eq!(
        verify(&run, judging(3, 48, 8), DEFAULT_MIN_SPEEDUP).unwrap(),
        summary
    );
    assert_eq!(std::fs::read(run.verified()).unwrap(), first);
}
