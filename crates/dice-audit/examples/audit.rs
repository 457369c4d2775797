//! Prints the findings for one candidate: `cargo run -p dice-audit --example audit -- CANDIDATE.py PROBLEM.py [--strict]`.

use anyhow::Context;
use dice_audit::{audit, custom_kernel_names, AuditOptions};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let strict = args.iter().any(|a| a == "--strict");
    let files: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let [candidate, problem] = files[..] else {
        anyhow::bail!("usage: audit CANDIDATE.py PROBLEM.py [--strict]");
    };
    let candidate =
        std::fs::read_to_string(candidate).with_context(|| format!("reading {candidate}"))?;
    let problem = std::fs::read_to_string(problem).with_context(|| format!("reading {problem}"))?;
    let result = audit(&candidate, &problem, &AuditOptions { strict });
    for f in &result.findings {
        println!(
            "{:?} {} {}:{} {}",
            f.severity, f.rule, f.line, f.column, f.message
        );
    }
    println!(
        "deceptive={} flags={:?}",
        result.deceptive(),
        result.flags()
    );
    println!("kernels={:?}", custom_kernel_names(&candidate));
    Ok(())
}
