//! Everything the rules share about one candidate/problem pair.

use tree_sitter::Node;

use crate::callgraph::{CallGraph, FnId, Reachable};
use crate::extension::Extension;
use crate::finding::{Report, Rule, Severity};
use crate::module::PyModule;
use crate::AuditOptions;

pub(crate) struct Context<'m, 't> {
    pub(crate) module: &'m PyModule<'t>,
    pub(crate) problem: Option<&'m PyModule<'m>>,
    pub(crate) extensions: &'m [Extension<'t>],
    pub(crate) graph: &'m CallGraph<'m, 't>,
    /// `ModelNew.forward`, when the candidate defines one (possibly inherited).
    pub(crate) forward: Option<(FnId, Node<'t>)>,
    /// Reachable from `ModelNew.forward`.
    pub(crate) forward_path: Reachable<'t>,
    pub(crate) options: &'m AuditOptions,
}

impl Context<'_, '_> {
    /// Severity of findings that are warnings unless `--strict`.
    pub(crate) fn strict_severity(&self) -> Severity {
        if self.options.strict {
            Severity::Error
        } else {
            Severity::Warning
        }
    }

    pub(crate) fn on_forward_path(&self, node: Node) -> bool {
        self.forward_path
            .functions
            .iter()
            .any(|(_, f)| f.byte_range().contains(&node.start_byte()))
    }

    pub(crate) fn report_strict(
        &self,
        report: &mut Report,
        rule: Rule,
        offset: usize,
        message: String,
    ) {
        report.add(rule, self.strict_severity(), offset, message);
    }
}
