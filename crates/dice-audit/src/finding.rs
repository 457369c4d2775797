//! What an audit reports: rules, severities, findings.

use serde::Serialize;

/// A detection rule. The snake_case id (`Rule::id`) is stable and is what `flags()` lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    NoCustomKernel,
    ExampleKernelCopied,
    KernelNotWired,
    KernelNotCalled,
    ExceptionFallback,
    ReferenceInheritance,
    ReferenceModelUse,
    ProblemConstantRedefined,
    Monkeypatch,
    Threads,
    Multiprocessing,
    Subprocess,
    Socket,
    FileWriteOutsideWorkdir,
    TensorSubclass,
    TorchFunctionOverride,
    StreamOrGraphCreation,
    DynamicCode,
    UnresolvedSource,
    TorchComputeInForward,
    PersistingL2Cache,
    // Run-time rules: reported by the evaluator (dice-eval) while running a candidate.
    InputMutation,
    TimingOutputMismatch,
    TimerInconsistent,
    CustomKernelNotLaunched,
    NonDefaultStream,
    LowCustomKernelShare,
    L2PersistingWindow,
}

impl Rule {
    pub const ALL: [Rule; 28] = [
        Rule::NoCustomKernel,
        Rule::ExampleKernelCopied,
        Rule::KernelNotWired,
        Rule::KernelNotCalled,
        Rule::ExceptionFallback,
        Rule::ReferenceInheritance,
        Rule::ReferenceModelUse,
        Rule::ProblemConstantRedefined,
        Rule::Monkeypatch,
        Rule::Threads,
        Rule::Multiprocessing,
        Rule::Subprocess,
        Rule::Socket,
        Rule::FileWriteOutsideWorkdir,
        Rule::TensorSubclass,
        Rule::TorchFunctionOverride,
        Rule::StreamOrGraphCreation,
        Rule::DynamicCode,
        Rule::UnresolvedSource,
        Rule::TorchComputeInForward,
        Rule::PersistingL2Cache,
        Rule::InputMutation,
        Rule::TimingOutputMismatch,
        Rule::TimerInconsistent,
        Rule::CustomKernelNotLaunched,
        Rule::NonDefaultStream,
        Rule::LowCustomKernelShare,
        Rule::L2PersistingWindow,
    ];

    pub fn id(self) -> &'static str {
        match self {
            Rule::NoCustomKernel => "no_custom_kernel",
            Rule::ExampleKernelCopied => "example_kernel_copied",
            Rule::KernelNotWired => "kernel_not_wired",
            Rule::KernelNotCalled => "kernel_not_called",
            Rule::ExceptionFallback => "exception_fallback",
            Rule::ReferenceInheritance => "reference_inheritance",
            Rule::ReferenceModelUse => "reference_model_use",
            Rule::ProblemConstantRedefined => "problem_constant_redefined",
            Rule::Monkeypatch => "monkeypatch",
            Rule::Threads => "threads",
            Rule::Multiprocessing => "multiprocessing",
            Rule::Subprocess => "subprocess",
            Rule::Socket => "socket",
            Rule::FileWriteOutsideWorkdir => "file_write_outside_workdir",
            Rule::TensorSubclass => "tensor_subclass",
            Rule::TorchFunctionOverride => "torch_function_override",
            Rule::StreamOrGraphCreation => "stream_or_graph_creation",
            Rule::DynamicCode => "dynamic_code",
            Rule::UnresolvedSource => "unresolved_source",
            Rule::TorchComputeInForward => "torch_compute_in_forward",
            Rule::PersistingL2Cache => "persisting_l2_cache",
            Rule::InputMutation => "input_mutation",
            Rule::TimingOutputMismatch => "timing_output_mismatch",
            Rule::TimerInconsistent => "timer_inconsistent",
            Rule::CustomKernelNotLaunched => "custom_kernel_not_launched",
            Rule::NonDefaultStream => "non_default_stream",
            Rule::LowCustomKernelShare => "low_custom_kernel_share",
            Rule::L2PersistingWindow => "l2_persisting_window",
        }
    }

    pub fn from_id(id: &str) -> Option<Rule> {
        Rule::ALL.into_iter().find(|rule| rule.id() == id)
    }

    /// Whether only running the candidate can show it (dice-eval reports these).
    pub fn is_runtime(self) -> bool {
        self >= Rule::InputMutation
    }
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.id())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Warning,
    Error,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub rule: Rule,
    pub severity: Severity,
    /// 1-based line in the candidate file.
    pub line: u32,
    /// 1-based byte column in the candidate file.
    pub column: u32,
    /// One line: what was found and where.
    pub message: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Audit {
    pub findings: Vec<Finding>,
}

impl Audit {
    /// True when any finding is an error.
    pub fn deceptive(&self) -> bool {
        self.findings.iter().any(|f| f.severity == Severity::Error)
    }

    /// The rule ids of all findings, sorted and without duplicates.
    pub fn flags(&self) -> Vec<&'static str> {
        let mut rules: Vec<Rule> = self.findings.iter().map(|f| f.rule).collect();
        rules.sort();
        rules.dedup();
        rules.into_iter().map(Rule::id).collect()
    }

    pub fn errors(&self) -> impl Iterator<Item = &Finding> {
        self.findings
            .iter()
            .filter(|f| f.severity == Severity::Error)
    }
}

/// Collects findings at byte offsets of the candidate and turns them into located findings.
pub(crate) struct Report<'a> {
    lines: &'a crate::syntax::LineIndex,
    pub(crate) findings: Vec<Finding>,
}

impl<'a> Report<'a> {
    pub(crate) fn new(lines: &'a crate::syntax::LineIndex) -> Self {
        Self {
            lines,
            findings: Vec::new(),
        }
    }

    pub(crate) fn add(&mut self, rule: Rule, severity: Severity, offset: usize, message: String) {
        let (line, column) = self.lines.position(offset);
        let finding = Finding {
            rule,
            severity,
            line,
            column,
            message: format!("line {line}: {message}"),
        };
        if !self.findings.contains(&finding) {
            self.findings.push(finding);
        }
    }

    pub(crate) fn error(&mut self, rule: Rule, offset: usize, message: String) {
        self.add(rule, Severity::Error, offset, message);
    }

    pub(crate) fn warning(&mut self, rule: Rule, offset: usize, message: String) {
        self.add(rule, Severity::Warning, offset, message);
    }
}
