//! dice-audit's static rules as the evaluator's [`Audit`]: every sample's program is checked
//! against its problem's reference before it is stored.

use crate::config::{Audit, EvalProblem, EvalSample};
use dice_store::SampleRecord;

/// The rule ids of dice-audit's findings become the sample's flags, and an error-severity
/// finding makes it deceptive.
pub struct StaticAudit {
    /// dice-audit's strict mode: PyTorch compute in `forward` is an error too.
    pub strict: bool,
}

impl Audit for StaticAudit {
    fn audit(&self, problem: &EvalProblem, sample: &EvalSample, record: &mut SampleRecord) {
        let Some(code) = &sample.code else { return };
        // Non-UTF-8 sources never get past loading; there is nothing to audit.
        let (Ok(code), Ok(reference)) = (
            std::str::from_utf8(code),
            std::str::from_utf8(&problem.source),
        ) else {
            return;
        };
        let options = dice_audit::AuditOptions {
            strict: self.strict,
        };
        let audit = dice_audit::audit(code, reference, &options);
        for rule in audit.flags() {
            if !record.flags.iter().any(|f| f == rule) {
                record.flags.push(rule.to_string());
            }
        }
        record.deceptive |= audit.deceptive();
    }
}
