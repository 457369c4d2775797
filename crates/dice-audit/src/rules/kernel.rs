//! Is a custom kernel really launched on `forward`'s path? Covers no_custom_kernel, the
//! three DICE deceptive types (example kernel copied, kernel not wired, kernel not called)
//! and PyTorch/ATen compute on forward's path.

use std::collections::{BTreeSet, HashSet};

use crate::callgraph::CallKind;
use crate::context::Context;
use crate::finding::{Report, Rule};
use crate::syntax::descendants;

pub(crate) fn check(ctx: &Context, report: &mut Report) {
    let module = ctx.module;
    let Some(model_new) = module.classes.get("ModelNew") else {
        if !module.bindings.contains_key("ModelNew") {
            report.error(
                Rule::NoCustomKernel,
                0,
                "the candidate defines no class `ModelNew`".to_string(),
            );
        }
        return;
    };
    let Some((_, forward)) = ctx.forward else {
        if !model_new.bases.iter().any(|b| b == "Model") {
            report.error(
                Rule::NoCustomKernel,
                model_new.node.start_byte(),
                "`ModelNew` defines no `forward`".to_string(),
            );
        }
        return;
    };
    let mut launched: HashSet<(usize, String)> = HashSet::new();
    let mut called: Vec<(usize, String, usize)> = Vec::new();
    for call in &ctx.forward_path.calls {
        if let CallKind::Extension { ext, function } = &call.kind {
            called.push((*ext, function.clone(), call.node.start_byte()));
            if ctx.extensions[*ext].launches_custom_code(function) {
                launched.insert((*ext, function.clone()));
            }
        }
    }
    // Exports that forward leaves alone while another kernel runs are not reported: honest
    // programs compile backward passes, variants and helpers beside the kernel they use.
    if launched.is_empty() {
        report_missing_kernel(ctx, report, &called, forward.start_byte());
    }
    report_example_copy(ctx, report, &launched);
    report_compute(ctx, report, &called);
}

fn report_missing_kernel(
    ctx: &Context,
    report: &mut Report,
    called: &[(usize, String, usize)],
    forward_offset: usize,
) {
    let with_code: BTreeSet<usize> = ctx
        .extensions
        .iter()
        .enumerate()
        .filter(|(_, e)| e.defines_custom_code())
        .map(|(i, _)| i)
        .collect();
    if let Some((ext, function, offset)) = called.first() {
        let name = ext_label(ctx, *ext);
        report.error(
            Rule::NoCustomKernel,
            *offset,
            format!(
                "forward calls `{name}.{function}`, which launches no custom (`__global__`) kernel; \
                 its C++ only calls library code"
            ),
        );
        return;
    }
    if with_code.is_empty() {
        let message = if ctx.extensions.is_empty() {
            "no custom kernel: nothing is compiled with `load_inline`/`load`; forward runs PyTorch"
                .to_string()
        } else {
            "no custom kernel: the compiled sources define no `__global__` kernel".to_string()
        };
        report.error(Rule::NoCustomKernel, forward_offset, message);
        return;
    }
    // ModelNew's own methods and those of the submodules it holds: a kernel they reach is
    // wired into the model, whether or not forward runs it.
    let mut model_new_code = Vec::new();
    let classes = std::iter::once("ModelNew".to_string()).chain(ctx.graph.held_classes("ModelNew"));
    for class in classes {
        if let Some(info) = ctx.module.classes.get(&class) {
            for name in info.methods.keys() {
                model_new_code.extend(ctx.graph.method(&class, name));
            }
        }
    }
    let reachable = ctx.graph.reachable(model_new_code);
    let mut wired = ctx.graph.extensions_mentioned(&reachable.functions);
    wired.extend(ctx.graph.class_binds_extension("ModelNew"));
    for ext in with_code {
        let name = ext_label(ctx, ext);
        if wired.contains(&ext) {
            report.error(
                Rule::KernelNotCalled,
                forward_offset,
                format!(
                    "extension `{name}` is wired into ModelNew but forward never calls its kernels"
                ),
            );
        } else {
            report.error(
                Rule::KernelNotWired,
                ctx.extensions[ext].call.start_byte(),
                format!("extension `{name}` is compiled but never used by ModelNew"),
            );
        }
    }
}

/// DICE type (1): the prompt's elementwise-add example is compiled while forward computes
/// the answer with PyTorch; clean only when the problem itself adds and the kernel runs.
fn report_example_copy(ctx: &Context, report: &mut Report, launched: &HashSet<(usize, String)>) {
    let computes_with_torch = ctx
        .forward_path
        .calls
        .iter()
        .any(|c| matches!(c.kind, CallKind::TorchCompute(_) | CallKind::Reference));
    if !computes_with_torch {
        return;
    }
    for (index, ext) in ctx.extensions.iter().enumerate() {
        if !ext.is_prompt_example() {
            continue;
        }
        let runs = launched.iter().any(|(e, _)| *e == index);
        if runs && problem_adds(ctx) {
            continue;
        }
        let reason = if runs {
            "the problem has no addition"
        } else {
            "the example kernel never runs on forward's path"
        };
        report.error(
            Rule::ExampleKernelCopied,
            ext.call.start_byte(),
            format!(
                "the prompt's elementwise-add example kernel is compiled while forward computes with PyTorch ({reason})"
            ),
        );
    }
}

/// Whether the reference `Model.forward` adds tensors (an add kernel then does real work).
fn problem_adds(ctx: &Context) -> bool {
    let Some(problem) = ctx.problem else {
        return false;
    };
    let Some(forward) = problem
        .classes
        .get("Model")
        .and_then(|m| m.methods.get("forward"))
    else {
        return false;
    };
    descendants(*forward).into_iter().any(|n| match n.kind() {
        "binary_operator" | "augmented_assignment" => n
            .child_by_field_name("operator")
            .is_some_and(|o| matches!(problem.text(o), "+" | "+=")),
        "call" => n
            .child_by_field_name("function")
            .and_then(|f| problem.resolve(f))
            .is_some_and(|d| d == "torch.add" || d.ends_with(".add") || d.ends_with(".add_")),
        _ => false,
    })
}

fn report_compute(ctx: &Context, report: &mut Report, called: &[(usize, String, usize)]) {
    for call in &ctx.forward_path.calls {
        match &call.kind {
            CallKind::TorchCompute(op) => ctx.report_strict(
                report,
                Rule::TorchComputeInForward,
                call.node.start_byte(),
                format!("forward's path computes with PyTorch: `{op}`"),
            ),
            CallKind::Reference => report.error(
                Rule::ReferenceModelUse,
                call.node.start_byte(),
                "forward's path runs the reference `Model`".to_string(),
            ),
            CallKind::Extension { .. } => {}
        }
    }
    let mut seen = HashSet::new();
    for (ext, function, _) in called {
        if !seen.insert((*ext, function.clone())) {
            continue;
        }
        for (op, offset) in ctx.extensions[*ext].reach(function).library_compute {
            ctx.report_strict(
                report,
                Rule::TorchComputeInForward,
                offset,
                format!("`{function}` computes with library code on forward's path: `{op}`"),
            );
        }
    }
}

fn ext_label(ctx: &Context, index: usize) -> String {
    let ext = &ctx.extensions[index];
    ext.module_name
        .clone()
        .unwrap_or_else(|| format!("extension #{}", index + 1))
}
