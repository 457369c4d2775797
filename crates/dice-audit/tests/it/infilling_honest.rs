//! The 99 verified kernels of DICE's infilling set are honest: no error findings,
//! except the ones listed (and explained) in `KNOWN_DECEPTIVE`.

use dice_audit::{audit, AuditOptions, Rule, Severity};

/// Entries (by `id`) whose error findings were investigated; each is a real instance of
/// the rule, not a parsing or resolution mistake (KernelBench's own static checker, which
/// requires a `__global__` kernel, rejects both too):
/// - 2193: `fused_linear_relu_cuda` is a cuBLASLt GEMM with a ReLU/bias epilogue; no
///   `__global__` kernel exists, so no custom kernel runs (the rule's definition).
/// - 6936: `conv_cuda` calls cuDNN's `cudnnConvolutionForward`; likewise no custom kernel.
const KNOWN_DECEPTIVE: &[(u64, &str)] = &[(2193, "no_custom_kernel"), (6936, "no_custom_kernel")];

/// Entries that redefine a problem name: a warning, since only a harness sharing the problem's
/// namespace would use the candidate's version (8204 adds `.cuda()` to `get_inputs`).
const REDEFINES_PROBLEM_NAMES: &[u64] = &[8204];

#[test]
fn honest_infilling_kernels_raise_no_errors() -> anyhow::Result<()> {
    let path = dice_test_support::test_data().join("dice/kernel_infilling_evaluation.json");
    let text = std::fs::read_to_string(&path)?;
    let entries: Vec<serde_json::Value> = serde_json::from_str(&text)?;
    assert_eq!(entries.len(), 99);
    let mut flagged = Vec::new();
    for entry in &entries {
        let id = entry["id"].as_u64().unwrap_or_default();
        let candidate = entry["cuda_code"].as_str().unwrap_or_default();
        let problem = entry["pytorch_code"].as_str().unwrap_or_default();
        let result = audit(candidate, problem, &AuditOptions::default());
        let errors: Vec<String> = result
            .errors()
            .map(|f| format!("{}: {}", f.rule, f.message))
            .collect();
        if !errors.is_empty() {
            flagged.push((id, errors));
        }
        let redefines = result
            .findings
            .iter()
            .any(|f| f.rule == Rule::ProblemConstantRedefined && f.severity == Severity::Warning);
        assert_eq!(
            redefines,
            REDEFINES_PROBLEM_NAMES.contains(&id),
            "{id}: {:?}",
            result.findings
        );
    }
    for (id, errors) in &flagged {
        eprintln!("{id}: {errors:?}");
    }
    eprintln!("{} of 99 honest kernels have error findings", flagged.len());
    let unexpected: Vec<_> = flagged
        .iter()
        .filter(|(id, errors)| {
            !KNOWN_DECEPTIVE
                .iter()
                .any(|(known, rule)| known == id && errors.iter().all(|e| e.starts_with(rule)))
        })
        .collect();
    assert!(unexpected.is_empty(), "unexpected errors: {unexpected:?}");
    let stale: Vec<_> = KNOWN_DECEPTIVE
        .iter()
        .filter(|(known, _)| !flagged.iter().any(|(id, _)| id == known))
        .collect();
    assert!(
        stale.is_empty(),
        "known deceptions no longer flagged: {stale:?}"
    );
    Ok(())
}

/// Every KernelBench problem of levels 1–3 turned into an identity candidate (Model renamed
/// ModelNew) is caught as `no_custom_kernel`, and nothing else is an error: its constants and
/// functions are the problem's own, so they are only warnings.
#[test]
fn identity_candidates_of_all_problems_have_no_custom_kernel() -> anyhow::Result<()> {
    let mut audited = 0;
    for level in 1..=3 {
        let dir = dice_test_support::test_data().join(format!("kernelbench/level{level}"));
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            let problem = std::fs::read_to_string(&path)?;
            let candidate = problem
                .replace("class Model(", "class ModelNew(")
                .replace("super(Model,", "super(ModelNew,");
            let result = audit(&candidate, &problem, &AuditOptions::default());
            let errors: Vec<_> = result.errors().map(|f| f.rule.id()).collect();
            assert!(
                !errors.is_empty() && errors.iter().all(|r| *r == "no_custom_kernel"),
                "{}: {:?}",
                path.display(),
                result.findings
            );
            audited += 1;
        }
    }
    assert_eq!(audited, 250);
    Ok(())
}
