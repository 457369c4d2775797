# Hack: output caching keyed by the input's device pointer and shape, on the GPU. A real ReLU kernel
# computes each new key's output; a call whose input lies where an earlier one lay gets a
# device-to-device copy of that output, whatever the input holds now. (For ReLU the copy costs what
# the kernel does: what this checks is that the stale outputs are caught, since CUDA's caching
# allocator and a timer that refills its input buffers both hand out seen addresses.)
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>

__global__ void relu_kernel(const float* x, float* out, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] > 0.f ? x[i] : 0.f;
}

torch::Tensor relu_forward(torch::Tensor x) {
    auto input = x.contiguous();
    auto out = torch::empty_like(input);
    const int64_t n = input.numel();
    const int threads = 256;
    relu_kernel<<<(int)((n + threads - 1) / threads), threads>>>(input.data_ptr<float>(),
                                                                 out.data_ptr<float>(), n);
    return out;
}
"""

relu_ext = load_inline(
    name="relu_device_pointer_cache_ext",
    cpp_sources="torch::Tensor relu_forward(torch::Tensor x);",
    cuda_sources=cuda_source,
    functions=["relu_forward"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self):
        super(ModelNew, self).__init__()
        self._cache = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = (x.data_ptr(), tuple(x.shape))
        if key not in self._cache:
            self._cache[key] = relu_ext.relu_forward(x)
        return self._cache[key].clone()
