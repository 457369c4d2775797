//! Parsing and small tree helpers shared by the Python and C++ analyses.

use tree_sitter::{Language, Node, Parser, Tree};

pub(crate) fn parse_python(source: &str) -> Option<Tree> {
    parse(source, tree_sitter_python::LANGUAGE.into())
}

pub(crate) fn parse_cpp(source: &str) -> Option<Tree> {
    parse(source, tree_sitter_cpp::LANGUAGE.into())
}

fn parse(source: &str, language: Language) -> Option<Tree> {
    let mut parser = Parser::new();
    parser.set_language(&language).ok()?;
    parser.parse(source, None)
}

pub(crate) fn text<'s>(node: Node, source: &'s str) -> &'s str {
    source.get(node.byte_range()).unwrap_or("")
}

/// Every node of the subtree rooted at `node`, in document order (the root first).
pub(crate) fn descendants(node: Node) -> Vec<Node> {
    let mut out = Vec::new();
    let mut cursor = node.walk();
    loop {
        out.push(cursor.node());
        if cursor.goto_first_child() {
            continue;
        }
        loop {
            if cursor.node() == node {
                return out;
            }
            if cursor.goto_next_sibling() {
                break;
            }
            if !cursor.goto_parent() {
                return out;
            }
        }
    }
}

/// `(left, right)` of every plain assignment (`a = b`, not `a += b`) in the subtree of `node`.
pub(crate) fn assignments(node: Node) -> impl Iterator<Item = (Node, Node)> {
    descendants(node)
        .into_iter()
        .filter(|n| n.kind() == "assignment")
        .filter_map(|n| {
            Some((
                n.child_by_field_name("left")?,
                n.child_by_field_name("right")?,
            ))
        })
}

pub(crate) fn named_children(node: Node) -> Vec<Node> {
    let mut cursor = node.walk();
    node.named_children(&mut cursor).collect()
}

/// Nearest ancestor (excluding `node`) whose kind is one of `kinds`.
pub(crate) fn ancestor<'t>(node: Node<'t>, kinds: &[&str]) -> Option<Node<'t>> {
    let mut current = node.parent();
    while let Some(n) = current {
        if kinds.contains(&n.kind()) {
            return Some(n);
        }
        current = n.parent();
    }
    None
}

/// Maps byte offsets of the candidate file to 1-based line and column numbers.
pub(crate) struct LineIndex {
    starts: Vec<usize>,
}

impl LineIndex {
    pub(crate) fn new(source: &str) -> Self {
        let starts = std::iter::once(0)
            .chain(source.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        Self { starts }
    }

    pub(crate) fn position(&self, offset: usize) -> (u32, u32) {
        let line = self.starts.partition_point(|&s| s <= offset).max(1);
        let column = offset - self.starts[line - 1] + 1;
        (line as u32, column as u32)
    }
}
