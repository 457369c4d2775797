//! Rule behaviour on small programs, including the false positives and negatives of
//! KernelBench's regex checker (spec §4.1) and the prompt's own example (§1.4, §4.5).

use crate::common;
use dice_audit::{audit, custom_kernel_names, Audit, AuditOptions, Rule, Severity};

const RELU_PROBLEM: &str = r#"
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super(Model, self).__init__()

    def forward(self, x):
        return torch.relu(x)

batch_size = 16
dim, depth = 128, 4

def get_inputs():
    return [torch.rand(batch_size, dim)]

def get_init_inputs():
    return []
"#;

/// An honest CUDA ReLU; `{extra}` is spliced into the module, `{forward}` is forward's body.
fn relu_candidate(extra: &str, forward: &str) -> String {
    format!(
        r#"
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

relu_source = """
#include <torch/extension.h>

// two pass reduction? no: one pass. try: except: are not C++.
/* cudaStreamCreate(&s); std::thread t; fork(); */
__global__ void __launch_bounds__(256) relu_kernel(const float* __restrict__ x, float* y, int n) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}}

torch::Tensor relu_cuda(torch::Tensor x) {{
    auto y = torch::empty_like(x);
    const int n = x.numel();
    relu_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}}
"""

relu_decl = "torch::Tensor relu_cuda(torch::Tensor x);"

relu = load_inline(
    name="relu",
    cpp_sources=relu_decl,
    cuda_sources=relu_source,
    functions=["relu_cuda"],
)
{extra}

class ModelNew(nn.Module):
    """A ReLU kernel. We try: nothing fancy; torch.allclose = anything is only prose.
    import threading; class X(torch.Tensor): pass
    """

    def __init__(self):
        super().__init__()
        # self.ext = torch.cuda.Stream()
        self.ext = relu

    def forward(self, x):
{forward}
"#
    )
}

fn run(candidate: &str, problem: &str) -> Audit {
    audit(candidate, problem, &AuditOptions::default())
}

fn has(result: &Audit, rule: Rule, severity: Severity) -> bool {
    result
        .findings
        .iter()
        .any(|f| f.rule == rule && f.severity == severity)
}

#[test]
fn honest_kernel_with_hostile_comments_and_docstrings_is_clean() {
    let result = run(
        &relu_candidate("", "        return self.ext.relu_cuda(x)"),
        RELU_PROBLEM,
    );
    assert!(result.findings.is_empty(), "{:?}", result.findings);
    assert_eq!(
        custom_kernel_names(&relu_candidate("", "        return x")),
        ["relu_kernel", "relu_cuda"]
    );
}

#[test]
fn prompt_example_is_clean_for_addition_and_copied_for_matmul() -> anyhow::Result<()> {
    let (add_problem, example) = common::prompt_example()?;
    let clean = run(&example, &add_problem);
    assert!(!clean.deceptive(), "{:?}", clean.findings);
    assert!(!has(&clean, Rule::TorchComputeInForward, Severity::Warning));

    let matmul_problem = common::problem_source(1, 1)?;
    let original = "return self.elementwise_add.elementwise_add_cuda(a, b)";
    assert!(example.contains(original));
    let cheat = example.replace(
        original,
        "c = torch.matmul(a, b)\n        return self.elementwise_add.elementwise_add_cuda(c, torch.zeros_like(c))",
    );
    let result = run(&cheat, &matmul_problem);
    assert!(
        has(&result, Rule::ExampleKernelCopied, Severity::Error),
        "{:?}",
        result.findings
    );
    Ok(())
}

#[test]
fn compute_the_regex_checker_misses_is_seen() {
    let extra = "\nfrom torch import nn as tnn\n";
    let forward = "        y = self.ext.relu_cuda(x)\n        z = y.matmul(y.t())\n        return tnn.functional.relu(z)";
    let result = run(&relu_candidate(extra, forward), RELU_PROBLEM);
    let compute: Vec<_> = result
        .findings
        .iter()
        .filter(|f| f.rule == Rule::TorchComputeInForward)
        .collect();
    assert_eq!(compute.len(), 2, "{:?}", result.findings);
    assert!(compute.iter().all(|f| f.severity == Severity::Warning));
    assert!(!result.deceptive());

    let strict = audit(
        &relu_candidate(extra, forward),
        RELU_PROBLEM,
        &AuditOptions { strict: true },
    );
    assert!(has(&strict, Rule::TorchComputeInForward, Severity::Error));
}

#[test]
fn nn_layer_without_torch_prefix_on_forward_path_is_compute() {
    let candidate = relu_candidate(
        "\nclass Head(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 4)\n    def forward(self, x):\n        return self.fc(x)\n",
        "        return Head()(self.ext.relu_cuda(x))",
    );
    let result = run(&candidate, RELU_PROBLEM);
    let found = result
        .findings
        .iter()
        .find(|f| f.rule == Rule::TorchComputeInForward)
        .expect("nn.Linear call not seen");
    assert!(
        found.message.contains("torch.nn.Linear"),
        "{}",
        found.message
    );
}

#[test]
fn aten_call_inside_cpp_is_seen_and_is_not_a_custom_kernel() {
    let candidate = relu_candidate("", "        return self.ext.relu_cuda(x)").replace(
        "relu_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);\n    return y;",
        "return at::matmul(x, x);",
    );
    let result = run(&candidate, RELU_PROBLEM);
    assert!(
        has(&result, Rule::NoCustomKernel, Severity::Error),
        "{:?}",
        result.findings
    );
    assert!(result
        .findings
        .iter()
        .any(|f| f.rule == Rule::TorchComputeInForward && f.message.contains("at::matmul")));
}

#[test]
fn kernels_reached_through_wrappers_and_autograd_functions_count() {
    let extra = r#"
class ReluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return relu.relu_cuda(x)

def run_relu(x):
    return ReluFn.apply(x)
"#;
    let result = run(
        &relu_candidate(extra, "        return run_relu(x)"),
        RELU_PROBLEM,
    );
    assert!(!result.deceptive(), "{:?}", result.findings);
}

#[test]
fn sources_built_from_names_concatenation_and_fstrings_resolve() {
    let candidate = r##"
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

BLOCK = 128
header = "#include <torch/extension.h>\n"
kernel = f"""
__global__ void scale_kernel(float* y, int n) {{
    int i = blockIdx.x * {BLOCK} + threadIdx.x;
    if (i < n) y[i] *= 2.f;
}}
"""
launcher = """
torch::Tensor scale(torch::Tensor y) {
    scale_kernel<<<(y.numel() + 127) / 128, 128>>>(y.data_ptr<float>(), y.numel());
    return y;
}
"""
ext = load_inline("scale_ext", ["torch::Tensor scale(torch::Tensor y);"], header + kernel + launcher, ["scale"])

class ModelNew(nn.Module):
    def forward(self, x):
        return ext.scale(x.clone())
"##;
    assert_eq!(custom_kernel_names(candidate), ["scale_kernel", "scale"]);
    let result = run(candidate, RELU_PROBLEM);
    assert!(!result.deceptive(), "{:?}", result.findings);
}

#[test]
fn problem_constants_compare_by_value() {
    let same = relu_candidate(
        "batch_size = 8 * 2\ndim, depth = 128, 4\n",
        "        return self.ext.relu_cuda(x)",
    );
    let result = run(&same, RELU_PROBLEM);
    assert!(!result.deceptive(), "{:?}", result.findings);
    assert!(has(
        &result,
        Rule::ProblemConstantRedefined,
        Severity::Warning
    ));

    // dice's judge draws inputs from the problem in its own process: other sizes, another
    // `get_inputs` or a `global` rebinding only fool a harness sharing the problem's namespace.
    let rebindings = [
        "dim, depth = 64, 4\n",
        "def get_inputs():\n    return [torch.rand(batch_size, dim).cuda()]\n",
        "def get_init_inputs():\n    return [1]\n",
        "def shrink():\n    global batch_size\n    batch_size = 1\n",
        "globals()['batch_size'] = 1\n",
    ];
    for extra in rebindings {
        let result = run(
            &relu_candidate(extra, "        return self.ext.relu_cuda(x)"),
            RELU_PROBLEM,
        );
        assert!(!result.deceptive(), "{extra}: {:?}", result.findings);
        let warning = result
            .findings
            .iter()
            .find(|f| f.rule == Rule::ProblemConstantRedefined)
            .unwrap_or_else(|| panic!("{extra}: no warning in {:?}", result.findings));
        assert!(
            warning.message.contains("KernelBench's harness")
                && warning.message.contains("dice's judge"),
            "{}",
            warning.message
        );
    }
}

#[test]
fn inheriting_model_only_for_its_construction_is_a_warning() {
    let model = "\nclass Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.scale = 1.0\n\n    def forward(self, x):\n        return torch.relu(x)\n";
    let own_forward = relu_candidate(model, "        return self.ext.relu_cuda(x)")
        .replace("class ModelNew(nn.Module):", "class ModelNew(Model):");
    let result = run(&own_forward, RELU_PROBLEM);
    assert!(!result.deceptive(), "{:?}", result.findings);
    assert!(has(&result, Rule::ReferenceInheritance, Severity::Warning));

    let reference_forward = relu_candidate(
        model,
        "        self.ext.relu_cuda(x)\n        return super().forward(x)",
    )
    .replace("class ModelNew(nn.Module):", "class ModelNew(Model):");
    let result = run(&reference_forward, RELU_PROBLEM);
    assert!(
        has(&result, Rule::ReferenceInheritance, Severity::Error),
        "{:?}",
        result.findings
    );
}

#[test]
fn the_judges_module_of_the_problem_is_the_reference() {
    for access in [
        "import dice_problem\n",
        "from dice_problem import Model as Reference\n",
    ] {
        let candidate = relu_candidate(access, "        return self.ext.relu_cuda(x)");
        let result = run(&candidate, RELU_PROBLEM);
        assert!(
            has(&result, Rule::ReferenceModelUse, Severity::Error),
            "{access}: {:?}",
            result.findings
        );
    }
}

#[test]
fn a_self_test_under_the_main_guard_may_call_the_problem_functions() {
    let self_test = "\nif __name__ == '__main__':\n    model = ModelNew(*get_init_inputs())\n    print(model(*get_inputs()))\n";
    let candidate = relu_candidate("", "        return self.ext.relu_cuda(x)") + self_test;
    let result = run(&candidate, RELU_PROBLEM);
    assert!(result.findings.is_empty(), "{:?}", result.findings);

    let at_import =
        relu_candidate("", "        return self.ext.relu_cuda(x)") + "\nEXAMPLE = get_inputs()\n";
    assert!(has(
        &run(&at_import, RELU_PROBLEM),
        Rule::ReferenceModelUse,
        Severity::Error
    ));
}

#[test]
fn import_guards_off_the_kernel_path_are_not_fallbacks() {
    let extra = "try:\n    import numpy\nexcept ImportError:\n    numpy = None\n";
    let result = run(
        &relu_candidate(extra, "        return self.ext.relu_cuda(x)"),
        RELU_PROBLEM,
    );
    assert!(result.findings.is_empty(), "{:?}", result.findings);

    let guarded_build = relu_candidate("", "        return self.ext.relu_cuda(x)")
        .replace("relu = load_inline(", "try:\n    relu = load_inline(");
    let guarded_build = guarded_build.replace(
        "    functions=[\"relu_cuda\"],\n)",
        "    functions=[\"relu_cuda\"],\n)\nexcept Exception:\n    relu = None",
    );
    let result = run(&guarded_build, RELU_PROBLEM);
    assert!(
        has(&result, Rule::ExceptionFallback, Severity::Error),
        "{:?}",
        result.findings
    );
}

#[test]
fn backend_flags_warn_and_library_patches_are_errors() {
    let flags = relu_candidate(
        "torch.backends.cudnn.benchmark = True\n",
        "        return self.ext.relu_cuda(x)",
    );
    let result = run(&flags, RELU_PROBLEM);
    assert!(has(&result, Rule::Monkeypatch, Severity::Warning));
    assert!(!result.deceptive());

    let patched = relu_candidate(
        "import numpy as np\nnp.testing.assert_allclose = print\n",
        "        return self.ext.relu_cuda(x)",
    );
    assert!(has(
        &run(&patched, RELU_PROBLEM),
        Rule::Monkeypatch,
        Severity::Error
    ));
}

#[test]
fn cpp_side_hazards_are_seen() {
    let candidate = relu_candidate("", "        return self.ext.relu_cuda(x)").replace(
        "auto y = torch::empty_like(x);",
        "auto y = torch::empty_like(x);\n    std::thread worker([] {});\n    if (fork() == 0) { system(\"sleep 100\"); }",
    );
    let result = run(&candidate, RELU_PROBLEM);
    for rule in [Rule::Threads, Rule::Multiprocessing, Rule::Subprocess] {
        assert!(
            has(&result, rule, Severity::Error),
            "{rule}: {:?}",
            result.findings
        );
    }
}

#[test]
fn findings_point_at_the_candidate_line() {
    let candidate = "import torch\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n";
    let result = run(candidate, RELU_PROBLEM);
    let compute = result
        .findings
        .iter()
        .find(|f| f.rule == Rule::TorchComputeInForward)
        .expect("torch.relu not reported");
    assert_eq!((compute.line, compute.column), (6, 16));
    assert_eq!(
        result.flags(),
        ["no_custom_kernel", "torch_compute_in_forward"]
    );
}

#[test]
fn rule_ids_round_trip() {
    for rule in Rule::ALL {
        assert_eq!(Rule::from_id(rule.id()), Some(rule));
    }
}

#[test]
fn local_aliases_of_extension_functions_are_followed() {
    let forward = "        run = self.ext.relu_cuda\n        return run(x)";
    let result = run(&relu_candidate("", forward), RELU_PROBLEM);
    assert!(result.findings.is_empty(), "{:?}", result.findings);
}

#[test]
fn forward_without_the_kernel_is_not_called_even_if_a_helper_uses_it() {
    let extra = "\ndef helper(x):\n    return relu.relu_cuda(x)\n";
    let result = run(
        &relu_candidate(extra, "        return torch.relu(x)"),
        RELU_PROBLEM,
    );
    assert!(
        has(&result, Rule::KernelNotCalled, Severity::Error),
        "{:?}",
        result.findings
    );
    assert!(!has(&result, Rule::KernelNotWired, Severity::Error));
}

/// Only errors a profile of forward cannot turn into warnings decide before the program runs:
/// "not called" may be the call graph's blind spot, PyTorch compute in a strict forward is not.
#[test]
fn only_errors_no_run_can_outweigh_decide_before_running() {
    let honest = run(
        &relu_candidate("", "        return self.ext.relu_cuda(x)"),
        RELU_PROBLEM,
    );
    assert!(honest.decided_without_running().is_none());
    let extra = "\ndef helper(x):\n    return relu.relu_cuda(x)\n";
    let not_called = relu_candidate(extra, "        return torch.relu(x)");
    let lenient = run(&not_called, RELU_PROBLEM);
    assert!(lenient.deceptive());
    assert!(lenient.decided_without_running().is_none());
    let strict = audit(&not_called, RELU_PROBLEM, &AuditOptions { strict: true });
    let decided = strict.decided_without_running().expect("decided");
    assert_eq!(decided.rule, Rule::TorchComputeInForward);
    assert_eq!(decided.severity, Severity::Error);
}

#[test]
fn file_writes_are_judged_by_mode_and_path() {
    let write = |code: &str| {
        run(
            &relu_candidate(
                &format!("import pathlib\n{code}\n"),
                "        return self.ext.relu_cuda(x)",
            ),
            RELU_PROBLEM,
        )
    };
    for outside in [
        "open('/tmp/out.txt', 'w')",
        "open('../out.txt', mode='a')",
        "pathlib.Path('/tmp/x').open('w')",
        "pathlib.Path('out.txt').write_text('x')",
        "import shutil\nshutil.rmtree('/tmp/cache')",
        "from shutil import copyfile",
        // Out of a fresh temporary folder, or into one that was not made fresh.
        "import os, tempfile\nD = tempfile.mkdtemp()\nopen(os.path.join(D, '../../x.cu'), 'w')",
        "import os, tempfile\nD = tempfile.mkdtemp()\nopen(os.path.join(D, '/etc/x'), 'w')",
        "import tempfile\nD = pathlib.Path(tempfile.mkdtemp())\n(D / '..' / 'x').write_text('y')",
        "import os, tempfile\nD = tempfile.gettempdir()\nopen(os.path.join(D, 'x.cu'), 'w')",
        // A name that is also bound to another place in the function.
        "import os, tempfile\ndef build(src, out):\n    d = tempfile.mkdtemp()\n    d = out\n    open(os.path.join(d, 'k.cu'), 'w')",
        "import os, tempfile\ndef build(src):\n    with open('/tmp/x') as d:\n        open(os.path.join(d, 'k.cu'), 'w')",
        "import os, tempfile\ndef build(src, d=None):\n    if d is None:\n        d = tempfile.mkdtemp()\n    open(os.path.join(d, 'k.cu'), 'w')",
        // A function's own name shadows the module's temporary folder.
        "import os, tempfile\nD = tempfile.mkdtemp()\ndef build(out):\n    D = out\n    open(os.path.join(D, 'k.cu'), 'w')",
    ] {
        assert!(
            has(
                &write(outside),
                Rule::FileWriteOutsideWorkdir,
                Severity::Error
            ),
            "{outside}"
        );
    }
    for inside in [
        "open('/etc/hostname')",
        "open('build/log.txt', 'w')",
        "pathlib.Path('/tmp/x').open()",
        "import tempfile\nBUILD = tempfile.mkdtemp()",
        "import shutil\nNVCC = shutil.which('nvcc')",
        // Sources written into a folder tempfile made for this process, to build from.
        "import os, tempfile\nD = tempfile.mkdtemp()\nP = os.path.join(D, 'relu.cu')\nopen(P, 'w')",
        "import os, tempfile\nopen(os.path.join(tempfile.mkdtemp(), 'k', 'relu.cpp'), 'w')",
        "import tempfile\nD = pathlib.Path(tempfile.mkdtemp())\n(D / 'relu.cu').open('w')",
        "import tempfile\n(pathlib.Path(tempfile.mkdtemp()) / 'relu.cu').write_text('src')",
        "import os, tempfile\ndef build(src):\n    d = tempfile.mkdtemp()\n    p = os.path.join(d, 'k.cu')\n    with open(p, 'w') as f:\n        f.write(src)",
        "import os, tempfile\ndef build(src):\n    with tempfile.TemporaryDirectory() as d:\n        open(os.path.join(d, 'k.cu'), 'w').write(src)",
    ] {
        assert!(write(inside).findings.is_empty(), "{inside}");
    }
}

#[test]
fn extensions_stored_as_class_attributes_are_followed() {
    let candidate = relu_candidate("", "        return self.kernels.relu_cuda(x)").replace(
        "    def __init__(self):",
        "    kernels = relu\n\n    def __init__(self):",
    );
    let result = run(&candidate, RELU_PROBLEM);
    assert!(result.findings.is_empty(), "{:?}", result.findings);
}

#[test]
fn extensions_built_from_files_get_the_benefit_of_the_doubt_with_a_warning() {
    let candidate = r#"
import torch.nn as nn
from torch.utils.cpp_extension import load

ext = load(name="relu_files", sources=["relu.cpp", "relu_kernel.cu"])

class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu(x)
"#;
    let result = run(candidate, RELU_PROBLEM);
    assert_eq!(
        result.flags(),
        ["unresolved_source"],
        "{:?}",
        result.findings
    );
    assert!(!result.deceptive());
    let strict = audit(candidate, RELU_PROBLEM, &AuditOptions { strict: true });
    assert!(strict.deceptive());
}

#[test]
fn malformed_input_is_reported_not_panicked_on() {
    for candidate in [
        "",
        "class ModelNew(:\n  def",
        "\u{0}\u{ffff}ä",
        "x = '''unterminated",
    ] {
        let result = audit(candidate, "not python ((", &AuditOptions::default());
        assert!(result.deceptive(), "{candidate:?}: {:?}", result.findings);
        assert!(custom_kernel_names(candidate).is_empty());
    }
}

/// An honest extension with a ReLU kernel and its gradient, compiled for a backward pass the
/// benchmark never runs: forward uses one export and leaves the other alone. `{module}` is
/// spliced in before `ModelNew`, `{methods}` into its body (with its `__init__`), `{forward}` is
/// forward's body.
fn relu_and_grad_candidate(module: &str, methods: &str, forward: &str) -> String {
    format!(
        r#"
import functools
from functools import partial
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = """
#include <torch/extension.h>

__global__ void relu_kernel(const float* x, float* y, int n) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}}

__global__ void relu_grad_kernel(const float* x, const float* g, float* dx, int n) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dx[i] = x[i] > 0.f ? g[i] : 0.f;
}}

torch::Tensor relu_cuda(torch::Tensor x) {{
    auto y = torch::empty_like(x);
    const int n = x.numel();
    relu_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}}

torch::Tensor relu_grad_cuda(torch::Tensor x, torch::Tensor g) {{
    auto dx = torch::empty_like(x);
    const int n = x.numel();
    relu_grad_kernel<<<(n + 255) / 256, 256>>>(
        x.data_ptr<float>(), g.data_ptr<float>(), dx.data_ptr<float>(), n);
    return dx;
}}
"""

ops = load_inline(
    name="relu_ops",
    cpp_sources="torch::Tensor relu_cuda(torch::Tensor x); torch::Tensor relu_grad_cuda(torch::Tensor x, torch::Tensor g);",
    cuda_sources=source,
    functions=["relu_cuda", "relu_grad_cuda"],
)
{module}

class ModelNew(nn.Module):
{methods}

    def forward(self, x):
{forward}
"#
    )
}

const PLAIN_INIT: &str = "    def __init__(self):\n        super().__init__()";

#[test]
fn kernels_wired_through_helpers_modules_and_partials_are_called() {
    let activation = "\nclass Activation(nn.Module):\n    def forward(self, x):\n        return ops.relu_cuda(x)\n";
    let wirings = [
        ("", PLAIN_INIT, "        return ops.relu_cuda(x)"),
        (
            "\ndef apply_relu(x):\n    return ops.relu_cuda(x)\n",
            PLAIN_INIT,
            "        return apply_relu(x)",
        ),
        (
            "",
            "    def __init__(self):\n        super().__init__()\n        self.ops = ops\n\n    def activate(self, x):\n        return self.ops.relu_cuda(x)",
            "        return self.activate(x)",
        ),
        (
            activation,
            "    def __init__(self):\n        super().__init__()\n        self.act = Activation()",
            "        return self.act(x)",
        ),
        (
            activation,
            "    def __init__(self):\n        super().__init__()\n        self.body = nn.Sequential(Activation())",
            "        return self.body(x)",
        ),
        (
            "\nrelu = functools.partial(ops.relu_cuda)\n",
            PLAIN_INIT,
            "        return relu(x)",
        ),
        (
            "",
            "    def __init__(self):\n        super().__init__()\n        self.relu = partial(ops.relu_cuda)",
            "        return self.relu(x)",
        ),
        (
            "",
            PLAIN_INIT,
            "        relu = partial(ops.relu_cuda)\n        return relu(x)",
        ),
        (
            activation,
            "    def __init__(self):\n        super().__init__()\n        self.layers = nn.ModuleList([Activation() for _ in range(2)])",
            "        for layer in self.layers:\n            x = layer(x)\n        return x",
        ),
        (
            activation,
            "    def __init__(self):\n        super().__init__()\n        self.layers = nn.ModuleList()\n        for _ in range(2):\n            self.layers.append(Activation())",
            "        for i, layer in enumerate(self.layers):\n            x = layer(x)\n        return x",
        ),
        (
            activation,
            "    def __init__(self):\n        super().__init__()\n        self.blocks = nn.ModuleDict({'act': Activation()})",
            "        return self.blocks['act'](x)",
        ),
        (
            activation,
            "    def __init__(self):\n        super().__init__()\n        self.blocks = nn.ModuleDict()\n        self.blocks['act'] = Activation()",
            "        for name, block in self.blocks.items():\n            x = block(x)\n        return x",
        ),
        (
            activation,
            "    def __init__(self):\n        super().__init__()\n        for i in range(2):\n            setattr(self, f'act{i}', Activation())",
            "        for i in range(2):\n            x = getattr(self, f'act{i}')(x)\n        return x",
        ),
        (
            activation,
            "    def __init__(self):\n        super().__init__()\n        for i in range(2):\n            self.add_module(f'act{i}', Activation())",
            "        return self.act1(self.act0(x))",
        ),
        (
            &format!("{activation}{NESTED_STAGES}"),
            "    def __init__(self):\n        super().__init__()\n        self.net = Network()",
            "        return self.net(x)",
        ),
        (
            "\nclass Runner:\n    def __init__(self):\n        self.ext = ops\n\n    def run(self, x):\n        return self.ext.relu_cuda(x)\n",
            "    def __init__(self):\n        super().__init__()\n        self.runners = [Runner(), Runner()]",
            "        return sum(runner.run(x) for runner in self.runners)",
        ),
        (
            "\nclass Fused(nn.Module):\n    def __init__(self, ext, scale=1.0):\n        super().__init__()\n        self.ext = ext\n\n    def forward(self, x):\n        return self.ext.relu_cuda(x)\n",
            "    def __init__(self):\n        super().__init__()\n        self.blocks = nn.ModuleList([Fused(ops), Fused(ext=ops)])",
            "        for block in self.blocks:\n            x = block(x)\n        return x",
        ),
        (
            "\ndef scaled_relu(x, scale):\n    return ops.relu_cuda(x) * scale\n",
            "    def __init__(self):\n        super().__init__()\n        self.act = partial(scaled_relu, scale=1.0)",
            "        return self.act(x)",
        ),
        (
            "\nACTIVATIONS = {'relu': ops.relu_cuda}\n",
            PLAIN_INIT,
            "        return ACTIVATIONS['relu'](x)",
        ),
        (
            "",
            "    def __init__(self):\n        super().__init__()\n        self.act = lambda t: ops.relu_cuda(t)",
            "        return self.act(x)",
        ),
        (
            "\nclass ReluFn(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n        return ops.relu_cuda(x)\n",
            "    def __init__(self):\n        super().__init__()\n        self.fn = ReluFn.apply",
            "        return self.fn(x)",
        ),
    ];
    for (module, methods, forward) in &wirings {
        let result = run(
            &relu_and_grad_candidate(module, methods, forward),
            RELU_PROBLEM,
        );
        assert!(
            result.findings.is_empty(),
            "{module}{methods}\n{forward}: {:?}",
            result.findings
        );
    }
}

/// Helper modules nested two deep: a `Network` of `Stage`s in a `ModuleList`, each running an
/// `Activation` from an `nn.Sequential`.
const NESTED_STAGES: &str = r#"
class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(Activation(), nn.Identity())

    def forward(self, x):
        return self.inner(x)

class Network(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList([Stage(), Stage()])

    def forward(self, x):
        return self.stages[1](self.stages[0](x))
"#;

#[test]
fn kernels_held_by_helper_modules_that_forward_never_runs_are_not_called() {
    let activation = "\nclass Activation(nn.Module):\n    def forward(self, x):\n        return ops.relu_cuda(x)\n";
    let methods = "    def __init__(self):\n        super().__init__()\n        self.layers = nn.ModuleList([Activation() for _ in range(2)])";
    let result = run(
        &relu_and_grad_candidate(activation, methods, "        return torch.relu(x)"),
        RELU_PROBLEM,
    );
    assert!(
        has(&result, Rule::KernelNotCalled, Severity::Error),
        "{:?}",
        result.findings
    );

    let never_used = relu_and_grad_candidate("", PLAIN_INIT, "        return torch.relu(x)");
    let result = run(&never_used, RELU_PROBLEM);
    assert!(
        has(&result, Rule::KernelNotWired, Severity::Error),
        "{:?}",
        result.findings
    );

    let pure_torch = "import torch\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n";
    let result = run(pure_torch, RELU_PROBLEM);
    assert!(
        has(&result, Rule::NoCustomKernel, Severity::Error),
        "{:?}",
        result.findings
    );
}

#[test]
fn forward_that_runs_no_kernel_is_not_called_even_through_a_partial() {
    let methods =
        "    def __init__(self):\n        super().__init__()\n        self.relu = partial(ops.relu_cuda)";
    let result = run(
        &relu_and_grad_candidate("", methods, "        return torch.relu(x)"),
        RELU_PROBLEM,
    );
    assert!(
        has(&result, Rule::KernelNotCalled, Severity::Error),
        "{:?}",
        result.findings
    );
}

/// The built-in examples' correct candidates (examples/README.md) raise no finding.
#[test]
fn correct_examples_are_clean() -> anyhow::Result<()> {
    let examples = dice_test_support::examples_dir();
    let candidates = std::fs::read_to_string(examples.join("candidates.jsonl"))?
        .lines()
        .map(serde_json::from_str::<serde_json::Value>)
        .collect::<Result<Vec<_>, _>>()?;
    for (problem, file) in [(1, "1_ReLU.py"), (2, "2_Scaled_residual.py")] {
        let source = std::fs::read_to_string(examples.join("kernelbench/level1").join(file))?;
        let code = candidates
            .iter()
            .find(|c| c["problem_id"] == problem && c["sample_id"] == 0)
            .and_then(|c| c["code"].as_str().map(str::to_string))
            .ok_or_else(|| anyhow::anyhow!("no sample 0 of problem {problem}"))?;
        let result = run(&code, &source);
        assert!(result.findings.is_empty(), "{file}: {:?}", result.findings);
    }
    Ok(())
}
