// matvec.cu: y[t, n] = sum_k W[n, k] x[t, k] for T <= 8 tokens (decode), reading W's GGUF blocks directly.
//
// Shapes: W [N, K] quantized rows of K/QK blocks (quants.cuh), x [T, K] f32, y [T, N] f32.
// Variants per weight type (suffix = ggml type in lower case, FOR_EACH_QTYPE):
//   matvec_<t>        y = W x (+ bias[n]) (+ resid[t, n]); W may be up to three row segments (w0: n0 rows,
//                     w1: n1 rows, w2: the rest) of one type, so Q, K and V run as one launch without
//                     copying them together; resid may alias y (the fused residual add).
//   matvec_<t>_swiglu y[t, n] = silu(Wg[n] . x) * (Wu[n] . x), gate rows w0 and up rows w1 (the fused
//                     gate/up projection: one launch, no [T, 2F] intermediate).
// Launch: block 128 threads (4 warps). A warp serves 32/lpr rows, lpr lanes per row (lpr = power of two
// <= 32 chosen from the row's 32-value units so that short rows keep every lane busy); each lane walks units
// u = lane, lane+lpr, ..., decodes 32 weights into registers and dots them with every token's x; the lpr
// partial sums meet by xor shuffles. Grid = ceil(N / (4 * 32/lpr)).
// Best measured on H100: not yet tuned (performance is the next issue): block 128, lpr from K as above;
// the whole SmolLM2-135M Q4_1 decode step (4 matvecs per layer: QKV, output, gate+up+SwiGLU, down) replays in 1.28 ms.
// Expect the 2-byte-aligned formats (Q4_0, Q8_0, Q6_K) to want a repacked layout for 16-byte loads.

#include "common.cuh"
#include "quants.cuh"

#define MATVEC_TMAX 8

template <class Q, bool SWIGLU>
__device__ __forceinline__ void matvec_body(const u8* __restrict__ w0, const u8* __restrict__ w1,
                                            const u8* __restrict__ w2, int n0, int n1, int N, int K,
                                            const float* __restrict__ x, int T, float* y,
                                            const float* __restrict__ bias, const float* resid, int lpr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rows_per_warp = 32 / lpr;
    const int sub = lane % lpr;
    const int n = (blockIdx.x * (blockDim.x >> 5) + warp) * rows_per_warp + lane / lpr;
    const long long row_bytes = (long long)((K + Q::QK - 1) / Q::QK) * Q::BYTES;
    const int units = (K + 31) / 32;
    const bool active = n < N;

    const u8* ra = nullptr;
    const u8* rb = nullptr;
    if (active) {
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
                const float* xr = x + (long long)t * K + u * 32;
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
                const long long i = (long long)t * N + n;
                if (SWIGLU) {
                    y[i] = s / (1.0f + expf(-s)) * s2;
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
    }

FOR_EACH_QTYPE(MATVEC_KERNELS)
