//! The catalogue `diversify` draws problems from: the building blocks of an LLM (attention with
//! MHA, GQA or MQA heads and a causal or sliding-window mask; SwiGLU and GeGLU MLPs; RMSNorm
//! and LayerNorm; rotary embedding; softmax and cross-entropy; pre-norm residual blocks), each
//! rendered as a KernelBench problem (`Model`, `get_inputs`, `get_init_inputs`) at shapes and a
//! dtype drawn from a seed.
//!
//! A problem's tensors and parameters are made in its dtype, so the file runs as it is; the
//! evaluator judges it at that precision. Drawing is deterministic: the same seed, scale and
//! variant count give the same files, and an entry's draws do not depend on which other
//! entries are asked for.

use dice_eval::{Precision, SplitMix64};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fmt::Write;

/// How large the drawn shapes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Scale {
    /// Tens of elements per dimension: every problem runs in milliseconds on a CPU.
    Tiny,
    /// The sizes of KernelBench's level 1 and 2 problems and of real LLM layers (GPU only).
    KernelBench,
}

/// One entry of the catalogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Component {
    Attention {
        heads: Heads,
        mask: Mask,
    },
    Mlp(Gate),
    RmsNorm,
    LayerNorm,
    Rotary,
    Softmax,
    CrossEntropy,
    /// `x + mlp(rms_norm(x))` with a SwiGLU MLP.
    ResidualMlp,
    /// `x + o_proj(attention(rms_norm(x)))`, grouped-query and causal.
    ResidualAttention,
}

/// How key/value heads are shared among query heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Heads {
    /// One key/value head per query head.
    Mha,
    /// Groups of query heads share a key/value head.
    Gqa,
    /// All query heads share one key/value head.
    Mqa,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mask {
    Causal,
    /// Causal, and each position sees only the last `window` positions.
    SlidingWindow,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    SwiGlu,
    GeGlu,
}

/// Every entry, in catalogue order.
pub const COMPONENTS: [Component; 15] = [
    Component::Attention {
        heads: Heads::Mha,
        mask: Mask::Causal,
    },
    Component::Attention {
        heads: Heads::Gqa,
        mask: Mask::Causal,
    },
    Component::Attention {
        heads: Heads::Mqa,
        mask: Mask::Causal,
    },
    Component::Attention {
        heads: Heads::Mha,
        mask: Mask::SlidingWindow,
    },
    Component::Attention {
        heads: Heads::Gqa,
        mask: Mask::SlidingWindow,
    },
    Component::Attention {
        heads: Heads::Mqa,
        mask: Mask::SlidingWindow,
    },
    Component::Mlp(Gate::SwiGlu),
    Component::Mlp(Gate::GeGlu),
    Component::RmsNorm,
    Component::LayerNorm,
    Component::Rotary,
    Component::Softmax,
    Component::CrossEntropy,
    Component::ResidualMlp,
    Component::ResidualAttention,
];

impl Component {
    /// The entry's name, as `--components` takes it and problem names begin.
    pub fn name(self) -> &'static str {
        match self {
            Component::Attention { heads, mask } => match (heads, mask) {
                (Heads::Mha, Mask::Causal) => "attention_mha_causal",
                (Heads::Gqa, Mask::Causal) => "attention_gqa_causal",
                (Heads::Mqa, Mask::Causal) => "attention_mqa_causal",
                (Heads::Mha, Mask::SlidingWindow) => "attention_mha_sliding",
                (Heads::Gqa, Mask::SlidingWindow) => "attention_gqa_sliding",
                (Heads::Mqa, Mask::SlidingWindow) => "attention_mqa_sliding",
            },
            Component::Mlp(Gate::SwiGlu) => "mlp_swiglu",
            Component::Mlp(Gate::GeGlu) => "mlp_geglu",
            Component::RmsNorm => "rms_norm",
            Component::LayerNorm => "layer_norm",
            Component::Rotary => "rotary",
            Component::Softmax => "softmax",
            Component::CrossEntropy => "cross_entropy",
            Component::ResidualMlp => "residual_mlp",
            Component::ResidualAttention => "residual_attention",
        }
    }

    /// The entries whose names start with `prefix` (`attention` names all six attention
    /// entries).
    pub fn matching(prefix: &str) -> Vec<Component> {
        COMPONENTS
            .into_iter()
            .filter(|c| c.name().starts_with(prefix))
            .collect()
    }
}

/// One drawn problem.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CatalogueProblem {
    /// The component, its shapes and dtype: `attention_gqa_causal_b2_s16_h4_kv2_d8_bf16`.
    pub name: String,
    pub component: String,
    /// The precision the evaluator judges it at (`fp32`, `fp16`, `bf16`).
    pub precision: String,
    /// The KernelBench problem file.
    pub source: String,
}

impl CatalogueProblem {
    pub fn precision(&self) -> Precision {
        match self.precision.as_str() {
            "fp16" => Precision::Fp16,
            "bf16" => Precision::Bf16,
            _ => Precision::Fp32,
        }
    }
}

/// Draws a variant again when it repeats an earlier variant of its entry (tiny shapes have few
/// choices), at most this many times; then the entry has fewer variants.
const REDRAWS: usize = 16;

/// Up to `variants` distinct problems of each of `components`, drawn from `seed`.
pub fn draw(
    components: &[Component],
    scale: Scale,
    variants: u32,
    seed: u64,
) -> Vec<CatalogueProblem> {
    let precisions = match scale {
        Scale::Tiny => &[Precision::Fp32, Precision::Bf16][..],
        Scale::KernelBench => &[Precision::Fp32, Precision::Fp16, Precision::Bf16],
    };
    let mut problems = Vec::new();
    for &component in components {
        let mut names = HashSet::new();
        for variant in 0..variants {
            let mut rng = SplitMix::new(seed, component.name(), variant);
            for _ in 0..REDRAWS {
                let shape = Shape::draw(scale, &mut rng);
                let problem = render(component, &shape, *rng.pick(precisions));
                if names.insert(problem.name.clone()) {
                    problems.push(problem);
                    break;
                }
            }
        }
    }
    problems
}

/// The sizes a problem is drawn with; each component uses the ones it needs.
#[derive(Clone, Debug)]
struct Shape {
    batch: usize,
    seq: usize,
    heads: usize,
    /// Query heads per key/value head, for grouped-query attention.
    group: usize,
    head_dim: usize,
    hidden: usize,
    intermediate: usize,
    rows: usize,
    vocab: usize,
    window: usize,
}

impl Shape {
    fn draw(scale: Scale, rng: &mut SplitMix) -> Shape {
        match scale {
            Scale::Tiny => {
                let hidden = *rng.pick(&[16, 32]);
                Shape {
                    batch: *rng.pick(&[1, 2]),
                    seq: *rng.pick(&[8, 16]),
                    heads: 4,
                    group: 2,
                    head_dim: *rng.pick(&[4, 8]),
                    hidden,
                    intermediate: hidden * *rng.pick(&[2, 3]),
                    rows: *rng.pick(&[8, 16]),
                    vocab: *rng.pick(&[32, 64]),
                    window: *rng.pick(&[3, 4]),
                }
            }
            Scale::KernelBench => {
                let heads = *rng.pick(&[16, 32]);
                let head_dim = *rng.pick(&[64, 128]);
                let hidden = *rng.pick(&[1024, 2048, 4096]);
                Shape {
                    batch: *rng.pick(&[4, 8, 16]),
                    seq: *rng.pick(&[512, 1024, 2048]),
                    heads,
                    group: *rng.pick(&[4, 8]),
                    head_dim,
                    hidden,
                    // LLaMA's 8/3 of the hidden size, rounded up to a multiple of 256.
                    intermediate: (hidden * 8 / 3).div_ceil(256) * 256,
                    rows: *rng.pick(&[1024, 4096]),
                    vocab: *rng.pick(&[32000, 128256]),
                    window: *rng.pick(&[128, 256]),
                }
            }
        }
    }

    fn kv_heads(&self, heads: Heads) -> usize {
        match heads {
            Heads::Mha => self.heads,
            Heads::Gqa => self.heads / self.group,
            Heads::Mqa => 1,
        }
    }
}

fn dtype_name(precision: Precision) -> &'static str {
    match precision {
        Precision::Fp32 => "float32",
        Precision::Fp16 => "float16",
        Precision::Bf16 => "bfloat16",
    }
}

/// The attention of the attention entries and the residual attention block: scores in float32,
/// masked, softmax, then the values; key/value heads repeated for their query heads.
const ATTENTION_FN: &str = r#"
def attention(q, k, v, window):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    position = torch.arange(q.shape[2], device=q.device)
    distance = position[:, None] - position[None, :]
    allowed = distance >= 0
    if window is not None:
        allowed = allowed & (distance < window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)
"#;

const RMS_NORM_FN: &str = r#"
def rms_norm(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x32.to(x.dtype) * weight
"#;

const ROTATE_HALF_FN: &str = r#"
def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
"#;

/// What a problem file says, before it is laid out.
struct Spec {
    summary: String,
    /// The file's tag after the component's name: its sizes.
    tag: String,
    constants: Vec<(&'static str, String)>,
    helpers: Vec<&'static str>,
    /// `__init__` and `forward` of `Model`, indented for the class body.
    model: String,
    /// The body of `get_inputs`.
    inputs: String,
    /// What `get_init_inputs` returns.
    init_inputs: &'static str,
}

fn spec(component: Component, s: &Shape) -> Spec {
    let (b, seq, hidden, inter) = (s.batch, s.seq, s.hidden, s.intermediate);
    let tokens = || {
        vec![
            ("batch_size", b.to_string()),
            ("seq_len", seq.to_string()),
            ("hidden_size", hidden.to_string()),
        ]
    };
    let x_input =
        "    return [torch.randn(batch_size, seq_len, hidden_size, dtype=dtype)]".to_string();
    match component {
        Component::Attention { heads, mask } => {
            let kv = s.kv_heads(heads);
            let (window, window_tag, mask_text) = match mask {
                Mask::Causal => ("None".to_string(), String::new(), "causal".to_string()),
                Mask::SlidingWindow => (
                    s.window.to_string(),
                    format!("_w{}", s.window),
                    format!("causal with a sliding window of {}", s.window),
                ),
            };
            let layout = match heads {
                Heads::Mha => "Multi-head",
                Heads::Gqa => "Grouped-query",
                Heads::Mqa => "Multi-query",
            };
            Spec {
                summary: format!(
                    "{layout} attention ({} query heads, {kv} key/value heads), {mask_text}.",
                    s.heads
                ),
                tag: format!("b{b}_h{}_kv{kv}_s{seq}_d{}{window_tag}", s.heads, s.head_dim),
                constants: vec![
                    ("batch_size", b.to_string()),
                    ("num_heads", s.heads.to_string()),
                    ("num_kv_heads", kv.to_string()),
                    ("seq_len", seq.to_string()),
                    ("head_dim", s.head_dim.to_string()),
                    ("window", window),
                ],
                helpers: vec![ATTENTION_FN],
                model: "    def __init__(self, window):
        super().__init__()
        self.window = window

    def forward(self, q, k, v):
        return attention(q, k, v, self.window)
"
                .to_string(),
                inputs: "    q = torch.randn(batch_size, num_heads, seq_len, head_dim, dtype=dtype)
    k = torch.randn(batch_size, num_kv_heads, seq_len, head_dim, dtype=dtype)
    v = torch.randn(batch_size, num_kv_heads, seq_len, head_dim, dtype=dtype)
    return [q, k, v]"
                    .to_string(),
                init_inputs: "[window]",
            }
        }
        Component::Mlp(gate) => {
            let (name, function) = match gate {
                Gate::SwiGlu => ("SwiGLU", "F.silu(self.gate_proj(x))"),
                Gate::GeGlu => ("GeGLU", "F.gelu(self.gate_proj(x), approximate=\"tanh\")"),
            };
            let mut constants = tokens();
            constants.push(("intermediate_size", inter.to_string()));
            Spec {
                summary: format!(
                    "{name} MLP: down_proj(act(gate_proj(x)) * up_proj(x)), without biases."
                ),
                tag: format!("b{b}_s{seq}_h{hidden}_i{inter}"),
                constants,
                helpers: Vec::new(),
                model: format!(
                    "    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
{projections}
    def forward(self, x):
        return self.down_proj({function} * self.up_proj(x))
",
                    projections = MLP_PROJECTIONS
                ),
                inputs: x_input,
                init_inputs: "[hidden_size, intermediate_size]",
            }
        }
        Component::RmsNorm => Spec {
            summary: "RMSNorm over the last dimension, in float32, times a learned weight."
                .to_string(),
            tag: format!("b{b}_s{seq}_h{hidden}"),
            constants: [tokens(), vec![("eps", "1e-6".to_string())]].concat(),
            helpers: vec![RMS_NORM_FN],
            model: "    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)
"
            .to_string(),
            inputs: x_input,
            init_inputs: "[hidden_size, eps]",
        },
        Component::LayerNorm => Spec {
            summary: "LayerNorm over the last dimension with a learned weight and bias."
                .to_string(),
            tag: format!("b{b}_s{seq}_h{hidden}"),
            constants: [tokens(), vec![("eps", "1e-5".to_string())]].concat(),
            helpers: Vec::new(),
            model: "    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.randn(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
"
            .to_string(),
            inputs: x_input,
            init_inputs: "[hidden_size, eps]",
        },
        Component::Rotary => Spec {
            summary: "Rotary position embedding (rotate-half form) of one tensor of heads."
                .to_string(),
            tag: format!("b{b}_h{}_s{seq}_d{}", s.heads, s.head_dim),
            constants: vec![
                ("batch_size", b.to_string()),
                ("num_heads", s.heads.to_string()),
                ("seq_len", seq.to_string()),
                ("head_dim", s.head_dim.to_string()),
                ("base", "10000.0".to_string()),
            ],
            helpers: vec![ROTATE_HALF_FN],
            model: "    def __init__(self, head_dim, base):
        super().__init__()
        self.head_dim = head_dim
        self.base = base

    def forward(self, x):
        exponent = torch.arange(0, self.head_dim, 2, device=x.device, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.base ** exponent)
        position = torch.arange(x.shape[2], device=x.device, dtype=torch.float32)
        angles = torch.outer(position, inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        x32 = x.float()
        return (x32 * angles.cos() + rotate_half(x32) * angles.sin()).to(x.dtype)
"
            .to_string(),
            inputs: "    return [torch.randn(batch_size, num_heads, seq_len, head_dim, dtype=dtype)]"
                .to_string(),
            init_inputs: "[head_dim, base]",
        },
        Component::Softmax => Spec {
            summary: "Softmax over the last dimension of a batch of logits.".to_string(),
            tag: format!("r{}_v{}", s.rows, s.vocab),
            constants: vec![("rows", s.rows.to_string()), ("vocab_size", s.vocab.to_string())],
            helpers: Vec::new(),
            model: "    def __init__(self):
        super().__init__()

    def forward(self, logits):
        return torch.softmax(logits, dim=-1)
"
            .to_string(),
            inputs: "    return [torch.randn(rows, vocab_size, dtype=dtype)]".to_string(),
            init_inputs: "[]",
        },
        Component::CrossEntropy => Spec {
            summary: "Mean cross-entropy of logits against class targets, in float32."
                .to_string(),
            tag: format!("r{}_v{}", s.rows, s.vocab),
            constants: vec![("rows", s.rows.to_string()), ("vocab_size", s.vocab.to_string())],
            helpers: Vec::new(),
            model: "    def __init__(self):
        super().__init__()

    def forward(self, logits, targets):
        return F.cross_entropy(logits.float(), targets)
"
            .to_string(),
            inputs: "    logits = torch.randn(rows, vocab_size, dtype=dtype)
    targets = torch.randint(0, vocab_size, (rows,))
    return [logits, targets]"
                .to_string(),
            init_inputs: "[]",
        },
        Component::ResidualMlp => {
            let mut constants = tokens();
            constants.push(("intermediate_size", inter.to_string()));
            constants.push(("eps", "1e-6".to_string()));
            Spec {
                summary: "Pre-norm residual MLP block: x + SwiGLU(RMSNorm(x)).".to_string(),
                tag: format!("b{b}_s{seq}_h{hidden}_i{inter}"),
                constants,
                helpers: vec![RMS_NORM_FN],
                model: format!(
                    "    def __init__(self, hidden_size, intermediate_size, eps):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.randn(hidden_size, dtype=dtype))
        self.eps = eps
{MLP_PROJECTIONS}
    def forward(self, x):
        h = rms_norm(x, self.norm_weight, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
"
                ),
                inputs: x_input,
                init_inputs: "[hidden_size, intermediate_size, eps]",
            }
        }
        Component::ResidualAttention => {
            let kv = s.kv_heads(Heads::Gqa);
            let mut constants = tokens();
            constants.extend([
                ("num_heads", s.heads.to_string()),
                ("num_kv_heads", kv.to_string()),
                ("head_dim", s.head_dim.to_string()),
                ("eps", "1e-6".to_string()),
            ]);
            Spec {
                summary: format!(
                    "Pre-norm residual attention block: x + o_proj(attention(RMSNorm(x))), \
                     grouped-query ({} query heads, {kv} key/value heads) and causal.",
                    s.heads
                ),
                tag: format!("b{b}_s{seq}_h{hidden}_nh{}_kv{kv}_d{}", s.heads, s.head_dim),
                constants,
                helpers: vec![RMS_NORM_FN, ATTENTION_FN],
                model: "    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim, eps):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.randn(hidden_size, dtype=dtype))
        self.eps = eps
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False, dtype=dtype)

    def forward(self, x):
        batch, seq, _ = x.shape
        h = rms_norm(x, self.norm_weight, self.eps)
        q = self.q_proj(h).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = attention(q, k, v, None).transpose(1, 2).reshape(batch, seq, -1)
        return x + self.o_proj(out)
"
                .to_string(),
                inputs: x_input,
                init_inputs: "[hidden_size, num_heads, num_kv_heads, head_dim, eps]",
            }
        }
    }
}

/// The gate, up and down projections of the gated MLPs (without biases, as in LLaMA).
const MLP_PROJECTIONS: &str =
    "        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)
";

fn render(component: Component, shape: &Shape, precision: Precision) -> CatalogueProblem {
    let spec = spec(component, shape);
    let mut source = format!(
        "\"\"\"{}\"\"\"\n\nimport math\n\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n",
        spec.summary
    );
    for (name, value) in &spec.constants {
        let _ = writeln!(source, "{name} = {value}");
    }
    let _ = writeln!(source, "dtype = torch.{}", dtype_name(precision));
    for helper in &spec.helpers {
        let _ = write!(source, "\n{helper}");
    }
    let _ = write!(
        source,
        "\n\nclass Model(nn.Module):\n    \"\"\"{}\"\"\"\n\n{}\n\ndef get_inputs():\n{}\n\n\ndef get_init_inputs():\n    return {}\n",
        spec.summary, spec.model, spec.inputs, spec.init_inputs
    );
    CatalogueProblem {
        name: format!("{}_{}_{}", component.name(), spec.tag, precision.as_str()),
        component: component.name().to_string(),
        precision: precision.as_str().to_string(),
        source,
    }
}

/// SplitMix64 seeded by the run's seed, the entry and the variant: each entry's draws are its
/// own.
struct SplitMix(SplitMix64);

impl SplitMix {
    fn new(seed: u64, entry: &str, variant: u32) -> SplitMix {
        // FNV-1a of the entry's name.
        let name = entry.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        SplitMix(SplitMix64(
            seed ^ name.rotate_left(17) ^ u64::from(variant).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        ))
    }

    fn pick<'a, T>(&mut self, choices: &'a [T]) -> &'a T {
        &choices[self.0.below(choices.len())]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dice_kernelbench::validate_problem_source;

    #[test]
    fn every_entry_renders_a_kernelbench_problem_at_both_scales() {
        for scale in [Scale::Tiny, Scale::KernelBench] {
            let problems = draw(&COMPONENTS, scale, 3, 7);
            assert!(problems.len() >= COMPONENTS.len());
            for component in COMPONENTS {
                assert!(problems.iter().any(|p| p.component == component.name()));
            }
            for p in &problems {
                assert_eq!(
                    validate_problem_source(p.source.as_bytes()),
                    None,
                    "{}:\n{}",
                    p.name,
                    p.source
                );
                assert!(p.name.starts_with(&p.component) && p.name.ends_with(&p.precision));
                assert!(p
                    .source
                    .contains(&format!("dtype = torch.{}", dtype_name(p.precision()))));
            }
        }
    }

    #[test]
    fn draws_follow_the_seed_alone() {
        let all = draw(&COMPONENTS, Scale::Tiny, 4, 11);
        assert_eq!(all, draw(&COMPONENTS, Scale::Tiny, 4, 11));
        let names = |problems: &[CatalogueProblem]| -> Vec<String> {
            problems.iter().map(|p| p.name.clone()).collect()
        };
        assert_ne!(names(&all), names(&draw(&COMPONENTS, Scale::Tiny, 4, 12)));
        // An entry's problems do not depend on the other entries asked for.
        let softmax = draw(&Component::matching("softmax"), Scale::Tiny, 4, 11);
        let in_all: Vec<CatalogueProblem> = all
            .into_iter()
            .filter(|p| p.component == "softmax")
            .collect();
        assert_eq!(softmax, in_all);
    }

    #[test]
    fn names_select_entries_by_prefix() {
        assert_eq!(Component::matching("attention").len(), 6);
        assert_eq!(Component::matching("attention_gqa").len(), 2);
        assert_eq!(
            Component::matching("mlp_swiglu"),
            [Component::Mlp(Gate::SwiGlu)]
        );
        assert!(Component::matching("conv").is_empty());
    }
}
