//! Extensions compiled by the candidate: `load_inline(...)` / `load(...)` calls, the
//! names they are bound to, their exported functions and their analysed sources.

use tree_sitter::Node;

use crate::cuda::{CppAnalysis, Reach};
use crate::module::PyModule;
use crate::strings;
use crate::syntax::{ancestor, descendants, named_children};

/// Where the extension module object ends up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Binding {
    Global(String),
    /// `self.<attr> = load_inline(...)` in a method of the named class.
    Attribute {
        class: String,
        attr: String,
    },
}

pub(crate) struct Extension<'t> {
    pub(crate) call: Node<'t>,
    pub(crate) bindings: Vec<Binding>,
    /// The `name=` argument.
    pub(crate) module_name: Option<String>,
    /// Python-visible functions: `functions=[...]` plus pybind `m.def` names.
    pub(crate) exports: Vec<String>,
    pub(crate) cpp: CppAnalysis,
    /// False when some source could not be evaluated statically (e.g. `load(sources=[files])`).
    pub(crate) sources_known: bool,
    pub(crate) has_cuda_sources: bool,
}

const LOADERS: [&str; 4] = [
    "torch.utils.cpp_extension.load_inline",
    "torch.utils.cpp_extension.load",
    "cpp_extension.load_inline",
    "cpp_extension.load",
];

pub(crate) fn is_loader(dotted: &str) -> bool {
    LOADERS
        .iter()
        .any(|l| dotted == *l || dotted.ends_with(&format!(".{l}")))
        || dotted == "load_inline"
}

pub(crate) fn find_extensions<'t>(module: &PyModule<'t>) -> Vec<Extension<'t>> {
    descendants(module.root)
        .into_iter()
        .filter(|n| n.kind() == "call")
        .filter(|n| {
            n.child_by_field_name("function")
                .and_then(|f| module.resolve(f))
                .is_some_and(|d| is_loader(&d))
        })
        .map(|call| build(module, call))
        .collect()
}

fn build<'t>(module: &PyModule<'t>, call: Node<'t>) -> Extension<'t> {
    let inline = call
        .child_by_field_name("function")
        .and_then(|f| module.resolve(f))
        .is_some_and(|d| d.ends_with("load_inline"));
    let positional_names: &[&str] = if inline {
        &["name", "cpp_sources", "cuda_sources", "functions"]
    } else {
        &["name", "sources"]
    };
    let argument = |wanted: &str| argument(module, call, positional_names, wanted);
    let module_name = argument("name").and_then(|n| {
        let resolved = strings::resolve(module, n);
        resolved.complete.then_some(resolved.text)
    });
    let mut cpp = CppAnalysis::default();
    let mut sources_known = inline && !has_splat(call);
    let mut has_cuda_sources = false;
    if inline {
        for (key, is_cuda) in [("cpp_sources", false), ("cuda_sources", true)] {
            let Some(value) = argument(key) else {
                continue;
            };
            for source in strings::resolve_items(module, value) {
                sources_known &= source.complete;
                has_cuda_sources |= is_cuda && !source.text.trim().is_empty();
                cpp.add_source(&source);
            }
        }
    }
    let mut exports: Vec<String> = argument("functions")
        .map(|f| {
            strings::resolve_items(module, f)
                .into_iter()
                .filter(|s| s.complete)
                .map(|s| s.text)
                .collect()
        })
        .unwrap_or_default();
    for (py, _) in &cpp.pybind {
        if !exports.contains(py) {
            exports.push(py.clone());
        }
    }
    Extension {
        call,
        bindings: bindings(module, call),
        module_name,
        exports,
        cpp,
        sources_known,
        has_cuda_sources,
    }
}

fn has_splat(call: Node) -> bool {
    call.child_by_field_name("arguments")
        .map(named_children)
        .unwrap_or_default()
        .iter()
        .any(|a| matches!(a.kind(), "list_splat" | "dictionary_splat"))
}

fn argument<'t>(
    module: &PyModule<'t>,
    call: Node<'t>,
    positional_names: &[&str],
    wanted: &str,
) -> Option<Node<'t>> {
    let args = named_children(call.child_by_field_name("arguments")?);
    for arg in &args {
        if arg.kind() == "keyword_argument"
            && arg
                .child_by_field_name("name")
                .is_some_and(|n| module.text(n) == wanted)
        {
            return arg.child_by_field_name("value");
        }
    }
    let index = positional_names.iter().position(|n| *n == wanted)?;
    args.into_iter()
        .filter(|a| {
            !matches!(
                a.kind(),
                "keyword_argument" | "list_splat" | "dictionary_splat"
            )
        })
        .nth(index)
}

/// Names the extension object is stored in: the assignment around the call, or, when the
/// call is returned from a module-level function, every assignment of that function's result.
fn bindings(module: &PyModule, call: Node) -> Vec<Binding> {
    let mut out = Vec::new();
    if let Some(target) = assignment_target(call) {
        out.extend(binding_of(module, target));
    }
    let returned = call
        .parent()
        .is_some_and(|p| p.kind() == "return_statement");
    let builder = ancestor(call, &["function_definition"])
        .and_then(|f| f.child_by_field_name("name"))
        .map(|n| module.text(n).to_string());
    if let (true, Some(builder)) = (returned, builder) {
        for node in descendants(module.root) {
            let calls_builder = node.kind() == "call"
                && node
                    .child_by_field_name("function")
                    .is_some_and(|f| module.text(f) == builder);
            if calls_builder {
                if let Some(target) = assignment_target(node) {
                    out.extend(binding_of(module, target));
                }
            }
        }
    }
    out
}

fn assignment_target(value: Node) -> Option<Node> {
    let parent = value.parent()?;
    (parent.kind() == "assignment" && parent.child_by_field_name("right") == Some(value))
        .then(|| parent.child_by_field_name("left"))
        .flatten()
}

fn binding_of(module: &PyModule, target: Node) -> Option<Binding> {
    match target.kind() {
        "identifier" => Some(Binding::Global(module.text(target).to_string())),
        "attribute" => {
            let object = target.child_by_field_name("object")?;
            let attr = target.child_by_field_name("attribute")?;
            if module.text(object) != "self" {
                return None;
            }
            let class = ancestor(target, &["class_definition"])?.child_by_field_name("name")?;
            Some(Binding::Attribute {
                class: module.text(class).to_string(),
                attr: module.text(attr).to_string(),
            })
        }
        _ => None,
    }
}

impl Extension<'_> {
    /// What calling exported function `name` reaches; unknown sources count as a launch.
    pub(crate) fn reach(&self, name: &str) -> Reach {
        self.cpp.reach(self.cpp.host_name(name))
    }

    pub(crate) fn launches_custom_code(&self, name: &str) -> bool {
        if !self.sources_known {
            return true;
        }
        let reach = self.reach(name);
        !reach.kernels.is_empty() || (!self.has_cuda_sources && reach.store_loop)
    }

    pub(crate) fn defines_custom_code(&self) -> bool {
        !self.sources_known
            || !self.cpp.kernels.is_empty()
            || (!self.has_cuda_sources && self.cpp.functions.values().any(|f| f.has_store_loop))
    }

    pub(crate) fn is_prompt_example(&self) -> bool {
        self.module_name.as_deref() == Some("elementwise_add")
            || self.cpp.kernels.contains("elementwise_add_kernel")
            || self.exports.iter().any(|e| e == "elementwise_add_cuda")
    }
}
