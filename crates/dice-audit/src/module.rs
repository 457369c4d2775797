//! The shape of a Python module: imports (as an alias table), module-level bindings,
//! functions and classes, and resolution of dotted names through the aliases; and the values
//! of plain string literals, which that resolution needs (`__import__("os")`) and on which the
//! string evaluation of strings.rs builds.

use std::collections::HashMap;

use tree_sitter::Node;

use crate::syntax::{descendants, named_children, text};

pub(crate) struct ClassInfo<'t> {
    pub(crate) node: Node<'t>,
    /// Base classes as written, resolved through the import aliases.
    pub(crate) bases: Vec<String>,
    pub(crate) methods: HashMap<String, Node<'t>>,
}

pub(crate) struct PyModule<'t> {
    pub(crate) source: &'t str,
    pub(crate) root: Node<'t>,
    /// Local name → fully qualified dotted name (`F` → `torch.nn.functional`).
    aliases: HashMap<String, String>,
    /// Module-level `name = value` bindings (the last one wins), value nodes.
    pub(crate) bindings: HashMap<String, Node<'t>>,
    pub(crate) functions: HashMap<String, Node<'t>>,
    pub(crate) classes: HashMap<String, ClassInfo<'t>>,
}

impl<'t> PyModule<'t> {
    pub(crate) fn new(root: Node<'t>, source: &'t str) -> Self {
        let mut module = PyModule {
            source,
            root,
            aliases: HashMap::new(),
            bindings: HashMap::new(),
            functions: HashMap::new(),
            classes: HashMap::new(),
        };
        module.collect_imports();
        module.collect_top_level();
        module
    }

    pub(crate) fn text(&self, node: Node) -> &'t str {
        text(node, self.source)
    }

    fn collect_imports(&mut self) {
        for node in descendants(self.root) {
            match node.kind() {
                "import_statement" => {
                    for item in named_children(node) {
                        if item.kind() == "aliased_import" {
                            let (Some(name), Some(alias)) = (
                                item.child_by_field_name("name"),
                                item.child_by_field_name("alias"),
                            ) else {
                                continue;
                            };
                            self.aliases
                                .insert(self.text(alias).to_string(), self.text(name).to_string());
                        } else {
                            let full = self.text(item);
                            let head = full.split('.').next().unwrap_or(full);
                            self.aliases.insert(head.to_string(), head.to_string());
                        }
                    }
                }
                "import_from_statement" => {
                    let Some(module) = node.child_by_field_name("module_name") else {
                        continue;
                    };
                    let module = self.text(module).to_string();
                    let mut cursor = node.walk();
                    for item in node.children_by_field_name("name", &mut cursor) {
                        let (name, alias) = if item.kind() == "aliased_import" {
                            (
                                item.child_by_field_name("name"),
                                item.child_by_field_name("alias"),
                            )
                        } else {
                            (Some(item), Some(item))
                        };
                        if let (Some(name), Some(alias)) = (name, alias) {
                            self.aliases.insert(
                                self.text(alias).to_string(),
                                format!("{module}.{}", self.text(name)),
                            );
                        }
                    }
                }
                _ => {}
            }
        }
    }

    fn collect_top_level(&mut self) {
        for statement in named_children(self.root) {
            let statement = unwrap_decorated(statement);
            match statement.kind() {
                "function_definition" => {
                    if let Some(name) = statement.child_by_field_name("name") {
                        self.functions
                            .insert(self.text(name).to_string(), statement);
                    }
                }
                "class_definition" => {
                    if let Some(name) = statement.child_by_field_name("name") {
                        let info = self.class_info(statement);
                        self.classes.insert(self.text(name).to_string(), info);
                    }
                }
                "expression_statement" => {
                    for (name, value) in assigned_names(statement, self.source) {
                        if let Some(resolved) = self.alias_target(value) {
                            self.aliases.insert(name.clone(), resolved);
                        }
                        self.bindings.insert(name, value);
                    }
                }
                _ => {}
            }
        }
    }

    /// `X = torch.Tensor` makes `X` an alias when the right side resolves into an import.
    fn alias_target(&self, value: Node) -> Option<String> {
        if !matches!(value.kind(), "identifier" | "attribute") {
            return None;
        }
        let root = leftmost_identifier(value)?;
        self.aliases.get(self.text(root))?;
        self.resolve(value)
    }

    fn class_info(&self, class: Node<'t>) -> ClassInfo<'t> {
        let bases = class
            .child_by_field_name("superclasses")
            .map(|list| {
                named_children(list)
                    .into_iter()
                    .filter(|b| b.kind() != "keyword_argument")
                    .map(|b| self.resolve(b).unwrap_or_else(|| self.text(b).to_string()))
                    .collect()
            })
            .unwrap_or_default();
        let mut methods = HashMap::new();
        if let Some(body) = class.child_by_field_name("body") {
            for item in named_children(body) {
                let item = unwrap_decorated(item);
                if item.kind() == "function_definition" {
                    if let Some(name) = item.child_by_field_name("name") {
                        methods.insert(self.text(name).to_string(), item);
                    }
                }
            }
        }
        ClassInfo {
            node: class,
            bases,
            methods,
        }
    }

    /// The dotted name an identifier/attribute chain stands for, with the first segment
    /// replaced through the import aliases (`F.relu` → `torch.nn.functional.relu`).
    /// `__import__("os").system` and `importlib.import_module("os").system` resolve too.
    pub(crate) fn resolve(&self, node: Node) -> Option<String> {
        match node.kind() {
            "identifier" => {
                let name = self.text(node);
                Some(
                    self.aliases
                        .get(name)
                        .cloned()
                        .unwrap_or_else(|| name.to_string()),
                )
            }
            "attribute" => {
                let object = self.resolve(node.child_by_field_name("object")?)?;
                let attribute = self.text(node.child_by_field_name("attribute")?);
                Some(format!("{object}.{attribute}"))
            }
            "call" => {
                let callee = self.resolve(node.child_by_field_name("function")?)?;
                if callee != "__import__" && callee != "importlib.import_module" {
                    return None;
                }
                let argument = named_children(node.child_by_field_name("arguments")?)
                    .into_iter()
                    .next()?;
                literal(argument, self.source)
            }
            "parenthesized_expression" => self.resolve(node.named_child(0)?),
            _ => None,
        }
    }

    /// Whether `name` was bound by an import (or aliases an imported object).
    pub(crate) fn is_imported(&self, name: &str) -> bool {
        self.aliases.contains_key(name)
    }

    pub(crate) fn is_module_name(&self, name: &str) -> bool {
        self.bindings.contains_key(name)
            || self.functions.contains_key(name)
            || self.classes.contains_key(name)
    }
}

pub(crate) fn unwrap_decorated(node: Node) -> Node {
    if node.kind() == "decorated_definition" {
        node.child_by_field_name("definition").unwrap_or(node)
    } else {
        node
    }
}

pub(crate) fn leftmost_identifier(node: Node) -> Option<Node> {
    match node.kind() {
        "identifier" => Some(node),
        "attribute" => leftmost_identifier(node.child_by_field_name("object")?),
        "subscript" => leftmost_identifier(node.child_by_field_name("value")?),
        "call" => leftmost_identifier(node.child_by_field_name("function")?),
        _ => None,
    }
}

/// `(name, value)` pairs bound by an assignment statement, pairing tuple targets with
/// tuple values element by element (`h, w = 32, 64`); a target that cannot be paired
/// gets the whole right side.
pub(crate) fn assigned_names<'t>(statement: Node<'t>, source: &str) -> Vec<(String, Node<'t>)> {
    let Some(assignment) = statement.named_child(0) else {
        return Vec::new();
    };
    if assignment.kind() != "assignment" {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut current = assignment;
    // Chained `a = b = 1` nests assignments in the right side.
    while let (Some(left), Some(right)) = (
        current.child_by_field_name("left"),
        current.child_by_field_name("right"),
    ) {
        let value = if right.kind() == "assignment" {
            innermost_value(right)
        } else {
            right
        };
        pair_targets(left, value, source, &mut out);
        if right.kind() != "assignment" {
            break;
        }
        current = right;
    }
    out
}

fn innermost_value(mut node: Node) -> Node {
    while node.kind() == "assignment" {
        match node.child_by_field_name("right") {
            Some(right) => node = right,
            None => break,
        }
    }
    node
}

fn pair_targets<'t>(
    target: Node<'t>,
    value: Node<'t>,
    source: &str,
    out: &mut Vec<(String, Node<'t>)>,
) {
    match target.kind() {
        "identifier" => out.push((text(target, source).to_string(), value)),
        "pattern_list" | "tuple_pattern" | "list_pattern" | "tuple" | "list" => {
            let targets = named_children(target);
            let values = match value.kind() {
                "expression_list" | "tuple" | "list" => named_children(value),
                _ => Vec::new(),
            };
            for (i, t) in targets.into_iter().enumerate() {
                pair_targets(t, values.get(i).copied().unwrap_or(value), source, out);
            }
        }
        _ => {}
    }
}

/// A plain (non-f) string literal's value.
pub(crate) fn literal(node: Node, source: &str) -> Option<String> {
    if node.kind() != "string" {
        return None;
    }
    let prefix = string_prefix(node, source);
    if prefix.contains('f') {
        return None;
    }
    let mut value = String::new();
    for child in named_children(node) {
        if child.kind() == "string_content" {
            value.push_str(&decode(text(child, source), prefix.contains('r'), false));
        }
    }
    Some(value)
}

pub(crate) fn string_prefix(node: Node, source: &str) -> String {
    node.child(0)
        .filter(|c| c.kind() == "string_start")
        .map(|c| {
            text(c, source)
                .trim_end_matches(['"', '\''])
                .to_ascii_lowercase()
        })
        .unwrap_or_default()
}

/// Decodes Python escapes (enough for C++ source text) and f-string brace escapes.
pub(crate) fn decode(content: &str, raw: bool, formatted: bool) -> String {
    let content = if formatted {
        content.replace("{{", "{").replace("}}", "}")
    } else {
        content.to_string()
    };
    if raw {
        return content;
    }
    let mut out = String::with_capacity(content.len());
    let mut chars = content.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some('0') => out.push('\0'),
            Some('\n') => {}
            Some(other @ ('\\' | '\'' | '"')) => out.push(other),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}
