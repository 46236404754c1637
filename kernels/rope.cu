// rope.cu: rotary position embedding (RoFormer), applied in place, plus the fused decode variant that also
// stores K and V into the fp16 cache.
//
// Math: for rotated pair i < rope_dim/2 of a head at position p:
//   theta = p * inv_freq[i]  (f64; inv_freq[i] = base^(-2i/rope_dim) / factor[i] / linear_factor, uploaded
//   once), (a, b) -> (a cos - b sin, a sin + b cos) * attn_factor on cos/sin.
//   Pairs: rope_normal (2i, 2i+1) (llama), rope_neox (i, i + rope_dim/2) (qwen2, phi3). Dims past rope_dim
//   pass through.
// Shapes: x [T, H, Dh] f32 rows `stride` floats apart per token; pos [T] i32 (device memory).
//   rope_<mode>(x, stride, H, Dh, rope_dim, pos, inv_freq, attn_factor)
//       grid (T, H), block Dh/2 rounded up to 32: one thread per pair.
//   rope_store_<mode>(qkv, stride, Hq, Hkv, Dh, rope_dim, pos, inv_freq, attn_factor, kcache, vcache, ring)
//       qkv [T, (Hq+2Hkv)*Dh] as the fused QKV matvec writes it; rotates q and k in place and writes k, v
//       as fp16 into the layer's cache [ring, Hkv, Dh] at row pos[t] mod ring (ring: ctx, or a sliding-window
//       layer's ring, llamacli/models/kv_cache.py). grid (T, Hq + 2*Hkv), block as above.
//   rope_store_pf_<mode>(qkv, stride, Hq, Hkv, Dh, rope_dim, pos, inv_freq, attn, kcache, vcache, ring, scale,
//                        bias, q16, q16_stride, qscale)
//       the fused prefill's QKV epilogue: first qkv[t, :] = qkv[t, :] * scale[t] + bias (the GEMM's row
//       scale, kernels/norm.cu rms_norm_f16; bias [(Hq+2Hkv)*Dh] or NULL), then as rope_store_<mode>, except
//       that the rotated q goes to q16 [T, Hq*Dh] (token stride q16_stride) as fp16(q * qscale), the form
//       attention_tc*_d* and attention_wg*_d* read (qscale = log2(e)/sqrt(Dh)), instead of back into qkv.
//   rope_store_pf_qkn_<mode>(..., qscale, qn, kn, eps): the same with qwen3's per-head RMSNorm of q and k
//       (weights qn, kn [Dh]) between the epilogue and the rotation.
//   rope_store_pfb_<mode>(qkv, stride, Hq, Hkv, Dh, rope_dim, pos, inv_freq, attn, kt, vt, slot, ring, scale,
//                         bias, qn, kn, eps)
//       the batched step's form (rows that are sequences of their own): as rope_store_pf(_qkn when qn is not
//       NULL), row t's K and V into the cache of slot slot[t] (kt, vt: each slot's array of this layer, by
//       address), q rotated in place (no q16).
// Best measured on H100: not yet tuned (tiny: T*H*Dh/2 threads).

#include "common.cuh"
#include "rope.cuh"

template <bool NEOX>
__device__ __forceinline__ void rope_body(float* x, int stride, int H, int Dh, int rope_dim, const int* pos,
                                          const double* inv_freq, float attn) {
    const int t = blockIdx.x, hd = blockIdx.y, i = threadIdx.x;
    const bool on = i < Dh / 2;
    float* h = x + (long long)t * stride + hd * Dh;
    int da = 0, db = 0;
    float oa = 0.0f, ob = 0.0f;
    if (on) rope_pair<NEOX>(h, i, Dh, rope_dim, pos[t], inv_freq, attn, da, db, oa, ob);
    __syncthreads();  // dims of one head are read and written by different threads of the block
    if (!on) return;
    h[da] = oa;
    h[db] = ob;
}

template <bool NEOX>
__device__ __forceinline__ void rope_store_body(float* qkv, int stride, int Hq, int Hkv, int Dh, int rope_dim,
                                                const int* pos, const double* inv_freq, float attn, u16* kcache,
                                                u16* vcache, int ring, u16* q16 = nullptr, int q16_stride = 0,
                                                float qscale = 1.0f) {
    const int t = blockIdx.x, hd = blockIdx.y, i = threadIdx.x;
    const int p = pos[t], row = p % ring;  // p's row in the caches
    float* h = qkv + (long long)t * stride + hd * Dh;
    int da = 2 * i, db = 2 * i + 1;
    float oa = 0.0f, ob = 0.0f;
    const bool on = i < Dh / 2;
    if (hd < Hq + Hkv) {
        if (on) rope_pair<NEOX>(h, i, Dh, rope_dim, p, inv_freq, attn, da, db, oa, ob);
        __syncthreads();
        if (!on) return;
        if (hd < Hq && q16) {  // q as the tensor-core attention reads it: fp16, times qscale
            u16* qd = q16 + (long long)t * q16_stride + hd * Dh;
            qd[da] = f2h(oa * qscale);
            qd[db] = f2h(ob * qscale);
            return;
        }
        h[da] = oa;
        h[db] = ob;
        if (hd >= Hq) {
            u16* k = kcache + ((long long)row * Hkv + (hd - Hq)) * Dh;
            k[da] = f2h(oa);
            k[db] = f2h(ob);
        }
    } else if (on) {
        u16* v = vcache + ((long long)row * Hkv + (hd - Hq - Hkv)) * Dh;
        v[da] = f2h(h[da]);
        v[db] = f2h(h[db]);
    }
}

// The prefill epilogue: undo the GEMM input's row scale and add the bias on this thread's two dims of the
// head, in place, then (QKN) RMSNorm q and k heads, before rope_store_body reads the head (a __syncthreads
// between: rope pairs cross threads).
template <bool NEOX, bool QKN>
__device__ __forceinline__ void rope_store_pf_body(float* qkv, int stride, int Hq, int Hkv, int Dh, int rope_dim,
                                                   const int* pos, const double* inv_freq, float attn, u16* kcache,
                                                   u16* vcache, int ring, const float* __restrict__ scale,
                                                   const float* __restrict__ bias, u16* q16, int q16_stride,
                                                   float qscale, const float* __restrict__ qn = nullptr,
                                                   const float* __restrict__ kn = nullptr, float eps = 0.0f) {
    const int t = blockIdx.x, hd = blockIdx.y, i = threadIdx.x;
    float* h = qkv + (long long)t * stride + hd * Dh + 2 * i;
    float a = 0.0f, b = 0.0f;
    if (i < Dh / 2) {
        const float s = scale[t];
        const float* bb = bias ? bias + hd * Dh + 2 * i : nullptr;
        a = h[0] * s + (bb ? bb[0] : 0.0f);
        b = h[1] * s + (bb ? bb[1] : 0.0f);
    }
    if (QKN && hd < Hq + Hkv) {  // the whole block takes this branch: one head per block
        const float r = rsqrtf(block_sum(fmaf(a, a, b * b)) / (float)Dh + eps);
        const float* w = (hd < Hq ? qn : kn) + 2 * i;
        if (i < Dh / 2) {
            a *= r * w[0];
            b *= r * w[1];
        }
    }
    if (i < Dh / 2) {
        h[0] = a;
        h[1] = b;
    }
    __syncthreads();
    rope_store_body<NEOX>(qkv, stride, Hq, Hkv, Dh, rope_dim, pos, inv_freq, attn, kcache, vcache, ring, q16,
                          q16_stride, qscale);
}

#define ROPE_STORE_PF(MODE, NEOX)                                                                                      \
    extern "C" __global__ void rope_store_pf_##MODE(                                                                   \
        float* qkv, int stride, int Hq, int Hkv, int Dh, int rope_dim, const int* pos, const double* inv_freq,         \
        float attn, u16* kc, u16* vc, int ring, const float* scale, const float* bias, u16* q16, int q16_stride,       \
        float qscale) {                                                                                                \
        rope_store_pf_body<NEOX, false>(qkv, stride, Hq, Hkv, Dh, rope_dim, pos, inv_freq, attn, kc, vc, ring, scale,  \
                                        bias, q16, q16_stride, qscale);                                                \
    }
#define ROPE_STORE_PF_QKN(MODE, NEOX)                                                                                  \
    extern "C" __global__ void rope_store_pf_qkn_##MODE(                                                               \
        float* qkv, int stride, int Hq, int Hkv, int Dh, int rope_dim, const int* pos, const double* inv_freq,         \
        float attn, u16* kc, u16* vc, int ring, const float* scale, const float* bias, u16* q16, int q16_stride,       \
        float qscale, const float* qn, const float* kn, float eps) {                                                   \
        rope_store_pf_body<NEOX, true>(qkv, stride, Hq, Hkv, Dh, rope_dim, pos, inv_freq, attn, kc, vc, ring, scale,   \
                                       bias, q16, q16_stride, qscale, qn, kn, eps);                                    \
    }
ROPE_STORE_PF(normal, false)
ROPE_STORE_PF(neox, true)
ROPE_STORE_PF_QKN(normal, false)
ROPE_STORE_PF_QKN(neox, true)

#define ROPE_STORE_PFB(MODE, NEOX)                                                                                     \
    extern "C" __global__ void rope_store_pfb_##MODE(                                                                  \
        float* qkv, int stride, int Hq, int Hkv, int Dh, int rope_dim, const int* pos, const double* inv_freq,         \
        float attn, const u64* kt, const u64* vt, const int* slot, int ring, const float* scale, const float* bias,    \
        const float* qn, const float* kn, float eps) {                                                                 \
        u16* kc = reinterpret_cast<u16*>(kt[slot[blockIdx.x]]);                                                        \
        u16* vc = reinterpret_cast<u16*>(vt[slot[blockIdx.x]]);                                                        \
        if (qn)                                                                                                        \
            rope_store_pf_body<NEOX, true>(qkv, stride, Hq, Hkv, Dh, rope_dim, pos, inv_freq, attn, kc, vc, ring,      \
                                           scale, bias, nullptr, 0, 1.0f, qn, kn, eps);                                \
        else                                                                                                           \
            rope_store_pf_body<NEOX, false>(qkv, stride, Hq, Hkv, Dh, rope_dim, pos, inv_freq, attn, kc, vc, ring,     \
                                            scale, bias, nullptr, 0, 1.0f);                                            \
    }
ROPE_STORE_PFB(normal, false)
ROPE_STORE_PFB(neox, true)

extern "C" __global__ void rope_normal(float* x, int stride, int H, int Dh, int rope_dim, const int* pos,
                                       const double* inv_freq, float attn) {
    rope_body<false>(x, stride, H, Dh, rope_dim, pos, inv_freq, attn);
}
extern "C" __global__ void rope_neox(float* x, int stride, int H, int Dh, int rope_dim, const int* pos,
                                     const double* inv_freq, float attn) {
    rope_body<true>(x, stride, H, Dh, rope_dim, pos, inv_freq, attn);
}
extern "C" __global__ void rope_store_normal(float* qkv, int stride, int Hq, int Hkv, int Dh, int rope_dim,
                                             const int* pos, const double* inv_freq, float attn, u16* kc, u16* vc,
                                             int ring) {
    rope_store_body<false>(qkv, stride, Hq, Hkv, Dh, rope_dim, pos, inv_freq, attn, kc, vc, ring);
}
extern "C" __global__ void rope_store_neox(float* qkv, int stride, int Hq, int Hkv, int Dh, int rope_dim,
                                           const int* pos, const double* inv_freq, float attn, u16* kc, u16* vc,
                                           int ring) {
    rope_store_body<true>(qkv, stride, Hq, Hkv, Dh, rope_dim, pos, inv_freq, attn, kc, vc, ring);
}
