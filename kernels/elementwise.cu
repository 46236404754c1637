// elementwise.cu: the small element-wise ops of the block. All f32, grid-stride, block 256.
//   swiglu_f32   y[i] = silu(g[i]) * u[i]            g, u, y [n] (y may alias either)
//   add_f32      y[i] = a[i] + b[i]                  residual add (y may alias a)
//   add_bias_f32 x[t, j] += b[j]                     x [T, N], b [N]
//   spin_ns      one thread waits `ns` nanoseconds of %globaltimer: the profiler (bench --profile) queues a
//                step behind it, so the step's kernels then run back to back without host launch gaps
// In the fused decode step these are folded into the matvec (swiglu, resid, bias arguments); these
// stand-alone kernels serve the op-by-op path of model.forward (prefill). Best measured: not tuned.

#include "common.cuh"

extern "C" __global__ void swiglu_f32(const float* g, const float* u, float* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float a = g[i];
        y[i] = a / (1.0f + expf(-a)) * u[i];
    }
}

extern "C" __global__ void add_f32(const float* a, const float* b, float* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = a[i] + b[i];
}

extern "C" __global__ void add_bias_f32(float* x, const float* __restrict__ b, long long n, int N) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] += b[i % N];
}

extern "C" __global__ void spin_ns(long long ns) {
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    t = t0;
    while ((long long)(t - t0) < ns) {
        __nanosleep(2000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    }
}
