//! Run-time evidence against static findings: where the CUDA profiler saw what forward really
//! launched, that outweighs what the syntax suggested.

use crate::finding::{Audit, Finding, Rule, Severity};

/// The share of forward's GPU time in the candidate's own kernels at and above which those
/// kernels did the work. Below it dice-eval reports `low_custom_kernel_share`; at or above it a
/// static `kernel_not_wired`/`kernel_not_called` finding is outweighed.
pub const SUBSTANTIAL_OWN_SHARE: f64 = 0.5;

impl Audit {
    /// Lets the profiled run of forward decide the static "not wired / not called" errors:
    /// when the candidate's own kernels took `own_share` (at least [`SUBSTANTIAL_OWN_SHARE`])
    /// of forward's GPU time they ran on forward's path whatever the call graph missed, so
    /// those errors become warnings whose message names both pieces of evidence.
    pub fn weigh_kernel_profile(&mut self, own_share: f64) {
        if own_share < SUBSTANTIAL_OWN_SHARE {
            return;
        }
        for finding in &mut self.findings {
            if !outweighed_by_a_profile(finding.rule) || finding.severity != Severity::Error {
                continue;
            }
            let prefix = format!("line {}: ", finding.line);
            let what = finding
                .message
                .strip_prefix(&prefix)
                .unwrap_or(&finding.message);
            finding.message = format!(
                "{prefix}static: {what}; run time: the program's own kernels took {:.0} % of \
                 forward's GPU time → not deceptive",
                own_share * 100.0
            );
            finding.severity = Severity::Warning;
        }
    }

    /// An error that no run of the program can outweigh (every one but the "not wired / not
    /// called" errors, which a profile can): the program is deceptive whatever it does.
    pub fn decided_without_running(&self) -> Option<&Finding> {
        self.errors().find(|f| !outweighed_by_a_profile(f.rule))
    }
}

/// Rules whose error a profile of forward can turn into a warning ([`Audit::weigh_kernel_profile`]).
fn outweighed_by_a_profile(rule: Rule) -> bool {
    matches!(rule, Rule::KernelNotWired | Rule::KernelNotCalled)
}
