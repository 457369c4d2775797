// Tensor-core building blocks of our NVRTC kernels (block_attention.cu, train_attention.cu):
// mma.m16n8k16 with f32 accumulation, ldmatrix, cp.async, reductions over the four lanes of a
// fragment row, and the online softmax's step. Included (after NEG_INF is defined) by sources
// compiled for sm_80 and newer, and by plain C++ builds (the CPU emulation in
// tests/kernel_emulation, which provides the warp-collective operations).
//
// Fragment layouts (PTX ISA, lane = 4 * group + quad_lane): an A tile (16 x 16, row-major)
// holds rows group and group + 8, columns 2 quad_lane, +1 (a[0], a[1]) and those + 8 (a[2],
// a[3]); a B tile (16 x 8) column group, rows 2 quad_lane, +1 (b0) and + 8 (b1); an accumulator
// (16 x 8) rows group (d[0], d[1]) and group + 8 (d[2], d[3]), columns 2 quad_lane, +1.
#pragma once
#ifdef __CUDACC__
// d += a * b for one m16n8k16 tile (fragment layouts of the PTX ISA). Plain C++ builds of this
// file (the CPU emulation in tests/kernel_emulation) provide these warp-collective operations.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned int (&a)[4],
                                             unsigned int b0, unsigned int b1);

template <>
__device__ __forceinline__ void mma_m16n8k16<bf16_t>(float (&d)[4], const unsigned int (&a)[4],
                                                     unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<f16_t>(float (&d)[4], const unsigned int (&a)[4],
                                                    unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The 32-bit shared-memory address of p (a pointer into shared memory). Through the intrinsic,
// not inline asm, so that the compiler folds a fragment's offset into the instruction's
// immediate: with a cvta in asm every ldmatrix paid 64-bit pointer arithmetic first (five to six
// integer instructions; the attention kernels' loops 12-19 % shorter without it, sm_90 SASS).
__device__ __forceinline__ unsigned int shared_address(const void* p) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

// 2^x by the special-function unit alone (ex2.approx.ftz: about 2 ulp, results below 2^-126
// flushed to zero), as FlashAttention's exponentials under --use_fast_math. exp2f's exact form
// wraps every exponential in a denormal range check, a halving and a squaring: three to five
// more instructions each, in loops bound by instruction issue. A probability under 2^-126 beside
// the row's maximum (whose weight is 1) changes no sum.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Four 8x8 b16 matrices from shared memory; lane i gives the address of row i % 8 of matrix
// i / 8. The memory clobber keeps the staging stores (ordered by __syncwarp) before the reads.
__device__ __forceinline__ void ldmatrix_x4(unsigned int (&r)[4], const unsigned short* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row))
                 : "memory");
}

// The same, each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int (&r)[4], const unsigned short* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row))
                 : "memory");
}

// 16 bytes from global to shared memory, asynchronously (L2 only: K and V are read once);
// zeros instead when !valid (src is then not read).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :
                 : "r"(shared_address(dst)), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

// The same for 4 bytes (through L1: cp.async.cg takes 16 bytes only).
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
                 :
                 : "r"(shared_address(dst)), "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
}

// Closes the group of this thread's copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Waits until at most `pending` of this thread's committed groups are still in flight.
template <int pending> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(pending) : "memory");
}

// 1,024-byte aligned: where wgmma operands (wgmma.cuh) start their swizzled atoms.
extern __shared__ __align__(1024) unsigned char dynamic_shared_memory[];
#endif

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ float warp_max(float x) {
    for (int mask = 16; mask > 0; mask >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, mask));
    return x;
}

// The online softmax's step over one tile of a warp's scores s (16 rows x `keys`, already scaled,
// -inf where masked; this lane's rows group and group + 8): the running max m and this lane's
// share of the running sum l updated (the quad's shares are added at the end), s replaced by
// exp(s - m), and alpha, the factor by which each row's earlier output must be scaled. A row
// that has seen nothing yet keeps m = -inf, zeros and alpha 1.
template <int keys>
__device__ __forceinline__ void online_softmax(float (&s)[keys / 8][4], float (&m)[2],
                                               float (&l)[2], float (&alpha)[2]) {
    for (int r = 0; r < 2; ++r) {
        float tile_max = NEG_INF;
        for (int nt = 0; nt < keys / 8; ++nt)
            tile_max = fmaxf(tile_max, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
        const float m_new = fmaxf(m[r], quad_max(tile_max));
        const bool empty = m_new == NEG_INF;
        alpha[r] = empty ? 1.f : expf(m[r] - m_new);
        float sum = 0.f;
        for (int nt = 0; nt < keys / 8; ++nt)
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
                s[nt][e] = empty ? 0.f : expf(s[nt][e] - m_new);
                sum += s[nt][e];
            }
        l[r] = l[r] * alpha[r] + sum;
        m[r] = m_new;
    }
}
