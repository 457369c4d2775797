//! The Python call graph from `ModelNew.forward`: helper methods, module-level wrappers,
//! submodules, `autograd.Function.apply`, `functools.partial`, and calls into extension
//! functions and PyTorch.

use std::collections::{HashMap, HashSet};

use tree_sitter::Node;

use crate::extension::{Binding, Extension};
use crate::module::{assigned_names, PyModule};
use crate::syntax::{assignments, descendants, named_children};
use crate::torch_ops;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct FnId {
    pub(crate) class: Option<String>,
    pub(crate) name: String,
}

/// What a name or expression holds, as far as the analysis can tell.
#[derive(Debug, Clone)]
enum Value {
    Extension(usize),
    ExtensionFunction(usize, String),
    Instance(String),
    Layer(String),
    Composite(Vec<Value>),
}

/// A call site on forward's path.
pub(crate) struct Call<'t> {
    pub(crate) node: Node<'t>,
    pub(crate) kind: CallKind,
}

pub(crate) enum CallKind {
    Extension {
        ext: usize,
        function: String,
    },
    TorchCompute(String),
    /// A forward inherited from (or delegated to) the reference `Model`.
    Reference,
}

pub(crate) struct CallGraph<'m, 't> {
    module: &'m PyModule<'t>,
    globals: HashMap<String, Value>,
    attributes: HashMap<(String, String), Value>,
}

/// Everything reachable from an entry point.
#[derive(Default)]
pub(crate) struct Reachable<'t> {
    pub(crate) functions: Vec<(FnId, Node<'t>)>,
    pub(crate) calls: Vec<Call<'t>>,
}

impl<'m, 't> CallGraph<'m, 't> {
    pub(crate) fn new(module: &'m PyModule<'t>, extensions: &[Extension<'t>]) -> Self {
        let mut graph = CallGraph {
            module,
            globals: HashMap::new(),
            attributes: HashMap::new(),
        };
        for (index, ext) in extensions.iter().enumerate() {
            for binding in &ext.bindings {
                match binding {
                    Binding::Global(name) => {
                        graph.globals.insert(name.clone(), Value::Extension(index));
                    }
                    Binding::Attribute { class, attr } => {
                        graph
                            .attributes
                            .insert((class.clone(), attr.clone()), Value::Extension(index));
                    }
                }
            }
        }
        // Two passes so that `f = ext.f` after `ext = load_inline(...)` and attributes that
        // refer to globals both resolve regardless of order.
        for _ in 0..2 {
            graph.bind_globals();
            graph.bind_attributes();
        }
        graph
    }

    fn bind_globals(&mut self) {
        let mut names: Vec<_> = self.module.bindings.iter().collect();
        names.sort_by_key(|(_, v)| v.start_byte());
        for (name, &value) in names {
            if matches!(self.globals.get(name), Some(Value::Extension(_))) {
                continue;
            }
            if let Some(v) = self.value_of(value, None) {
                self.globals.insert(name.clone(), v);
            }
        }
    }

    /// Class-body assignments (`ext = my_ext`) and `self.<attr> = ...` in methods.
    fn bind_attributes(&mut self) {
        let mut found = Vec::new();
        for (class_name, class) in &self.module.classes {
            if let Some(body) = class.node.child_by_field_name("body") {
                for statement in named_children(body) {
                    if statement.kind() == "expression_statement" {
                        for (name, value) in assigned_names(statement, self.module.source) {
                            found.push((class_name.clone(), name, value));
                        }
                    }
                }
            }
            for method in class.methods.values() {
                for (left, right) in assignments(*method) {
                    if let Some(attr) = self_attribute(self.module, left) {
                        found.push((class_name.clone(), attr.to_string(), right));
                    }
                }
            }
        }
        for (class, attr, value) in found {
            let key = (class, attr);
            if matches!(self.attributes.get(&key), Some(Value::Extension(_))) {
                continue;
            }
            if let Some(v) = self.value_of(value, Some(&key.0)) {
                self.attributes.insert(key, v);
            }
        }
    }

    fn value_of(&self, node: Node, class: Option<&str>) -> Option<Value> {
        match node.kind() {
            "identifier" => self.globals.get(self.module.text(node)).cloned(),
            "attribute" => {
                if let Some(attr) = self_attribute(self.module, node) {
                    return self.attribute_value(class?, attr);
                }
                let object = node.child_by_field_name("object")?;
                let name = self.module.text(node.child_by_field_name("attribute")?);
                match self.value_of(object, class)? {
                    Value::Extension(i) => Some(Value::ExtensionFunction(i, name.to_string())),
                    _ => None,
                }
            }
            "call" => {
                let function = node.child_by_field_name("function")?;
                let dotted = self.module.resolve(function)?;
                if dotted == "functools.partial" {
                    // Calling the partial calls its first argument.
                    let target = named_children(node.child_by_field_name("arguments")?)
                        .into_iter()
                        .next()?;
                    return self.value_of(target, class);
                }
                if dotted == "torch.nn.Sequential" {
                    let parts = named_children(node.child_by_field_name("arguments")?)
                        .into_iter()
                        .filter_map(|a| self.value_of(a, class))
                        .collect();
                    return Some(Value::Composite(parts));
                }
                if torch_ops::is_nn_layer(&dotted) {
                    return Some(Value::Layer(dotted));
                }
                self.module
                    .classes
                    .contains_key(&dotted)
                    .then_some(Value::Instance(dotted))
            }
            _ => None,
        }
    }

    fn attribute_value(&self, class: &str, attr: &str) -> Option<Value> {
        if let Some(v) = self.attributes.get(&(class.to_string(), attr.to_string())) {
            return Some(v.clone());
        }
        let info = self.module.classes.get(class)?;
        info.bases
            .iter()
            .filter(|b| b.as_str() != class)
            .find_map(|b| self.attribute_value(b, attr))
    }

    /// A method of `class` or of its bases defined in the candidate.
    pub(crate) fn method(&self, class: &str, name: &str) -> Option<(FnId, Node<'t>)> {
        self.method_at(class, name, 0)
    }

    fn method_at(&self, class: &str, name: &str, depth: usize) -> Option<(FnId, Node<'t>)> {
        let info = self.module.classes.get(class)?;
        if let Some(&node) = info.methods.get(name) {
            let id = FnId {
                class: Some(class.to_string()),
                name: name.to_string(),
            };
            return Some((id, node));
        }
        if depth > 8 {
            return None;
        }
        info.bases
            .iter()
            .find_map(|b| self.method_at(b, name, depth + 1))
    }

    /// Functions and calls reachable from `entries`.
    pub(crate) fn reachable(&self, entries: Vec<(FnId, Node<'t>)>) -> Reachable<'t> {
        let mut out = Reachable::default();
        let mut seen = HashSet::new();
        let mut stack = entries;
        while let Some((id, node)) = stack.pop() {
            if !seen.insert(id.clone()) {
                continue;
            }
            out.functions.push((id.clone(), node));
            let locals = self.local_values(node, id.class.as_deref());
            for inner in descendants(node) {
                match inner.kind() {
                    "call" => self.visit_call(&id, &locals, inner, &mut stack, &mut out.calls),
                    "binary_operator" | "augmented_assignment" => {
                        let is_matmul = inner
                            .child_by_field_name("operator")
                            .is_some_and(|o| matches!(self.module.text(o), "@" | "@="));
                        if is_matmul {
                            out.calls.push(Call {
                                node: inner,
                                kind: CallKind::TorchCompute("@ (matmul operator)".to_string()),
                            });
                        }
                    }
                    _ => {}
                }
            }
        }
        out
    }

    /// `fn = self.ext.fn`-style local names inside one function.
    fn local_values(&self, function: Node, class: Option<&str>) -> HashMap<String, Value> {
        let mut locals = HashMap::new();
        for (left, right) in assignments(function) {
            if left.kind() == "identifier" {
                if let Some(value) = self.value_of(right, class) {
                    locals.insert(self.module.text(left).to_string(), value);
                }
            }
        }
        locals
    }

    fn visit_call(
        &self,
        caller: &FnId,
        locals: &HashMap<String, Value>,
        call: Node<'t>,
        stack: &mut Vec<(FnId, Node<'t>)>,
        calls: &mut Vec<Call<'t>>,
    ) {
        let Some(function) = call.child_by_field_name("function") else {
            return;
        };
        let class = caller.class.as_deref();
        let push_value = |value: Value, stack: &mut Vec<_>, calls: &mut Vec<Call<'t>>| {
            self.call_value(value, call, stack, calls);
        };
        match function.kind() {
            "identifier" => {
                let name = self.module.text(function);
                if let Some(value) = locals.get(name) {
                    push_value(value.clone(), stack, calls);
                } else if let Some(&node) = self.module.functions.get(name) {
                    stack.push((
                        FnId {
                            class: None,
                            name: name.to_string(),
                        },
                        node,
                    ));
                } else if self.module.classes.contains_key(name) {
                    stack.extend(self.method(name, "__new__"));
                    stack.extend(self.method(name, "__init__"));
                } else if let Some(value) = self.globals.get(name) {
                    push_value(value.clone(), stack, calls);
                } else if name == "Model" {
                    calls.push(Call {
                        node: call,
                        kind: CallKind::Reference,
                    });
                } else if let Some(dotted) = self.module.resolve(function) {
                    if torch_ops::is_torch_compute(&dotted) || torch_ops::is_nn_layer(&dotted) {
                        calls.push(Call {
                            node: call,
                            kind: CallKind::TorchCompute(dotted),
                        });
                    }
                }
            }
            "attribute" => self.visit_attribute_call(class, call, function, stack, calls),
            "call" => {
                if let Some(value) = self.value_of(function, class) {
                    push_value(value, stack, calls);
                }
            }
            _ => {}
        }
    }

    fn visit_attribute_call(
        &self,
        class: Option<&str>,
        call: Node<'t>,
        function: Node<'t>,
        stack: &mut Vec<(FnId, Node<'t>)>,
        calls: &mut Vec<Call<'t>>,
    ) {
        let (Some(object), Some(attr)) = (
            function.child_by_field_name("object"),
            function.child_by_field_name("attribute"),
        ) else {
            return;
        };
        let attr = self.module.text(attr);
        if let Some(value) = self.value_of(function, class) {
            self.call_value(value, call, stack, calls);
            return;
        }
        let object_text = self.module.text(object);
        if object_text == "self" {
            if let Some(found) = class.and_then(|c| self.method(c, attr)) {
                stack.push(found);
                return;
            }
        }
        if object.kind() == "call" && object_text.starts_with("super(") {
            let bases = class
                .and_then(|c| self.module.classes.get(c))
                .map(|info| info.bases.clone())
                .unwrap_or_default();
            for base in bases {
                if let Some(found) = self.method(&base, attr) {
                    stack.push(found);
                } else if base == "Model" && attr == "forward" {
                    calls.push(Call {
                        node: call,
                        kind: CallKind::Reference,
                    });
                }
            }
            return;
        }
        if self.module.classes.contains_key(object_text) {
            let target = if attr == "apply" { "forward" } else { attr };
            stack.extend(self.method(object_text, target));
            return;
        }
        if let Some(value) = self.value_of(object, class) {
            if let Value::Instance(instance_class) = value {
                stack.extend(self.method(&instance_class, attr));
            }
            return;
        }
        let dotted = self.module.resolve(function);
        let compute = match &dotted {
            Some(d) if d.starts_with("torch.") => torch_ops::is_torch_compute(d),
            _ => torch_ops::is_compute_method(attr),
        };
        if compute {
            calls.push(Call {
                node: call,
                kind: CallKind::TorchCompute(dotted.unwrap_or_else(|| format!(".{attr}()"))),
            });
        }
    }

    fn call_value(
        &self,
        value: Value,
        call: Node<'t>,
        stack: &mut Vec<(FnId, Node<'t>)>,
        calls: &mut Vec<Call<'t>>,
    ) {
        match value {
            Value::ExtensionFunction(ext, function) => calls.push(Call {
                node: call,
                kind: CallKind::Extension { ext, function },
            }),
            Value::Layer(dotted) => calls.push(Call {
                node: call,
                kind: CallKind::TorchCompute(dotted),
            }),
            Value::Instance(class) => {
                stack.extend(self.method(&class, "forward"));
                stack.extend(self.method(&class, "__call__"));
            }
            Value::Composite(parts) => {
                for part in parts {
                    self.call_value(part, call, stack, calls);
                }
            }
            Value::Extension(_) => {}
        }
    }

    /// Extensions that the code of `functions` mentions (by name, attribute or call).
    pub(crate) fn extensions_mentioned(&self, functions: &[(FnId, Node<'t>)]) -> HashSet<usize> {
        let mut out = HashSet::new();
        for (id, node) in functions {
            for inner in descendants(*node) {
                if !matches!(inner.kind(), "identifier" | "attribute") {
                    continue;
                }
                if let Some(Value::Extension(i) | Value::ExtensionFunction(i, _)) =
                    self.value_of(inner, id.class.as_deref())
                {
                    out.insert(i);
                }
            }
        }
        out
    }

    /// Whether `self.<attr> = load_inline(...)` happens inside `class`.
    pub(crate) fn class_binds_extension(&self, class: &str) -> HashSet<usize> {
        self.attributes
            .iter()
            .filter(|((c, _), _)| c == class)
            .filter_map(|(_, v)| match v {
                Value::Extension(i) | Value::ExtensionFunction(i, _) => Some(*i),
                _ => None,
            })
            .collect()
    }
}

fn self_attribute<'a>(module: &PyModule<'a>, node: Node) -> Option<&'a str> {
    if node.kind() != "attribute" {
        return None;
    }
    let object = node.child_by_field_name("object")?;
    if object.kind() != "identifier" || module.text(object) != "self" {
        return None;
    }
    Some(module.text(node.child_by_field_name("attribute")?))
}
