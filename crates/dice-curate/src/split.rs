//! The kernel-infilling split of a program (DICE's stage-1 RL task, Figure 3 of the paper): a
//! prefix (imports and environment), the core the model must write (the kernel source passed to
//! `load_inline`) and a suffix (the rest: declarations, the `load_inline` wiring, `ModelNew`).
//!
//! The rules, read off the released split of 99 pairs and stated for any program:
//! * the kernel source is what `load_inline` receives as `cuda_sources` (as `cpp_sources` when
//!   there are no CUDA sources, as in C++ CPU programs); `cpp_sources` beside CUDA sources are
//!   declarations and stay in the suffix;
//! * a name is followed to its module-level assignments before the call (and names in their
//!   right-hand sides, e.g. `source = header + body`); a literal passed in the call is itself
//!   the source;
//! * the core runs from the first byte of the first such statement (or literal) to the last byte
//!   of the last one: comments above the statement stay in the prefix, the line break after it
//!   starts the suffix.

use anyhow::Result;
use dice_kernelbench::read_records;
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use thiserror::Error;
use tree_sitter::{Node, Parser, Tree};

/// A program cut in three; `prefix + core + suffix` is the program, byte for byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split<'a> {
    pub prefix: &'a str,
    pub core: &'a str,
    pub suffix: &'a str,
}

impl Split<'_> {
    /// Byte offsets of the core's start and end in the program.
    pub fn core_range(&self) -> (usize, usize) {
        (self.prefix.len(), self.prefix.len() + self.core.len())
    }
}

/// Why a program has no infilling split.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum SplitError {
    #[error("the program does not parse as Python")]
    Syntax,
    #[error("the program calls no load_inline")]
    NoLoadInline,
    #[error("load_inline receives no kernel source")]
    NoKernelSource,
    #[error("the kernel source `{0}` is not assigned at module level before load_inline")]
    Unassigned(String),
    #[error("the three parts do not reassemble the program")]
    Reassembly,
}

/// `load_inline`'s positional parameters, in order.
const POSITIONAL: [&str; 4] = ["name", "cpp_sources", "cuda_sources", "functions"];

/// Splits `program` into prefix, core and suffix on its parse tree.
pub fn split_program(program: &str) -> Result<Split<'_>, SplitError> {
    let tree = parse(program).ok_or(SplitError::Syntax)?;
    let root = tree.root_node();
    if root.has_error() {
        return Err(SplitError::Syntax);
    }
    let calls: Vec<Node> = descendants(root)
        .into_iter()
        .filter(|n| n.kind() == "call" && is_load_inline(n, program))
        .collect();
    if calls.is_empty() {
        return Err(SplitError::NoLoadInline);
    }
    let mut pieces: Vec<(usize, usize)> = Vec::new();
    for call in calls {
        let source = argument(call, program, "cuda_sources")
            .filter(|v| !is_empty_source(*v, program))
            .or_else(|| argument(call, program, "cpp_sources"))
            .filter(|v| !is_empty_source(*v, program));
        let Some(source) = source else { continue };
        let mut seen = BTreeSet::new();
        collect_pieces(
            root,
            source,
            program,
            call.start_byte(),
            &mut seen,
            &mut pieces,
        )?;
    }
    let start = pieces.iter().map(|p| p.0).min();
    let end = pieces.iter().map(|p| p.1).max();
    let (Some(start), Some(end)) = (start, end) else {
        return Err(SplitError::NoKernelSource);
    };
    let split = Split {
        prefix: &program[..start],
        core: &program[start..end],
        suffix: &program[end..],
    };
    let reassembled = [split.prefix, split.core, split.suffix].concat();
    if reassembled != program {
        return Err(SplitError::Reassembly);
    }
    Ok(split)
}

fn parse(program: &str) -> Option<Tree> {
    let mut parser = Parser::new();
    parser
        .set_language(&tree_sitter_python::LANGUAGE.into())
        .ok()?;
    parser.parse(program, None)
}

fn text<'s>(node: Node, program: &'s str) -> &'s str {
    &program[node.byte_range()]
}

fn descendants(node: Node) -> Vec<Node> {
    let mut out = vec![node];
    let mut i = 0;
    while i < out.len() {
        let mut cursor = out[i].walk();
        out.extend(out[i].children(&mut cursor));
        i += 1;
    }
    out.sort_by_key(Node::start_byte);
    out
}

/// `load_inline(...)`, `cpp_extension.load_inline(...)`, `torch.utils.cpp_extension.load_inline(...)`.
fn is_load_inline(call: &Node, program: &str) -> bool {
    call.child_by_field_name("function")
        .is_some_and(|f| text(f, program).rsplit('.').next() == Some("load_inline"))
}

/// The argument bound to parameter `name`, by keyword or by position.
fn argument<'t>(call: Node<'t>, program: &str, name: &str) -> Option<Node<'t>> {
    let args = call.child_by_field_name("arguments")?;
    let mut cursor = args.walk();
    let mut position = 0;
    for arg in args.named_children(&mut cursor) {
        match arg.kind() {
            "keyword_argument" => {
                let key = arg.child_by_field_name("name")?;
                if text(key, program) == name {
                    return arg.child_by_field_name("value");
                }
            }
            "comment" => {}
            _ => {
                if POSITIONAL.get(position) == Some(&name) {
                    return Some(arg);
                }
                position += 1;
            }
        }
    }
    None
}

/// `None`, `""`, `[]`: no source given.
fn is_empty_source(value: Node, program: &str) -> bool {
    match value.kind() {
        "none" => true,
        "list" | "tuple" => value.named_child_count() == 0,
        "string" => {
            let body = text(value, program).trim_matches(|c| c == '"' || c == '\'');
            body.trim().is_empty()
        }
        _ => false,
    }
}

/// Adds to `pieces` the byte ranges that make up the source expression `value`: literals as
/// they are, names through their module-level assignments before `before`.
fn collect_pieces(
    root: Node,
    value: Node,
    program: &str,
    before: usize,
    seen: &mut BTreeSet<String>,
    pieces: &mut Vec<(usize, usize)>,
) -> Result<(), SplitError> {
    match value.kind() {
        "identifier" => {
            let name = text(value, program).to_string();
            if !seen.insert(name.clone()) {
                return Ok(());
            }
            let statements = assignments_of(root, &name, program, before);
            if statements.is_empty() {
                return Err(SplitError::Unassigned(name));
            }
            for statement in statements {
                pieces.push((statement.start_byte(), statement.end_byte()));
                for inner in descendants(statement) {
                    if inner.kind() == "identifier"
                        && is_right_hand_side(inner, statement)
                        && !assignments_of(root, text(inner, program), program, before).is_empty()
                    {
                        collect_pieces(root, inner, program, before, seen, pieces)?;
                    }
                }
            }
        }
        "list" | "tuple" | "parenthesized_expression" | "binary_operator" => {
            let mut cursor = value.walk();
            let children: Vec<Node> = value.named_children(&mut cursor).collect();
            for child in children {
                collect_pieces(root, child, program, before, seen, pieces)?;
            }
        }
        "comment" => {}
        _ => pieces.push((value.start_byte(), value.end_byte())),
    }
    Ok(())
}

/// Module-level statements before `before` that assign `name` (`name = …`, `name += …`).
fn assignments_of<'t>(root: Node<'t>, name: &str, program: &str, before: usize) -> Vec<Node<'t>> {
    let mut cursor = root.walk();
    root.named_children(&mut cursor)
        .filter(|s| s.kind() == "expression_statement" && s.end_byte() <= before)
        .filter(|s| {
            s.named_child(0).is_some_and(|a| {
                matches!(a.kind(), "assignment" | "augmented_assignment")
                    && a.child_by_field_name("left")
                        .is_some_and(|l| text(l, program) == name)
            })
        })
        .collect()
}

/// Whether `node` lies in the right-hand side of the assignment statement `statement`.
fn is_right_hand_side(node: Node, statement: Node) -> bool {
    statement
        .named_child(0)
        .and_then(|a| a.child_by_field_name("right"))
        .is_some_and(|r| r.start_byte() <= node.start_byte() && node.end_byte() <= r.end_byte())
}

/// How a split's core boundaries differ from another split of the same program (the released
/// one): `None` when they agree, else a category naming which boundary moved and what lies
/// between the two positions (blank lines, comments or code).
pub fn difference(program: &str, ours: (usize, usize), theirs: (usize, usize)) -> Option<String> {
    let describe = |edge: &str, a: usize, b: usize| -> Option<String> {
        if a == b {
            return None;
        }
        let (lo, hi, side) = if b < a {
            (b, a, "earlier")
        } else {
            (a, b, "later")
        };
        let between = program.get(lo..hi).map_or("code", classify);
        Some(format!("released core {edge}s {side} ({between} between)"))
    };
    let parts: Vec<String> = [
        describe("start", ours.0, theirs.0),
        describe("end", ours.1, theirs.1),
    ]
    .into_iter()
    .flatten()
    .collect();
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// What a stretch of program text holds: `blank lines`, `comments` or `code`.
fn classify(stretch: &str) -> &'static str {
    let lines = stretch.lines().map(str::trim).filter(|l| !l.is_empty());
    let mut kind = "blank lines";
    for line in lines {
        if line.starts_with('#') {
            kind = "comments";
        } else {
            return "code";
        }
    }
    kind
}

/// One program's split as `dice curate split` writes it (a JSONL line).
#[derive(Clone, Debug, Serialize)]
pub struct SplitRecord {
    /// The record's `id`, else its 0-based position in the file.
    pub id: Value,
    pub prefix: String,
    pub core: String,
    pub suffix: String,
}

/// The splits of a pairs file and how they compare with the split the file carries.
#[derive(Clone, Debug, Default)]
pub struct SplitRun {
    pub records: Vec<SplitRecord>,
    /// `(id, why)` of programs without a split.
    pub failures: Vec<(Value, SplitError)>,
    /// Present when the file carries its own split (`prefix`, `middle`, `suffix`, as DICE's
    /// released infilling file does).
    pub agreement: Option<Agreement>,
}

/// How often our split equals the one a file carries, and the categories of the differences.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Agreement {
    /// Programs with both splits.
    pub compared: usize,
    pub exact: usize,
    /// Programs the file splits but we do not.
    pub unsplit: usize,
    /// Carried splits that do not reassemble their program (left out of the comparison).
    pub inconsistent: usize,
    /// Difference category → programs.
    pub differences: BTreeMap<String, usize>,
}

impl Agreement {
    pub fn exact_rate(&self) -> f64 {
        if self.compared == 0 {
            return 0.0;
        }
        self.exact as f64 / self.compared as f64
    }
}

impl std::fmt::Display for Agreement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "split agreement with the file's own: {}/{} exact ({:.1} %)",
            self.exact,
            self.compared,
            100.0 * self.exact_rate()
        )?;
        if self.unsplit > 0 {
            write!(f, ", {} split there but not here", self.unsplit)?;
        }
        if self.inconsistent > 0 {
            write!(
                f,
                ", {} carried splits do not reassemble",
                self.inconsistent
            )?;
        }
        for (category, n) in &self.differences {
            write!(f, "\n  {n}: {category}")?;
        }
        Ok(())
    }
}

/// Splits the program (`cuda_code`, else `code`) of every record of a JSON array or JSONL file.
pub fn split_file(path: &Path) -> Result<SplitRun> {
    let mut run = SplitRun::default();
    let mut agreement = Agreement::default();
    let mut carried = false;
    for (position, record) in read_records(path)?.into_iter().enumerate() {
        let id = record
            .fields
            .get("id")
            .filter(|v| !v.is_null())
            .cloned()
            .unwrap_or_else(|| Value::from(position));
        let program = match record.str_field("cuda_code")? {
            Some(code) => code,
            None => record.required_str("code")?,
        };
        let theirs = match (
            record.str_field("prefix")?,
            record.str_field("middle")?,
            record.str_field("suffix")?,
        ) {
            (Some(p), Some(m), Some(s)) => Some((p, m, s)),
            _ => None,
        };
        carried |= theirs.is_some();
        match split_program(program) {
            Ok(split) => {
                if let Some((p, m, s)) = theirs {
                    if [p, m, s].concat() == program {
                        agreement.compared += 1;
                        let range = (p.len(), p.len() + m.len());
                        match difference(program, split.core_range(), range) {
                            None => agreement.exact += 1,
                            Some(category) => {
                                *agreement.differences.entry(category).or_default() += 1;
                            }
                        }
                    } else {
                        agreement.inconsistent += 1;
                    }
                }
                run.records.push(SplitRecord {
                    id,
                    prefix: split.prefix.to_string(),
                    core: split.core.to_string(),
                    suffix: split.suffix.to_string(),
                });
            }
            Err(why) => {
                agreement.unsplit += usize::from(theirs.is_some());
                run.failures.push((id, why));
            }
        }
    }
    run.agreement = carried.then_some(agreement);
    Ok(run)
}

/// Writes one JSON object per split program.
pub fn write_splits(records: &[SplitRecord], out: &Path) -> Result<()> {
    crate::run::write_jsonl(out, records)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CUDA: &str = "import torch\nfrom torch.utils.cpp_extension import load_inline\n\n\
# the kernel\nsource = \"\"\"\n__global__ void k() {}\n\"\"\"\n\ncpp_src = \"void f();\"\n\
ext = load_inline(name='e', cpp_sources=cpp_src, cuda_sources=source, functions=['f'])\n\
class ModelNew(torch.nn.Module):\n    pass\n";

    #[test]
    fn cuda_source_statement_is_the_core() {
        let s = split_program(CUDA).unwrap();
        assert!(s.prefix.ends_with("# the kernel\n"));
        assert_eq!(s.core, "source = \"\"\"\n__global__ void k() {}\n\"\"\"");
        assert!(s.suffix.starts_with("\n\ncpp_src"));
    }

    #[test]
    fn cpp_sources_are_the_core_without_cuda_sources() {
        let program = "from torch.utils.cpp_extension import load_inline\n\
cpp = \"int f() { return 1; }\"\next = load_inline('e', cpp, functions=['f'])\n";
        let s = split_program(program).unwrap();
        assert_eq!(s.core, "cpp = \"int f() { return 1; }\"");
    }

    #[test]
    fn composed_sources_span_all_their_parts() {
        let program = "import torch.utils.cpp_extension as ce\nhead = '#include <x>'\n\
body = 'void k() {}'\nsrc = head + body\nother = 1\nk2 = 'void j() {}'\n\
ext = ce.load_inline(name='e', cpp_sources='', cuda_sources=[src, k2])\n";
        let s = split_program(program).unwrap();
        assert!(s.core.starts_with("head = "));
        assert!(s.core.ends_with("k2 = 'void j() {}'"));
        let inline = "from torch.utils.cpp_extension import load_inline\n\
ext = load_inline(name='e', cpp_sources='', cuda_sources='void k() {}')\n";
        assert_eq!(split_program(inline).unwrap().core, "'void k() {}'");
    }

    #[test]
    fn programs_without_a_kernel_source_are_refused() {
        assert_eq!(
            split_program("import torch\nx = 1\n"),
            Err(SplitError::NoLoadInline)
        );
        assert_eq!(
            split_program("from m import load_inline\ne = load_inline('e', src)\n"),
            Err(SplitError::Unassigned("src".into()))
        );
        assert_eq!(
            split_program("from m import load_inline\ne = load_inline('e', '')\n"),
            Err(SplitError::NoKernelSource)
        );
        assert_eq!(split_program("def f(:\n"), Err(SplitError::Syntax));
    }

    #[test]
    fn differences_name_the_boundary_and_what_lies_between() {
        let program = "import x\n# note\nsrc = 1\n\nrest\n";
        let ours = (16, 23);
        assert_eq!(difference(program, ours, ours), None);
        assert_eq!(
            difference(program, ours, (9, 23)).as_deref(),
            Some("released core starts earlier (comments between)")
        );
        assert_eq!(
            difference(program, ours, (16, 25)).as_deref(),
            Some("released core ends later (blank lines between)")
        );
    }
}
