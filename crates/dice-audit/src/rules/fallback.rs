//! exception_fallback: `try`/`except` (or `contextlib.suppress`) around kernel calls,
//! around the extension build, or anywhere on forward's path.

use crate::callgraph::FnId;
use crate::context::Context;
use crate::extension::is_loader;
use crate::finding::{Report, Rule};
use crate::syntax::{ancestor, descendants, named_children};

pub(crate) fn check(ctx: &Context, report: &mut Report) {
    for node in descendants(ctx.module.root) {
        let guarded = match node.kind() {
            "try_statement" => {
                let catches = named_children(node)
                    .iter()
                    .any(|c| matches!(c.kind(), "except_clause" | "except_group_clause"));
                if !catches {
                    continue;
                }
                node.child_by_field_name("body")
            }
            "with_statement" => {
                let suppresses = descendants(node)
                    .into_iter()
                    .filter(|n| n.kind() == "call")
                    .take(4)
                    .any(|c| {
                        c.child_by_field_name("function")
                            .and_then(|f| ctx.module.resolve(f))
                            .is_some_and(|d| d == "contextlib.suppress")
                    });
                if !suppresses {
                    continue;
                }
                node.child_by_field_name("body")
            }
            _ => continue,
        };
        let Some(body) = guarded else {
            continue;
        };
        let reason = if guards_extension(ctx, body) {
            "around a custom-kernel call or the extension build"
        } else if ctx.on_forward_path(node) {
            "on forward's path"
        } else {
            continue;
        };
        report.error(
            Rule::ExceptionFallback,
            node.start_byte(),
            format!("exception handler {reason}: a failing kernel can silently fall back"),
        );
    }
}

fn guards_extension(ctx: &Context, body: tree_sitter::Node) -> bool {
    let builds = descendants(body).into_iter().any(|n| {
        n.kind() == "call"
            && n.child_by_field_name("function")
                .and_then(|f| ctx.module.resolve(f))
                .is_some_and(|d| is_loader(&d))
    });
    if builds {
        return true;
    }
    let class = ancestor(body, &["class_definition"])
        .and_then(|c| c.child_by_field_name("name"))
        .map(|n| ctx.module.text(n).to_string());
    let scope = FnId {
        class,
        name: String::new(),
    };
    !ctx.graph.extensions_mentioned(&[(scope, body)]).is_empty()
}
