//! The Python call graph from `ModelNew.forward`: helper methods, module-level wrappers,
//! submodules (also kept in `nn.ModuleList`/`nn.ModuleDict`/`nn.Sequential`, lists and dicts,
//! added in loops with `.append`, `setattr` or `add_module`), `autograd.Function.apply`,
//! `functools.partial`, lambdas, and calls into extension functions and PyTorch.

use std::collections::{HashMap, HashSet};

use tree_sitter::Node;

use crate::extension::{Binding, Extension};
use crate::module::{assigned_names, PyModule};
use crate::syntax::{ancestor, assignments, descendants, named_children};
use crate::torch_ops;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct FnId {
    pub(crate) class: Option<String>,
    pub(crate) name: String,
}

/// What a name or expression holds, as far as the analysis can tell.
#[derive(Debug, Clone, PartialEq)]
enum Value<'t> {
    Extension(usize),
    ExtensionFunction(usize, String),
    Instance(String),
    Layer(String),
    /// A module-level function or a method (`Fn.apply` is its class's `forward`).
    Function(FnId),
    /// A lambda, with the class whose method defines it (for `self` in its body).
    Lambda(Option<String>, Node<'t>),
    /// Any of several values: the items of a container, or every binding of a name.
    Composite(Vec<Value<'t>>),
}

impl<'t> Value<'t> {
    /// `self` and `other` as one value; containers are flattened, duplicates dropped.
    fn merge(self, other: Value<'t>) -> Value<'t> {
        let mut parts = self.into_parts();
        for part in other.into_parts() {
            if !parts.contains(&part) {
                parts.push(part);
            }
        }
        if parts.len() == 1 {
            parts.pop().expect("one part")
        } else {
            Value::Composite(parts)
        }
    }

    fn into_parts(self) -> Vec<Value<'t>> {
        match self {
            Value::Composite(parts) => parts.into_iter().flat_map(Value::into_parts).collect(),
            other => vec![other],
        }
    }

    fn extensions(&self) -> Vec<usize> {
        match self {
            Value::Extension(i) | Value::ExtensionFunction(i, _) => vec![*i],
            Value::Composite(parts) => parts.iter().flat_map(Value::extensions).collect(),
            _ => Vec::new(),
        }
    }
}

/// The attribute key under which values stored with a computed name are kept
/// (`setattr(self, f"layer{i}", ...)`, `self.add_module(name, ...)`).
const DYNAMIC_ATTRIBUTE: &str = "*";

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
    globals: HashMap<String, Value<'t>>,
    /// `self.<attr>` of each class: the extension bindings, then every value stored there.
    extension_attributes: HashMap<(String, String), Value<'t>>,
    attributes: HashMap<(String, String), Value<'t>>,
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
            extension_attributes: HashMap::new(),
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
                            .extension_attributes
                            .insert((class.clone(), attr.clone()), Value::Extension(index));
                    }
                }
            }
        }
        graph.attributes = graph.extension_attributes.clone();
        // Several passes so that `f = ext.f` after `ext = load_inline(...)`, attributes that
        // refer to globals and containers of submodules that hold extensions all resolve
        // regardless of order.
        for _ in 0..3 {
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

    /// Class-body assignments (`ext = my_ext`) and what methods store on `self`:
    /// `self.<attr> = ...`, `self.<attr>[key] = ...`, `self.<attr>.append/extend/insert(...)`,
    /// `setattr(self, name, ...)`, `self.add_module(name, ...)`.
    fn bind_attributes(&mut self) {
        let mut found: Vec<(String, String, Value<'t>)> = Vec::new();
        for (class_name, class) in &self.module.classes {
            let mut store = |attr: &str, value: Option<Value<'t>>| {
                if let Some(value) = value {
                    found.push((class_name.clone(), attr.to_string(), value));
                }
            };
            if let Some(body) = class.node.child_by_field_name("body") {
                for statement in named_children(body) {
                    if statement.kind() == "expression_statement" {
                        for (name, value) in assigned_names(statement, self.module.source) {
                            store(&name, self.value_of(value, Some(class_name)));
                        }
                    }
                }
            }
            for method in class.methods.values() {
                for (left, right) in assignments(*method) {
                    let target = match left.kind() {
                        "subscript" => left.child_by_field_name("value"),
                        _ => Some(left),
                    };
                    if let Some(attr) = target.and_then(|t| self_attribute(self.module, t)) {
                        let value = self
                            .value_of(right, Some(class_name))
                            .or_else(|| self.constructor_argument(class_name, *method, right));
                        store(attr, value);
                    }
                }
                for call in descendants(*method)
                    .into_iter()
                    .filter(|n| n.kind() == "call")
                {
                    if let Some((attr, value)) = self.stored_by_call(call, class_name) {
                        store(&attr, Some(value));
                    }
                }
            }
        }
        let mut attributes = self.extension_attributes.clone();
        for (class, attr, value) in found {
            let key = (class, attr);
            if self.extension_attributes.contains_key(&key) {
                continue;
            }
            let merged = match attributes.remove(&key) {
                Some(old) => old.merge(value),
                None => value,
            };
            attributes.insert(key, merged);
        }
        self.attributes = attributes;
    }

    /// What `__init__` parameter `name` of `class` receives: the matching argument of every
    /// `Class(...)` call in the candidate (`Block(ops)`, `Block(ext=ops)`), and its default.
    fn constructor_argument(
        &self,
        class: &str,
        method: Node<'t>,
        name: Node<'t>,
    ) -> Option<Value<'t>> {
        let is_init = method
            .child_by_field_name("name")
            .is_some_and(|n| self.module.text(n) == "__init__");
        if !is_init || name.kind() != "identifier" {
            return None;
        }
        let name = self.module.text(name);
        let parameters = named_children(method.child_by_field_name("parameters")?);
        let (index, parameter) = parameters.iter().enumerate().skip(1).find(|(_, p)| {
            let identifier = p.child_by_field_name("name").unwrap_or(**p);
            self.module.text(identifier) == name
        })?;
        let mut values: Vec<Value<'t>> = Vec::new();
        values.extend(
            parameter
                .child_by_field_name("value")
                .and_then(|default| self.value_of(default, Some(class))),
        );
        for call in descendants(self.module.root) {
            let constructs = call.kind() == "call"
                && call
                    .child_by_field_name("function")
                    .is_some_and(|f| self.module.text(f) == class);
            let Some(arguments) = call.child_by_field_name("arguments").filter(|_| constructs)
            else {
                continue;
            };
            let arguments = named_children(arguments);
            let keyword = arguments.iter().find_map(|a| {
                (a.kind() == "keyword_argument"
                    && a.child_by_field_name("name")
                        .is_some_and(|n| self.module.text(n) == name))
                .then(|| a.child_by_field_name("value"))
                .flatten()
            });
            let positional = || {
                arguments
                    .iter()
                    .filter(|a| a.kind() != "keyword_argument")
                    .nth(index - 1)
                    .copied()
            };
            let caller = ancestor(call, &["class_definition"])
                .and_then(|c| c.child_by_field_name("name"))
                .map(|n| self.module.text(n));
            if let Some(argument) = keyword.or_else(positional) {
                values.extend(self.value_of(argument, caller));
            }
        }
        values.into_iter().reduce(Value::merge)
    }

    /// The attribute and value a call in a method of `class` stores on `self`.
    fn stored_by_call(&self, call: Node<'t>, class: &str) -> Option<(String, Value<'t>)> {
        let function = call.child_by_field_name("function")?;
        let args: Vec<Node> = named_children(call.child_by_field_name("arguments")?)
            .into_iter()
            .filter(|a| a.kind() != "keyword_argument")
            .collect();
        let named = |name: Node| {
            crate::strings::literal(name, self.module.source)
                .unwrap_or_else(|| DYNAMIC_ATTRIBUTE.to_string())
        };
        if function.kind() == "attribute" {
            let object = function.child_by_field_name("object")?;
            let method = self.module.text(function.child_by_field_name("attribute")?);
            if self.module.text(object) == "self"
                && matches!(method, "add_module" | "register_module")
            {
                return Some((
                    named(*args.first()?),
                    self.value_of(*args.get(1)?, Some(class))?,
                ));
            }
            let attr = self_attribute(self.module, object)?;
            let value = match method {
                "append" | "add" => self.value_of(*args.first()?, Some(class))?,
                "insert" => self.value_of(*args.get(1)?, Some(class))?,
                "extend" | "update" => self.value_of(*args.first()?, Some(class))?,
                _ => return None,
            };
            return Some((attr.to_string(), value));
        }
        let callee = self.module.resolve(function)?;
        let is_self = args.first().is_some_and(|a| self.module.text(*a) == "self");
        if matches!(callee.as_str(), "setattr" | "builtins.setattr") && is_self {
            return Some((
                named(*args.get(1)?),
                self.value_of(*args.get(2)?, Some(class))?,
            ));
        }
        None
    }

    fn value_of(&self, node: Node<'t>, class: Option<&str>) -> Option<Value<'t>> {
        match node.kind() {
            "identifier" => {
                let name = self.module.text(node);
                self.globals.get(name).cloned().or_else(|| {
                    self.module.functions.contains_key(name).then(|| {
                        Value::Function(FnId {
                            class: None,
                            name: name.to_string(),
                        })
                    })
                })
            }
            "attribute" => {
                if let Some(attr) = self_attribute(self.module, node) {
                    return self.class_member(class?, attr);
                }
                let object = node.child_by_field_name("object")?;
                let name = self.module.text(node.child_by_field_name("attribute")?);
                let object_text = self.module.text(object);
                if self.module.classes.contains_key(object_text) {
                    let target = if name == "apply" { "forward" } else { name };
                    return self
                        .method(object_text, target)
                        .map(|(id, _)| Value::Function(id));
                }
                self.member(self.value_of(object, class)?, name)
            }
            "call" => self.call_result(node, class),
            "subscript" => {
                // Any item of a container may be the one taken.
                self.value_of(node.child_by_field_name("value")?, class)
            }
            "parenthesized_expression" => self.value_of(node.named_child(0)?, class),
            "list" | "tuple" | "set" | "dictionary" | "expression_list" => {
                let items = named_children(node).into_iter().filter_map(|item| {
                    let item = match item.kind() {
                        "pair" => item.child_by_field_name("value")?,
                        _ => item,
                    };
                    self.value_of(item, class)
                });
                items.reduce(Value::merge)
            }
            "list_comprehension" | "generator_expression" | "set_comprehension" => {
                self.value_of(node.child_by_field_name("body")?, class)
            }
            "dictionary_comprehension" => {
                let pair = node.child_by_field_name("body")?;
                self.value_of(pair.child_by_field_name("value")?, class)
            }
            "lambda" => Some(Value::Lambda(class.map(str::to_string), node)),
            _ => None,
        }
    }

    /// `value.name`: an extension's function, an instance's attribute or method.
    fn member(&self, value: Value<'t>, name: &str) -> Option<Value<'t>> {
        match value {
            Value::Extension(i) => Some(Value::ExtensionFunction(i, name.to_string())),
            Value::Instance(class) => self.class_member(&class, name),
            Value::Composite(parts) => parts
                .into_iter()
                .filter_map(|p| self.member(p, name))
                .reduce(Value::merge),
            _ => None,
        }
    }

    /// What calling `call` returns, where it is a value the graph follows.
    fn call_result(&self, node: Node<'t>, class: Option<&str>) -> Option<Value<'t>> {
        let function = node.child_by_field_name("function")?;
        let args = named_children(node.child_by_field_name("arguments")?);
        let positional: Vec<Node> = args
            .iter()
            .copied()
            .filter(|a| a.kind() != "keyword_argument")
            .collect();
        let dotted = self.module.resolve(function)?;
        match dotted.as_str() {
            // Calling the partial calls its first argument.
            "functools.partial" => self.value_of(*positional.first()?, class),
            "torch.nn.Sequential" => positional
                .iter()
                .filter_map(|a| self.value_of(*a, class))
                .reduce(Value::merge),
            "torch.nn.ModuleList" | "torch.nn.ModuleDict" => {
                self.value_of(*positional.first()?, class)
            }
            "getattr" | "builtins.getattr" => {
                let object = *positional.first()?;
                let name = positional.get(1)?;
                let name = crate::strings::literal(*name, self.module.source);
                if self.module.text(object) == "self" {
                    return self.class_member(class?, name.as_deref().unwrap_or(DYNAMIC_ATTRIBUTE));
                }
                self.member(self.value_of(object, class)?, &name?)
            }
            _ if torch_ops::is_nn_layer(&dotted) => Some(Value::Layer(dotted)),
            _ => self
                .module
                .classes
                .contains_key(&dotted)
                .then_some(Value::Instance(dotted)),
        }
    }

    /// `self.<attr>` of an instance of `class`: what is stored there (also by its bases), else
    /// its method; values stored under computed names stand for any other attribute.
    fn class_member(&self, class: &str, attr: &str) -> Option<Value<'t>> {
        self.stored_attribute(class, attr, 0)
            .or_else(|| self.method(class, attr).map(|(id, _)| Value::Function(id)))
            .or_else(|| {
                (attr != DYNAMIC_ATTRIBUTE)
                    .then(|| self.stored_attribute(class, DYNAMIC_ATTRIBUTE, 0))
                    .flatten()
            })
    }

    fn stored_attribute(&self, class: &str, attr: &str, depth: usize) -> Option<Value<'t>> {
        if let Some(v) = self.attributes.get(&(class.to_string(), attr.to_string())) {
            return Some(v.clone());
        }
        let info = self.module.classes.get(class)?;
        if depth > 8 {
            return None;
        }
        info.bases
            .iter()
            .filter(|b| b.as_str() != class)
            .find_map(|b| self.stored_attribute(b, attr, depth + 1))
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

    /// Local names inside one function: `fn = self.ext.fn`, and loop variables over containers
    /// (`for layer in self.layers`, `enumerate`, `zip`, `.items()`, `.values()`, comprehensions).
    fn local_values(&self, function: Node<'t>, class: Option<&str>) -> HashMap<String, Value<'t>> {
        let mut bound: Vec<(Node<'t>, Node<'t>)> = Vec::new();
        for node in descendants(function) {
            let (Some(left), Some(right)) = (
                node.child_by_field_name("left"),
                node.child_by_field_name("right"),
            ) else {
                continue;
            };
            match node.kind() {
                "assignment" => bound.push((left, right)),
                "for_statement" | "for_in_clause" => bound.extend(self.loop_items(left, right)),
                _ => {}
            }
        }
        let mut locals: HashMap<String, Value<'t>> = HashMap::new();
        for (target, value) in bound {
            if target.kind() != "identifier" {
                continue;
            }
            if let Some(value) = self.value_of(value, class) {
                let name = self.module.text(target).to_string();
                let merged = match locals.remove(&name) {
                    Some(old) => old.merge(value),
                    None => value,
                };
                locals.insert(name, merged);
            }
        }
        locals
    }

    /// Loop targets paired with the container whose items they take.
    fn loop_items(&self, target: Node<'t>, iterable: Node<'t>) -> Vec<(Node<'t>, Node<'t>)> {
        let targets = match target.kind() {
            "pattern_list" | "tuple_pattern" | "list_pattern" | "tuple" | "list" => {
                named_children(target)
            }
            _ => vec![target],
        };
        let last = targets.last().copied();
        let call = (iterable.kind() == "call")
            .then(|| {
                let function = iterable.child_by_field_name("function")?;
                let args = named_children(iterable.child_by_field_name("arguments")?);
                Some((function, args))
            })
            .flatten();
        let Some((function, args)) = call else {
            return targets.into_iter().map(|t| (t, iterable)).collect();
        };
        let method = (function.kind() == "attribute")
            .then(|| {
                let object = function.child_by_field_name("object")?;
                let name = self.module.text(function.child_by_field_name("attribute")?);
                Some((object, name))
            })
            .flatten();
        match (self.module.resolve(function).as_deref(), method) {
            (Some("enumerate"), _) => last.zip(args.first().copied()).into_iter().collect(),
            (Some("zip"), _) => targets.into_iter().zip(args).collect(),
            (_, Some((object, "items"))) => last.map(|t| (t, object)).into_iter().collect(),
            (_, Some((object, "values" | "children" | "modules"))) => {
                targets.into_iter().map(|t| (t, object)).collect()
            }
            _ => Vec::new(),
        }
    }

    fn visit_call(
        &self,
        caller: &FnId,
        locals: &HashMap<String, Value<'t>>,
        call: Node<'t>,
        stack: &mut Vec<(FnId, Node<'t>)>,
        calls: &mut Vec<Call<'t>>,
    ) {
        let Some(function) = call.child_by_field_name("function") else {
            return;
        };
        let class = caller.class.as_deref();
        let push_value = |value: Value<'t>, stack: &mut Vec<_>, calls: &mut Vec<Call<'t>>| {
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
            "attribute" => self.visit_attribute_call(class, locals, call, function, stack, calls),
            "call" | "subscript" | "parenthesized_expression" => {
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
        locals: &HashMap<String, Value<'t>>,
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
        let object_text = self.module.text(object);
        let value = self.value_of(function, class).or_else(|| {
            let local = locals.get(object_text).cloned()?;
            self.member(local, attr)
        });
        if let Some(value) = value {
            self.call_value(value, call, stack, calls);
            return;
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
        // Other members of the candidate's own objects are not PyTorch compute.
        if self.module.classes.contains_key(object_text)
            || locals.contains_key(object_text)
            || self.value_of(object, class).is_some()
        {
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
        value: Value<'t>,
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
            Value::Function(id) => {
                let node = match &id.class {
                    Some(class) => self.method(class, &id.name).map(|(_, node)| node),
                    None => self.module.functions.get(&id.name).copied(),
                };
                stack.extend(node.map(|node| (id, node)));
            }
            Value::Lambda(class, node) => stack.push((
                FnId {
                    class,
                    name: format!("<lambda>@{}", node.start_byte()),
                },
                node,
            )),
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
                if let Some(value) = self.value_of(inner, id.class.as_deref()) {
                    out.extend(value.extensions());
                }
            }
        }
        out
    }

    /// Classes of the candidate's objects that `class` keeps in its attributes (submodules,
    /// also in containers).
    pub(crate) fn held_classes(&self, class: &str) -> Vec<String> {
        let mut held: Vec<String> = Vec::new();
        for ((c, _), value) in &self.attributes {
            if c != class {
                continue;
            }
            for part in value.clone().into_parts() {
                if let Value::Instance(name) = part {
                    if !held.contains(&name) {
                        held.push(name);
                    }
                }
            }
        }
        held
    }

    /// Whether `self.<attr> = load_inline(...)` happens inside `class`.
    pub(crate) fn class_binds_extension(&self, class: &str) -> HashSet<usize> {
        self.attributes
            .iter()
            .filter(|((c, _), _)| c == class)
            .flat_map(|(_, v)| v.extensions())
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
