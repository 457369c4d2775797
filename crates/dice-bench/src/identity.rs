//! Identity candidates: a reference program submitted as its own solution, the floor a timing
//! benchmark measures against (its speedup is 1 up to the timer's noise).

const REFERENCE_CLASS: &str = "Model";
const CANDIDATE_CLASS: &str = "ModelNew";

/// The reference `source` as a candidate: every identifier `Model` renamed `ModelNew`
/// (`class Model(nn.Module)`, `super(Model, self)`, and the word in comments alike). Only whole
/// identifiers are renamed: `MyModel`, `Model_x`, `Model2` and `ModelNew` stay as they are.
pub fn identity_candidate(source: &str) -> String {
    let mut out = String::with_capacity(source.len() + 16);
    let mut copied = 0;
    for (at, _) in source.match_indices(REFERENCE_CLASS) {
        let end = at + REFERENCE_CLASS.len();
        let before = source[..at].chars().next_back();
        let after = source[end..].chars().next();
        if !before.is_some_and(is_identifier_char) && !after.is_some_and(is_identifier_char) {
            out.push_str(&source[copied..at]);
            out.push_str(CANDIDATE_CLASS);
            copied = end;
        }
    }
    out.push_str(&source[copied..]);
    out
}

/// Python identifiers continue with letters, digits and `_` (Unicode letters included).
fn is_identifier_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renames_whole_identifiers_only() {
        let source = "class Model(nn.Module):\n    def __init__(self):\n        \
                      super(Model, self).__init__()\n# Model: MyModel Model_x Model2 ModelNew \
                      xModel éModel Model\n";
        assert_eq!(
            identity_candidate(source),
            "class ModelNew(nn.Module):\n    def __init__(self):\n        \
             super(ModelNew, self).__init__()\n# ModelNew: MyModel Model_x Model2 ModelNew \
             xModel éModel ModelNew\n"
        );
    }

    #[test]
    fn text_without_the_class_is_unchanged() {
        assert_eq!(identity_candidate(""), "");
        assert_eq!(identity_candidate("Models = MyModel"), "Models = MyModel");
    }
}
