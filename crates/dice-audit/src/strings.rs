//! Static evaluation of the Python string expressions handed to `load_inline`
//! (literals, module-level names, `+`, implicit concatenation, f-strings, `dedent`,
//! `"".join`), keeping track of where each piece came from in the candidate file.

use tree_sitter::Node;

/// The rules evaluate plain literals here, beside every other string expression.
pub(crate) use crate::module::literal;
use crate::module::{decode, string_prefix, PyModule};
use crate::syntax::{named_children, text};

/// A resolved string and a map from its byte offsets back to candidate offsets.
#[derive(Debug, Clone, Default)]
pub(crate) struct SourceText {
    pub(crate) text: String,
    /// `(offset in text, offset in candidate)`, sorted by text offset.
    pieces: Vec<(usize, usize)>,
    /// False when some part could not be evaluated statically.
    pub(crate) complete: bool,
}

impl SourceText {
    fn unresolved() -> Self {
        SourceText {
            complete: false,
            ..SourceText::default()
        }
    }

    fn push(&mut self, piece: &str, origin: usize) {
        self.pieces.push((self.text.len(), origin));
        self.text.push_str(piece);
    }

    fn append(&mut self, other: SourceText) {
        let base = self.text.len();
        self.pieces
            .extend(other.pieces.into_iter().map(|(t, c)| (t + base, c)));
        self.text.push_str(&other.text);
        self.complete &= other.complete;
    }

    /// The candidate offset of byte `offset` of the text (exact up to escape sequences).
    pub(crate) fn origin(&self, offset: usize) -> usize {
        let index = self.pieces.partition_point(|&(t, _)| t <= offset);
        match index.checked_sub(1).and_then(|i| self.pieces.get(i)) {
            Some(&(t, c)) => c + (offset - t),
            None => 0,
        }
    }
}

const MAX_DEPTH: usize = 16;

/// Resolves a string-valued expression.
pub(crate) fn resolve(module: &PyModule, node: Node) -> SourceText {
    resolve_at(module, node, 0)
}

/// Resolves a list/tuple of strings item by item; any other expression as one item.
pub(crate) fn resolve_items(module: &PyModule, node: Node) -> Vec<SourceText> {
    let node = follow_name(module, node, 0);
    match node.kind() {
        "list" | "tuple" => named_children(node)
            .into_iter()
            .flat_map(|item| resolve_items(module, item))
            .collect(),
        _ => vec![resolve(module, node)],
    }
}

/// Follows module-level names to the expression they are bound to.
pub(crate) fn follow_name<'t>(module: &PyModule<'t>, node: Node<'t>, depth: usize) -> Node<'t> {
    if node.kind() == "identifier" && depth < MAX_DEPTH {
        if let Some(&value) = module.bindings.get(module.text(node)) {
            if value != node {
                return follow_name(module, value, depth + 1);
            }
        }
    }
    node
}

fn resolve_at(module: &PyModule, node: Node, depth: usize) -> SourceText {
    if depth > MAX_DEPTH {
        return SourceText::unresolved();
    }
    let source = module.source;
    match node.kind() {
        "string" => resolve_string(module, node, depth),
        "concatenated_string" => concat(module, named_children(node), depth),
        "parenthesized_expression" => match node.named_child(0) {
            Some(inner) => resolve_at(module, inner, depth + 1),
            None => SourceText::unresolved(),
        },
        "binary_operator" => {
            let is_plus = node
                .child_by_field_name("operator")
                .is_some_and(|op| text(op, source) == "+");
            match (
                is_plus,
                node.child_by_field_name("left"),
                node.child_by_field_name("right"),
            ) {
                (true, Some(left), Some(right)) => concat(module, vec![left, right], depth),
                _ => SourceText::unresolved(),
            }
        }
        "identifier" => {
            let target = follow_name(module, node, 0);
            if target == node {
                SourceText::unresolved()
            } else {
                resolve_at(module, target, depth + 1)
            }
        }
        "call" => resolve_call(module, node, depth),
        _ => SourceText::unresolved(),
    }
}

fn concat(module: &PyModule, parts: Vec<Node>, depth: usize) -> SourceText {
    let mut out = SourceText {
        complete: true,
        ..SourceText::default()
    };
    for part in parts {
        out.append(resolve_at(module, part, depth + 1));
    }
    out
}

/// `dedent(s)`, `s.strip()`-like methods and `sep.join([...])`.
fn resolve_call(module: &PyModule, node: Node, depth: usize) -> SourceText {
    let (Some(function), Some(arguments)) = (
        node.child_by_field_name("function"),
        node.child_by_field_name("arguments"),
    ) else {
        return SourceText::unresolved();
    };
    let args = named_children(arguments);
    let callee = module.resolve(function).unwrap_or_default();
    if callee.ends_with("dedent") {
        return match args.first() {
            Some(&arg) => resolve_at(module, arg, depth + 1),
            None => SourceText::unresolved(),
        };
    }
    if function.kind() != "attribute" {
        return SourceText::unresolved();
    }
    let (Some(object), Some(method)) = (
        function.child_by_field_name("object"),
        function.child_by_field_name("attribute"),
    ) else {
        return SourceText::unresolved();
    };
    match module.text(method) {
        "strip" | "lstrip" | "rstrip" => resolve_at(module, object, depth + 1),
        "join" => {
            let separator = resolve_at(module, object, depth + 1);
            let Some(&list) = args.first() else {
                return SourceText::unresolved();
            };
            let mut out = SourceText {
                complete: separator.complete,
                ..SourceText::default()
            };
            for (i, item) in resolve_items(module, list).into_iter().enumerate() {
                if i > 0 {
                    out.append(separator.clone());
                }
                out.append(item);
            }
            out
        }
        _ => SourceText::unresolved(),
    }
}

fn resolve_string(module: &PyModule, node: Node, depth: usize) -> SourceText {
    let source = module.source;
    let prefix = string_prefix(node, source);
    let raw = prefix.contains('r');
    let formatted = prefix.contains('f');
    let mut out = SourceText {
        complete: true,
        ..SourceText::default()
    };
    for child in named_children(node) {
        match child.kind() {
            "string_content" => out.push(
                &decode(text(child, source), raw, formatted),
                child.start_byte(),
            ),
            "escape_interpolation" => {
                out.push(
                    text(child, source).get(..1).unwrap_or(""),
                    child.start_byte(),
                );
            }
            "interpolation" => {
                let value = child
                    .child_by_field_name("expression")
                    .and_then(|e| interpolated(module, e, depth));
                match value {
                    Some(value) => out.push(&value, child.start_byte()),
                    None => {
                        out.complete = false;
                        out.push("0", child.start_byte());
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// The text an f-string interpolation stands for, when it is a known string or number.
fn interpolated(module: &PyModule, expression: Node, depth: usize) -> Option<String> {
    let target = follow_name(module, expression, 0);
    if matches!(target.kind(), "integer" | "float") {
        return Some(module.text(target).to_string());
    }
    let resolved = resolve_at(module, expression, depth + 1);
    resolved.complete.then_some(resolved.text)
}
