//! Which PyTorch (and ATen) operations count as "compute" rather than allocation,
//! views or data movement.

/// Operator names that do the arithmetic of KernelBench problems.
const COMPUTE_OPS: &[&str] = &[
    "matmul",
    "mm",
    "bmm",
    "addmm",
    "addmv",
    "addbmm",
    "baddbmm",
    "mv",
    "dot",
    "einsum",
    "tensordot",
    "linear",
    "bilinear",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "convolution",
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "avg_pool1d",
    "avg_pool2d",
    "avg_pool3d",
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "adaptive_avg_pool3d",
    "adaptive_max_pool1d",
    "adaptive_max_pool2d",
    "adaptive_max_pool3d",
    "lp_pool1d",
    "lp_pool2d",
    "relu",
    "relu_",
    "relu6",
    "leaky_relu",
    "gelu",
    "silu",
    "selu",
    "elu",
    "celu",
    "mish",
    "sigmoid",
    "tanh",
    "softmax",
    "log_softmax",
    "softplus",
    "softsign",
    "hardtanh",
    "hardswish",
    "hardsigmoid",
    "tanhshrink",
    "softshrink",
    "hardshrink",
    "threshold",
    "prelu",
    "rrelu",
    "glu",
    "logsigmoid",
    "batch_norm",
    "layer_norm",
    "group_norm",
    "instance_norm",
    "local_response_norm",
    "rms_norm",
    "normalize",
    "dropout",
    "logsumexp",
    "clamp",
    "clip",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "sum",
    "mean",
    "prod",
    "amax",
    "amin",
    "argmax",
    "argmin",
    "norm",
    "var",
    "std",
    "var_mean",
    "frobenius_norm",
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "kl_div",
    "cosine_similarity",
    "cosine_embedding_loss",
    "triplet_margin_loss",
    "hinge_embedding_loss",
    "margin_ranking_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "scaled_dot_product_attention",
    "multi_head_attention_forward",
    "lstm",
    "gru",
    "rnn_tanh",
    "rnn_relu",
    "embedding",
    "interpolate",
    "upsample",
    "upsample_nearest2d",
    "upsample_bilinear2d",
    "pixel_shuffle",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "pow",
    "abs",
    "reciprocal",
    "erf",
    "sin",
    "cos",
    "where",
    "triu",
    "tril",
    "diag",
    "outer",
    "cross",
    "cdist",
    "sort",
    "topk",
    "max",
    "min",
    "add",
    "sub",
    "mul",
    "div",
    "addcmul",
    "addcdiv",
    "fft",
];

pub(crate) fn is_compute_op(name: &str) -> bool {
    COMPUTE_OPS.contains(&name)
}

/// `torch.nn` members that hold parameters or containers and compute nothing themselves.
const NN_NON_COMPUTE: &[&str] = &[
    "Module",
    "ModuleList",
    "ModuleDict",
    "Parameter",
    "ParameterList",
    "ParameterDict",
    "Identity",
    "Flatten",
    "Unflatten",
    "init",
    "parameter",
    "Buffer",
];

/// `torch.nn.Conv2d` and friends: a layer whose call computes with PyTorch.
pub(crate) fn is_nn_layer(dotted: &str) -> bool {
    let Some(member) = dotted.strip_prefix("torch.nn.") else {
        return false;
    };
    !member.contains('.')
        && member.starts_with(|c: char| c.is_ascii_uppercase())
        && !NN_NON_COMPUTE.contains(&member)
}

/// Whether a resolved dotted call name (`torch.matmul`, `torch.nn.functional.relu`,
/// `torch.special.erf`) is a PyTorch compute op.
pub(crate) fn is_torch_compute(dotted: &str) -> bool {
    if let Some(rest) = dotted.strip_prefix("torch.nn.functional.") {
        return !rest.contains('.') && !rest.starts_with('_') && rest != "pad";
    }
    for namespace in [
        "torch.",
        "torch.special.",
        "torch.linalg.",
        "torch.fft.",
        "torch._C._nn.",
    ] {
        if let Some(op) = dotted.strip_prefix(namespace) {
            if !op.contains('.') && (is_compute_op(op) || namespace != "torch.") {
                return true;
            }
        }
    }
    false
}

/// Tensor methods that compute (`x.matmul(w)`, `x.softmax(-1)`); receivers are not typed,
/// so names that commonly belong to non-tensors (`max`, `add`, `sort`, `cat`...) are left out.
pub(crate) fn is_compute_method(name: &str) -> bool {
    const AMBIGUOUS: &[&str] = &[
        "max",
        "min",
        "add",
        "sub",
        "mul",
        "div",
        "sort",
        "where",
        "abs",
        "pow",
        "sum",
        "mean",
        "fft",
        "diag",
        "log",
        "exp",
        "norm",
        "clip",
        "cross",
        "outer",
        "dot",
        "embedding",
        "upsample",
        "lstm",
        "gru",
    ];
    is_compute_op(name) && !AMBIGUOUS.contains(&name)
}
