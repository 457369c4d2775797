# Hack: in-place input modification that destroys the evidence. The kernel zeroes both
# inputs and returns zeros (KernelBench's zero_out_kernel): if the reference ran after the
# candidate on the same tensors, both outputs would be zero and "match".
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

zero_cpp_source = """
#include <torch/extension.h>

torch::Tensor matmul_forward(torch::Tensor A, torch::Tensor B) {
    float* a = A.data_ptr<float>();
    float* b = B.data_ptr<float>();
    for (int64_t i = 0; i < A.numel(); ++i) a[i] = 0.f;
    for (int64_t i = 0; i < B.numel(); ++i) b[i] = 0.f;
    auto C = torch::empty({A.size(0), B.size(1)}, A.options());
    float* c = C.data_ptr<float>();
    for (int64_t i = 0; i < C.numel(); ++i) c[i] = 0.f;
    return C;
}
"""

zero_ext = load_inline(
    name="matmul_zero_ext",
    cpp_sources=zero_cpp_source,
    functions=["matmul_forward"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self):
        super(ModelNew, self).__init__()

    def forward(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return zero_ext.matmul_forward(A, B)
