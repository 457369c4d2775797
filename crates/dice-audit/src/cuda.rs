//! Analysis of the C++/CUDA sources of an extension on tree-sitter-cpp parse trees:
//! `__global__` kernels, host functions with what they call and launch, pybind exports,
//! ATen/cuBLAS compute calls and hazardous system calls.

use std::collections::{BTreeSet, HashMap, HashSet};

use tree_sitter::Node;

use crate::finding::Rule;
use crate::strings::SourceText;
use crate::syntax::{descendants, named_children, parse_cpp, text};

/// A function defined in the sources (host or device).
#[derive(Debug, Default)]
pub(crate) struct CppFunction {
    /// Last path segment of every function called.
    pub(crate) calls: BTreeSet<String>,
    /// Every identifier used in the body (a kernel name here means a launch or a
    /// kernel pointer passed to `cudaLaunchKernel`).
    pub(crate) identifiers: HashSet<String>,
    /// ATen/torch/cuBLAS/cuDNN compute calls: (name, candidate offset).
    pub(crate) library_compute: Vec<(String, usize)>,
    /// A loop that stores through a subscript or pointer: a CPU kernel.
    pub(crate) has_store_loop: bool,
}

#[derive(Debug, Default)]
pub(crate) struct CppAnalysis {
    pub(crate) kernels: BTreeSet<String>,
    pub(crate) functions: HashMap<String, CppFunction>,
    /// pybind `m.def("py_name", &cpp_name)` pairs.
    pub(crate) pybind: Vec<(String, String)>,
    /// (rule, candidate offset, what was found).
    pub(crate) hazards: Vec<(Rule, usize, String)>,
}

/// What a host entry point reaches through host calls.
#[derive(Debug, Default)]
pub(crate) struct Reach {
    pub(crate) kernels: BTreeSet<String>,
    pub(crate) store_loop: bool,
    pub(crate) library_compute: Vec<(String, usize)>,
}

impl CppAnalysis {
    pub(crate) fn add_source(&mut self, source: &SourceText) {
        let prepared = blank_cuda_syntax(&source.text);
        let Some(tree) = parse_cpp(&prepared) else {
            return;
        };
        let unit = Unit {
            text: &prepared,
            original: &source.text,
            source,
        };
        for node in descendants(tree.root_node()) {
            match node.kind() {
                "function_definition" => unit.function(node, self),
                "call_expression" => unit.call(node, self),
                "qualified_identifier" | "type_identifier" => unit.type_use(node, self),
                _ => {}
            }
        }
    }

    /// Kernels, CPU store loops and library compute reachable from host function `entry`.
    pub(crate) fn reach(&self, entry: &str) -> Reach {
        let mut reach = Reach::default();
        let mut seen = HashSet::new();
        let mut stack = vec![entry.to_string()];
        while let Some(name) = stack.pop() {
            if !seen.insert(name.clone()) {
                continue;
            }
            let Some(function) = self.functions.get(&name) else {
                continue;
            };
            reach.kernels.extend(
                self.kernels
                    .iter()
                    .filter(|k| function.identifiers.contains(*k))
                    .cloned(),
            );
            reach.store_loop |= function.has_store_loop;
            reach
                .library_compute
                .extend(function.library_compute.iter().cloned());
            stack.extend(
                function
                    .calls
                    .iter()
                    .filter(|c| !self.kernels.contains(*c))
                    .cloned(),
            );
        }
        reach
    }

    /// The C++ function a Python-visible name is bound to.
    pub(crate) fn host_name<'a>(&'a self, exported: &'a str) -> &'a str {
        self.pybind
            .iter()
            .find(|(py, _)| py == exported)
            .map(|(_, cpp)| cpp.as_str())
            .unwrap_or(exported)
    }
}

struct Unit<'a> {
    text: &'a str,
    original: &'a str,
    source: &'a SourceText,
}

impl Unit<'_> {
    fn origin(&self, node: Node) -> usize {
        self.source.origin(node.start_byte())
    }

    fn function(&self, node: Node, analysis: &mut CppAnalysis) {
        let (Some(declarator), Some(body)) = (
            node.child_by_field_name("declarator"),
            node.child_by_field_name("body"),
        ) else {
            return;
        };
        let Some(name) = function_name(declarator, self.text) else {
            return;
        };
        let head = self
            .original
            .get(node.start_byte()..declarator.start_byte())
            .unwrap_or("");
        if head.contains("__global__") {
            analysis.kernels.insert(name);
            return;
        }
        let mut function = CppFunction::default();
        for inner in descendants(body) {
            match inner.kind() {
                "identifier" => {
                    function
                        .identifiers
                        .insert(text(inner, self.text).to_string());
                }
                "call_expression" => {
                    if let Some(callee) = inner.child_by_field_name("function") {
                        let callee_name = callee_path(callee, self.text);
                        if let Some(last) = callee_name.rsplit("::").next() {
                            function.calls.insert(last.to_string());
                        }
                        if is_library_compute(callee, &callee_name) {
                            function
                                .library_compute
                                .push((callee_name, self.origin(inner)));
                        }
                    }
                }
                "for_statement" | "while_statement" | "do_statement" | "for_range_loop" => {
                    function.has_store_loop |= stores_through_memory(inner);
                }
                _ => {}
            }
        }
        analysis.functions.entry(name).or_insert(function);
    }

    fn call(&self, node: Node, analysis: &mut CppAnalysis) {
        let Some(callee) = node.child_by_field_name("function") else {
            return;
        };
        let args = node
            .child_by_field_name("arguments")
            .map(named_children)
            .unwrap_or_default();
        if callee.kind() == "field_expression" {
            let field = callee
                .child_by_field_name("field")
                .map(|f| text(f, self.text))
                .unwrap_or("");
            if field == "def" {
                if let (Some(py), Some(cpp)) = (args.first(), args.get(1)) {
                    let py = text(*py, self.text).trim_matches('"').to_string();
                    if let Some(cpp) = last_identifier(*cpp, self.text) {
                        analysis.pybind.push((py, cpp));
                    }
                }
            }
            return;
        }
        let path = callee_path(callee, self.text);
        let last = path.rsplit("::").next().unwrap_or(&path);
        let offset = self.origin(node);
        if let Some(rule) = hazard_call(last, &path) {
            analysis
                .hazards
                .push((rule, offset, format!("C++ calls `{path}`")));
        }
        let args_text: Vec<&str> = args.iter().map(|a| text(*a, self.text)).collect();
        if keeps_lines_in_l2(last, &args_text.concat()) {
            analysis.hazards.push((
                Rule::PersistingL2Cache,
                offset,
                format!("C++ calls `{path}` to keep data persisting in L2, out of reach of the flush before each timed call"),
            ));
        }
        if last == "fopen" || last == "freopen" {
            let writes = args
                .get(1)
                .map(|m| text(*m, self.text))
                .is_some_and(|m| m.contains('w') || m.contains('a') || m.contains('+'));
            if writes {
                analysis.hazards.push((
                    Rule::FileWriteOutsideWorkdir,
                    offset,
                    format!("C++ opens a file for writing with `{path}`"),
                ));
            }
        }
    }

    fn type_use(&self, node: Node, analysis: &mut CppAnalysis) {
        let name = text(node, self.text);
        let rule = match name {
            "std::thread" | "std::jthread" => Rule::Threads,
            "std::ofstream" | "std::fstream" => Rule::FileWriteOutsideWorkdir,
            _ if name.ends_with("CUDAGraph") => Rule::StreamOrGraphCreation,
            _ => return,
        };
        analysis
            .hazards
            .push((rule, self.origin(node), format!("C++ uses `{name}`")));
    }
}

fn hazard_call(last: &str, path: &str) -> Option<Rule> {
    const STREAM_OR_GRAPH: [&str; 10] = [
        "cudaStreamCreate",
        "cudaStreamCreateWithFlags",
        "cudaStreamCreateWithPriority",
        "cuStreamCreate",
        "cuStreamCreateWithPriority",
        "getStreamFromPool",
        "getStreamFromExternal",
        "setCurrentCUDAStream",
        "cudaStreamBeginCapture",
        "cudaStreamBeginCaptureToGraph",
    ];
    if STREAM_OR_GRAPH.contains(&last)
        || last.starts_with("cudaGraph")
        || last.starts_with("cuGraph")
    {
        return Some(Rule::StreamOrGraphCreation);
    }
    let bare = !path.contains("::") || path.starts_with("::") || path.starts_with("std::");
    if !bare {
        return None;
    }
    match last {
        "pthread_create" => Some(Rule::Threads),
        "async" if path.starts_with("std::") => Some(Rule::Threads),
        "fork" | "vfork" => Some(Rule::Multiprocessing),
        "system" | "popen" | "execl" | "execlp" | "execle" | "execv" | "execvp" | "execvpe"
        | "posix_spawn" | "posix_spawnp" => Some(Rule::Subprocess),
        "socket" | "connect" => Some(Rule::Socket),
        _ => None,
    }
}

/// Whether a call with these arguments reserves L2 for persisting lines or marks memory
/// persisting (an access-policy window).
fn keeps_lines_in_l2(last: &str, args: &str) -> bool {
    let names = |needles: [&str; 2]| needles.iter().any(|n| args.contains(n));
    match last {
        "cudaDeviceSetLimit" | "cuCtxSetLimit" => names([
            "cudaLimitPersistingL2CacheSize",
            "CU_LIMIT_PERSISTING_L2_CACHE_SIZE",
        ]),
        "cudaStreamSetAttribute"
        | "cuStreamSetAttribute"
        | "cudaGraphKernelNodeSetAttribute"
        | "cuGraphKernelNodeSetAttribute" => names(["AccessPolicyWindow", "ACCESS_POLICY_WINDOW"]),
        _ => false,
    }
}

/// Library calls that do the real work instead of a custom kernel.
fn is_library_compute(callee: Node, path: &str) -> bool {
    let last = path.rsplit("::").next().unwrap_or(path);
    let lower = last.to_ascii_lowercase();
    if lower.starts_with("cublas") || lower.starts_with("cudnn") {
        let bookkeeping = [
            "get",
            "set",
            "create",
            "destroy",
            "desc",
            "preference",
            "layout",
        ]
        .iter()
        .any(|w| lower.contains(w));
        let computes = lower == "cublasltmatmul"
            || ["gemm", "gemv", "forward"]
                .iter()
                .any(|w| lower.contains(w));
        return computes && !bookkeeping;
    }
    let qualified = callee.kind() == "qualified_identifier"
        && ["at::", "torch::", "F::"]
            .iter()
            .any(|p| path.starts_with(p));
    qualified && crate::torch_ops::is_compute_op(last)
}

fn stores_through_memory(loop_node: Node) -> bool {
    descendants(loop_node).into_iter().any(|n| {
        matches!(n.kind(), "assignment_expression")
            && n.child_by_field_name("left")
                .is_some_and(|l| matches!(l.kind(), "subscript_expression" | "pointer_expression"))
    })
}

fn function_name(declarator: Node, source: &str) -> Option<String> {
    match declarator.kind() {
        "function_declarator" => {
            let inner = declarator.child_by_field_name("declarator")?;
            let path = text(inner, source);
            Some(path.rsplit("::").next().unwrap_or(path).to_string())
        }
        "pointer_declarator" | "reference_declarator" | "attributed_declarator" => {
            let inner = declarator
                .child_by_field_name("declarator")
                .or_else(|| declarator.named_children(&mut declarator.walk()).last())?;
            function_name(inner, source)
        }
        _ => None,
    }
}

/// `at::matmul`, `kernel` (template arguments dropped), `obj.method` → `method`.
fn callee_path(callee: Node, source: &str) -> String {
    let node = match callee.kind() {
        "template_function" => callee.child_by_field_name("name").unwrap_or(callee),
        "field_expression" => callee.child_by_field_name("field").unwrap_or(callee),
        _ => callee,
    };
    let raw = text(node, source);
    let without_template = raw.split('<').next().unwrap_or(raw);
    without_template.split_whitespace().collect()
}

fn last_identifier(node: Node, source: &str) -> Option<String> {
    descendants(node)
        .into_iter()
        .rfind(|n| n.kind() == "identifier")
        .map(|n| text(n, source).to_string())
}

/// Makes CUDA parse as C++ without moving any byte: launch configurations
/// `<<<...>>>` become spaces and CUDA qualifiers become `static` or spaces.
pub(crate) fn blank_cuda_syntax(source: &str) -> String {
    let mut bytes = source.as_bytes().to_vec();
    let mut from = 0;
    while let Some(start) = find(&bytes, b"<<<", from) {
        let Some(end) = find(&bytes, b">>>", start + 3) else {
            break;
        };
        bytes[start..end + 3].fill(b' ');
        from = end + 3;
    }
    const AS_STATIC: [&str; 2] = ["__global__", "__device__"];
    const BLANK: [&str; 9] = [
        "__host__",
        "__forceinline__",
        "__inline__",
        "__noinline__",
        "__restrict__",
        "__shared__",
        "__constant__",
        "__managed__",
        "__restrict",
    ];
    for word in AS_STATIC {
        replace_word(&mut bytes, word, |slot| {
            slot.fill(b' ');
            slot[..6].copy_from_slice(b"static");
        });
    }
    for word in BLANK {
        replace_word(&mut bytes, word, |slot| slot.fill(b' '));
    }
    for word in ["__launch_bounds__", "__align__"] {
        let mut from = 0;
        while let Some(start) = find(&bytes, word.as_bytes(), from) {
            let mut end = start + word.len();
            if bytes.get(end) == Some(&b'(') {
                let mut depth = 0;
                while end < bytes.len() {
                    match bytes[end] {
                        b'(' => depth += 1,
                        b')' => {
                            depth -= 1;
                            if depth == 0 {
                                end += 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                    end += 1;
                }
            }
            bytes[start..end].fill(b' ');
            from = end;
        }
    }
    String::from_utf8(bytes).unwrap_or_else(|_| source.to_string())
}

fn replace_word(bytes: &mut [u8], word: &str, mut replace: impl FnMut(&mut [u8])) {
    let mut from = 0;
    while let Some(start) = find(bytes, word.as_bytes(), from) {
        let end = start + word.len();
        let before_ok = start == 0 || !is_ident_byte(bytes[start - 1]);
        let after_ok = bytes.get(end).is_none_or(|b| !is_ident_byte(*b));
        if before_ok && after_ok {
            replace(&mut bytes[start..end]);
        }
        from = end;
    }
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

fn find(haystack: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    haystack
        .get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}
