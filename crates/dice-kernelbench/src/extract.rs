//! Code extraction from raw model answers, exactly as KernelBench and DICE do it
//! (`extract_first_code(text, ["python", "cpp"])` in `src/utils.py`).

use regex::Regex;
use std::sync::LazyLock;

static FIRST_FENCED_BLOCK: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?s)```(.*?)```").expect("valid regex"));

/// Language tags removed from the start of the block, in this order.
const TAGS: [&str; 2] = ["python", "cpp"];

/// The first ```` ``` ```` … ```` ``` ```` block of `text`, or `None` when there is none.
///
/// Reproduces the reference's quirks on purpose, since verdicts depend on them: the whole
/// answer is stripped, the first non-greedy match wins (a snippet before the real answer is
/// taken), the block is stripped, then a leading `python` and after it a leading `cpp` are cut
/// as plain prefixes (`pythonic = 1` loses `python`), stripping again after each cut. Other tags
/// (`py`, `cuda`, `Python`) stay as the first line. Whitespace is Python's `str.isspace`.
pub fn extract_first_code(text: &str) -> Option<String> {
    let trimmed = py_strip(text);
    let block = FIRST_FENCED_BLOCK.captures(trimmed)?.get(1)?.as_str();
    let mut code = py_strip(block);
    for tag in TAGS {
        if let Some(rest) = code.strip_prefix(tag) {
            code = py_strip(rest);
        }
    }
    Some(code.to_string())
}

/// Python's `str.strip()`: Unicode whitespace plus the separators U+001C..U+001F.
fn py_strip(s: &str) -> &str {
    s.trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn x(text: &str) -> Option<String> {
        extract_first_code(text)
    }

    #[test]
    fn no_fence_means_no_code() {
        assert_eq!(x("class ModelNew: pass"), None);
        assert_eq!(x("``` only one fence"), None);
        assert_eq!(x(""), None);
    }

    #[test]
    fn takes_the_first_block_not_the_answer() {
        let text = "Plan:\n```\nsnippet\n```\nAnswer:\n```python\nclass ModelNew: pass\n```";
        assert_eq!(x(text).as_deref(), Some("snippet"));
    }

    #[test]
    fn strips_python_then_cpp_tags() {
        assert_eq!(
            x("```python\nimport torch\n```").as_deref(),
            Some("import torch")
        );
        assert_eq!(x("```cpp\nint x;\n```").as_deref(), Some("int x;"));
        assert_eq!(x("```python cpp\nint x;\n```").as_deref(), Some("int x;"));
        assert_eq!(x("```cpp\npython\n```").as_deref(), Some("python"));
    }

    #[test]
    fn tags_are_plain_prefixes() {
        assert_eq!(x("```pythonic = 1```").as_deref(), Some("ic = 1"));
        assert_eq!(
            x("```py\nimport torch\n```").as_deref(),
            Some("py\nimport torch")
        );
        assert_eq!(x("```cuda\nint x;\n```").as_deref(), Some("cuda\nint x;"));
        assert_eq!(x("```Python\nx = 1\n```").as_deref(), Some("Python\nx = 1"));
    }

    #[test]
    fn a_fence_inside_the_code_cuts_the_block() {
        let text = "```python\ns = \"\"\"```inner```\"\"\"\n```";
        assert_eq!(x(text).as_deref(), Some("s = \"\"\""));
    }

    #[test]
    fn empty_block_is_empty_code_not_none() {
        assert_eq!(x("``````").as_deref(), Some(""));
        assert_eq!(x("```python```").as_deref(), Some(""));
    }

    #[test]
    fn whitespace_is_pythons() {
        assert_eq!(
            x("```\u{1f}\u{a0}x = 1\u{2003}\n```").as_deref(),
            Some("x = 1")
        );
        assert_eq!(x("```\r\n\tx = 1  \r\n```").as_deref(), Some("x = 1"));
    }

    #[test]
    fn inner_indentation_and_newlines_are_kept() {
        let text = "```python\nclass A:\n    def f(self):\n        return 1\n```";
        assert_eq!(
            x(text).as_deref(),
            Some("class A:\n    def f(self):\n        return 1")
        );
    }
}
