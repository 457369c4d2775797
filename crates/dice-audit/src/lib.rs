//! Static detection of reward hacks ("deceptive" kernels) in KernelBench candidates.
//!
//! The candidate is parsed with tree-sitter-python; the C++/CUDA strings it hands to
//! `load_inline` are evaluated statically and parsed with tree-sitter-cpp. Rules then
//! look at real syntax, so comments, docstrings and string contents never trigger them.
//! See README.md for every rule and its limits.

mod callgraph;
mod context;
mod cuda;
mod evidence;
mod extension;
mod finding;
mod module;
mod rules;
mod strings;
mod syntax;
mod torch_ops;

pub use evidence::SUBSTANTIAL_OWN_SHARE;
pub use finding::{Audit, Finding, Rule, Severity};

use callgraph::CallGraph;
use context::Context;
use finding::Report;
use module::PyModule;
use syntax::{parse_python, LineIndex};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AuditOptions {
    /// Report PyTorch/library compute on forward's path as errors instead of warnings.
    pub strict: bool,
}

/// Audits `candidate` (a `ModelNew` program) against `problem` (the reference source,
/// used to know its `Model`, functions and module-level constants).
pub fn audit(candidate: &str, problem: &str, options: &AuditOptions) -> Audit {
    let lines = LineIndex::new(candidate);
    let mut report = Report::new(&lines);
    let Some(tree) = parse_python(candidate) else {
        report.error(
            Rule::NoCustomKernel,
            0,
            "the candidate could not be parsed as Python".to_string(),
        );
        return Audit {
            findings: report.findings,
        };
    };
    let problem_tree = parse_python(problem);
    let module = PyModule::new(tree.root_node(), candidate);
    let problem_module = problem_tree
        .as_ref()
        .map(|t| PyModule::new(t.root_node(), problem));
    let extensions = extension::find_extensions(&module);
    let graph = CallGraph::new(&module, &extensions);
    let forward = graph.method("ModelNew", "forward");
    let forward_path = graph.reachable(forward.iter().cloned().collect());
    let ctx = Context {
        module: &module,
        problem: problem_module.as_ref(),
        extensions: &extensions,
        graph: &graph,
        forward,
        forward_path,
        options,
    };
    if tree.root_node().has_error() {
        report.warning(
            Rule::UnresolvedSource,
            first_error(tree.root_node()),
            "the candidate has Python syntax errors; the audit may be incomplete".to_string(),
        );
    }
    for ext in &extensions {
        if !ext.sources_known {
            ctx.report_strict(
                &mut report,
                Rule::UnresolvedSource,
                ext.call.start_byte(),
                "extension sources are not statically known; their kernels cannot be checked"
                    .to_string(),
            );
        }
    }
    rules::kernel::check(&ctx, &mut report);
    rules::fallback::check(&ctx, &mut report);
    rules::reference::check(&ctx, &mut report);
    rules::hazards::check(&ctx, &mut report);
    let mut findings = report.findings;
    findings.sort_by_key(|f| (f.line, f.column, f.rule));
    Audit { findings }
}

/// Names of the `__global__` kernels defined in the candidate's C++/CUDA sources followed by
/// the functions its extensions export; the run-time check matches launched kernels to them.
pub fn custom_kernel_names(candidate: &str) -> Vec<String> {
    let Some(tree) = parse_python(candidate) else {
        return Vec::new();
    };
    let module = PyModule::new(tree.root_node(), candidate);
    let extensions = extension::find_extensions(&module);
    let mut names: Vec<String> = Vec::new();
    let kernels = extensions
        .iter()
        .flat_map(|e| e.cpp.kernels.iter().cloned());
    let exports = extensions.iter().flat_map(|e| e.exports.iter().cloned());
    for name in kernels.chain(exports) {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

fn first_error(root: tree_sitter::Node) -> usize {
    syntax::descendants(root)
        .into_iter()
        .find(|n| n.is_error() || n.is_missing())
        .map(|n| n.start_byte())
        .unwrap_or(0)
}
