//! Process-level tampering: monkeypatching, threads, processes, sockets, file writes,
//! tensor subclasses, `__torch_function__`, streams/graphs, dynamic code, and
//! interpreter introspection that reaches the reference. Python and C++ sides.

use tree_sitter::Node;

use crate::context::Context;
use crate::finding::{Report, Rule};
use crate::module::{leftmost_identifier, PyModule};
use crate::strings;
use crate::syntax::{ancestor, assignments, descendants, named_children};

/// Modules whose attributes a candidate must never rebind.
const PATCH_ROOTS: [&str; 9] = [
    "torch", "numpy", "time", "timeit", "builtins", "sys", "gc", "triton", "math",
];

const STREAM_OR_GRAPH: [&str; 12] = [
    "torch.cuda.Stream",
    "torch.cuda.stream",
    "torch.cuda.StreamContext",
    "torch.cuda.ExternalStream",
    "torch.cuda.set_stream",
    "torch.cuda.CUDAGraph",
    "torch.cuda.graph",
    "torch.cuda.graphs.graph",
    "torch.cuda.make_graphed_callables",
    "torch.cuda.graph_pool_handle",
    "torch.Stream",
    "torch.cuda.streams.Stream",
];

const INTROSPECTION: [&str; 10] = [
    "gc.get_objects",
    "gc.get_referrers",
    "gc.get_referents",
    "sys._getframe",
    "inspect.currentframe",
    "inspect.stack",
    "inspect.getouterframes",
    "inspect.getsource",
    "runpy.run_path",
    "runpy.run_module",
];

pub(crate) fn check(ctx: &Context, report: &mut Report) {
    let module = ctx.module;
    for node in descendants(module.root) {
        match node.kind() {
            "import_statement" | "import_from_statement" => import(module, node, report),
            "call" => call(module, node, report),
            "assignment" | "augmented_assignment" => {
                if let Some(left) = node.child_by_field_name("left") {
                    patched_targets(module, left, report);
                }
            }
            "delete_statement" => {
                for target in named_children(node) {
                    patched_targets(module, target, report);
                }
            }
            "class_definition" => class(module, node, report),
            "function_definition" => {
                let name = node
                    .child_by_field_name("name")
                    .map(|n| module.text(n))
                    .unwrap_or("");
                if name == "__torch_function__" || name == "__torch_dispatch__" {
                    report.error(
                        Rule::TorchFunctionOverride,
                        node.start_byte(),
                        format!(
                            "defines `{name}`, which intercepts every torch call on its tensors"
                        ),
                    );
                }
            }
            "attribute" => introspection_attribute(module, node, report),
            _ => {}
        }
    }
    for ext in ctx.extensions {
        for (rule, offset, message) in &ext.cpp.hazards {
            report.error(*rule, *offset, message.clone());
        }
    }
}

/// The rule a use of module `dotted` (or of something inside it) falls under.
fn module_rule(dotted: &str) -> Option<Rule> {
    let within = |prefix: &str| dotted == prefix || dotted.starts_with(&format!("{prefix}."));
    if ["threading", "_thread"].iter().any(|m| within(m))
        || dotted == "concurrent.futures.ThreadPoolExecutor"
    {
        return Some(Rule::Threads);
    }
    if ["multiprocessing", "torch.multiprocessing", "concurrent"]
        .iter()
        .any(|m| within(m))
        || ["os.fork", "os.forkpty", "os.register_at_fork"].contains(&dotted)
    {
        return Some(Rule::Multiprocessing);
    }
    if [
        "subprocess",
        "pty",
        "asyncio.create_subprocess_exec",
        "asyncio.create_subprocess_shell",
    ]
    .iter()
    .any(|m| within(m))
        || ["os.system", "os.popen"].contains(&dotted)
        || ["os.exec", "os.spawn", "os.posix_spawn"]
            .iter()
            .any(|p| dotted.starts_with(p))
    {
        return Some(Rule::Subprocess);
    }
    let network = [
        "socket",
        "socketserver",
        "ssl",
        "http",
        "urllib.request",
        "requests",
        "ftplib",
        "smtplib",
        "telnetlib",
        "xmlrpc",
        "websocket",
        "websockets",
        "aiohttp",
        "httpx",
        "paramiko",
        "asyncio.open_connection",
        "asyncio.start_server",
    ];
    if network.iter().any(|m| within(m)) {
        return Some(Rule::Socket);
    }
    // `tempfile` only creates new files of its own (honest programs build extensions in a
    // `mkdtemp()` folder), and `shutil` has read-only queries (`import shutil` is judged by
    // the calls made through it); the rest of `shutil` copies, moves and deletes anywhere.
    let shutil_queries = [
        "shutil.which",
        "shutil.disk_usage",
        "shutil.get_terminal_size",
    ];
    if dotted.starts_with("shutil.") && !shutil_queries.contains(&dotted) {
        return Some(Rule::FileWriteOutsideWorkdir);
    }
    // dice's judge loads the problem as module `dice_problem` in the candidate's process too.
    if within("__main__") || within("dice_problem") {
        return Some(Rule::ReferenceModelUse);
    }
    if within("torch.library")
        || within("torch.overrides")
        || within("torch.utils._python_dispatch")
    {
        return Some(Rule::TorchFunctionOverride);
    }
    None
}

fn import(module: &PyModule, node: Node, report: &mut Report) {
    let mut names = Vec::new();
    if node.kind() == "import_from_statement" {
        if let Some(m) = node.child_by_field_name("module_name") {
            let base = module.text(m);
            let mut cursor = node.walk();
            for item in node.children_by_field_name("name", &mut cursor) {
                let item = item.child_by_field_name("name").unwrap_or(item);
                let name = module.text(item);
                if matches!(name, "Model" | "get_inputs" | "get_init_inputs") {
                    report.error(
                        Rule::ReferenceModelUse,
                        node.start_byte(),
                        format!("imports `{name}` from `{base}`: the reference problem's code"),
                    );
                }
                names.push(format!("{base}.{name}"));
            }
            names.push(base.to_string());
        }
    } else {
        for item in named_children(node) {
            let item = item.child_by_field_name("name").unwrap_or(item);
            names.push(module.text(item).to_string());
        }
    }
    for name in names {
        if let Some(rule) = module_rule(&name) {
            report.error(rule, node.start_byte(), format!("imports `{name}`"));
            return;
        }
    }
}

fn call(module: &PyModule, node: Node, report: &mut Report) {
    let Some(function) = node.child_by_field_name("function") else {
        return;
    };
    let args: Vec<Node> = node
        .child_by_field_name("arguments")
        .map(named_children)
        .unwrap_or_default();
    let offset = node.start_byte();
    if function.kind() == "attribute" {
        let method = function
            .child_by_field_name("attribute")
            .map(|a| module.text(a))
            .unwrap_or("");
        let object = function.child_by_field_name("object");
        match method {
            "write_text" | "write_bytes" | "touch"
                if object.is_some_and(|o| in_fresh_temporary_folder(module, o, 0)) =>
            {
                return;
            }
            "write_text" | "write_bytes" | "touch" | "symlink_to" | "hardlink_to" => {
                report.error(
                    Rule::FileWriteOutsideWorkdir,
                    offset,
                    format!("writes a file through `.{method}()` (path not checked)"),
                );
                return;
            }
            "as_subclass" => {
                report.error(
                    Rule::TensorSubclass,
                    offset,
                    "re-types a tensor with `.as_subclass()`".to_string(),
                );
                return;
            }
            "open" => {
                if let Some(path) = pathlib_path(module, function) {
                    let mode = keyword(module, &args, "mode").or_else(|| positional(&args, 0));
                    if is_write_mode(module, mode) {
                        file_write(module, path, "Path.open", offset, report);
                    }
                    return;
                }
            }
            _ => {}
        }
    }
    let Some(dotted) = module.resolve(function) else {
        return;
    };
    if is_dynamic_import(&dotted) {
        dynamic_import(module, node, &args, report);
        return;
    }
    match dotted.as_str() {
        "exec" | "eval" | "compile" | "builtins.exec" | "builtins.eval" => {
            report.error(
                Rule::DynamicCode,
                offset,
                format!("runs code built at run time with `{dotted}()`, hidden from static checks"),
            );
            return;
        }
        "setattr" | "delattr" | "builtins.setattr" | "object.__setattr__" => {
            let target = args.first().and_then(|t| module.resolve(*t));
            if let Some(target) = target.filter(|t| is_patch_root(module, t)) {
                report.error(
                    Rule::Monkeypatch,
                    offset,
                    format!("`{dotted}` on `{target}` replaces library behaviour"),
                );
            }
            return;
        }
        "open" | "io.open" | "codecs.open" | "builtins.open" => {
            let mode = keyword(module, &args, "mode").or_else(|| positional(&args, 1));
            if is_write_mode(module, mode) {
                file_write(module, positional(&args, 0), &dotted, offset, report);
            }
            return;
        }
        "os.open" => {
            let flags = positional(&args, 1).map(|f| module.text(f)).unwrap_or("");
            if ["O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND"]
                .iter()
                .any(|f| flags.contains(f))
            {
                file_write(module, positional(&args, 0), &dotted, offset, report);
            }
            return;
        }
        "os.remove" | "os.unlink" | "os.rename" | "os.replace" | "os.makedirs" | "os.mkdir"
        | "os.rmdir" | "os.removedirs" | "os.symlink" | "os.link" | "os.chmod" | "os.chown"
        | "os.truncate" | "os.utime" | "numpy.save" | "numpy.savez" | "numpy.savetxt" => {
            file_write(module, positional(&args, 0), &dotted, offset, report);
            return;
        }
        "torch.save" | "pickle.dump" => {
            file_write(module, positional(&args, 1), &dotted, offset, report);
            return;
        }
        _ => {}
    }
    if let Some(rule) = module_rule(&dotted) {
        report.error(rule, offset, format!("calls `{dotted}`"));
    } else if STREAM_OR_GRAPH.contains(&dotted.as_str()) {
        report.error(
            Rule::StreamOrGraphCreation,
            offset,
            format!("creates or switches CUDA streams/graphs with `{dotted}`"),
        );
    } else if INTROSPECTION.contains(&dotted.as_str())
        || dotted.starts_with("importlib.util.")
        || dotted.starts_with("importlib.machinery.")
    {
        report.error(
            Rule::ReferenceModelUse,
            offset,
            format!("`{dotted}` can reach the reference model, its module or its outputs"),
        );
    } else if matches!(
        dotted.as_str(),
        "torch.Tensor._make_subclass" | "torch.Tensor.__new__" | "torch._C._TensorBase.__new__"
    ) {
        report.error(
            Rule::TensorSubclass,
            offset,
            format!("builds a tensor subclass with `{dotted}`"),
        );
    }
}

/// A mode argument that writes; a mode that is not a literal counts as writing.
fn is_write_mode(module: &PyModule, mode: Option<Node>) -> bool {
    mode.is_some_and(|m| {
        strings::literal(m, module.source).is_none_or(|m| m.contains(['w', 'a', 'x', '+']))
    })
}

/// For `pathlib.Path(p).open`, the path argument `p` (`None` inside when it has none).
fn pathlib_path<'t>(module: &PyModule, method: Node<'t>) -> Option<Option<Node<'t>>> {
    let object = method.child_by_field_name("object")?;
    if object.kind() != "call" {
        return None;
    }
    let constructor = module.resolve(object.child_by_field_name("function")?)?;
    if !constructor.starts_with("pathlib.") {
        return None;
    }
    let args = named_children(object.child_by_field_name("arguments")?);
    Some(positional(&args, 0))
}

fn is_dynamic_import(dotted: &str) -> bool {
    matches!(
        dotted,
        "__import__" | "importlib.import_module" | "importlib.reload"
    )
}

fn dynamic_import(module: &PyModule, node: Node, args: &[Node], report: &mut Report) {
    let name = args
        .first()
        .and_then(|a| strings::literal(*a, module.source));
    match name {
        Some(name) => {
            if let Some(rule) = module_rule(&name) {
                report.error(
                    rule,
                    node.start_byte(),
                    format!("imports `{name}` dynamically"),
                );
            }
        }
        None => report.error(
            Rule::DynamicCode,
            node.start_byte(),
            "imports a module whose name is computed at run time".to_string(),
        ),
    }
}

fn keyword<'t>(module: &PyModule, args: &[Node<'t>], name: &str) -> Option<Node<'t>> {
    args.iter()
        .find(|a| {
            a.kind() == "keyword_argument"
                && a.child_by_field_name("name")
                    .is_some_and(|n| module.text(n) == name)
        })
        .and_then(|a| a.child_by_field_name("value"))
}

fn positional<'t>(args: &[Node<'t>], index: usize) -> Option<Node<'t>> {
    args.iter()
        .filter(|a| a.kind() != "keyword_argument")
        .nth(index)
        .copied()
}

/// Writes are allowed only to literal relative paths that stay inside the work folder.
fn file_write(
    module: &PyModule,
    path: Option<Node>,
    what: &str,
    offset: usize,
    report: &mut Report,
) {
    let literal = path
        .map(|p| strings::resolve(module, p))
        .filter(|p| p.complete);
    let inside = literal.as_ref().is_some_and(|p| stays_below(&p.text));
    if inside || path.is_some_and(|p| in_fresh_temporary_folder(module, p, 0)) {
        return;
    }
    let shown = literal
        .map(|p| format!("`{}`", p.text))
        .unwrap_or_else(|| "a path not known statically".to_string());
    report.error(
        Rule::FileWriteOutsideWorkdir,
        offset,
        format!("`{what}` writes to {shown}, outside the work folder"),
    );
}

/// A relative path that cannot climb out of the folder it is joined to.
fn stays_below(path: &str) -> bool {
    !path.is_empty()
        && !path.starts_with('/')
        && !path.starts_with('~')
        && !path.split(['/', '\\']).any(|c| c == "..")
}

/// Whether `path` names a place inside a folder `tempfile.mkdtemp()` (or a
/// `with tempfile.TemporaryDirectory() as …`) created for this process: directly, through a
/// name bound to one (at module level, or only to such folders in the enclosing function), or
/// joined with literal relative parts by `os.path.join`, `pathlib.Path` or `/`. A fresh private
/// folder, where honest programs write the sources they build, that nothing else reads.
fn in_fresh_temporary_folder(module: &PyModule, path: Node, depth: usize) -> bool {
    const MAX_DEPTH: usize = 8;
    if depth > MAX_DEPTH {
        return false;
    }
    // A function's own name shadows the module's.
    if let Some(bound) = local_bindings(module, path) {
        return !bound.is_empty()
            && bound.iter().all(|binding| match *binding {
                Binding::Value(value) => in_fresh_temporary_folder(module, value, depth + 1),
                Binding::WithTarget(manager) => {
                    manager.kind() == "call"
                        && manager
                            .child_by_field_name("function")
                            .and_then(|f| module.resolve(f))
                            .is_some_and(|f| f == "tempfile.TemporaryDirectory")
                }
            });
    }
    let path = strings::follow_name(module, path, 0);
    let relative_literal = |node: Node| {
        let part = strings::resolve(module, node);
        part.complete && stays_below(&part.text)
    };
    match path.kind() {
        "call" => {
            let Some(function) = path
                .child_by_field_name("function")
                .and_then(|f| module.resolve(f))
            else {
                return false;
            };
            let args: Vec<Node> = path
                .child_by_field_name("arguments")
                .map(named_children)
                .unwrap_or_default();
            match function.as_str() {
                "tempfile.mkdtemp" => true,
                "os.path.join" | "pathlib.Path" | "pathlib.PurePath" => {
                    args.first()
                        .is_some_and(|&base| in_fresh_temporary_folder(module, base, depth + 1))
                        && args[1..].iter().all(|&part| relative_literal(part))
                }
                _ => false,
            }
        }
        "binary_operator" => {
            let slash = path
                .child_by_field_name("operator")
                .is_some_and(|op| module.text(op) == "/");
            match (
                slash,
                path.child_by_field_name("left"),
                path.child_by_field_name("right"),
            ) {
                (true, Some(left), Some(right)) => {
                    in_fresh_temporary_folder(module, left, depth + 1) && relative_literal(right)
                }
                _ => false,
            }
        }
        "parenthesized_expression" => path
            .named_child(0)
            .is_some_and(|inner| in_fresh_temporary_folder(module, inner, depth + 1)),
        _ => false,
    }
}

/// How a name is bound inside a function.
enum Binding<'t> {
    /// `name = value`.
    Value(Node<'t>),
    /// `with manager as name`: the name is what the manager's `__enter__` returns.
    WithTarget(Node<'t>),
}

/// Every binding of the identifier `name` in the function around it (plain assignments and
/// `with … as` targets); none when it is one of the function's parameters (the caller may pass
/// any path); `None` when `name` is not an identifier the enclosing function binds (a
/// module-level name, or an expression).
fn local_bindings<'t>(module: &PyModule<'t>, name: Node<'t>) -> Option<Vec<Binding<'t>>> {
    if name.kind() != "identifier" {
        return None;
    }
    let function = ancestor(name, &["function_definition"])?;
    let wanted = module.text(name);
    let is_name = |node: Node| node.kind() == "identifier" && module.text(node) == wanted;
    let parameters = function.child_by_field_name("parameters");
    if parameters.is_some_and(|p| descendants(p).into_iter().any(is_name)) {
        return Some(Vec::new());
    }
    let mut bound: Vec<Binding<'t>> = assignments(function)
        .filter(|(left, _)| is_name(*left))
        .map(|(_, right)| Binding::Value(right))
        .collect();
    for pattern in descendants(function)
        .into_iter()
        .filter(|n| n.kind() == "as_pattern")
    {
        let parts = named_children(pattern);
        if let (Some(&manager), Some(&target)) = (parts.first(), parts.last()) {
            let target = named_children(target).first().copied().unwrap_or(target);
            if parts.len() == 2 && is_name(target) {
                bound.push(Binding::WithTarget(manager));
            }
        }
    }
    (!bound.is_empty()).then_some(bound)
}

fn is_patch_root(module: &PyModule, dotted: &str) -> bool {
    let root = dotted.split('.').next().unwrap_or("");
    PATCH_ROOTS.contains(&root) && module.is_imported(root)
}

fn patched_targets(module: &PyModule, target: Node, report: &mut Report) {
    match target.kind() {
        "pattern_list" | "tuple_pattern" | "list_pattern" | "tuple" | "list"
        | "expression_list" => {
            for t in named_children(target) {
                patched_targets(module, t, report);
            }
        }
        "attribute" | "subscript" => {
            let base = if target.kind() == "subscript" {
                target.child_by_field_name("value")
            } else {
                Some(target)
            };
            let Some(dotted) = base.and_then(|b| module.resolve(b)) else {
                return;
            };
            let imported_root =
                leftmost_identifier(target).is_some_and(|r| module.is_imported(module.text(r)));
            let root = dotted.split('.').next().unwrap_or("");
            if !imported_root || !PATCH_ROOTS.contains(&root) {
                return;
            }
            if dotted.starts_with("torch.backends.") {
                report.warning(
                    Rule::Monkeypatch,
                    target.start_byte(),
                    format!("sets global backend flag `{dotted}`, which also changes the reference's numerics"),
                );
            } else {
                report.error(
                    Rule::Monkeypatch,
                    target.start_byte(),
                    format!("assigns to `{dotted}`, replacing library behaviour"),
                );
            }
        }
        _ => {}
    }
}

fn class(module: &PyModule, node: Node, report: &mut Report) {
    let Some(name) = node.child_by_field_name("name").map(|n| module.text(n)) else {
        return;
    };
    let Some(info) = module.classes.get(name) else {
        return;
    };
    for base in &info.bases {
        if is_tensor_class(module, base, 0) {
            report.error(
                Rule::TensorSubclass,
                node.start_byte(),
                format!("class `{name}` subclasses a tensor type (`{base}`)"),
            );
        } else if base.ends_with("TorchFunctionMode") || base.ends_with("TorchDispatchMode") {
            report.error(
                Rule::TorchFunctionOverride,
                node.start_byte(),
                format!("class `{name}` is a `{base}`, which intercepts torch calls"),
            );
        }
    }
}

fn is_tensor_class(module: &PyModule, class: &str, depth: usize) -> bool {
    if matches!(
        class,
        "torch.Tensor"
            | "torch._C._TensorBase"
            | "torch._C.TensorBase"
            | "torch.nn.Parameter"
            | "torch.nn.parameter.Parameter"
    ) {
        return true;
    }
    depth < 8
        && module.classes.get(class).is_some_and(|c| {
            c.bases
                .iter()
                .any(|b| b != class && is_tensor_class(module, b, depth + 1))
        })
}

fn introspection_attribute(module: &PyModule, node: Node, report: &mut Report) {
    let Some(attr) = node
        .child_by_field_name("attribute")
        .map(|a| module.text(a))
    else {
        return;
    };
    let frame_walk = matches!(
        attr,
        "f_back" | "f_globals" | "f_locals" | "gi_frame" | "tb_frame"
    );
    let modules_table = attr == "modules" && module.resolve(node).as_deref() == Some("sys.modules");
    if frame_walk || modules_table {
        report.error(
            Rule::ReferenceModelUse,
            node.start_byte(),
            format!(
                "reads `.{attr}`, which can reach the reference model, its module or its outputs"
            ),
        );
    }
}
