//! The adversarial suite under tests/adversarial (repository root): every hack with a static
//! expectation is caught by that rule as an error; run-time-only hacks are documented as
//! invisible to the static rules (they must raise no error here, or the manifest is stale).

use crate::common;
use anyhow::Context;
use dice_audit::{audit, AuditOptions, Rule, Severity};
use serde_json::Value;

fn manifest() -> anyhow::Result<Vec<Value>> {
    let path = common::adversarial_dir().join("manifest.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

fn audit_entry(entry: &Value) -> anyhow::Result<dice_audit::Audit> {
    let file = entry["file"].as_str().context("entry without file")?;
    let level = entry["level"].as_u64().context("entry without level")? as u32;
    let id = entry["problem_id"]
        .as_u64()
        .context("entry without problem_id")? as u32;
    let candidate = std::fs::read_to_string(common::adversarial_dir().join(file))?;
    let problem = common::problem_source(level, id)?;
    Ok(audit(&candidate, &problem, &AuditOptions::default()))
}

#[test]
fn manifest_is_complete() -> anyhow::Result<()> {
    let entries = manifest()?;
    assert!(
        entries.len() >= 25,
        "only {} adversarial programs",
        entries.len()
    );
    for entry in &entries {
        let file = entry["file"].as_str().context("entry without file")?;
        assert!(
            common::adversarial_dir().join(file).is_file(),
            "{file} is missing"
        );
        assert!(
            entry["hack"].as_str().is_some_and(|h| !h.is_empty()),
            "{file}: no hack"
        );
        assert!(
            matches!(entry["device"].as_str(), Some("cpu" | "cuda")),
            "{file}: bad device"
        );
        let level = entry["level"].as_u64().context("level")? as u32;
        let id = entry["problem_id"].as_u64().context("problem_id")? as u32;
        common::problem_source(level, id)?;
        let expect = &entry["expect"];
        let static_rule = expect["rule"].as_str().map(Rule::from_id);
        // Run-time expectations: a verdict other than `correct`, or (an output cache whose
        // kernel is slow) a speedup no better than the kernel's own.
        let runtime = expect["runtime"] == Value::Bool(true)
            && (expect["verdict_not"] == "correct" || expect["speedup_at_most"].is_f64());
        assert!(
            matches!(static_rule, Some(Some(r)) if !r.is_runtime()) || runtime,
            "{file}: expectation is neither a known static rule nor a run-time verdict or speed: {expect}"
        );
        if let Some(id) = expect["runtime_rule"].as_str() {
            assert!(
                Rule::from_id(id).is_some_and(Rule::is_runtime),
                "{file}: {id} is not a run-time rule"
            );
        }
    }
    Ok(())
}

#[test]
fn static_hacks_are_caught_by_their_rule() -> anyhow::Result<()> {
    let mut missed = Vec::new();
    for entry in manifest()? {
        let Some(rule) = entry["expect"]["rule"].as_str() else {
            continue;
        };
        let severity = match entry["expect"]["severity"].as_str() {
            Some("warning") => Severity::Warning,
            _ => Severity::Error,
        };
        let result = audit_entry(&entry)?;
        let caught = result
            .findings
            .iter()
            .any(|f| f.rule.id() == rule && f.severity == severity);
        assert!(result.deceptive() || severity == Severity::Warning);
        if !caught {
            missed.push(format!(
                "{}: expected {rule}, got {:?}",
                entry["file"], result.findings
            ));
        }
    }
    assert!(missed.is_empty(), "missed:\n{}", missed.join("\n"));
    Ok(())
}

#[test]
fn runtime_only_hacks_pass_the_static_rules() -> anyhow::Result<()> {
    for entry in manifest()? {
        if entry["expect"]["runtime"] != Value::Bool(true) {
            continue;
        }
        let result = audit_entry(&entry)?;
        let errors: Vec<_> = result.errors().collect();
        assert!(errors.is_empty(), "{}: {errors:?}", entry["file"]);
    }
    Ok(())
}
