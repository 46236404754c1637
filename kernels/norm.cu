// norm.cu: RMSNorm. y[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * w[:]
//
// Shapes: x, y [T, D] f32 (y may alias x), w [D] f32. Launch: grid T, block 256 (D <= 8192 reads each
// element twice from L1/L2; a single pass would need the row in registers); fp32 accumulation.
// Best measured on H100: not yet tuned (one block per row: D=576..4096 is latency-bound, ~2-3 us).

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
