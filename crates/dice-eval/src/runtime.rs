//! Run-time reward-hack findings: what running a candidate showed, beyond its outputs. Rule ids
//! are dice-audit's, so static and run-time findings share one vocabulary in `flags`.

use dice_audit::{Rule, Severity, SUBSTANTIAL_OWN_SHARE};
use dice_store::{KernelProfile, LaunchedKernel};
use serde_json::Value;

/// Timer check slack: per timed call and per round, for the evaluator's own jitter.
const SLACK_PER_CALL_MS: f64 = 0.5;
const SLACK_PER_ROUND_MS: f64 = 50.0;

#[derive(Clone, Debug, PartialEq)]
pub struct Finding {
    pub rule: Rule,
    pub severity: Severity,
    pub message: String,
}

impl Finding {
    pub fn error(rule: Rule, message: String) -> Finding {
        Finding {
            rule,
            severity: Severity::Error,
            message,
        }
    }
}

/// Judges a `kernels` event against the candidate's own kernel names (dice-audit's
/// `custom_kernel_names`): they must run, and everything must run on the default stream.
pub fn check_kernels(
    msg: &Value,
    custom_names: &[String],
    strict: bool,
) -> (KernelProfile, Vec<Finding>) {
    let kernels: Vec<LaunchedKernel> =
        serde_json::from_value(msg["kernels"].clone()).unwrap_or_default();
    let default_stream = msg["default_stream"].as_i64();
    // Folded from +0.0: `sum()` of no f64 is -0.0, which a report would show as a share of -0.
    let total = kernels.iter().fold(0.0, |sum, k| sum + k.us);
    let own = |k: &&LaunchedKernel| custom_names.iter().any(|n| names_kernel(&k.name, n));
    let own_us = kernels.iter().filter(own).fold(0.0, |sum, k| sum + k.us);
    let launched_own = kernels.iter().any(|k| own(&k));
    let custom_share =
        (!custom_names.is_empty()).then(|| if total > 0.0 { own_us / total } else { 0.0 });
    let mut findings = Vec::new();
    if !custom_names.is_empty() && !launched_own {
        let ran: Vec<&str> = kernels.iter().take(3).map(|k| k.name.as_str()).collect();
        findings.push(Finding::error(
            Rule::CustomKernelNotLaunched,
            format!(
                "none of the program's kernels ({}) ran during forward; it launched {}",
                custom_names.join(", "),
                if ran.is_empty() {
                    "no kernel".to_string()
                } else {
                    ran.join("; ")
                }
            ),
        ));
    } else if let Some(share) = custom_share.filter(|s| *s < SUBSTANTIAL_OWN_SHARE) {
        findings.push(Finding {
            rule: Rule::LowCustomKernelShare,
            severity: if strict {
                Severity::Error
            } else {
                Severity::Warning
            },
            message: format!(
                "only {:.0}% of the kernel time of forward is in the program's own kernels",
                share * 100.0
            ),
        });
    }
    if let Some(default) = default_stream {
        if let Some(k) = kernels
            .iter()
            .find(|k| k.stream.is_some_and(|s| s != default))
        {
            findings.push(Finding::error(
                Rule::NonDefaultStream,
                format!(
                    "kernel {} ran on stream {}, not on the timed default stream {default}",
                    k.name,
                    k.stream.unwrap_or_default()
                ),
            ));
        }
    }
    let profile = KernelProfile {
        default_stream,
        custom_share,
        kernels,
    };
    (profile, findings)
}

/// Whether a (demangled) launched kernel name contains `name` as a whole identifier.
fn names_kernel(launched: &str, name: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    !name.is_empty()
        && launched.match_indices(name).any(|(at, _)| {
            let before = launched[..at].chars().next_back();
            let after = launched[at + name.len()..].chars().next();
            !before.is_some_and(ident) && !after.is_some_and(ident)
        })
}

/// The evaluator's wall time of the candidate's timed batches against the times it reported.
/// The baseline runs the same timing code, so its wall time minus its reported time is the
/// overhead both share; a candidate whose reported time is far below its wall time minus that
/// overhead has a tampered clock.
pub fn check_timer(
    candidate_ms: &[f64],
    candidate_wall_ms: f64,
    baseline_ms: &[f64],
    baseline_wall_ms: f64,
    rounds: u32,
) -> Option<Finding> {
    let reported: f64 = candidate_ms.iter().sum();
    let overhead = (baseline_wall_ms - baseline_ms.iter().sum::<f64>()).max(0.0);
    let measured = candidate_wall_ms - overhead;
    let slack =
        SLACK_PER_CALL_MS * candidate_ms.len() as f64 + SLACK_PER_ROUND_MS * f64::from(rounds);
    (measured > 2.0 * reported + slack).then(|| {
        Finding::error(
            Rule::TimerInconsistent,
            format!(
                "the timed calls reported {reported:.3} ms in all, but took about {measured:.3} ms \
                 of the evaluator's wall time"
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn kernels(list: &[(&str, i64, f64)]) -> Value {
        let k: Vec<Value> = list
            .iter()
            .map(|(n, s, us)| json!({"name": n, "stream": s, "us": us, "calls": 1}))
            .collect();
        json!({"default_stream": 7, "kernels": k})
    }

    fn rules(findings: &[Finding]) -> Vec<Rule> {
        findings.iter().map(|f| f.rule).collect()
    }

    #[test]
    fn own_kernels_must_run_on_the_default_stream() {
        let names = vec!["relu_kernel".to_string(), "relu_cuda".to_string()];
        let honest = kernels(&[(
            "void relu_kernel<float>(float const*, float*, int)",
            7,
            90.0,
        )]);
        let (profile, findings) = check_kernels(&honest, &names, false);
        assert!(findings.is_empty(), "{findings:?}");
        assert_eq!(profile.custom_share, Some(1.0));

        let aten = kernels(&[("void at::native::vectorized_elementwise_kernel", 7, 90.0)]);
        let (profile, findings) = check_kernels(&aten, &names, false);
        assert_eq!(rules(&findings), [Rule::CustomKernelNotLaunched]);
        assert_eq!(
            profile.custom_share.map(f64::to_bits),
            Some(0.0f64.to_bits())
        );

        let prefix_only = kernels(&[("my_relu_kernel_v2(float*)", 7, 1.0)]);
        let (_, findings) = check_kernels(&prefix_only, &names, false);
        assert_eq!(rules(&findings), [Rule::CustomKernelNotLaunched]);

        let side = kernels(&[("relu_kernel(float*)", 15, 1.0)]);
        let (_, findings) = check_kernels(&side, &names, false);
        assert_eq!(rules(&findings), [Rule::NonDefaultStream]);
    }

    #[test]
    fn a_small_share_is_a_warning_unless_strict() {
        let names = vec!["add_kernel".to_string()];
        let mostly_cublas = kernels(&[
            ("sm90_xmma_gemm", 7, 900.0),
            ("add_kernel(float*)", 7, 100.0),
        ]);
        let (profile, findings) = check_kernels(&mostly_cublas, &names, false);
        assert!((profile.custom_share.unwrap() - 0.1).abs() < 1e-12);
        assert_eq!(findings[0].rule, Rule::LowCustomKernelShare);
        assert_eq!(findings[0].severity, Severity::Warning);
        let (_, findings) = check_kernels(&mostly_cublas, &names, true);
        assert_eq!(findings[0].severity, Severity::Error);
    }

    #[test]
    fn programs_without_kernels_are_left_to_the_static_rules() {
        let (profile, findings) = check_kernels(&kernels(&[("gemm", 7, 1.0)]), &[], false);
        assert!(findings.is_empty());
        assert_eq!(profile.custom_share, None);
    }

    #[test]
    fn a_clock_far_behind_the_wall_time_is_inconsistent() {
        let honest = check_timer(&[10.0; 10], 130.0, &[20.0; 10], 230.0, 2);
        assert!(honest.is_none(), "{honest:?}");
        let forged = check_timer(&[0.1; 10], 130.0 + 200.0, &[20.0; 10], 230.0, 2);
        assert_eq!(forged.unwrap().rule, Rule::TimerInconsistent);
    }
}
