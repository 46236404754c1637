// common.cuh: helpers shared by every kernels/*.cu file (inlined into each source by the Python loader,
// so CuPy's compile cache sees the whole text).
//
// Header-free on purpose: NVRTC 13 ships no cuda_fp16.h / cuda_bf16.h / cstdint as built-ins, so fp16 is
// carried as `unsigned short` bits and converted with the PTX cvt instructions; bf16 is the top half of
// an fp32 word.
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu

// Programmatic dependent launch (sm_90+; cuda.loader.dependent_launches, inside the captured decode step):
// such a kernel may start while the kernel before it in the stream is still running. Everything before
// pdl_wait() may read only what no earlier kernel of the step writes (weights, the position); pdl_wait()
// returns once the previous kernel has finished and its writes are visible. pdl_launch_dependents() lets
// the next kernel's blocks start their own pre-wait work: right after pdl_wait() (`early`) where the next
// kernel is latency-bound, after the main loop where it streams many megabytes (its blocks, placed on SMs
// still busy with this kernel, measured spread badly: cuda.decode's DecodeStep.launch_step chooses). Both are no-ops
// in an ordinary launch and below sm_90.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

// Shared-memory addresses and 16-byte cp.async copies (zero-filled past src_bytes; the attention families, the
// tiled matvec).
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Unaligned-tolerant little-endian loads from a byte pointer with a known alignment of 2.
__device__ __forceinline__ u16 ld16(const u8* p) { return *reinterpret_cast<const u16*>(p); }
__device__ __forceinline__ u32 ld32_a2(const u8* p) {
    const u16* q = reinterpret_cast<const u16*>(p);
    return (u32)q[0] | ((u32)q[1] << 16);
}
__device__ __forceinline__ u32 ld32(const u8* p) { return *reinterpret_cast<const u32*>(p); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over a whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // part[] may still be read by a previous call
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < n_warps ? part[lane] : 0.0f;
    return warp_sum(v);
}

// Max over a whole block (as block_sum); NaN drops out (fmaxf), so a NaN row keeps its scale at 1 below.
__device__ __forceinline__ float block_max(float v) {
    __shared__ float partm[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partm[warp] = v;
    __syncthreads();
    v = lane < n_warps ? partm[lane] : 0.0f;
    return warp_max(v);
}

// q8_0 (the 8-bit KV cache; ggml's quantize_row_q8_0): a whole warp holds one 32-value block, a value per lane ->
// the lane's code (int8 as a byte) and the block's fp16 scale d = max|x| / 127 (code = round(x / d), half away
// from zero); a block holding a non-finite value gets a NaN scale (and codes 0), so the NaN reaches the output.
__device__ __forceinline__ void quantize_q8_lane(float x, u8& code, u16& d16) {
    const bool bad = __any_sync(FULL_MASK, !isfinite(x));
    const float d = warp_max(fabsf(x)) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    code = bad ? (u8)0 : (u8)(i8)(int)roundf(x * id);
    d16 = f2h(bad ? __int_as_float(0x7fc00000) : d);
}

// The prefill GEMM's fp16 input scale for a row whose largest |value| is m: 1, or the power of two
// 2^ceil(log2(m / F16_SAFE)) that brings it under F16_SAFE (fp16's max is 65504; an exact power of two, so
// scaling rounds nothing). An infinite m keeps 1, so inf/NaN still reach the output and the NaN checks.
#define F16_SAFE 16384.0f
__device__ __forceinline__ float f16_rowscale(float m) {
    return (m > F16_SAFE && m <= 3.0e38f) ? exp2f(ceilf(log2f(m / F16_SAFE))) : 1.0f;
}

// gelu with the tanh approximation (gemma's gelu_pytorch_tanh): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))).
__device__ __forceinline__ float gelu_tanh(float g) {
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * fmaf(0.044715f * g, g * g, g)));
}

// A gated FFN's activation of gate a and up b (the matvecs' fused forms): ACT_SILU silu(a) b (SwiGLU),
// ACT_GELU gelu_tanh(a) b (GeGLU), ACT_OAI gpt-oss's clamped SwiGLU: g = min(a, 7), u = clamp(b, -7, 7),
// g sigmoid(1.702 g) (u + 1). The clamps are comparisons, so NaN passes through as in the reference.
#define ACT_SILU 0
#define ACT_GELU 1
#define ACT_OAI 2
template <int ACT>
__device__ __forceinline__ float glu_act(float a, float b) {
    if constexpr (ACT == ACT_GELU) {
        return gelu_tanh(a) * b;
    } else if constexpr (ACT == ACT_OAI) {
        const float g = a > 7.0f ? 7.0f : a;
        const float u = b > 7.0f ? 7.0f : (b < -7.0f ? -7.0f : b);
        return g / (1.0f + expf(-1.702f * g)) * (u + 1.0f);
    } else {
        return a / (1.0f + expf(-a)) * b;
    }
}
