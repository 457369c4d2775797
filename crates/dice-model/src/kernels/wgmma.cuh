// Hopper's warpgroup matrix multiply (wgmma.mma_async, sm_90a) for our NVRTC kernels
// (train_attention.cu): a warpgroup's 64 x N accumulator += A (64 x 16, from registers or shared
// memory) times B (16 x N, from shared memory), the shared operands through matrix descriptors,
// issued by the 4 warps together and completed asynchronously. Included after mma.cuh by
// sources compiled for sm_90a; plain C++ builds (tests/kernel_emulation) provide these
// operations and `shared_address`, and decode the descriptors swizzled_descriptor makes.
//
// Register layouts: warp w of the warpgroup holds rows 16 w.. of A and of the accumulator, in
// mma.m16n8k16's layouts (mma.cuh): A as one m16k16 fragment, the accumulator as N / 8 m16n8
// tiles, so a kernel written for per-warp m16 tiles keeps its fragments.
//
// Operands in shared memory with Hopper's 128-byte swizzle (PTX ISA, "Shared Memory Matrix Layout";
// CUTLASS's canonical GMMA layouts, cute/atom/mma_traits_sm90_gmma.hpp): rows of 128 bytes (64
// 16-bit values along B's contiguous dimension, k for K-major, N for MN-major), 8 rows making a
// 1,024-byte atom that starts 1,024-byte aligned, where the 16-byte chunk c of row r is stored
// at chunk c ^ (r % 8) (the hardware swizzles by address bits 4-6 ^ 7-9). The descriptor's
// stride is the byte step between 8-row groups; the leading offset is the step between atoms
// along the contiguous dimension, which our wgmmas never span (K-major: k16 steps of 32 bytes
// within a row; MN-major: N = 64), so it is left at 16 bytes. Checked on an H100 by
// bench/train/wgmma_probe.cu.
#pragma once

// The 64-bit descriptor of an operand in 128-byte swizzled atoms (bits 62-63 = 1) whose first
// row starts at `start` (a row of an atom, or 32-byte steps into one: the swizzle follows the
// address), with 8-row groups `stride` bytes apart (base offset 0: atoms 1,024-byte aligned).
__device__ __forceinline__ unsigned long long swizzled_descriptor(const unsigned short* start,
                                                                 unsigned int stride) {
    const unsigned long long address = shared_address(start);
    return ((address & 0x3FFFFull) >> 4) | (1ull << 16) |
           ((unsigned long long)(stride >> 4) << 32) | (1ull << 62);
}

#ifdef __CUDACC__

// Orders this warpgroup's register writes (accumulators, A fragments) before the wgmmas that
// read them.
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

// Closes the wgmmas issued since the last commit into one group.
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Waits until at most `pending` committed groups are still in flight.
template <int pending> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(pending) : "memory");
}

// Makes this thread's ordinary shared-memory writes (stores, cp.async) visible to the async
// proxy that wgmma reads B through; before the barrier that publishes them.
__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Keeps the compiler from moving an accumulator across the asynchronous window (CUTLASS's
// warpgroup_fence_operand): its registers are read and written by a wgmma in flight.
template <int n> __device__ __forceinline__ void pin(float (&acc)[n][4]) {
    for (int i = 0; i < n; ++i)
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[i][e])::"memory");
}

// The same for A fragments computed just before the wgmmas that read them.
template <int n> __device__ __forceinline__ void pin(unsigned int (&a)[n][4]) {
    for (int i = 0; i < n; ++i)
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}

// The same for one accumulator or set of A fragments per query head (several products in
// flight together).
template <int heads, int n, typename Word>
__device__ __forceinline__ void pin(Word (&per_head)[heads][n][4]) {
    for (auto& operand : per_head) pin(operand);
}

#define WGMMA_ACC8(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define WGMMA_ACC32() WGMMA_ACC8(0), WGMMA_ACC8(1), WGMMA_ACC8(2), WGMMA_ACC8(3)
#define WGMMA_ACC64() WGMMA_ACC32(), WGMMA_ACC8(4), WGMMA_ACC8(5), WGMMA_ACC8(6), WGMMA_ACC8(7)
#define WGMMA_REGS16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define WGMMA_REGS32                                                                           \
    WGMMA_REGS16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, " \
                 "%31"

// acc += A B for one k16 step (acc = A B where `accumulate` is false: the accumulator's values are
// not read, so it needs no zeroing first), B by descriptor (`transposed`: MN-major), A either
// this warp's m16k16 fragment or, by descriptor, the warpgroup's 64 rows (K-major). Specialised
// per N (the accumulator's registers are operands); after the accumulators come A's operand(s),
// then the descriptor(s), the accumulate flag (wgmma's scale-d) and the transpose immediate.
template <typename T, int n, bool transposed> struct Wgmma;

#define WGMMA_SPECIALISATION(N, TYPE, NAME, REGS, ACC, X0, X1, X2, X3, X4, X5, X6)             \
    template <bool transposed> struct Wgmma<TYPE, N, transposed> {                           \
        static __device__ __forceinline__ void run(float (&d)[N / 8][4],                       \
                                                   const unsigned int (&a)[4],                 \
                                                   unsigned long long b, bool accumulate) {    \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" X5 ", 0;\n"                    \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." NAME "." NAME " {" \
                         REGS "}, {%" X0 ", %" X1 ", %" X2 ", %" X3 "}, %" X4 ", p, 1, 1, %" X6  \
                         ";\n}"                                                                \
                         : ACC()                                                               \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b),                 \
                           "r"((int)accumulate),                                               \
                           "n"(transposed ? 1 : 0));                                           \
        }                                                                                      \
        static __device__ __forceinline__ void run(float (&d)[N / 8][4], unsigned long long a, \
                                                   unsigned long long b, bool accumulate) {    \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" X2 ", 0;\n"                    \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." NAME "." NAME " {" \
                         REGS "}, %" X0 ", %" X1 ", p, 1, 1, 0, %" X3 ";\n}"                   \
                         : ACC()                                                               \
                         : "l"(a), "l"(b), "r"((int)accumulate), "n"(transposed ? 1 : 0));     \
        }                                                                                      \
    };

#define WGMMA_TYPES(N, REGS, ACC, X0, X1, X2, X3, X4, X5, X6)                                  \
    WGMMA_SPECIALISATION(N, bf16_t, "bf16", REGS, ACC, X0, X1, X2, X3, X4, X5, X6)            \
    WGMMA_SPECIALISATION(N, f16_t, "f16", REGS, ACC, X0, X1, X2, X3, X4, X5, X6)

WGMMA_TYPES(32, WGMMA_REGS16, WGMMA_ACC32, "16", "17", "18", "19", "20", "21", "22")
WGMMA_TYPES(64, WGMMA_REGS32, WGMMA_ACC64, "32", "33", "34", "35", "36", "37", "38")

// A from this warp's registers.
template <typename T, bool transposed, int n>
__device__ __forceinline__ void wgmma_m64k16(float (&acc)[n / 8][4], const unsigned int (&a)[4],
                                             unsigned long long b, bool accumulate = true) {
    Wgmma<T, n, transposed>::run(acc, a, b, accumulate);
}

// A from shared memory (K-major, 128-byte swizzled as B).
template <typename T, bool transposed, int n>
__device__ __forceinline__ void wgmma_m64k16(float (&acc)[n / 8][4], unsigned long long a,
                                             unsigned long long b, bool accumulate = true) {
    Wgmma<T, n, transposed>::run(acc, a, b, accumulate);
}

#endif

// Before a warpgroup's wgmmas into `acc`: its registers settled, then the fence.
template <int n> __device__ __forceinline__ void wgmma_begin(float (&acc)[n][4]) {
    pin(acc);
    wgmma_fence();
}
