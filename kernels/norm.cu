// norm.cu: RMSNorm. y[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * w[:]
//
// Shapes: x, y [T, D] f32 (y may alias x), w [D] f32. Launch: grid T, block 256 (D <= 8192 reads each
// element twice from L1/L2; a single pass would need the row in registers); fp32 accumulation.
// rms_norm_f16(x, w, y16, scale, D, eps): the same y stored as fp16(y / s) with s[t] = f16_rowscale(max |y|)
// (common.cuh): the fused prefill's GEMM input. Same launch.
// head_rms_norm(x, stride, Hq, Hkv, Dh, wq, wk, eps): qwen3's per-head RMSNorm of q and k, in place, on rows
// [T, stride] that start with Hq q heads then Hkv k heads of Dh floats (the fused QKV matvec's output);
// q heads take wq [Dh], k heads wk [Dh]. grid (T, Hq + Hkv), block Dh rounded up to 32 (at most 1024). In the
// captured decode step it may launch as a programmatic dependent of the QKV matvec: it waits for it first.
// rms_norm_add(x, y, s, w, D, eps): gemma's post-norm before the residual add, x[t, :] += RMSNorm(y[t, :] * s[t])
// * w (s [T] the GEMM's row scales, or NULL: 1). grid T, block 256. (The decode step folds it into the next
// matvec's input instead: kernels/matvec.cu PostIn.)
// Best measured on H100: not yet tuned (one block per row: D=576..4096 is latency-bound).

#include "common.cuh"

extern "C" __global__ void rms_norm_f32(const float* x, const float* __restrict__ w, float* y, int D, float eps) {
    const long long base = (long long)blockIdx.x * D;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float v = x[base + i];
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss);
    const float r = rsqrtf(ss / (float)D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) y[base + i] = x[base + i] * r * w[i];
}

extern "C" __global__ void rms_norm_f16(const float* __restrict__ x, const float* __restrict__ w, u16* __restrict__ y,
                                        float* __restrict__ scale, int D, float eps) {
    const long long base = (long long)blockIdx.x * D;
    float ss = 0.0f, m = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float v = x[base + i];
        ss = fmaf(v, v, ss);
        m = fmaxf(m, fabsf(v * w[i]));
    }
    ss = block_sum(ss);
    m = block_max(m);
    const float r = rsqrtf(ss / (float)D + eps);
    const float s = f16_rowscale(m * r);
    const float inv = 1.0f / s;
    for (int i = threadIdx.x; i < D; i += blockDim.x) y[base + i] = f2h(x[base + i] * r * w[i] * inv);
    if (threadIdx.x == 0) scale[blockIdx.x] = s;
}

extern "C" __global__ void head_rms_norm(float* x, int stride, int Hq, int Hkv, int Dh, const float* __restrict__ wq,
                                         const float* __restrict__ wk, float eps) {
    pdl_wait();
    float* h = x + (long long)blockIdx.x * stride + (long long)blockIdx.y * Dh;
    const float* w = (int)blockIdx.y < Hq ? wq : wk;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < Dh; i += blockDim.x) ss = fmaf(h[i], h[i], ss);
    const float r = rsqrtf(block_sum(ss) / (float)Dh + eps);
    for (int i = threadIdx.x; i < Dh; i += blockDim.x) h[i] = h[i] * r * w[i];  // each thread its own dims
}

extern "C" __global__ void rms_norm_add(float* x, const float* __restrict__ y, const float* __restrict__ s,
                                        const float* __restrict__ w, int D, float eps) {
    const long long base = (long long)blockIdx.x * D;
    const float sc = s ? s[blockIdx.x] : 1.0f;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float v = y[base + i] * sc;
        ss = fmaf(v, v, ss);
    }
    const float r = rsqrtf(block_sum(ss) / (float)D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) x[base + i] += y[base + i] * sc * r * w[i];
}
