//! dice-audit's static rules as the evaluator's [`Audit`]: every sample's program is checked
//! against its problem's reference before it is stored, and the static findings that only
//! guess what runs yield to the profile of what forward really launched.

use crate::config::{Audit, EvalProblem, EvalSample};
use crate::runtime::Finding;
use dice_audit::{Rule, Severity};
use dice_store::{KernelProfile, SampleRecord};

/// The rule ids of dice-audit's findings become the sample's flags, and an error-severity
/// finding makes it deceptive.
pub struct StaticAudit {
    /// dice-audit's strict mode: PyTorch compute in `forward` is an error too.
    pub strict: bool,
}

impl Audit for StaticAudit {
    fn audit(
        &self,
        problem: &EvalProblem,
        sample: &EvalSample,
        kernels: Option<&KernelProfile>,
        record: &mut SampleRecord,
    ) {
        let Some(code) = &sample.code else { return };
        // Non-UTF-8 sources never get past loading; there is nothing to audit.
        let (Ok(code), Ok(reference)) = (
            std::str::from_utf8(code),
            std::str::from_utf8(&problem.source),
        ) else {
            return;
        };
        let audit = weighed_audit(code, reference, self.strict, kernels);
        for rule in audit.flags() {
            if !record.flags.iter().any(|f| f == rule) {
                record.flags.push(rule.to_string());
            }
        }
        record.deceptive |= audit.deceptive();
        // The log says which evidence decided: every static error, and the kernel findings
        // whether the profile outweighed them or not.
        let decisive = audit.findings.iter().filter(|f| {
            f.severity == Severity::Error
                || matches!(f.rule, Rule::KernelNotWired | Rule::KernelNotCalled)
        });
        // (A finding that rejected the program before it ran is in the log already.)
        let lines: Vec<String> = decisive
            .filter(|f| !record.log_excerpt.contains(&f.message))
            .map(|f| format!("\n[dice-audit] {}: {}", f.rule.id(), f.message))
            .collect();
        record.log_excerpt.extend(lines);
    }
}

/// Under `--strict`, the finding for which the program `code` is rejected before it is built or
/// run: a static error that no run can outweigh makes it deceptive, hence not correct, whatever
/// it does.
pub(crate) fn rejected_before_running(problem: &EvalProblem, code: &[u8]) -> Option<Finding> {
    let (Ok(code), Ok(reference)) = (
        std::str::from_utf8(code),
        std::str::from_utf8(&problem.source),
    ) else {
        return None;
    };
    let audit = dice_audit::audit(code, reference, &dice_audit::AuditOptions { strict: true });
    let finding = audit.decided_without_running()?;
    Some(Finding::error(finding.rule, finding.message.clone()))
}

/// The static audit of `code`, with its "not wired / not called" errors weighed against the
/// share of forward's GPU time the profiled run saw in the program's own kernels.
fn weighed_audit(
    code: &str,
    reference: &str,
    strict: bool,
    kernels: Option<&KernelProfile>,
) -> dice_audit::Audit {
    let mut audit = dice_audit::audit(code, reference, &dice_audit::AuditOptions { strict });
    if let Some(share) = kernels.and_then(|k| k.custom_share) {
        audit.weigh_kernel_profile(share);
    }
    audit
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::check_kernels;
    use serde_json::json;

    const PROBLEM: &str = "import torch\nimport torch.nn as nn\n\nclass Model(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n\ndef get_inputs():\n    return [torch.rand(16, 16)]\n\ndef get_init_inputs():\n    return []\n";

    /// Wires its kernel through a name computed at run time, which the static call graph
    /// cannot follow: statically `kernel_not_wired`.
    const COMPUTED_WIRING: &str = r#"
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = """
#include <torch/extension.h>
__global__ void relu_kernel(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
torch::Tensor relu_cuda(torch::Tensor x) {
    auto y = torch::empty_like(x);
    relu_kernel<<<(x.numel() + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
    return y;
}
"""
ops = load_inline(name="relu_ops", cpp_sources="torch::Tensor relu_cuda(torch::Tensor x);",
                  cuda_sources=source, functions=["relu_cuda"])

class ModelNew(nn.Module):
    def __init__(self, op="relu"):
        super().__init__()
        self.op = op + "_cuda"

    def forward(self, x):
        return getattr(globals()["o" + "ps"], self.op)(x)
"#;

    fn profile(own_us: f64, library_us: f64) -> KernelProfile {
        let event = json!({"default_stream": 7, "kernels": [
            {"name": "relu_kernel(float const*, float*, int)", "stream": 7, "us": own_us, "calls": 1},
            {"name": "at::native::vectorized_elementwise_kernel", "stream": 7, "us": library_us, "calls": 1},
        ]});
        let names = dice_audit::custom_kernel_names(COMPUTED_WIRING);
        check_kernels(&event, &names, false).0
    }

    #[test]
    fn a_large_own_share_at_run_time_outweighs_a_static_kernel_not_wired() {
        let alone = weighed_audit(COMPUTED_WIRING, PROBLEM, false, None);
        assert!(alone.deceptive(), "{:?}", alone.findings);
        assert_eq!(alone.flags(), ["kernel_not_wired"]);

        let ran = weighed_audit(COMPUTED_WIRING, PROBLEM, false, Some(&profile(98.0, 2.0)));
        assert!(!ran.deceptive(), "{:?}", ran.findings);
        assert_eq!(ran.flags(), ["kernel_not_wired"]);
        let message = &ran.findings[0].message;
        assert!(
            message.contains("static: extension `relu_ops` is compiled but never used")
                && message.contains("run time: the program's own kernels took 98 %")
                && message.contains("not deceptive"),
            "{message}"
        );

        let library_did_it =
            weighed_audit(COMPUTED_WIRING, PROBLEM, false, Some(&profile(10.0, 90.0)));
        assert!(library_did_it.deceptive(), "{:?}", library_did_it.findings);
    }
}
