//! Use of the reference: inheriting `Model`, calling it or the problem's functions, and
//! rebinding the problem's module-level names (sizes read by `get_inputs` at call time).
//!
//! Rebinding is only a warning: KernelBench's harness runs the candidate in the problem's
//! namespace, where a new `N` or `get_inputs` changes the inputs of both models, but dice's
//! judge loads the problem as a module of its own, in its own process, and draws every input
//! from it; the candidate's names never reach it.

use std::collections::HashMap;

use tree_sitter::Node;

use crate::callgraph::CallKind;
use crate::context::Context;
use crate::finding::{Report, Rule};
use crate::module::{assigned_names, PyModule};
use crate::syntax::{ancestor, descendants, named_children};

pub(crate) fn check(ctx: &Context, report: &mut Report) {
    inheritance(ctx, report);
    reference_names(ctx, report);
    if let Some(problem) = ctx.problem {
        constants(ctx.module, problem, report);
    }
    globals_writes(ctx.module, report);
}

fn inheritance(ctx: &Context, report: &mut Report) {
    let module = ctx.module;
    if let Some(info) = module.classes.get("ModelNew") {
        if !inherits_model(module, "ModelNew", 0) {
            return;
        }
        // Inheriting only to reuse `Model.__init__` (the same parameters, initialised the same
        // way) is honest when forward is the candidate's own and never reaches the reference.
        let runs_reference = ctx
            .forward
            .as_ref()
            .is_none_or(|(id, _)| id.class.as_deref() == Some("Model"))
            || ctx
                .forward_path
                .functions
                .iter()
                .any(|(id, _)| id.class.as_deref() == Some("Model"))
            || ctx
                .forward_path
                .calls
                .iter()
                .any(|c| matches!(c.kind, CallKind::Reference));
        if runs_reference {
            report.error(
                Rule::ReferenceInheritance,
                info.node.start_byte(),
                "`ModelNew` inherits from the reference `Model` and runs its forward".to_string(),
            );
        } else {
            report.warning(
                Rule::ReferenceInheritance,
                info.node.start_byte(),
                "`ModelNew` inherits from the reference `Model` for its construction; its forward is its own".to_string(),
            );
        }
    } else if let Some(&value) = module.bindings.get("ModelNew") {
        if module.text(value) == "Model" {
            report.error(
                Rule::ReferenceInheritance,
                value.start_byte(),
                "`ModelNew` is bound to the reference `Model`".to_string(),
            );
        }
    }
}

fn inherits_model(module: &PyModule, class: &str, depth: usize) -> bool {
    let Some(info) = module.classes.get(class) else {
        return false;
    };
    depth < 8
        && info
            .bases
            .iter()
            .any(|b| b == "Model" || (b != class && inherits_model(module, b, depth + 1)))
}

/// Names of classes and functions the problem defines and the candidate does not.
fn reference_names(ctx: &Context, report: &mut Report) {
    let module = ctx.module;
    let mut names: Vec<String> = vec![
        "Model".into(),
        "get_inputs".into(),
        "get_init_inputs".into(),
    ];
    if let Some(problem) = ctx.problem {
        names.extend(problem.classes.keys().cloned());
        names.extend(problem.functions.keys().cloned());
    }
    names.retain(|n| !module.is_module_name(n) && !module.is_imported(n));
    if names.is_empty() {
        return;
    }
    for node in descendants(module.root) {
        if node.kind() != "identifier" || !names.iter().any(|n| n == module.text(node)) {
            continue;
        }
        if !is_use(node)
            || ancestor(node, &["import_from_statement", "import_statement"]).is_some()
            || in_main_guard(module, node)
        {
            continue;
        }
        let in_bases = node.parent().is_some_and(|p| {
            p.kind() == "argument_list"
                && p.parent().is_some_and(|c| c.kind() == "class_definition")
        });
        if in_bases {
            continue;
        }
        report.error(
            Rule::ReferenceModelUse,
            node.start_byte(),
            format!("uses the reference problem's `{}`", module.text(node)),
        );
    }
}

/// Inside `if __name__ == "__main__":`, which runs only when the file is a script: self-tests
/// there may call `get_inputs()` without it ever running under a judge.
fn in_main_guard(module: &PyModule, node: Node) -> bool {
    let mut current = node;
    while let Some(parent) = current.parent() {
        let guarded = parent.kind() == "if_statement"
            && parent.child_by_field_name("consequence") == Some(current)
            && parent.child_by_field_name("condition").is_some_and(|c| {
                let condition: String = module.text(c).split_whitespace().collect();
                let condition = condition.replace('\'', "\"");
                condition == "__name__==\"__main__\"" || condition == "\"__main__\"==__name__"
            });
        if guarded {
            return true;
        }
        current = parent;
    }
    false
}

/// Whether an identifier reads a variable (not a definition, attribute or keyword name).
fn is_use(node: Node) -> bool {
    let Some(parent) = node.parent() else {
        return false;
    };
    let is_field = |field: &str| parent.child_by_field_name(field) == Some(node);
    match parent.kind() {
        "attribute" => !is_field("attribute"),
        "keyword_argument" => !is_field("name"),
        "function_definition" | "class_definition" => false,
        "parameters" | "default_parameter" | "typed_parameter" => false,
        "assignment" => !is_field("left"),
        _ => true,
    }
}

/// Module-level values of the problem, evaluated where possible.
#[derive(Debug, Clone, PartialEq)]
enum Constant {
    Number(f64),
    Text(String),
    Sequence(Vec<Constant>),
    /// Not evaluable: compared by its tokens.
    Tokens(String),
}

fn constants(module: &PyModule, problem: &PyModule, report: &mut Report) {
    let problem_env = Env::new(problem);
    let candidate_env = Env::new(module);
    let mut defined: Vec<(String, Node, Option<Node>)> = Vec::new();
    for statement in named_children(module.root) {
        let statement = crate::module::unwrap_decorated(statement);
        match statement.kind() {
            "expression_statement" => defined.extend(
                assigned_names(statement, module.source)
                    .into_iter()
                    .map(|(name, value)| (name, statement, Some(value))),
            ),
            "function_definition" | "class_definition" => defined.extend(
                statement
                    .child_by_field_name("name")
                    .map(|n| (module.text(n).to_string(), statement, None)),
            ),
            _ => {}
        }
    }
    // Only the last binding of a name is what the shared namespace ends up holding, and it
    // is compared with the problem's last binding.
    let last: HashMap<&str, usize> = defined
        .iter()
        .enumerate()
        .map(|(i, (name, _, _))| (name.as_str(), i))
        .collect();
    for (index, (name, at, value)) in defined.iter().enumerate() {
        if last.get(name.as_str()) != Some(&index) {
            continue;
        }
        let Some(original) = problem_definition(problem, name) else {
            continue;
        };
        let same = match value {
            Some(value) => problem
                .bindings
                .get(name)
                .is_some_and(|o| problem_env.eval(*o, 0) == candidate_env.eval(*value, 0)),
            None => tokens(original, problem.source) == tokens(*at, module.source),
        };
        let message = if same {
            format!("redefines the problem's `{name}` (same value)")
        } else {
            format!(
                "redefines the problem's `{name}` with a different value or body; {HARNESS_NOTE}"
            )
        };
        report.warning(Rule::ProblemConstantRedefined, at.start_byte(), message);
    }
    global_rebinds(module, problem, report);
}

/// Why a rebinding of the problem's names is a warning (see the module documentation).
const HARNESS_NOTE: &str = "KernelBench's harness, which shares the problem's namespace with \
    the candidate, would be fooled; dice's judge, which draws inputs from the problem in its own \
    process, is not";

fn problem_definition<'p>(problem: &PyModule<'p>, name: &str) -> Option<Node<'p>> {
    if let Some(f) = problem.functions.get(name) {
        return Some(*f);
    }
    if let Some(c) = problem.classes.get(name) {
        return Some(c.node);
    }
    problem.bindings.get(name).copied()
}

/// `global N` inside a function followed by an assignment to `N`.
fn global_rebinds(module: &PyModule, problem: &PyModule, report: &mut Report) {
    for node in descendants(module.root) {
        if node.kind() != "global_statement" {
            continue;
        }
        let Some(function) = ancestor(node, &["function_definition"]) else {
            continue;
        };
        for name in named_children(node) {
            let name = module.text(name);
            if !problem.is_module_name(name) {
                continue;
            }
            let assigned = descendants(function).into_iter().any(|n| {
                matches!(n.kind(), "assignment" | "augmented_assignment")
                    && n.child_by_field_name("left").is_some_and(|l| {
                        descendants(l)
                            .iter()
                            .any(|i| i.kind() == "identifier" && module.text(*i) == name)
                    })
            });
            if assigned {
                report.warning(
                    Rule::ProblemConstantRedefined,
                    node.start_byte(),
                    format!(
                        "rebinds the problem's `{name}` at run time through `global`; {HARNESS_NOTE}"
                    ),
                );
            }
        }
    }
}

/// `globals()[...] = ...`, `globals().update(...)`, `setattr(sys.modules[...], ...)`-style
/// writes into the shared namespace.
fn globals_writes(module: &PyModule, report: &mut Report) {
    for node in descendants(module.root) {
        let target = match node.kind() {
            "assignment" | "augmented_assignment" => node
                .child_by_field_name("left")
                .filter(|l| l.kind() == "subscript")
                .and_then(|l| l.child_by_field_name("value")),
            "call" => node
                .child_by_field_name("function")
                .filter(|f| f.kind() == "attribute")
                .filter(|f| {
                    f.child_by_field_name("attribute").is_some_and(|a| {
                        matches!(module.text(a), "update" | "__setitem__" | "setdefault")
                    })
                })
                .and_then(|f| f.child_by_field_name("object")),
            _ => None,
        };
        let Some(target) = target else {
            continue;
        };
        let writes_namespace = target.kind() == "call"
            && target
                .child_by_field_name("function")
                .is_some_and(|f| matches!(module.text(f), "globals" | "vars"));
        if writes_namespace {
            report.warning(
                Rule::ProblemConstantRedefined,
                node.start_byte(),
                format!("writes into its module namespace through `globals()`; {HARNESS_NOTE}"),
            );
        }
    }
}

/// Constant evaluation over a module's own bindings.
struct Env<'m, 't> {
    module: &'m PyModule<'t>,
}

impl<'m, 't> Env<'m, 't> {
    fn new(module: &'m PyModule<'t>) -> Self {
        Env { module }
    }

    fn eval(&self, node: Node, depth: usize) -> Constant {
        let tokens_of = || Constant::Tokens(tokens(node, self.module.source));
        if depth > 16 {
            return tokens_of();
        }
        let text = self.module.text(node);
        match node.kind() {
            "integer" => parse_int(text)
                .map(Constant::Number)
                .unwrap_or_else(tokens_of),
            "float" => text
                .replace('_', "")
                .parse()
                .map(Constant::Number)
                .unwrap_or_else(|_| tokens_of()),
            "true" => Constant::Number(1.0),
            "false" => Constant::Number(0.0),
            "string" => crate::strings::literal(node, self.module.source)
                .map(Constant::Text)
                .unwrap_or_else(tokens_of),
            "parenthesized_expression" => node
                .named_child(0)
                .map(|n| self.eval(n, depth + 1))
                .unwrap_or_else(tokens_of),
            "tuple" | "list" | "expression_list" => Constant::Sequence(
                named_children(node)
                    .into_iter()
                    .map(|n| self.eval(n, depth + 1))
                    .collect(),
            ),
            "identifier" => match self.module.bindings.get(text) {
                Some(&value) if value != node => self.eval(value, depth + 1),
                _ => tokens_of(),
            },
            "unary_operator" => match (
                node.child_by_field_name("operator"),
                node.child_by_field_name("argument"),
            ) {
                (Some(op), Some(arg)) => match (self.module.text(op), self.eval(arg, depth + 1)) {
                    ("-", Constant::Number(v)) => Constant::Number(-v),
                    ("+", Constant::Number(v)) => Constant::Number(v),
                    _ => tokens_of(),
                },
                _ => tokens_of(),
            },
            "binary_operator" => {
                let parts = (
                    node.child_by_field_name("left"),
                    node.child_by_field_name("operator"),
                    node.child_by_field_name("right"),
                );
                let (Some(left), Some(op), Some(right)) = parts else {
                    return tokens_of();
                };
                match (self.eval(left, depth + 1), self.eval(right, depth + 1)) {
                    (Constant::Number(a), Constant::Number(b)) => {
                        arithmetic(self.module.text(op), a, b)
                            .map(Constant::Number)
                            .unwrap_or_else(tokens_of)
                    }
                    _ => tokens_of(),
                }
            }
            _ => tokens_of(),
        }
    }
}

fn arithmetic(op: &str, a: f64, b: f64) -> Option<f64> {
    Some(match op {
        "+" => a + b,
        "-" => a - b,
        "*" => a * b,
        "/" if b != 0.0 => a / b,
        "//" if b != 0.0 => (a / b).floor(),
        "%" if b != 0.0 => a.rem_euclid(b),
        "**" => a.powf(b),
        "<<" => a * 2f64.powf(b),
        ">>" => (a / 2f64.powf(b)).floor(),
        _ => return None,
    })
}

fn parse_int(text: &str) -> Option<f64> {
    let t = text.replace('_', "").to_ascii_lowercase();
    let value = if let Some(h) = t.strip_prefix("0x") {
        i128::from_str_radix(h, 16).ok()?
    } else if let Some(b) = t.strip_prefix("0b") {
        i128::from_str_radix(b, 2).ok()?
    } else if let Some(o) = t.strip_prefix("0o") {
        i128::from_str_radix(o, 8).ok()?
    } else {
        t.parse().ok()?
    };
    Some(value as f64)
}

/// The node's tokens without comments and whitespace, for comparing definitions.
fn tokens(node: Node, source: &str) -> String {
    descendants(node)
        .into_iter()
        .filter(|n| n.child_count() == 0 && n.kind() != "comment")
        .map(|n| crate::syntax::text(n, source))
        .collect::<Vec<_>>()
        .join(" ")
}
