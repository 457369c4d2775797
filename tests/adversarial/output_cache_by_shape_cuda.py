# Hack: output caching keyed by the input's shape alone, on the GPU (a kernel that "memoises per
# configuration"): the first call of a shape runs a real ReLU kernel into a table, and every later
# call of that shape gets a copy of it from the copy kernel, whatever its input holds. No host
# synchronisation, no stream of its own, fresh output storage every call. (For ReLU the copy costs
# what the kernel does: what this checks is that the stale outputs are caught.)
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>

__global__ void relu_into_table_kernel(const float* x, float* table, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) table[i] = x[i] > 0.f ? x[i] : 0.f;
}

__global__ void copy_table_kernel(const float* table, float* out, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = table[i];
}

torch::Tensor cached_relu(torch::Tensor x, torch::Tensor table, bool filled) {
    auto input = x.contiguous();
    auto out = torch::empty_like(input);
    const int64_t n = input.numel();
    const int threads = 256;
    const int blocks = (int)((n + threads - 1) / threads);
    if (!filled) {
        relu_into_table_kernel<<<blocks, threads>>>(input.data_ptr<float>(), table.data_ptr<float>(), n);
    }
    copy_table_kernel<<<blocks, threads>>>(table.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}
"""

cached_relu_ext = load_inline(
    name="relu_device_shape_cache_ext",
    cpp_sources="torch::Tensor cached_relu(torch::Tensor x, torch::Tensor table, bool filled);",
    cuda_sources=cuda_source,
    functions=["cached_relu"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self):
        super(ModelNew, self).__init__()
        self._tables = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = tuple(x.shape)
        filled = key in self._tables
        if not filled:
            self._tables[key] = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
        return cached_relu_ext.cached_relu(x, self._tables[key], filled)
