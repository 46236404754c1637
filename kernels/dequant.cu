// dequant.cu: whole blocks to floating point, for the two places that want plain numbers.
//
//   dequant_<t>(W [N, K] blocks, N, K, out f16 bits [N, K])   prefill: the fp16 weight that cuBLAS
//       multiplies (cupy.matmul, fp32 accumulation); done in row chunks so no fp16 copy of the model lives
//       on the GPU. One thread per 32-value unit, grid-stride over N*K/32 units, block 256.
//   embed_<t>(ids [T] i32, W [V, K], K, out f32 [T, K])       the token embedding gather: grid (T,
//       ceil(units/128)), block 128, one thread per 32-value unit of row ids[t].
// Both call the decoders of quants.cuh that matvec.cu uses. Best measured on H100: not yet tuned.

#include "common.cuh"
#include "quants.cuh"

template <class Q>
__device__ __forceinline__ void dequant_body(const u8* __restrict__ w, long long N, int K, u16* __restrict__ out) {
    const long long row_bytes = (long long)((K + Q::QK - 1) / Q::QK) * Q::BYTES;
    const int units = (K + 31) / 32;
    const long long total = N * units;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long n = i / units;
        const int u = (int)(i - n * units);
        float v[32];
        Q::unit(w + n * row_bytes, u, K, v);
        u16* o = out + n * K + u * 32;
        if ((K & 7) == 0) {
            uint4* o4 = reinterpret_cast<uint4*>(o);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                uint4 q;
                q.x = (u32)f2h(v[8 * k + 0]) | ((u32)f2h(v[8 * k + 1]) << 16);
                q.y = (u32)f2h(v[8 * k + 2]) | ((u32)f2h(v[8 * k + 3]) << 16);
                q.z = (u32)f2h(v[8 * k + 4]) | ((u32)f2h(v[8 * k + 5]) << 16);
                q.w = (u32)f2h(v[8 * k + 6]) | ((u32)f2h(v[8 * k + 7]) << 16);
                o4[k] = q;
            }
        } else {
#pragma unroll
            for (int k = 0; k < 32; ++k)
                if (u * 32 + k < K) o[k] = f2h(v[k]);
        }
    }
}

template <class Q>
__device__ __forceinline__ void embed_body(const int* __restrict__ ids, const u8* __restrict__ w, int K,
                                           float* __restrict__ out) {
    const int t = blockIdx.x;
    const int u = blockIdx.y * blockDim.x + threadIdx.x;
    if (u * 32 >= K) return;
    const long long row_bytes = (long long)((K + Q::QK - 1) / Q::QK) * Q::BYTES;
    float v[32];
    Q::unit(w + (long long)ids[t] * row_bytes, u, K, v);
    float* o = out + (long long)t * K + u * 32;
    if ((K & 3) == 0 && u * 32 + 32 <= K) {
#pragma unroll
        for (int k = 0; k < 8; ++k)
            reinterpret_cast<float4*>(o)[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
    } else {
#pragma unroll
        for (int k = 0; k < 32; ++k)
            if (u * 32 + k < K) o[k] = v[k];
    }
}

#define DEQUANT_KERNELS(name, Q)                                                                  \
    extern "C" __global__ void dequant_##name(const u8* w, long long N, int K, u16* out) {         \
        dequant_body<Q>(w, N, K, out);                                                            \
    }                                                                                             \
    extern "C" __global__ void embed_##name(const int* ids, const u8* w, int K, float* out) {     \
        embed_body<Q>(ids, w, K, out);                                                            \
    }

FOR_EACH_QTYPE(DEQUANT_KERNELS)
