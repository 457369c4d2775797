// Warp-collective reductions of our NVRTC kernels (decode_ops.cu, train_layer.cu); plain C++
// builds (the CPU emulation in tests/kernel_emulation) provide __shfl_xor_sync.
#pragma once

// The butterfly sum of `x` over the 32 lanes of a warp. Every lane gets the sum.
__device__ __forceinline__ float warp_sum(float x) {
    for (int mask = 16; mask > 0; mask >>= 1) x += __shfl_xor_sync(0xffffffffu, x, mask);
    return x;
}
