//! The infilling split on DICE's 99 released pairs, against the split released with them.

use dice_curate::split_file;
use dice_test_support::test_data;
use serde_json::Value;

fn released() -> std::path::PathBuf {
    test_data().join("dice/kernel_infilling_evaluation.json")
}

#[test]
fn every_released_program_splits_and_reassembles() {
    let path = released();
    let raw: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let run = split_file(&path).unwrap();
    assert!(run.failures.is_empty(), "{:?}", run.failures);
    assert_eq!(run.records.len(), raw.len());
    for (record, pair) in run.records.iter().zip(&raw) {
        assert_eq!(record.id, pair["id"]);
        let program = [&*record.prefix, &*record.core, &*record.suffix].concat();
        assert_eq!(
            program,
            pair["cuda_code"].as_str().unwrap(),
            "pair {}",
            record.id
        );
        assert!(!record.core.trim().is_empty(), "pair {}", record.id);
    }
    let agreement = run.agreement.expect("the released file carries its split");
    println!("{agreement}");
    assert_eq!(agreement.compared, raw.len());
    assert_eq!(agreement.inconsistent, 0);
    // The rules reproduce every released boundary (crate README: how they were derived).
    assert_eq!(agreement.exact, agreement.compared, "{agreement}");
}
