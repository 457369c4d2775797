// Just enough of CUDA, on the CPU, to run our kernels (block_attention.cu, decode_ops.cu): one
// fiber per CUDA thread, the blocks of a grid one after another (so `__shared__` variables can
// be plain statics), __syncthreads as a barrier of the block, warp shuffles through a barrier of
// the warp.
//
// A block's threads are fibers (ucontext) of the one OS thread that launches the kernel: each
// runs until it waits at a barrier, and when every thread of that barrier has arrived they all
// go on. Between two barriers the runnable threads take turns in an order drawn anew for each
// round from a fixed seed, so that a read missing its barrier can see another thread's write or
// not, as on the GPU, and every run of a check is the same. (One OS thread per CUDA thread, as
// before, cost a kernel thread switch at every barrier: tens of times slower, for nothing more.)
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <random>
#include <ucontext.h>
#include <vector>

using std::max;
using std::min;
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(bytes) __attribute__((aligned(bytes)))
#define __restrict__

struct dim3_emulated {
    unsigned x = 0, y = 0, z = 0;
};
inline thread_local dim3_emulated threadIdx, blockIdx, blockDim, gridDim;

struct float4 {
    float x, y, z, w;
};
struct uint2 {
    unsigned int x, y;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
// The host compiles in ISO C++ mode, which contracts no multiply-add: each operation rounds once.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
// The GPU's rsqrtf is approximate; the emulated kernels are checked against references that
// call this same function.
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// mma.cuh's ex2.approx.ftz: exact here (the checks' tolerances cover the GPU's 2 ulp).
inline float exp2_approx(float x) { return std::exp2(x); }

constexpr int MAX_THREADS = 1024;

struct Fiber {
    ucontext_t context;
    bool waiting = false, done = false;
};
// The threads of the running block, the one running now, and where a fiber returns to when it
// waits or ends.
inline std::vector<Fiber> fibers;
inline int running_fiber = 0;
inline ucontext_t scheduler_context;

// A barrier of `expected` threads (a block or a warp) among the fibers.
struct FiberBarrier {
    int expected = 0, arrived = 0;
    std::vector<int> waiting;
    void arrive_and_wait() {
        if (++arrived == expected) {
            arrived = 0;
            for (int f : waiting) fibers[f].waiting = false;
            waiting.clear();
            return;
        }
        waiting.push_back(running_fiber);
        fibers[running_fiber].waiting = true;
        swapcontext(&fibers[running_fiber].context, &scheduler_context);
    }
};
inline FiberBarrier* block_barrier;
inline FiberBarrier* warp_barriers[MAX_THREADS / 32];
inline float shuffle_slots[MAX_THREADS];

inline void __syncthreads() { block_barrier->arrive_and_wait(); }

// A warp-collective exchange: this lane's value published in the warp's slots and, once every
// lane has published, read(the warp's 32 slots); every lane of the warp must call it, as with a
// full mask on the GPU.
template <typename Read> auto through_warp_slots(float value, Read read) {
    int t = threadIdx.x;
    shuffle_slots[t] = value;
    warp_barriers[t / 32]->arrive_and_wait();
    auto result = read(&shuffle_slots[t & ~31]);
    warp_barriers[t / 32]->arrive_and_wait();
    return result;
}

inline float __shfl_xor_sync(unsigned, float value, int lane_mask) {
    const int lane = threadIdx.x & 31;
    return through_warp_slots(value, [&](const float* warp) { return warp[lane ^ lane_mask]; });
}

inline void __syncwarp() { warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }

inline int __all_sync(unsigned, int predicate) {
    return through_warp_slots(predicate ? 1.f : 0.f, [](const float* warp) {
        return (int)std::all_of(warp, warp + 32, [](float p) { return p != 0.f; });
    });
}

// Tensor-core operations, with the fragment layouts of the PTX ISA (mma.m16n8k16 with
// .row.col bf16/f16 operands and f32 accumulators; ldmatrix .m8n8.x4 [.trans] .b16). The 16-bit
// values are read with half.cuh's `to_float(T)`, which the kernel source includes.
struct MmaOperands {
    unsigned int a[4], b[2];
};
inline MmaOperands mma_slots[MAX_THREADS];

template <typename T>
void mma_m16n8k16(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    const int t = threadIdx.x, warp = t & ~31, lane = t & 31;
    mma_slots[t] = {{a[0], a[1], a[2], a[3]}, {b0, b1}};
    __syncwarp();
    auto half = [](unsigned int word, int k) {
        return to_float(T{(unsigned short)(k & 1 ? word >> 16 : word & 0xffffu)});
    };
    for (int e = 0; e < 4; ++e) {
        const int row = lane / 4 + 8 * (e / 2), col = 2 * (lane % 4) + (e & 1);
        float sum = 0.f;
        for (int k = 0; k < 16; ++k) {
            const MmaOperands& a_lane = mma_slots[warp + (row % 8) * 4 + (k % 8) / 2];
            const MmaOperands& b_lane = mma_slots[warp + col * 4 + (k % 8) / 2];
            const float a_value = half(a_lane.a[(row >= 8) + 2 * (k >= 8)], k);
            const float b_value = half(b_lane.b[k >= 8], k);
            sum += a_value * b_value;
        }
        d[e] += sum;
    }
    __syncwarp();
}

inline const unsigned short* ldmatrix_rows[MAX_THREADS];

// Lane l receives elements (l / 4, 2 (l % 4)) and (l / 4, 2 (l % 4) + 1) of each matrix, or of
// its transpose.
inline void ldmatrix_x4_any(unsigned int (&r)[4], const unsigned short* row, bool transposed) {
    const int t = threadIdx.x, warp = t & ~31, lane = t & 31;
    ldmatrix_rows[t] = row;
    __syncwarp();
    const int i0 = lane / 4, j0 = 2 * (lane % 4);
    for (int m = 0; m < 4; ++m) {
        auto element = [&](int i, int j) -> unsigned int {
            return transposed ? ldmatrix_rows[warp + 8 * m + j][i]
                              : ldmatrix_rows[warp + 8 * m + i][j];
        };
        r[m] = element(i0, j0) | (element(i0, j0 + 1) << 16);
    }
    __syncwarp();
}

inline void ldmatrix_x4(unsigned int (&r)[4], const unsigned short* row) {
    ldmatrix_x4_any(r, row, false);
}

inline void ldmatrix_x4_trans(unsigned int (&r)[4], const unsigned short* row) {
    ldmatrix_x4_any(r, row, true);
}

// Hopper's wgmma (wgmma.cuh), one warp at a time: a warp's rows of the warpgroup's product
// depend only on its own A fragment, so each warp multiplies its m16 rows by the B that the
// descriptor addresses, n8 tile by n8 tile through mma_m16n8k16. As on the GPU the products are
// asynchronous: each thread's wgmmas are queued, closed into a group by wgmma_commit and run
// when a wgmma_wait leaves fewer groups in flight (A from registers as it was when issued; B, and
// A from shared memory, read when run; the accumulator added to when run). A kernel that reads
// an accumulator before the wait that completes its product, writes one in flight, or changes a
// staged operand before the product has read it computes wrong values here, as on the GPU.
// Shared addresses are offsets into dynamic_shared_memory (1,024-byte aligned, as on the GPU),
// where the kernels stage B; the descriptor is decoded as the GPU does (PTX ISA "Matrix
// Descriptor Format"; checked on an H100 by bench/train/wgmma_probe.cu): start address >> 4 in
// bits 0-13, the 8-row groups' stride >> 4 in bits 32-45, the 128-byte swizzle (bits 62-63 = 1,
// the only mode wgmma.cuh makes): rows of 128 bytes along B's contiguous dimension (k for
// K-major, N for MN-major) whose 16-byte chunks are XORed with address bits 7-9.
alignas(1024) inline unsigned char dynamic_shared_memory[227 * 1024];

inline unsigned int shared_address(const void* p) {
    const auto offset = reinterpret_cast<const unsigned char*>(p) - dynamic_shared_memory;
    if (offset < 0 || offset >= (long)sizeof(dynamic_shared_memory)) {
        std::fprintf(stderr, "a wgmma operand outside the dynamic shared memory\n");
        std::abort();
    }
    return (unsigned int)offset;
}

// Each thread's wgmmas: those issued since its last commit, then the committed groups, oldest
// first.
struct WgmmaQueue {
    std::vector<std::function<void()>> open;
    std::deque<std::vector<std::function<void()>>> committed;
    bool empty() const { return open.empty() && committed.empty(); }
};
inline WgmmaQueue wgmma_queues[MAX_THREADS];

inline void wgmma_fence() {}
inline void wgmma_commit() {
    WgmmaQueue& queue = wgmma_queues[threadIdx.x];
    queue.committed.push_back(std::move(queue.open));
    queue.open.clear();
}
// Runs the oldest groups until at most `pending` are left in flight; every lane of a warp waits
// at the same point of the kernel (wgmma.wait_group is .sync.aligned), so the warp's deferred
// mma_m16n8k16 calls meet at their warp barriers as issued ones would.
template <int pending> void wgmma_wait() {
    WgmmaQueue& queue = wgmma_queues[threadIdx.x];
    if (!queue.open.empty()) {
        std::fprintf(stderr, "wgmma_wait with wgmmas issued but not committed\n");
        std::abort();
    }
    while (queue.committed.size() > (size_t)pending) {
        for (auto& product : queue.committed.front()) product();
        queue.committed.pop_front();
    }
}
inline void fence_async_shared() {}
template <typename A> void pin(A&) {}

// The 16-bit value a swizzled descriptor addresses at (row, along): rows of 128 bytes (`along`
// the contiguous dimension), 8-row groups the descriptor's stride apart, then the swizzle of the
// address.
inline unsigned int swizzled_element(unsigned long long descriptor, int row, int along) {
    if (descriptor >> 62 != 1 || along >= 64) {
        std::fprintf(stderr, "a wgmma descriptor this emulation does not decode\n");
        std::abort();
    }
    const size_t start = (descriptor & 0x3fffull) << 4;
    const size_t stride = ((descriptor >> 32) & 0x3fffull) << 4;
    size_t address = start + (row / 8) * stride + (row % 8) * 128 + along * 2;
    address ^= ((address >> 7) & 7) << 4;
    unsigned short value;
    std::memcpy(&value, dynamic_shared_memory + address, 2);
    return value;
}

// A from this warp's registers: B's (k, column) is row `column` of a K-major descriptor, row k
// of an MN-major one.
template <typename T, bool transposed, int n>
void wgmma_m64k16_now(float (&acc)[n / 8][4], const unsigned int (&a)[4], unsigned long long b) {
    auto element = [&](int k, int column) {
        return transposed ? swizzled_element(b, k, column) : swizzled_element(b, column, k);
    };
    const int lane = threadIdx.x & 31, group = lane / 4, quad_lane = lane % 4;
    for (int j = 0; j < n / 8; ++j) {
        const int column = 8 * j + group;
        const unsigned int b0 = element(2 * quad_lane, column) |
                                element(2 * quad_lane + 1, column) << 16;
        const unsigned int b1 = element(2 * quad_lane + 8, column) |
                                element(2 * quad_lane + 9, column) << 16;
        mma_m16n8k16<T>(acc[j], a, b0, b1);
    }
}

// A from shared memory (K-major): this warp's fragment of rows 16 w.., in mma.m16n8k16's layout.
template <typename T, bool transposed, int n>
void wgmma_m64k16_now(float (&acc)[n / 8][4], unsigned long long a, unsigned long long b) {
    const int lane = threadIdx.x & 31, row = 16 * (threadIdx.x / 32) + lane / 4;
    const int k = 2 * (lane % 4);
    unsigned int fragment[4];
    for (int r = 0; r < 2; ++r)
        for (int half = 0; half < 2; ++half)
            fragment[r + 2 * half] = swizzled_element(a, row + 8 * r, k + 8 * half) |
                                     swizzled_element(a, row + 8 * r, k + 8 * half + 1) << 16;
    wgmma_m64k16_now<T, transposed, n>(acc, fragment, b);
}

// A wgmma that does not accumulate (scale-d false) writes its product over whatever the
// accumulator held.
template <int n> void overwritten(float (&acc)[n][4]) {
    for (auto& tile : acc)
        for (float& x : tile) x = 0.f;
}

// The wgmmas a kernel issues: queued in the thread's open group.
template <typename T, bool transposed, int n>
void wgmma_m64k16(float (&acc)[n / 8][4], const unsigned int (&a)[4], unsigned long long b,
                  bool accumulate = true) {
    const std::array<unsigned int, 4> issued = {a[0], a[1], a[2], a[3]};
    wgmma_queues[threadIdx.x].open.push_back([&acc, issued, b, accumulate] {
        const unsigned int fragment[4] = {issued[0], issued[1], issued[2], issued[3]};
        if (!accumulate) overwritten(acc);
        wgmma_m64k16_now<T, transposed, n>(acc, fragment, b);
    });
}

template <typename T, bool transposed, int n>
void wgmma_m64k16(float (&acc)[n / 8][4], unsigned long long a, unsigned long long b,
                  bool accumulate = true) {
    wgmma_queues[threadIdx.x].open.push_back([&acc, a, b, accumulate] {
        if (!accumulate) overwritten(acc);
        wgmma_m64k16_now<T, transposed, n>(acc, a, b);
    });
}

// cp.async (global to shared, 16 or 4 bytes, zero-filled when !valid): the copy is made when it is
// issued, a schedule the GPU may also take, so committing and waiting have nothing left to do.
// The kernels still order the copies before other lanes' reads with __syncwarp, as on the GPU.
inline void cp_async_16(void* dst, const void* src, bool valid) {
    if (valid)
        std::memcpy(dst, src, 16);
    else
        std::memset(dst, 0, 16);
}
inline void cp_async_4(void* dst, const void* src, bool valid) {
    if (valid)
        std::memcpy(dst, src, 4);
    else
        std::memset(dst, 0, 4);
}
inline void cp_async_commit() {}
template <int pending> void cp_async_wait() {}

// `extern __shared__` memory (declared above, beside wgmma): blocks run one at a time, so one
// buffer of the most a block may have (227 KiB on sm_90) serves every launch.

inline const std::function<void()>* launched_kernel;

inline void run_fiber() {
    (*launched_kernel)();
    if (!wgmma_queues[running_fiber].empty()) {
        std::fprintf(stderr, "thread %d ended with wgmmas it never waited for\n", running_fiber);
        std::abort();
    }
    fibers[running_fiber].done = true;
}

// Runs `kernel` on every block of `grid` with `threads` threads per block.
inline void launch(dim3_emulated grid, int threads, const std::function<void()>& kernel) {
    constexpr size_t STACK_BYTES = 256 * 1024;
    static std::vector<std::unique_ptr<char[]>> stacks;
    while ((int)stacks.size() < threads) stacks.emplace_back(new char[STACK_BYTES]);
    static std::mt19937 turns(1);
    std::vector<int> order(threads);
    for (int t = 0; t < threads; ++t) order[t] = t;
    launched_kernel = &kernel;
    blockDim = {(unsigned)threads, 1, 1};
    gridDim = grid;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = {x, y, z};
                FiberBarrier block{threads};
                std::vector<FiberBarrier> warps;
                for (int w = 0; 32 * w < threads; ++w)
                    warps.push_back(FiberBarrier{std::min(32, threads - 32 * w)});
                for (size_t w = 0; w < warps.size(); ++w) warp_barriers[w] = &warps[w];
                block_barrier = &block;
                fibers.assign(threads, Fiber{});
                for (int t = 0; t < threads; ++t) {
                    getcontext(&fibers[t].context);
                    fibers[t].context.uc_stack = {stacks[t].get(), 0, STACK_BYTES};
                    fibers[t].context.uc_link = &scheduler_context;
                    makecontext(&fibers[t].context, run_fiber, 0);
                }
                for (int finished = 0; finished < threads;) {
                    std::shuffle(order.begin(), order.end(), turns);
                    bool ran = false;
                    for (int t : order) {
                        if (fibers[t].done || fibers[t].waiting) continue;
                        running_fiber = t;
                        threadIdx = {(unsigned)t, 0, 0};
                        swapcontext(&scheduler_context, &fibers[t].context);
                        ran = true;
                        finished += fibers[t].done;
                    }
                    if (!ran) {
                        std::fprintf(stderr, "block (%u, %u, %u): threads wait at a barrier that "
                                             "the others never reach\n", x, y, z);
                        std::abort();
                    }
                }
            }
}
