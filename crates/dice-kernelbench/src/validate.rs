//! Checks that a problem file defines what the evaluator calls, on a real Python parse tree.

use tree_sitter::{Node, Parser};

/// Module-level names every problem must define, with the kind of definition expected.
const REQUIRED: [(&str, &str); 3] = [
    ("Model", "class_definition"),
    ("get_inputs", "function_definition"),
    ("get_init_inputs", "function_definition"),
];

/// Why `source` is not a usable problem, or `None` when it is valid.
///
/// Valid means: UTF-8, parses as Python without syntax errors, and defines at module level
/// `class Model`, `def get_inputs` and `def get_init_inputs` (decorated definitions count).
pub fn validate_problem_source(source: &[u8]) -> Option<String> {
    if let Err(e) = std::str::from_utf8(source) {
        return Some(format!(
            "not valid UTF-8 (first bad byte at offset {})",
            e.valid_up_to()
        ));
    }
    let mut parser = Parser::new();
    parser
        .set_language(&tree_sitter_python::LANGUAGE.into())
        .expect("the bundled tree-sitter-python grammar matches the tree-sitter version");
    let Some(tree) = parser.parse(source, None) else {
        return Some("the Python parser gave up on this file".to_string());
    };
    let root = tree.root_node();
    if root.has_error() {
        let line = first_error(root).map_or(0, |n| n.start_position().row + 1);
        return Some(format!("Python syntax error near line {line}"));
    }
    let defined = module_level_definitions(root, source);
    let missing: Vec<String> = REQUIRED
        .iter()
        .filter(|req| !defined.contains(req))
        .map(|(name, kind)| match *kind {
            "class_definition" => format!("`class {name}`"),
            _ => format!("`def {name}`"),
        })
        .collect();
    if missing.is_empty() {
        None
    } else {
        Some(format!(
            "does not define {} at module level",
            missing.join(", ")
        ))
    }
}

fn module_level_definitions<'s>(root: Node, source: &'s [u8]) -> Vec<(&'s str, &'static str)> {
    let mut cursor = root.walk();
    root.named_children(&mut cursor)
        .filter_map(|stmt| {
            let def = if stmt.kind() == "decorated_definition" {
                stmt.child_by_field_name("definition")?
            } else {
                stmt
            };
            let kind = match def.kind() {
                "class_definition" => "class_definition",
                "function_definition" => "function_definition",
                _ => return None,
            };
            let name = def.child_by_field_name("name")?.utf8_text(source).ok()?;
            Some((name, kind))
        })
        .collect()
}

fn first_error(node: Node) -> Option<Node> {
    if node.is_error() || node.is_missing() {
        return Some(node);
    }
    let mut cursor = node.walk();
    let children: Vec<Node> = node.children(&mut cursor).collect();
    children
        .into_iter()
        .filter(tree_sitter::Node::has_error)
        .find_map(first_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "import torch\nclass Model(torch.nn.Module):\n    pass\n\
def get_inputs():\n    return []\n@staticmethod\ndef get_init_inputs():\n    return []\n";

    #[test]
    fn accepts_a_complete_problem() {
        assert_eq!(validate_problem_source(VALID.as_bytes()), None);
    }

    #[test]
    fn names_every_missing_definition() {
        let src = "class Model:\n    pass\n";
        let reason = validate_problem_source(src.as_bytes()).unwrap();
        assert!(reason.contains("`def get_inputs`"), "{reason}");
        assert!(reason.contains("`def get_init_inputs`"), "{reason}");
        assert!(!reason.contains("Model"), "{reason}");
    }

    #[test]
    fn nested_or_textual_definitions_do_not_count() {
        let src = "class Model:\n    def get_inputs(self):\n        return []\n\
# def get_init_inputs():\nx = 'def get_inputs(): pass'\ndef get_init_inputs():\n    return []\n";
        let reason = validate_problem_source(src.as_bytes()).unwrap();
        assert!(reason.contains("`def get_inputs`"), "{reason}");
    }

    #[test]
    fn a_variable_named_model_is_not_a_class() {
        let src =
            "Model = 1\ndef get_inputs():\n    return []\ndef get_init_inputs():\n    return []\n";
        let reason = validate_problem_source(src.as_bytes()).unwrap();
        assert!(reason.contains("`class Model`"), "{reason}");
    }

    #[test]
    fn reports_syntax_errors_with_a_line() {
        let src = format!("{VALID}\ndef broken(:\n    pass\n");
        let reason = validate_problem_source(src.as_bytes()).unwrap();
        assert!(
            reason.starts_with("Python syntax error near line"),
            "{reason}"
        );
    }

    #[test]
    fn rejects_non_utf8() {
        let mut src = VALID.as_bytes().to_vec();
        src.insert(3, 0xff);
        let reason = validate_problem_source(&src).unwrap();
        assert!(
            reason.contains("UTF-8") && reason.contains("offset 3"),
            "{reason}"
        );
    }
}
