// bf16 and f16 as raw 16-bit values, and their conversions to and from f32 (round to nearest
// even, as candle's casts __float2bfloat16 / __float2half), for our NVRTC sources: no CUDA
// headers are included, so that they compile wherever NVRTC runs (nvrtc.rs hands this file to
// every program). Plain C++ builds (tests/kernel_emulation) take the software paths.
#pragma once

struct bf16_t {
    unsigned short bits;
};
struct f16_t {
    unsigned short bits;
};

__device__ __forceinline__ float f16_bits_to_float(unsigned int h) {
#ifdef __CUDA_ARCH__
    float f;
    unsigned short s = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
#else
    unsigned int sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    if (exp == 0) return (sign ? -1.0f : 1.0f) * (float)man * 5.9604644775390625e-8f;
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

__device__ __forceinline__ unsigned short float_to_f16_bits(float x) {
#ifdef __CUDA_ARCH__
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#else
    // F. Giesen's float_to_half_fast3_rtne.
    unsigned int u = __float_as_uint(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a >= 0x47800000u) return (unsigned short)(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (a < 0x38800000u)
        return (unsigned short)(sign | (__float_as_uint(__uint_as_float(a) + 0.5f) - 0x3f000000u));
    a += 0xc8000fffu + ((a >> 13) & 1u);
    return (unsigned short)(sign | (a >> 13));
#endif
}

// On sm_80 and newer one cvt instruction (the software rounding takes six, which the attention
// kernels paid for every probability they round).
__device__ __forceinline__ unsigned int float_to_bf16_bits(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#else
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
#endif
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16_t x) {
    return __uint_as_float((unsigned int)x.bits << 16);
}
__device__ __forceinline__ float to_float(f16_t x) { return f16_bits_to_float(x.bits); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
    return {(unsigned short)float_to_bf16_bits(x)};
}
template <> __device__ __forceinline__ f16_t from_float<f16_t>(float x) {
    return {float_to_f16_bits(x)};
}

// Two bf16/f16 T in one word hold the first in the low half (the order of memory and of mma
// fragments).
template <typename T> __device__ __forceinline__ float low_half(unsigned int word) {
    return to_float(T{(unsigned short)(word & 0xffffu)});
}
template <typename T> __device__ __forceinline__ float high_half(unsigned int word) {
    return to_float(T{(unsigned short)(word >> 16)});
}
template <typename T> __device__ __forceinline__ unsigned int pack_pair(float lo, float hi) {
    return (unsigned int)from_float<T>(lo).bits | ((unsigned int)from_float<T>(hi).bits << 16);
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// Both halves by one cvt (its first source goes to the high half).
template <> __device__ __forceinline__ unsigned int pack_pair<bf16_t>(float lo, float hi) {
    unsigned int word;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(hi), "f"(lo));
    return word;
}
template <> __device__ __forceinline__ unsigned int pack_pair<f16_t>(float lo, float hi) {
    unsigned int word;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(hi), "f"(lo));
    return word;
}
#endif

// V consecutive values of T moved as one access of V * sizeof(T) bytes: element-wise kernels
// move 16 bytes a thread (Vec16, VEC_COLS(T) values) where their rows allow it, instead of one
// 2-byte value, which leaves a warp's loads at 64 bytes an instruction and the kernel far below
// the memory's bandwidth.
template <typename T, int V> struct alignas(V * sizeof(T)) Pack {
    T v[V];
};
template <typename T> using Vec16 = Pack<T, 16 / sizeof(T)>;
#define VEC_COLS(T) ((int)(16 / sizeof(T)))

// Whether `p` may be read or written in accesses of `bytes` (a power of two; null counts as
// aligned: an absent operand).
__device__ __forceinline__ bool aligned(const void* p, size_t bytes) {
    return ((size_t)p & (bytes - 1)) == 0;
}

// p[0..V) in one access, bits unchanged.
template <typename T, int V> __device__ __forceinline__ Pack<T, V> load_pack(const T* p) {
    return *reinterpret_cast<const Pack<T, V>*>(p);
}

// v into p[0..V) in one access.
template <typename T, int V> __device__ __forceinline__ void store_pack(T* p, const Pack<T, V>& v) {
    *reinterpret_cast<Pack<T, V>*>(p) = v;
}

// Values p[0..V) as f32, in one access.
template <typename T, int V>
__device__ __forceinline__ void load_floats(const T* p, float (&f)[V]) {
    const Pack<T, V> pack = load_pack<T, V>(p);
    for (int i = 0; i < V; ++i) f[i] = to_float(pack.v[i]);
}

// p[0..V) to q[0..V), bits unchanged, in one access each.
template <typename T, int V> __device__ __forceinline__ void copy_pack(T* q, const T* p) {
    store_pack(q, load_pack<T, V>(p));
}

// f rounded to T into p[0..V), in one access.
template <typename T, int V>
__device__ __forceinline__ void store_floats(T* p, const float (&f)[V]) {
    Pack<T, V> pack;
    for (int i = 0; i < V; ++i) pack.v[i] = from_float<T>(f[i]);
    store_pack(p, pack);
}
