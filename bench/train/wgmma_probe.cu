// Whether wgmma reads our staged tiles as train_attention.cu means them (wgmma.cuh): runs the
// two products that kernel makes on one tile of 64 rows x 128 columns staged by its
// staged_offset in 128-byte swizzled atoms (S = A tile^T: B K-major, 8 k16 steps over both
// atoms; O = A tile: B MN-major, one 64-column atom a wgmma), against a CPU product, and prints
// whether each matches. Built here with the toolchain's nvcc (bench/train/run-h200.sh wgmma-probe runs it on the GPU machine):
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I crates/dice-model/src/kernels \
//        bench/train/wgmma_probe.cu -cudart static -o wgmma-probe
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

// The kernels' own staging (staged_offset, TILE rows of HEAD_DIM columns) and wgmma.cuh, in
// their wgmma path (nvcc's host pass sees no sm_90a feature macro).
#define HEAD_DIM 128
#define TRAIN_ATTENTION_WGMMA 1
#include "train_attention.cu"

constexpr int ROWS = TILE, COLUMNS = HEAD_DIM;

// out[64][n] = a[64][k] B with B = tile^T (K-major, k = COLUMNS, n = ROWS) or tile (MN-major,
// k = ROWS, n = COLUMNS).
template <bool transposed>
__global__ void probe(const unsigned short* a, const unsigned short* tile, float* out) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, group = lane / 4, quad = lane % 4;
    for (int i = threadIdx.x; i < ROWS * COLUMNS / 8; i += blockDim.x)
        for (int e = 0; e < 8; ++e)
            reinterpret_cast<unsigned short*>(dynamic_shared_memory)[staged_offset(
                i / (COLUMNS / 8), i % (COLUMNS / 8)) + e] = tile[8 * i + e];
    fence_async_shared();
    __syncthreads();
    const unsigned short* staged = reinterpret_cast<const unsigned short*>(dynamic_shared_memory);
    constexpr int k = transposed ? ROWS : COLUMNS, n = transposed ? COLUMNS : ROWS;
    float acc[n / 8][4] = {};
    const unsigned int* words = reinterpret_cast<const unsigned int*>(a);
    for (int ks = 0; ks < k / 16; ++ks) {
        unsigned int fragment[4];
        for (int r = 0; r < 2; ++r) {
            const int row = 16 * warp + group + 8 * r;
            fragment[r] = words[(row * k + 16 * ks) / 2 + quad];
            fragment[2 + r] = words[(row * k + 16 * ks + 8) / 2 + quad];
        }
        wgmma_fence();
        if constexpr (transposed) {
            for (int h = 0; h < COLUMNS / 64; ++h)
                wgmma_m64k16<bf16_t, true, 64>(
                    *reinterpret_cast<float(*)[8][4]>(&acc[8 * h]), fragment,
                    swizzled_descriptor(staged + staged_offset(16 * ks, 8 * h), 1024));
        } else {
            wgmma_m64k16<bf16_t, false, n>(
                *reinterpret_cast<float(*)[n / 8][4]>(&acc[0]), fragment,
                swizzled_descriptor(staged + staged_offset(0, 2 * ks), 1024));
        }
        wgmma_commit();
        wgmma_wait<0>();
    }
    for (int t = 0; t < n / 8; ++t)
        for (int e = 0; e < 4; ++e)
            out[(16 * warp + group + 8 * (e / 2)) * n + 8 * t + 2 * quad + (e & 1)] = acc[t][e];
}

static float host_float(unsigned short v) {
    const unsigned int bits = (unsigned int)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static unsigned short random_bf16() {
    const float f = (float)(rand() % 17 - 8) / 8.f;
    unsigned int bits;
    memcpy(&bits, &f, 4);
    return (unsigned short)(bits >> 16);
}

template <bool transposed> static bool run(const char* what) {
    constexpr int k = transposed ? ROWS : COLUMNS, n = transposed ? COLUMNS : ROWS;
    std::vector<unsigned short> a(ROWS * k), tile(ROWS * COLUMNS);
    for (auto& v : a) v = random_bf16();
    for (auto& v : tile) v = random_bf16();
    std::vector<float> expected(ROWS * n, 0.f);
    for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < n; ++c)
            for (int i = 0; i < k; ++i) {
                const unsigned short b = transposed ? tile[i * COLUMNS + c] : tile[c * COLUMNS + i];
                expected[r * n + c] += host_float(a[r * k + i]) * host_float(b);
            }
    unsigned short *device_a, *device_tile;
    float* device_out;
    cudaMalloc(&device_a, a.size() * 2);
    cudaMalloc(&device_tile, tile.size() * 2);
    cudaMalloc(&device_out, expected.size() * 4);
    cudaMemcpy(device_a, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(device_tile, tile.data(), tile.size() * 2, cudaMemcpyHostToDevice);
    cudaMemset(device_out, 0, expected.size() * 4);
    probe<transposed><<<1, 128, ROWS * COLUMNS * 2>>>(device_a, device_tile, device_out);
    const cudaError_t error = cudaDeviceSynchronize();
    std::vector<float> got(expected.size());
    cudaMemcpy(got.data(), device_out, got.size() * 4, cudaMemcpyDeviceToHost);
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) worst = fmax(worst, fabs(got[i] - expected[i]));
    const bool match = error == cudaSuccess && worst < 1e-3;
    printf("%s: %s, max |error| %g\n", what,
           error == cudaSuccess ? (match ? "MATCH" : "wrong") : cudaGetErrorString(error), worst);
    // A failed launch poisons the context: the next case starts on a fresh one.
    if (error != cudaSuccess) cudaDeviceReset();
    cudaFree(device_a);
    cudaFree(device_tile);
    cudaFree(device_out);
    return match;
}

int main() {
    const bool k_major = run<false>("K-major B (S = Q K^T), 128-byte swizzle");
    const bool mn_major = run<true>("MN-major B (O = P V), 128-byte swizzle");
    return k_major && mn_major ? 0 : 1;
}
