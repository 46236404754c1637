// matvec.cu: y[t, n] = sum_k W[n, k] x[t, k] for T <= 8 tokens (decode), reading W's GGUF blocks directly.
//
// Shapes: W [N, K] quantized rows of K/QK blocks (quants.cuh), x [T, K] f32, y [T, N] f32.
// Variants per weight type (suffix = ggml type in lower case, FOR_EACH_QTYPE):
//   matvec_<t>        y = W x (+ bias[n]) (+ resid[t, n]); W may be up to three row segments (w0: n0 rows,
//                     w1: n1 rows, w2: the rest) of one type, so Q, K and V run as one launch without
//                     copying them together; resid may alias y (the fused residual add).
//   matvec_<t>_swiglu y[t, n] = silu(Wg[n] . x) * (Wu[n] . x), gate rows w0 and up rows w1 (the fused
//                     gate/up projection: one launch, no [T, 2F] intermediate). In the SwiGLU forms of the
//                     bodies (matvec_body, mv1_body, mv1_put) `bias` and `resid` carry the gate and the up
//                     biases (gpt-oss's experts, kernels/moe.cu); the kernels here pass neither.
// Launch: block 128 threads (4 warps). A warp serves 32/lpr rows, lpr lanes per row (lpr = power of two
// <= 32 chosen from the row's 32-value units so that short rows keep every lane busy); each lane walks units
// u = lane, lane+lpr, ..., decodes 32 weights into registers and dots them with every token's x; the lpr
// partial sums meet by xor shuffles. Grid = ceil(N / (4 * 32/lpr)).
//
// One-token variants (decode; T = 1), the ones the fused decode step uses:
//   mv1_<t>(w0, w1, w2, n0, n1, N, K, x, y, bias, resid, norm_w, eps, lpr, groups, am, early)
//   mv1_<t>_swiglu(wg, wu, N, K, x, y, norm_w, eps, lpr, groups, early)
//   mv1_<t>_geglu, mv1_stream_<t>_geglu, matvec_<t>_geglu: the _swiglu forms with gelu_tanh (common.cuh)
//     for silu: gemma's GeGLU
//   mv1_mixed_<a>_<b>(mv1_<t>'s arguments): w0 and w1 of type a, w2 of type b, both int8-activation types
//     (Q4_K_M's layers with a Q6_K V: one QKV launch instead of three).
//     In the captured decode step these may run as programmatic dependents (common.cuh pdl_wait): the
//     weight prefetch runs before pdl_wait(), everything else after; `early` lets the next kernel start
//     right after the wait instead of after the main loop.
//     x [K] is staged once per block in shared memory (units of 32 floats, float4 slots XOR-swizzled by
//     the unit index so that 8 lanes reading 8 consecutive units hit 8 different bank groups). With norm_w,
//     the block first computes RMSNorm(x) * norm_w itself (every block reads all of x anyway): the
//     stand-alone rms_norm kernel disappears from the step. Before staging x, each lane of a matrix under
//     MV1_PREFETCH_MAX prefetches its first 4 weight units into L2, so the weight reads start while x is
//     read and normalised (and, as a programmatic dependent, while the previous kernel runs). Each lane
//     decodes two units per iteration (four for the int8 forms, MV1_UNROLL8) before the dots, so that many
//     units' loads are in flight per lane. With `am` (the LM head of a greedy
//     step) every block also reduces its rows' (logit, id) to one packed 64-bit key (order-preserving
//     float bits, then ~id so ties go to the lowest id) and atomicMax-es it into am[0]; the last block to
//     finish writes out[0] = id, out[1] = NaN/+inf seen, advances *pos_inc and resets its cells, so no
//     separate argmax kernel runs (argmax_f32's semantics).
//     Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 dot their units with float x without int -> float conversions (unit_dot
//     below); Q4_K, Q5_K, Q6_K and MXFP4 dot them with x rounded to int8 per 32 values (act8, stage_xq,
//     unit_dot8: __dp4a, llama.cpp's MMVQ numerics).
//   Launch: block 256 (8 warps), dynamic shared memory units*132 bytes (x slots + per-unit sums of x; the
//   int8 forms units*40), grid ceil(N / (groups * 8 * 32/lpr)): a block serves `groups` groups of rows with
//   one staging of x (2 or 4 where staging x per 8 rows costs as much as the rows; cuda.linear.mv1_groups).
// Best measured configuration (`llamacli bench --kernels`, weights rotated past L2; the figures are in
// docs/perf-log.md): the int8-activation forms with cuda.linear.mv1_groups's row groups, faster than float x
// for Q4_K and, on the larger shapes, Q6_K; F16 / BF16 rows go through mv1_stream (below) instead. The
// quantized types stay under memory speed: each block's x staging and the short per-lane loops (a
// 4096-column Q4_K row is 128 units: four per lane) keep too few bytes in flight.

// With MATVEC_BODIES_ONLY defined before it is included (kernels/moe.cu), this file gives its device bodies
// and none of its kernels.
#include "common.cuh"
#include "quants.cuh"

// MATVEC_TMAX: llamacli/backends/cuda/constants.py (the loader puts them in front)
// mv1 prefetches its first weight units into L2 for matrices under these sizes (the SwiGLU form: per matrix).
// Plain forms under 16 MiB (8B Q4_K_M's QKV and O launches) measured faster at tg128 on the 8B and the 1B;
// the SwiGLU form under 4 MiB (a 16 MiB cap slowed the 1B); larger matrices measured slower (docs/perf-log.md).
#define MV1_PREFETCH_MAX (16ll << 20)
#define MV1_PREFETCH_MAX_SWIGLU (4ll << 20)
// The int8-activation forms: units per lane and iteration (their loads issued together; the float forms: 2),
// and the blocks per SM they are compiled for (__launch_bounds__: up to 64 registers). Left to itself ptxas
// gives them 40-48 registers and issues the loads one unit at a time; (4, 4) measured best at tg128 on the
// 1B, 8B and Qwen2.5-0.5B Q4_K_M shapes ((2, 4), (4, 3) and (8, 2-3) slower; docs/perf-log.md).
#define MV1_UNROLL8 4
// MV1_MINB8: llamacli/backends/cuda/constants.py (the loader puts them in front)

// Row n's bytes: the gate and up rows (SWIGLU), or row n of the three stacked segments w0 (n0 rows), w1 (n1
// rows), w2 (the rest). Both matvec bodies address rows through this.
template <bool SWIGLU>
__device__ __forceinline__ void row_pointers(const u8* w0, const u8* w1, const u8* w2, int n0, int n1, int n,
                                             long long row_bytes, const u8*& ra, const u8*& rb) {
    if (SWIGLU) {
        ra = w0 + n * row_bytes;
        rb = w1 + n * row_bytes;
    } else if (n < n0) {
        ra = w0 + n * row_bytes;
    } else if (n < n0 + n1) {
        ra = w1 + (n - n0) * row_bytes;
    } else {
        ra = w2 + (n - n0 - n1) * row_bytes;
    }
}

template <class Q, bool SWIGLU, int ACT = ACT_SILU>
__device__ __forceinline__ void matvec_body(const u8* __restrict__ w0, const u8* __restrict__ w1,
                                            const u8* __restrict__ w2, int n0, int n1, int N, int K,
                                            const float* __restrict__ x, int T, float* y,
                                            const float* __restrict__ bias, const float* resid, int lpr,
                                            const int* xrow = nullptr, const int* yrow = nullptr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rows_per_warp = 32 / lpr;
    const int sub = lane % lpr;
    const int n = (blockIdx.x * (blockDim.x >> 5) + warp) * rows_per_warp + lane / lpr;
    const long long row_bytes = (long long)((K + Q::QK - 1) / Q::QK) * Q::BYTES;
    const int units = (K + 31) / 32;
    const bool active = n < N;

    const u8* ra = nullptr;
    const u8* rb = nullptr;
    if (active) row_pointers<SWIGLU>(w0, w1, w2, n0, n1, n, row_bytes, ra, rb);

    float acc[MATVEC_TMAX], acc2[MATVEC_TMAX];
#pragma unroll
    for (int t = 0; t < MATVEC_TMAX; ++t) acc[t] = acc2[t] = 0.0f;

    const bool vec_x = (K & 3) == 0;
    for (int u = sub; active && u < units; u += lpr) {
        float w[32], w2v[32];
        Q::unit(ra, u, K, w);
        if (SWIGLU) Q::unit(rb, u, K, w2v);
        const bool full = u * 32 + 32 <= K;
#pragma unroll
        for (int t = 0; t < MATVEC_TMAX; ++t) {
            if (t < T) {
                const float* xr = x + (long long)(xrow ? xrow[t] : t) * K + u * 32;
                float xv[32];
                if (vec_x && full) {
#pragma unroll
                    for (int k = 0; k < 8; ++k) {
                        const float4 v = *reinterpret_cast<const float4*>(xr + 4 * k);
                        xv[4 * k] = v.x; xv[4 * k + 1] = v.y; xv[4 * k + 2] = v.z; xv[4 * k + 3] = v.w;
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < 32; ++i) xv[i] = u * 32 + i < K ? xr[i] : 0.0f;
                }
                float s = 0.0f, s2 = 0.0f;
#pragma unroll
                for (int i = 0; i < 32; ++i) {
                    s = fmaf(w[i], xv[i], s);
                    if (SWIGLU) s2 = fmaf(w2v[i], xv[i], s2);
                }
                acc[t] += s;
                if (SWIGLU) acc2[t] += s2;
            }
        }
    }

#pragma unroll
    for (int t = 0; t < MATVEC_TMAX; ++t) {
        if (t < T) {
            float s = acc[t], s2 = acc2[t];
            for (int o = lpr >> 1; o > 0; o >>= 1) {
                s += __shfl_xor_sync(FULL_MASK, s, o);
                if (SWIGLU) s2 += __shfl_xor_sync(FULL_MASK, s2, o);
            }
            if (active && sub == 0) {
                const long long i = (long long)(yrow ? yrow[t] : t) * N + n;
                if (SWIGLU) {
                    if (bias) s += bias[n];  // the gate and up biases (bias, resid)
                    if (resid) s2 += resid[n];
                    y[i] = glu_act<ACT>(s, s2);
                } else {
                    if (bias) s += bias[n];
                    if (resid) s += resid[i];
                    y[i] = s;
                }
            }
        }
    }
}

#define MATVEC_KERNELS(name, Q)                                                                              \
    extern "C" __global__ void __launch_bounds__(128) matvec_##name(                                        \
        const u8* w0, const u8* w1, const u8* w2, int n0, int n1, int N, int K, const float* x, int T,       \
        float* y, const float* bias, const float* resid, int lpr) {                                         \
        matvec_body<Q, false>(w0, w1, w2, n0, n1, N, K, x, T, y, bias, resid, lpr);                          \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) matvec_##name##_swiglu(                               \
        const u8* wg, const u8* wu, int N, int K, const float* x, int T, float* y, int lpr) {               \
        matvec_body<Q, true>(wg, wu, nullptr, N, 0, N, K, x, T, y, nullptr, nullptr, lpr);                   \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) matvec_##name##_geglu(                                \
        const u8* wg, const u8* wu, int N, int K, const float* x, int T, float* y, int lpr) {               \
        matvec_body<Q, true, ACT_GELU>(wg, wu, nullptr, N, 0, N, K, x, T, y, nullptr, nullptr, lpr);             \
    }

#ifndef MATVEC_BODIES_ONLY
FOR_EACH_QTYPE(MATVEC_KERNELS)
#endif

// ---- one token: x in shared memory, fused RMSNorm, fused argmax ---------------------------------------------

__device__ __forceinline__ int xslot(int u, int k) { return u * 8 + (k ^ (u & 7)); }

__device__ __forceinline__ float dot_unit(const float (&w)[32], const float4* __restrict__ xs4, int u) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float4 v = xs4[xslot(u, k)];
        s = fmaf(w[4 * k], v.x, s);
        s = fmaf(w[4 * k + 1], v.y, s);
        s = fmaf(w[4 * k + 2], v.z, s);
        s = fmaf(w[4 * k + 3], v.w, s);
    }
    return s;
}

// Values 4i .. 4i+3 of x [K] (zeros past K). stage_x reads STAGE_BATCH of these per thread before using any, so
// a block's staging costs one memory latency per batch, not one per float4 (SB: another batch, for a kernel
// that holds many registers across the staging, mv1_stream).
#define STAGE_BATCH 4
__device__ __forceinline__ float4 x4(const float* __restrict__ p, int K, int i) {
    const int b = 4 * i;
    float4 v;
    if ((K & 3) == 0 && b + 4 <= K) {
        v = *reinterpret_cast<const float4*>(p + b);
    } else {
        v.x = b < K ? p[b] : 0.0f;
        v.y = b + 1 < K ? p[b + 1] : 0.0f;
        v.z = b + 2 < K ? p[b + 2] : 0.0f;
        v.w = b + 3 < K ? p[b + 3] : 0.0f;
    }
    return v;
}

// A gemma block's input (post != null, one-token forms): x + RMSNorm(blk) * w, the post-norm and residual add
// of the block before, which no kernel of its own then computes. post is a device array {blk, w, out} of three
// pointers; every block computes the sum of squares of blk [K] and adds the scaled rows as it stages x, and
// block 0 also writes the new residual to out (another buffer than x: other blocks still read x).
struct PostIn {
    const float* blk = nullptr;
    const float* w = nullptr;
    float* out = nullptr;
    float r = 0.0f;
};

__device__ __forceinline__ PostIn post_in(const u64* __restrict__ post, int K, float eps) {
    PostIn pi;
    if (post == nullptr) return pi;
    pi.blk = reinterpret_cast<const float*>(post[0]);
    pi.w = reinterpret_cast<const float*>(post[1]);
    pi.out = blockIdx.x == 0 ? reinterpret_cast<float*>(post[2]) : nullptr;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) ss = fmaf(pi.blk[i], pi.blk[i], ss);
    pi.r = rsqrtf(block_sum(ss) / (float)K + eps);  // rms_norm_add's math
    return pi;
}

// Values 4i .. 4i+3 of the input: x4(x), plus the post-norm term (and stored to out when `store`).
__device__ __forceinline__ float4 in4(const float* __restrict__ x, int K, int i, const PostIn& pi, bool store) {
    float4 v = x4(x, K, i);
    if (pi.blk != nullptr) {
        const float4 b = x4(pi.blk, K, i), w = x4(pi.w, K, i);
        v.x += b.x * pi.r * w.x;
        v.y += b.y * pi.r * w.y;
        v.z += b.z * pi.r * w.z;
        v.w += b.w * pi.r * w.w;
        if (store && pi.out != nullptr) {
            const int e = 4 * i;
            if (e < K) pi.out[e] = v.x;
            if (e + 1 < K) pi.out[e + 1] = v.y;
            if (e + 2 < K) pi.out[e + 2] = v.z;
            if (e + 3 < K) pi.out[e + 3] = v.w;
        }
    }
    return v;
}

// Stage x [K] (zero-padded to whole units) into xs4; with norm_w, x / rms(x) * norm_w (the norm weights are
// read in the same pass as x, so their loads are in flight together). With XSUM, also the per-unit sums of
// the staged x after the slots (the offset terms of Q4_1, Q5_1: d*q + m dotted with x is d * (q . x) +
// m * sum(x)); the 8 lanes of a unit are 8 consecutive lanes of one warp.
template <bool XSUM, int SB = STAGE_BATCH>
__device__ __forceinline__ void stage_x(const float* __restrict__ x, int K, const float* __restrict__ norm_w, float eps,
                                        float4* xs4, const PostIn& pi = PostIn()) {
    const int units = (K + 31) / 32, n = units * 8;
    float ss = 0.0f;
    for (int base = threadIdx.x; base < n; base += SB * blockDim.x) {
        float4 v[SB], w[SB];
#pragma unroll
        for (int b = 0; b < SB; ++b) {
            const int i = base + b * blockDim.x;
            if (i < n) {
                v[b] = in4(x, K, i, pi, true);
                if (norm_w) w[b] = x4(norm_w, K, i);
            }
        }
#pragma unroll
        for (int b = 0; b < SB; ++b) {
            const int i = base + b * blockDim.x;
            if (i < n) {
                ss += v[b].x * v[b].x + v[b].y * v[b].y + v[b].z * v[b].z + v[b].w * v[b].w;
                if (norm_w) {
                    v[b].x *= w[b].x;
                    v[b].y *= w[b].y;
                    v[b].z *= w[b].z;
                    v[b].w *= w[b].w;
                }
                xs4[xslot(i >> 3, i & 7)] = v[b];
            }
        }
    }
    float r = 1.0f;
    if (norm_w) {
        ss = block_sum(ss);  // (synchronizes the block)
        r = rsqrtf(ss / (float)K + eps);
    }
    if (norm_w || XSUM) {
        float* xsum = reinterpret_cast<float*>(xs4 + n);
        for (int base = 0; base < n; base += blockDim.x) {  // uniform trip count: the shuffles need every lane
            const int i = base + threadIdx.x;
            float t = 0.0f;
            if (i < n) {
                float4 f = xs4[xslot(i >> 3, i & 7)];  // a slot this thread wrote
                if (norm_w) {
                    f.x *= r;
                    f.y *= r;
                    f.z *= r;
                    f.w *= r;
                    xs4[xslot(i >> 3, i & 7)] = f;
                }
                t = (f.x + f.y) + (f.z + f.w);
            }
            if (XSUM) {
                t += __shfl_xor_sync(FULL_MASK, t, 1);
                t += __shfl_xor_sync(FULL_MASK, t, 2);
                t += __shfl_xor_sync(FULL_MASK, t, 4);
                if (i < n && (i & 7) == 0) xsum[i >> 3] = t;
            }
        }
    }
    __syncthreads();
}

// Weight types whose unit_dot reads the per-unit sums of x.
template <class Q> struct needs_xsum { static constexpr bool value = false; };

// Sum over unit u of w[i] * x[i]: the generic form decodes the unit to floats (Q::unit) and dots them. The
// specialisations below skip the int -> float conversions, which run at 16 per clock per SM on sm_90 (a
// quarter-warp) and bound the generic form far below memory speed: a byte b becomes the float 2^23 + b by
// one byte permute into 0x4B000000's mantissa, one exact subtraction removes 2^23 (and the type's offset),
// and the block scales multiply the unit's sum instead of each value. Exact integers in, float32 sums out:
// the same math as the generic form up to summation order.
template <class Q>
__device__ __forceinline__ float unit_dot(const u8* row, int u, int K, const float4* __restrict__ xs4,
                                          const float* __restrict__ xsum) {
    float w[32];
    Q::unit(row, u, K, w);
    return dot_unit(w, xs4, u);
}

// s + sum_b (byte b of w - off) * v[b], with bias = 2^23 + off.
__device__ __forceinline__ float dot_bytes4(u32 w, float4 v, float bias, float s) {
    s = fmaf(__int_as_float(__byte_perm(w, 0x4B000000u, 0x7650)) - bias, v.x, s);
    s = fmaf(__int_as_float(__byte_perm(w, 0x4B000000u, 0x7651)) - bias, v.y, s);
    s = fmaf(__int_as_float(__byte_perm(w, 0x4B000000u, 0x7652)) - bias, v.z, s);
    s = fmaf(__int_as_float(__byte_perm(w, 0x4B000000u, 0x7653)) - bias, v.w, s);
    return s;
}
#define TWO23 8388608.0f

template <>
__device__ __forceinline__ float unit_dot<QQ8_0>(const u8* row, int u, int, const float4* __restrict__ xs4,
                                                 const float* __restrict__) {
    const u8* p = row + u * QQ8_0::BYTES;
    u32 q[8];
    load_words<2, 8>(p + 2, q);
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) s = dot_bytes4(q[k] ^ 0x80808080u, xs4[xslot(u, k)], TWO23 + 128.0f, s);  // i8 + 128
    return ldh(p) * s;
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1: 16 bytes of nibbles, value i < 16 the low nibble of byte i, value i + 16 its
// high nibble; Q5 types add bit i of qh as the value's fifth bit (qh = 0 for Q4: folded away).
__device__ __forceinline__ u32 spread_bits4(u32 h) {  // bits 0-3 of h -> bit 4 of bytes 0-3 (no carries)
    return (((h & 0xFu) * 0x00204081u) & 0x01010101u) << 4;
}

__device__ __forceinline__ float nibbles_dot(const u32* q, u32 qh, const float4* __restrict__ xs4, int u, float bias) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        s = dot_bytes4((q[k] & 0x0F0F0F0Fu) | spread_bits4(qh >> (4 * k)), xs4[xslot(u, k)], bias, s);
        s = dot_bytes4(((q[k] >> 4) & 0x0F0F0F0Fu) | spread_bits4(qh >> (16 + 4 * k)), xs4[xslot(u, 4 + k)], bias, s);
    }
    return s;
}

template <>
__device__ __forceinline__ float unit_dot<QQ4_0>(const u8* row, int u, int, const float4* __restrict__ xs4,
                                                 const float* __restrict__) {
    const u8* p = row + u * QQ4_0::BYTES;
    u32 q[4];
    load_words<2, 4>(p + 2, q);
    return ldh(p) * nibbles_dot(q, 0u, xs4, u, TWO23 + 8.0f);  // v = d * (q - 8)
}

template <>
__device__ __forceinline__ float unit_dot<QQ5_0>(const u8* row, int u, int, const float4* __restrict__ xs4,
                                                 const float* __restrict__) {
    const u8* p = row + u * QQ5_0::BYTES;
    u32 q[5];  // qh, then the 16 bytes of nibbles
    load_words<2, 5>(p + 2, q);
    return ldh(p) * nibbles_dot(q + 1, q[0], xs4, u, TWO23 + 16.0f);  // v = d * (q - 16)
}

template <> struct needs_xsum<QQ4_1> { static constexpr bool value = true; };
template <> struct needs_xsum<QQ5_1> { static constexpr bool value = true; };

template <>
__device__ __forceinline__ float unit_dot<QQ4_1>(const u8* row, int u, int, const float4* __restrict__ xs4,
                                                 const float* __restrict__ xsum) {
    const u8* p = row + u * QQ4_1::BYTES;
    u32 q[4];
    load_words<4, 4>(p + 4, q);
    return ldh(p) * nibbles_dot(q, 0u, xs4, u, TWO23) + ldh(p + 2) * xsum[u];  // v = d * q + m
}

template <>
__device__ __forceinline__ float unit_dot<QQ5_1>(const u8* row, int u, int, const float4* __restrict__ xs4,
                                                 const float* __restrict__ xsum) {
    const u8* p = row + u * QQ5_1::BYTES;
    u32 q[5];
    load_words<4, 5>(p + 4, q);
    return ldh(p) * nibbles_dot(q + 1, q[0], xs4, u, TWO23) + ldh(p + 2) * xsum[u];  // v = d * q + m
}

// ---- int8 activations (the K-quants): x rounded to 8 bits per 32 values, dotted with __dp4a -------------------
// Weight types whose mv1 dots int8 activations (llama.cpp's MMVQ numerics): each block stages x as xq[u] =
// rint(x[u] * 127 / max|x[u]|) (int8, 32 per unit), xd[u] = max|x[u]| / 127 and xsum[u] = xd[u] * sum(xq[u])
// (for the offset terms), so the result is exactly W . (xd * xq) up to float32 summation. A unit's dot is 8
// __dp4a on the weights' integer codes (4 products each) and one float multiply by the scales: about a
// sixth of the float form's instructions, a quarter of its shared-memory reads. Each value of x moves by
// at most xd[u] / 2; a non-finite value makes its unit's xd NaN, so NaN/inf still reach the output (the
// fused argmax's flag).
template <class Q> struct act8 { static constexpr bool value = false; };
template <> struct act8<QQ4_K> { static constexpr bool value = true; };
template <> struct act8<QQ5_K> { static constexpr bool value = true; };
template <> struct act8<QQ6_K> { static constexpr bool value = true; };
template <> struct act8<QMXFP4> { static constexpr bool value = true; };

// uint4 slot of half h (values 16h .. 16h+15) of unit u: the halves swap every 4 units, so the 8 lanes of a
// quarter-warp reading 8 consecutive units' same half hit 8 different bank groups.
__device__ __forceinline__ int xqslot(int u, int h) { return 2 * u + (h ^ ((u >> 2) & 1)); }

// The four float4 of half-unit h (values 16h .. 16h+15 of p [K]; zeros past K, or for h >= nh).
__device__ __forceinline__ void load_half(const float* __restrict__ p, int K, int h, int nh, float4 (&v)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = h < nh ? x4(p, K, 4 * h + k) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// load_half of the input x with the post-norm term (PostIn), stored to out when `store`.
__device__ __forceinline__ void load_half_in(const float* __restrict__ x, int K, int h, int nh, float4 (&v)[4],
                                             const PostIn& pi, bool store) {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = h < nh ? in4(x, K, 4 * h + k, pi, store) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// Round half-unit h (the 16 values v) to int8 into its uint4 slot; the unit's two halves are lanes 2j and
// 2j + 1 of one warp, which meet by one shuffle for the unit's max and one for its code sum, and the even one
// writes xd and xsum. Every lane must call it. The max runs on the float bits (an integer max orders
// non-negative floats, and NaN lies above +inf), so max >= +inf's bits flags a non-finite value: the unit's
// xd is then NaN (its codes do not matter).
__device__ __forceinline__ void quant_half(const float4 (&v)[4], int h, int nh, uint4* xq4, float* xd, float* xsum) {
    u32 ab = 0u;
#pragma unroll
    for (int k = 0; k < 4; ++k)
        ab = max(ab, max(max(__float_as_uint(fabsf(v[k].x)), __float_as_uint(fabsf(v[k].y))),
                         max(__float_as_uint(fabsf(v[k].z)), __float_as_uint(fabsf(v[k].w)))));
    ab = max(ab, __shfl_xor_sync(FULL_MASK, ab, 1));
    const float amax = __uint_as_float(ab);
    const bool bad = ab >= 0x7f800000u;
    const float inv = !bad && amax > 0.0f ? 127.0f / amax : 0.0f;
    u32 word[4];
    int qsum = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int q0 = __float2int_rn(v[k].x * inv), q1 = __float2int_rn(v[k].y * inv);
        const int q2 = __float2int_rn(v[k].z * inv), q3 = __float2int_rn(v[k].w * inv);
        qsum += (q0 + q1) + (q2 + q3);
        word[k] = ((u32)q0 & 0xFFu) | (((u32)q1 & 0xFFu) << 8) | (((u32)q2 & 0xFFu) << 16) | ((u32)q3 << 24);
    }
    qsum += __shfl_xor_sync(FULL_MASK, qsum, 1);
    if (h < nh) {
        const int u = h >> 1;
        xq4[xqslot(u, h & 1)] = make_uint4(word[0], word[1], word[2], word[3]);
        if ((h & 1) == 0) {
            const float d = bad ? __int_as_float(0x7fffffff) : amax / 127.0f;
            xd[u] = d;
            xsum[u] = d * (float)qsum;
        }
    }
}

// Stage x [K] (with norm_w: x * norm_w / rms(x), stage_x's order of operations) as int8 units: xq4 [units * 2]
// uint4, then xd [units] and xsum [units] floats. Each thread rounds whole half-units (16 values), H per
// pass (H * 4 float4 of x in registers; NORM: also the norm weights, H = 1). Normalised x that fits one pass
// (K <= 4096 at 256 threads) is read once: sum of squares, block sum, then the rounding from registers.
// Whole half-units per thread measured faster at tg128 (1B, 8B, Qwen2.5-0.5B Q4_K_M; docs/perf-log.md) than 8
// threads per unit with float4 values, whose dependent shuffle chains (max, non-finite flag, code sum), not
// its loads, were most of the staging time.
template <int H, bool NORM>
__device__ __forceinline__ void stage_xq_halves(const float* __restrict__ x, int K, const float* __restrict__ norm_w,
                                                float eps, uint4* xq4, const PostIn& pi) {
    const int units = (K + 31) / 32, nh = units * 2, per = H * (int)blockDim.x;
    float* xd = reinterpret_cast<float*>(xq4 + 2 * units);
    float* xsum = xd + units;
    float r = 1.0f;
    if (NORM && nh > per) {  // a separate sum-of-squares pass
        float ss = 0.0f;
        for (int base = threadIdx.x; base < nh; base += per) {
#pragma unroll
            for (int j = 0; j < H; ++j) {
                float4 v[4];
                load_half_in(x, K, base + j * (int)blockDim.x, nh, v, pi, false);
#pragma unroll
                for (int k = 0; k < 4; ++k) ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
            }
        }
        r = rsqrtf(block_sum(ss) / (float)K + eps);
    }
    for (int base = 0; base < nh; base += per) {  // uniform trip count: the shuffles need every lane
        float4 v[H][4], w[NORM ? H : 1][4];
#pragma unroll
        for (int j = 0; j < H; ++j) {
            const int h = base + j * (int)blockDim.x + (int)threadIdx.x;
            load_half_in(x, K, h, nh, v[j], pi, true);
            if (NORM) load_half(norm_w, K, h, nh, w[NORM ? j : 0]);
        }
        if (NORM) {
            if (nh <= per) {
                float ss = 0.0f;
#pragma unroll
                for (int j = 0; j < H; ++j)
#pragma unroll
                    for (int k = 0; k < 4; ++k)
                        ss += v[j][k].x * v[j][k].x + v[j][k].y * v[j][k].y + v[j][k].z * v[j][k].z + v[j][k].w * v[j][k].w;
                r = rsqrtf(block_sum(ss) / (float)K + eps);
            }
#pragma unroll
            for (int j = 0; j < H; ++j)
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float4 a = v[j][k], b = w[NORM ? j : 0][k];
                    v[j][k] = make_float4(a.x * b.x * r, a.y * b.y * r, a.z * b.z * r, a.w * b.w * r);
                }
        }
#pragma unroll
        for (int j = 0; j < H; ++j) quant_half(v[j], base + j * (int)blockDim.x + (int)threadIdx.x, nh, xq4, xd, xsum);
    }
    __syncthreads();
}

__device__ __forceinline__ void stage_xq(const float* __restrict__ x, int K, const float* __restrict__ norm_w, float eps,
                                         uint4* xq4, const PostIn& pi = PostIn()) {
    if (norm_w)
        stage_xq_halves<1, true>(x, K, norm_w, eps, xq4, pi);
    else
        stage_xq_halves<2, false>(x, K, nullptr, eps, xq4, pi);
}

// Sum over unit u of w[i] * x[i] against the int8 x: (scales) * xd[u] * (integer dot) (- the offset term).
template <class Q>
__device__ float unit_dot8(const u8* row, int u, const uint4* __restrict__ xq4, const float* __restrict__ xd,
                           const float* __restrict__ xsum);

// The unit's 8 words of int8 x (values 4k .. 4k+3 in word k).
__device__ __forceinline__ void x8_words(const uint4* __restrict__ xq4, int u, int (&xw)[8]) {
    const uint4 a = xq4[xqslot(u, 0)], b = xq4[xqslot(u, 1)];
    xw[0] = (int)a.x; xw[1] = (int)a.y; xw[2] = (int)a.z; xw[3] = (int)a.w;
    xw[4] = (int)b.x; xw[5] = (int)b.y; xw[6] = (int)b.z; xw[7] = (int)b.w;
}

template <>
__device__ __forceinline__ float unit_dot8<QQ4_K>(const u8* row, int u, const uint4* __restrict__ xq4,
                                                  const float* __restrict__ xd, const float* __restrict__ xsum) {
    const u8* p = row + (u >> 3) * QQ4_K::BYTES;
    const int j = u & 7, shift = 4 * (j & 1);
    int sc, m;
    scale_min_k4(p + 4, j, sc, m);
    u32 q[8];
    load_words<16, 8>(p + 16 + (j >> 1) * 32, q);
    int xw[8];
    x8_words(xq4, u, xw);
    int s = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) s = __dp4a((int)((q[k] >> shift) & 0x0F0F0F0Fu), xw[k], s);
    return ldh(p) * xd[u] * (float)(sc * s) - ldh(p + 2) * (float)m * xsum[u];
}

template <>
__device__ __forceinline__ float unit_dot8<QQ5_K>(const u8* row, int u, const uint4* __restrict__ xq4,
                                                  const float* __restrict__ xd, const float* __restrict__ xsum) {
    const u8* p = row + (u >> 3) * QQ5_K::BYTES;
    const int j = u & 7, shift = 4 * (j & 1);
    u32 h[4], qh[8], q[8];  // header; the 32 bytes of fifth bits (bit j: this unit); 32 bytes of nibbles
    load_words<16, 4>(p, h);
    load_words<16, 8>(p + 16, qh);
    load_words<16, 8>(p + 48 + (j >> 1) * 32, q);
    int sc, m;
    scale_min_k4w(h[1], h[2], h[3], j, sc, m);
    int xw[8];
    x8_words(xq4, u, xw);
    int s = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k)
        s = __dp4a((int)(((q[k] >> shift) & 0x0F0F0F0Fu) | (((qh[k] >> j) & 0x01010101u) << 4)), xw[k], s);
    return h2f((u16)(h[0] & 0xFFFFu)) * xd[u] * (float)(sc * s) - h2f((u16)(h[0] >> 16)) * (float)m * xsum[u];
}

template <>
__device__ __forceinline__ float unit_dot8<QQ6_K>(const u8* row, int u, const uint4* __restrict__ xq4,
                                                  const float* __restrict__ xd, const float* __restrict__) {
    const u8* p = row + (u >> 3) * QQ6_K::BYTES;
    const int j = u & 7, h = j >> 2, s4 = j & 3;
    u32 ql[8], qh[8];
    load_words<2, 8>(p + h * 64 + (s4 & 1) * 32, ql);
    load_words<2, 8>(p + 128 + h * 32, qh);
    const int lshift = 4 * (s4 >> 1), hshift = 2 * s4;
    int xw[8];
    x8_words(xq4, u, xw);
    int s0 = 0, s1 = 0;  // values 0-15 and 16-31: one scale each
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        // 6-bit codes c in 0..63 -> c - 32 in each byte, no borrow between bytes: (c + 128 - 32) ^ 128
        const u32 c = ((ql[k] >> lshift) & 0x0F0F0F0Fu) | (((qh[k] >> hshift) & 0x03030303u) << 4);
        const int w = (int)(((c | 0x80808080u) - 0x20202020u) ^ 0x80808080u);
        if (k < 4)
            s0 = __dp4a(w, xw[k], s0);
        else
            s1 = __dp4a(w, xw[k], s1);
    }
    return ldh(p + 208) * xd[u] * (float)((int)(i8)p[192 + 2 * j] * s0 + (int)(i8)p[192 + 2 * j + 1] * s1);
}

// 8 MXFP4 nibbles (one word of the block: byte i holds value i in its low nibble, value i + 16 in its high
// one) -> (the four low values, the four high values) as int8, twice E2M1 (0, 1, 2, 3, 4, 6, 8, 12 and their
// negatives): two byte permutes choose each nibble's entry among the table's lower and upper 8 bytes, a third
// picks by its bit 3, two more part the even and odd nibbles (llama.cpp's get_int_from_table_16).
__device__ __forceinline__ void mxfp4_int8(u32 q, int& lo, int& hi) {
    constexpr u32 T0 = 0x03020100u, T1 = 0x0C080604u, T2 = 0xFDFEFF00u, T3 = 0xF4F8FAFCu;
    const u32 pick = 0x32103210u | ((q & 0x88888888u) >> 1);
    u32 t[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const u32 s = (q >> (16 * i)) & 0x7777u;
        t[i] = __byte_perm(__byte_perm(T0, T1, s), __byte_perm(T2, T3, s), pick >> (16 * i));
    }
    lo = (int)__byte_perm(t[0], t[1], 0x6420);
    hi = (int)__byte_perm(t[0], t[1], 0x7531);
}

template <>
__device__ __forceinline__ float unit_dot8<QMXFP4>(const u8* row, int u, const uint4* __restrict__ xq4,
                                                   const float* __restrict__ xd, const float* __restrict__) {
    const u8* p = row + u * QMXFP4::BYTES;
    u32 q[4];
    load_words<1, 4>(p + 1, q);
    int xw[8];
    x8_words(xq4, u, xw);
    int s = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        int lo, hi;
        mxfp4_int8(q[k], lo, hi);
        s = __dp4a(lo, xw[k], s);      // values 4k .. 4k + 3
        s = __dp4a(hi, xw[k + 4], s);  // values 16 + 4k ..
    }
    return e8m0_half(__ldg(p)) * xd[u] * (float)s;
}

__device__ __forceinline__ u32 order_key_f(float f) {
    const u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Type equality for the mixed-type mv1 (no <type_traits> under NVRTC).
template <class A, class B> struct same_type { static constexpr bool value = false; };
template <class A> struct same_type<A, A> { static constexpr bool value = true; };

// One unit's dot against the staged x: int8 x for the act8 types, float x for the rest.
template <class Q>
__device__ __forceinline__ float mv1_dot(const u8* r, int u, int K, const float4* __restrict__ xs4,
                                         const uint4* __restrict__ xq4, const float* __restrict__ xd,
                                         const float* __restrict__ xsum) {
    if constexpr (act8<Q>::value)
        return unit_dot8<Q>(r, u, xq4, xd, xsum);
    else
        return unit_dot<Q>(r, u, K, xs4, xsum);
}

// This lane's share of one row (with SWIGLU also of the up row rb): units u, u + lpr, ... added into acc
// (acc2), UN units' loads in flight per iteration (the SwiGLU form: UN / 2 units of two rows).
template <class Q, bool SWIGLU>
__device__ __forceinline__ void mv1_row(const u8* ra, const u8* rb, int u, int lpr, int units, int K,
                                        const float4* __restrict__ xs4, const uint4* __restrict__ xq4,
                                        const float* __restrict__ xd, const float* __restrict__ xsum, float& acc,
                                        float& acc2) {
    constexpr int UN = act8<Q>::value ? MV1_UNROLL8 : 2;
    constexpr int UR = SWIGLU ? UN / 2 : UN;
    for (; u + (UR - 1) * lpr < units; u += UR * lpr) {
        float s = 0.0f, s2 = 0.0f;
#pragma unroll
        for (int i = 0; i < UR; ++i) {
            s += mv1_dot<Q>(ra, u + i * lpr, K, xs4, xq4, xd, xsum);
            if (SWIGLU) s2 += mv1_dot<Q>(rb, u + i * lpr, K, xs4, xq4, xd, xsum);
        }
        acc += s;
        if (SWIGLU) acc2 += s2;
    }
    for (; u < units; u += lpr) {
        acc += mv1_dot<Q>(ra, u, K, xs4, xq4, xd, xsum);
        if (SWIGLU) acc2 += mv1_dot<Q>(rb, u, K, xs4, xq4, xd, xsum);
    }
}

// Row n's output: silu(a) * b (SWIGLU), else a (+ bias[n]) (+ resid[n]) into y[n]; with the fused argmax,
// this lane's best packed (logit, id) key and NaN/+inf flag take it in (mv1 and mv1_stream).
template <bool SWIGLU, int ACT = ACT_SILU>
__device__ __forceinline__ void mv1_put(float a, float b, int n, float* y, const float* __restrict__ bias,
                                        const float* resid, bool argmax, u64& key, int& bad) {
    float out = a;
    if (SWIGLU) {
        if (bias) a += bias[n];  // the SwiGLU forms: the gate and up biases (bias, resid)
        if (resid) b += resid[n];
        out = glu_act<ACT>(a, b);
    } else {
        if (bias) out += bias[n];
        if (resid) out += resid[n];
    }
    y[n] = out;
    if (argmax) {
        const u64 k = ((u64)order_key_f(out) << 32) | (u64)(0xffffffffu - (u32)n);
        key = k > key ? k : key;
        bad |= (out != out) || (out == INFINITY);
    }
}

// The fused argmax's block and grid steps (mv1 and mv1_stream; every thread of the block calls it, `key`
// and `bad` its own rows' best packed (logit, id) key and NaN/+inf seen). am[0] = packed best key, am[1] =
// finished-block counter, am[2] = NaN/+inf flag (all zero between steps), am[3] = int* out [id, bad], am[4] =
// int* pos_inc or 0 (set once by the launcher).
__device__ __forceinline__ void mv1_argmax(u64 key, int bad, u64* am) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(FULL_MASK, key, o);
        key = other > key ? other : key;
    }
    __shared__ u64 s_key[32];
    __shared__ int s_last;
    bad = __syncthreads_or(bad);
    if (lane == 0) s_key[warp] = key;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 best = 0;
        for (int i = 0; i < (int)(blockDim.x >> 5); ++i) best = s_key[i] > best ? s_key[i] : best;
        atomicMax(am, best);
        if (bad) atomicOr(reinterpret_cast<unsigned int*>(am + 2), 1u);
        __threadfence();
        const unsigned int done = atomicAdd(reinterpret_cast<unsigned int*>(am + 1), 1u);
        s_last = done == gridDim.x - 1;
    }
    __syncthreads();
    if (s_last && threadIdx.x == 0) {
        __threadfence();
        const u64 best = atomicMax(am, 0ull);  // an atomic read: every block's max has landed
        const unsigned int flag = atomicOr(reinterpret_cast<unsigned int*>(am + 2), 0u);
        int* ids = *reinterpret_cast<int**>(am + 3);
        ids[0] = (int)(0xffffffffu - (u32)(best & 0xffffffffull));
        ids[1] = flag ? 1 : 0;
        int* pos_inc = *reinterpret_cast<int**>(am + 4);
        if (pos_inc) pos_inc[0] += 1;
        am[0] = 0ull;
        am[1] = 0ull;
        am[2] = 0ull;
    }
}

// QV: the type of segment w2 (the V rows of a QKV launch; Q elsewhere). A mixed pair (Q4_K_M's Q4_K Q/K
// with Q6_K V) shares one int8 staging of x, so the three matrices still run as one launch.
template <class Q, class QV, bool SWIGLU, int ACT = ACT_SILU>
__device__ __forceinline__ void mv1_body(const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2,
                                         int n0, int n1, int N, int K, const float* __restrict__ x, float* y,
                                         const float* __restrict__ bias, const float* resid,
                                         const float* __restrict__ norm_w, float eps, int lpr, int groups, u64* am,
                                         int early, const u64* __restrict__ post = nullptr) {
    constexpr bool MIXED = !same_type<Q, QV>::value;
    static_assert(!MIXED || (act8<Q>::value && act8<QV>::value && !SWIGLU), "mixed mv1: two int8-activation types");
    extern __shared__ float4 xs4[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rows_per_warp = 32 / lpr;
    const int sub = lane % lpr;
    const long long row_bytes = (long long)((K + Q::QK - 1) / Q::QK) * Q::BYTES;
    const long long row_bytes_v = (long long)((K + QV::QK - 1) / QV::QK) * QV::BYTES;
    const int units = (K + 31) / 32;
    // Row n of group g (a block serves `groups` groups of 8 * 32/lpr rows, one staging of x for all).
    auto row_of = [&](int g) {
        return (((int)blockIdx.x * groups + g) * (int)(blockDim.x >> 5) + warp) * rows_per_warp + lane / lpr;
    };
    auto in_v = [&](int n) { return MIXED && n >= n0 + n1; };
    auto rows_at = [&](int n, const u8*& ra, const u8*& rb) {
        row_pointers<SWIGLU>(w0, w1, w2, n0, n1, n, row_bytes, ra, rb);
        if (in_v(n)) ra = w2 + (long long)(n - n0 - n1) * row_bytes_v;
    };

    // Start this lane's first weight units on their way to L2 (about where unit u lies in the row), then
    // stage x: the two global reads overlap instead of following each other. Weights only, so this runs
    // before pdl_wait(): in the captured decode step, while the previous kernel is still running.
    if (row_of(0) < N && (long long)N * row_bytes < (SWIGLU ? MV1_PREFETCH_MAX_SWIGLU : MV1_PREFETCH_MAX)) {
        const u8* ra = nullptr;
        const u8* rb = nullptr;
        rows_at(row_of(0), ra, rb);
        const long long rbytes = in_v(row_of(0)) ? row_bytes_v : row_bytes;
        for (int j = 0, uu = sub; j < 4 && uu < units; ++j, uu += lpr) {
            const long long off = (long long)uu * rbytes / units;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(ra + off));
            if (SWIGLU) asm volatile("prefetch.global.L2 [%0];" ::"l"(rb + off));
        }
    }
    pdl_wait();  // x, resid, y and the argmax cells belong to earlier kernels of the step
    if (early) pdl_launch_dependents();
    const uint4* xq4 = reinterpret_cast<const uint4*>(xs4);
    const float* xd = reinterpret_cast<const float*>(xq4 + 2 * units);
    const float* xsum;
    const PostIn pi = post_in(post, K, eps);
    if constexpr (act8<Q>::value) {
        stage_xq(x, K, norm_w, eps, reinterpret_cast<uint4*>(xs4), pi);
        xsum = xd + units;
    } else {
        stage_x<needs_xsum<Q>::value>(x, K, norm_w, eps, xs4, pi);
        xsum = reinterpret_cast<const float*>(xs4 + units * 8);
    }

    u64 key = 0;  // fused argmax: this lane's best (logit, id) key over its rows, and NaN/+inf seen
    int bad = 0;
    for (int g = 0; g < groups; ++g) {
        const int n = row_of(g);
        const bool active = n < N;
        const u8* ra = nullptr;
        const u8* rb = nullptr;
        float acc = 0.0f, acc2 = 0.0f;
        if (active) {
            rows_at(n, ra, rb);
            if (in_v(n))
                mv1_row<QV, SWIGLU>(ra, rb, sub, lpr, units, K, xs4, xq4, xd, xsum, acc, acc2);
            else
                mv1_row<Q, SWIGLU>(ra, rb, sub, lpr, units, K, xs4, xq4, xd, xsum, acc, acc2);
        }
        for (int o = lpr >> 1; o > 0; o >>= 1) {
            acc += __shfl_xor_sync(FULL_MASK, acc, o);
            if (SWIGLU) acc2 += __shfl_xor_sync(FULL_MASK, acc2, o);
        }
        if (active && sub == 0) mv1_put<SWIGLU, ACT>(acc, acc2, n, y, bias, resid, am != nullptr, key, bad);
    }
    if (!early) pdl_launch_dependents();
    if (am != nullptr) mv1_argmax(key, bad, am);
}

#define MV1_KERNELS(name, Q)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, act8<Q>::value ? MV1_MINB8 : 0) mv1_##name(            \
        const u8* w0, const u8* w1, const u8* w2, int n0, int n1, int N, int K, const float* x, float* y,    \
        const float* bias, const float* resid, const float* norm_w, float eps, int lpr, int groups, u64* am, \
        int early, const u64* post) {                                                                        \
        mv1_body<Q, Q, false>(w0, w1, w2, n0, n1, N, K, x, y, bias, resid, norm_w, eps, lpr, groups, am,     \
                              early, post);                                                                  \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256, act8<Q>::value ? MV1_MINB8 : 0) mv1_##name##_swiglu(   \
        const u8* wg, const u8* wu, int N, int K, const float* x, float* y, const float* norm_w, float eps,  \
        int lpr, int groups, int early, const u64* post) {                                                   \
        mv1_body<Q, Q, true>(wg, wu, nullptr, N, 0, N, K, x, y, nullptr, nullptr, norm_w, eps, lpr, groups,  \
                             nullptr, early, post);                                                          \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256, act8<Q>::value ? MV1_MINB8 : 0) mv1_##name##_geglu(    \
        const u8* wg, const u8* wu, int N, int K, const float* x, float* y, const float* norm_w, float eps,  \
        int lpr, int groups, int early, const u64* post) {                                                   \
        mv1_body<Q, Q, true, ACT_GELU>(wg, wu, nullptr, N, 0, N, K, x, y, nullptr, nullptr, norm_w, eps, lpr,    \
                                   groups, nullptr, early, post);                                            \
    }

#ifndef MATVEC_BODIES_ONLY
FOR_EACH_QTYPE(MV1_KERNELS)
#endif

// The QKV launch of Q4_K_M-style layers: Q and K rows (w0, w1) of type QA, V rows (w2) of type QB.
#define MV1_MIXED(a, QA, b, QB)                                                                              \
    extern "C" __global__ void __launch_bounds__(256, MV1_MINB8) mv1_mixed_##a##_##b(                        \
        const u8* w0, const u8* w1, const u8* w2, int n0, int n1, int N, int K, const float* x, float* y,    \
        const float* bias, const float* resid, const float* norm_w, float eps, int lpr, int groups, u64* am, \
        int early, const u64* post) {                                                                        \
        mv1_body<QA, QB, false>(w0, w1, w2, n0, n1, N, K, x, y, bias, resid, norm_w, eps, lpr, groups, am,   \
                                early, post);                                                                \
    }
#ifndef MATVEC_BODIES_ONLY
MV1_MIXED(q4_k, QQ4_K, q5_k, QQ5_K)
MV1_MIXED(q4_k, QQ4_K, q6_k, QQ6_K)
MV1_MIXED(q5_k, QQ5_K, q4_k, QQ4_K)
MV1_MIXED(q5_k, QQ5_K, q6_k, QQ6_K)
MV1_MIXED(q6_k, QQ6_K, q4_k, QQ4_K)
MV1_MIXED(q6_k, QQ6_K, q5_k, QQ5_K)
#endif

// ---- one token, short Q8_0 rows: the tiled form -----------------------------------------------------------------
// mv1_tile_q8_0(w, N, K, x, y, bias, resid, norm_w, eps, am, early, post): mv1_q8_0's results (one segment,
// bias, residual, fused RMSNorm, post-norm input, argmax; `early` as mv1's) for many short rows: the LM head of
// a small model (cuda.linear.mv1_tile_ok). mv1 gives a row's 34-byte blocks to its lanes, one block a lane: a
// 640-column row (Gemma 3's 262,144-row head) keeps 20 of 32 lanes busy, and a block 2-byte aligned is read as
// 17 two-byte loads whose addresses 34 bytes apart touch a new sector each, so a warp's load moves ~42 useful
// bytes: the head ran far under copy speed. Here each warp walks tiles of MV1T_ROWS consecutive rows (one contiguous,
// 16-byte aligned byte range): tile t, t + warps in the grid, ..., copied into the warp's own shared memory by
// 16-byte cp.async chunks (512 contiguous bytes a warp instruction), MV1T_STAGES tiles in flight per warp, no
// block barrier in the loop. Lane 8a + b takes row b of the tile and its units a, a + 4, ...: the 8 lanes of a
// unit read the same float4 of x (a broadcast: x's shared-memory reads were the limit when every lane read
// its own), a block's 34 bytes come as 9 aligned words and a funnel shift, and a row's 4 lanes meet by two
// shuffles. Grid: one block of MV1T_WARPS warps per SM at most; the first tiles' copies start before
// pdl_wait(). A unit's math is unit_dot<QQ8_0>'s (four partial sums where it has one).
// Measured (262,144 x 640, weights past L2, CUDA events; the figures are in docs/perf-log.md): close to a device
// copy's rate, faster than x read per lane from shared memory (one (row, block) pair a lane, block-wide tiles,
// partial sums in shared memory) and about twice as fast as mv1. Stages and warps: (2, 12), (3, 8) and (4, 8)
// alike, (2, 16) and (2, 20) slower; (2, 12) is kept, the fastest at 576 columns.
// MV1T_ROWS, MV1T_STAGES, MV1T_WARPS: llamacli/backends/cuda/constants.py (the loader puts them in front)

#ifndef MATVEC_BODIES_ONLY
extern "C" __global__ void __launch_bounds__(32 * MV1T_WARPS, 1) mv1_tile_q8_0(
    const u8* __restrict__ w, int N, int K, const float* __restrict__ x, float* y, const float* __restrict__ bias,
    const float* resid, const float* __restrict__ norm_w, float eps, u64* am, int early,
    const u64* __restrict__ post) {
    extern __shared__ float4 xs4[];
    const int units = (K + 31) / 32;
    const int tile_bytes = MV1T_ROWS * units * QQ8_0::BYTES;  // a multiple of 16 (MV1T_ROWS = 8)
    const int n_tiles = (N + MV1T_ROWS - 1) / MV1T_ROWS;
    const long long total = (long long)N * units * QQ8_0::BYTES;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int W = (int)(gridDim.x * (blockDim.x >> 5)), gw = (int)(blockIdx.x * (blockDim.x >> 5)) + warp;
    // After x (stage_x's slots), this warp's stages.
    u8* stages = reinterpret_cast<u8*>(xs4) + ((units * 128 + 15) & ~15) + warp * MV1T_STAGES * tile_bytes;
    auto issue = [&](int t, int s) {  // tile t into stage s; past N zero-filled; always a commit group
        if (t < n_tiles) {
            const long long base = (long long)t * tile_bytes;
            const u32 dst = smem_addr(stages + s * tile_bytes);
            for (int c = lane; 16 * c < tile_bytes; c += 32) {
                const long long off = base + 16ll * c;
                const long long left = total - off;
                const int bytes = left >= 16 ? 16 : (left > 0 ? (int)left : 0);
                cp_async16(dst + 16u * c, w + (bytes > 0 ? off : 0ll), bytes);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
#pragma unroll
    for (int s = 0; s < MV1T_STAGES - 1; ++s) issue(gw + s * W, s);
    pdl_wait();  // x, resid, y and the argmax cells belong to earlier kernels of the step
    if (early) pdl_launch_dependents();
    stage_x<false>(x, K, norm_w, eps, xs4, post_in(post, K, eps));

    u64 key = 0;  // fused argmax, as mv1's
    int bad = 0;
    const int rb = lane & 7, ua = lane >> 3;
    int i = 0;
    for (int t = gw; t < n_tiles; t += W, ++i) {
        asm volatile("cp.async.wait_group %0;" ::"n"(MV1T_STAGES - 2) : "memory");
        __syncwarp();  // tile t is in for every lane; every lane is done with the stage refilled next
        issue(t + (MV1T_STAGES - 1) * W, (i + MV1T_STAGES - 1) % MV1T_STAGES);
        const u8* st = stages + (i % MV1T_STAGES) * tile_bytes;
        float acc = 0.0f;
        for (int u = ua; u < units; u += 4) {
            // Block (rb, u): 9 words from the one at or before it; its values start 2 bytes (block 4-byte
            // aligned) or 4 bytes (2 past: the clamped funnel shift by 32 takes the high word) into them.
            const int b = (rb * units + u) * QQ8_0::BYTES, sh = (b & 2) ? 32 : 16;
            const u32* wp = reinterpret_cast<const u32*>(st + (b & ~3));
            u32 wd[9];
#pragma unroll
            for (int k = 0; k < 9; ++k) wd[k] = wp[k];
            float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int k = 0; k < 8; ++k) {  // i8 + 128, as unit_dot
                const u32 q = __funnelshift_rc(wd[k], wd[k + 1], sh);
                s[k & 3] = dot_bytes4(q ^ 0x80808080u, xs4[xslot(u, k)], TWO23 + 128.0f, s[k & 3]);
            }
            acc += h2f((u16)(wd[0] >> (sh - 16))) * ((s[0] + s[1]) + (s[2] + s[3]));
        }
        acc += __shfl_xor_sync(FULL_MASK, acc, 8);
        acc += __shfl_xor_sync(FULL_MASK, acc, 16);
        const int n = t * MV1T_ROWS + rb;
        if (ua == 0 && n < N) mv1_put<false>(acc, 0.0f, n, y, bias, resid, am != nullptr, key, bad);
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    if (!early) pdl_launch_dependents();
    if (am != nullptr) mv1_argmax(key, bad, am);
}
#endif

// ---- one token, 16-bit float rows: the streaming form ---------------------------------------------------------
// mv1_stream_<t>(w0, w1, w2, n0, n1, N, K, x, y, bias, resid, norm_w, eps, am, early) and
// mv1_stream_<t>_swiglu(wg, wu, N, K, x, y, norm_w, eps, early), t = f16 / bf16: mv1's results (segments,
// bias, residual, fused RMSNorm, SwiGLU, argmax; `early` as mv1's) for rows with K % 8 == 0 in 16-byte
// aligned segments (cuda.linear.mv1_stream_ok). mv1 reads F16 rows as 64-byte units per lane with one pair
// of units in flight, stages x once per 8 rows, and runs grids of many waves that launch plainly in the
// decode step (this form made Llama-3-8B F16's decode markedly faster: docs/perf-log.md). Here:
//   - 16-byte chunks, chunk c of a row (values 8c .. 8c+7) read by lane c % 32 of its warp: one load
//     instruction of a warp reads 512 contiguous bytes;
//   - one wave: at most MV1S_BLOCKS_PER_SM blocks of 256 threads per SM (cuda.linear.mv1_stream_grid), x
//     staged once per block; warp w of W in the grid serves rows w, w + W, ... (the SwiGLU form: the gate
//     row, then the up row);
//   - each lane keeps MV1S_BUFS batches of MV1S_BATCH chunks in flight (256 bytes): a batch is loaded again
//     as soon as it is dotted, across row ends;
//   - the first MV1S_BUFS batches are loaded before pdl_wait(): as a programmatic dependent (the decode step
//     lets it in early) the block does that while the kernel before it finishes.
// Measured on 8B F16 tg128 (the figures are in docs/perf-log.md): (batch, buffers, blocks per SM) = (8, 2, 2)
// was the best of the shapes tried (x staged one float4 a thread at a time, the next kernel let in after the
// main loop); with it, the next streaming kernel let in right after pdl_wait() (`early`; its blocks take the
// SMs this kernel's leave) was faster, and x staged 2 float4 a thread at a time (MV1S_STAGE_BATCH) faster
// again. Weights prefetched into L2 before pdl_wait() measured slower or the same.
// Sums in float32 as mv1's; the order of the additions differs (per lane: its chunks in row order).
#define MV1S_BATCH 8
#define MV1S_BUFS 2
// MV1S_BLOCKS_PER_SM: llamacli/backends/cuda/constants.py (the loader puts them in front)
#define MV1S_STAGE_BATCH 2

__device__ __forceinline__ uint4 ld_stream16(const u8* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

template <bool BF> __device__ __forceinline__ float half_lo(u32 w) {
    return BF ? __uint_as_float(w << 16) : h2f((u16)(w & 0xffffu));
}
template <bool BF> __device__ __forceinline__ float half_hi(u32 w) {
    return BF ? __uint_as_float(w & 0xffff0000u) : h2f((u16)(w >> 16));
}

// s + chunk c (values 8c .. 8c+7 as the 16-bit floats of w) dotted with the staged x (unit c / 4, float4
// slots 2 (c % 4) and the next: 8 consecutive lanes read 8 different bank groups).
template <bool BF>
__device__ __forceinline__ float chunk_dot(uint4 w, const float4* __restrict__ xs4, int c, float s) {
    const int u = c >> 2, k = 2 * (c & 3);
    const float4 a = xs4[xslot(u, k)], b = xs4[xslot(u, k + 1)];
    s = fmaf(half_lo<BF>(w.x), a.x, s);
    s = fmaf(half_hi<BF>(w.x), a.y, s);
    s = fmaf(half_lo<BF>(w.y), a.z, s);
    s = fmaf(half_hi<BF>(w.y), a.w, s);
    s = fmaf(half_lo<BF>(w.z), b.x, s);
    s = fmaf(half_hi<BF>(w.z), b.y, s);
    s = fmaf(half_lo<BF>(w.w), b.z, s);
    s = fmaf(half_hi<BF>(w.w), b.w, s);
    return s;
}

// Where a warp's weight stream stands: batch j (MV1S_BATCH chunks a lane) of pass p (SwiGLU: 0 gate, 1 up)
// of row n, whose bytes start at row. Rows n, n + W, ... are the warp's (W warps in the grid).
template <bool SWIGLU>
struct StreamCursor {
    const u8 *w0, *w1, *w2;
    int n0, n1, N, W, nb;
    long long row_bytes;
    int n, p, j;
    const u8* row;
    __device__ __forceinline__ void seek() {
        if (n >= N) return;
        const u8* ra = nullptr;
        const u8* rb = nullptr;
        row_pointers<SWIGLU>(w0, w1, w2, n0, n1, n, row_bytes, ra, rb);
        row = SWIGLU && p ? rb : ra;
    }
    __device__ __forceinline__ void next() {
        if (++j < nb) return;
        j = 0;
        if (SWIGLU && p == 0) {
            p = 1;
        } else {
            p = 0;
            n += W;
        }
        seek();
    }
    // Chunk i of this batch for this lane: its index in the row (past the row's end: cpr or more).
    __device__ __forceinline__ int chunk(int i, int lane) const { return (j * MV1S_BATCH + i) * 32 + lane; }
};

template <bool BF, bool SWIGLU, int ACT = ACT_SILU>
__device__ __forceinline__ void mv1s_body(const u8* __restrict__ w0, const u8* __restrict__ w1,
                                          const u8* __restrict__ w2, int n0, int n1, int N, int K,
                                          const float* __restrict__ x, float* y, const float* __restrict__ bias,
                                          const float* resid, const float* __restrict__ norm_w, float eps, u64* am,
                                          int early, const u64* __restrict__ post = nullptr) {
    constexpr int B = MV1S_BATCH, NB = MV1S_BUFS;
    extern __shared__ float4 xs4[];
    const int lane = threadIdx.x & 31;
    const int W = (int)(gridDim.x * (blockDim.x >> 5));
    const int gw = (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));
    const int cpr = K >> 3;                        // 16-byte chunks per row
    const int nb = (cpr + 32 * B - 1) / (32 * B);  // batches per row (pass)
    // The warp's steps: its rows, each in 1 pass (SwiGLU: 2, gate then up) of nb batches; warp-uniform.
    const int steps = (gw < N ? (N - 1 - gw) / W + 1 : 0) * (SWIGLU ? 2 : 1) * nb;
    StreamCursor<SWIGLU> ld{w0, w1, w2, n0, n1, N, W, nb, 2ll * K, gw, 0, 0, nullptr};
    ld.seek();
    auto load = [&](uint4 (&v)[B]) {
#pragma unroll
        for (int i = 0; i < B; ++i) {
            const int c = ld.chunk(i, lane);
            if (c < cpr) v[i] = ld_stream16(ld.row + 16ll * c);
        }
        ld.next();
    };

    // Before pdl_wait(): the first NB batches into registers.
    uint4 v[NB][B];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
#pragma unroll
        for (int i = 0; i < B; ++i) v[b][i] = make_uint4(0u, 0u, 0u, 0u);
        if (b < steps) load(v[b]);
    }
    pdl_wait();  // x, resid, y and the argmax cells belong to earlier kernels of the step
    if (early) pdl_launch_dependents();
    stage_x<false, MV1S_STAGE_BATCH>(x, K, norm_w, eps, xs4, post_in(post, K, eps));

    // Dot cursor: batch cj of pass cp of row cn.
    int cn = gw, cp = 0, cj = 0;
    float acc = 0.0f, gate = 0.0f;
    u64 key = 0;  // fused argmax, as mv1's
    int bad = 0;
    auto dot = [&](const uint4 (&w)[B]) {
#pragma unroll
        for (int i = 0; i < B; ++i) {
            const int c = (cj * B + i) * 32 + lane;
            if (c < cpr) acc = chunk_dot<BF>(w[i], xs4, c, acc);
        }
        if (++cj < nb) return;
        cj = 0;
        const float t = warp_sum(acc);
        acc = 0.0f;
        if (SWIGLU && cp == 0) {
            cp = 1;
            gate = t;
            return;
        }
        cp = 0;
        if (lane == 0) mv1_put<SWIGLU, ACT>(SWIGLU ? gate : t, t, cn, y, bias, resid, am != nullptr, key, bad);
        cn += W;
    };
    for (int s = 0; s < steps; s += NB) {
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            if (s + b < steps) {
                dot(v[b]);
                if (s + b + NB < steps) load(v[b]);
            }
        }
    }
    if (!early) pdl_launch_dependents();
    if (am != nullptr) mv1_argmax(key, bad, am);
}

#define MV1S_KERNELS(name, BF)                                                                              \
    extern "C" __global__ void __launch_bounds__(256, MV1S_BLOCKS_PER_SM) mv1_stream_##name(                         \
        const u8* w0, const u8* w1, const u8* w2, int n0, int n1, int N, int K, const float* x, float* y,   \
        const float* bias, const float* resid, const float* norm_w, float eps, u64* am, int early, const u64* post) { \
        mv1s_body<BF, false>(w0, w1, w2, n0, n1, N, K, x, y, bias, resid, norm_w, eps, am, early, post);     \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, MV1S_BLOCKS_PER_SM) mv1_stream_##name##_swiglu(                \
        const u8* wg, const u8* wu, int N, int K, const float* x, float* y, const float* norm_w, float eps, \
        int early, const u64* post) {                                                                        \
        mv1s_body<BF, true>(wg, wu, nullptr, N, 0, N, K, x, y, nullptr, nullptr, norm_w, eps, nullptr,      \
                            early, post);                                                                    \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, MV1S_BLOCKS_PER_SM) mv1_stream_##name##_geglu(                 \
        const u8* wg, const u8* wu, int N, int K, const float* x, float* y, const float* norm_w, float eps, \
        int early, const u64* post) {                                                                        \
        mv1s_body<BF, true, ACT_GELU>(wg, wu, nullptr, N, 0, N, K, x, y, nullptr, nullptr, norm_w, eps, nullptr, \
                                  early, post);                                                              \
    }
#ifndef MATVEC_BODIES_ONLY
MV1S_KERNELS(f16, false)
MV1S_KERNELS(bf16, true)
#endif
