// attention_common.cuh: helpers shared by the attention families (attention_*.cu, each inlined by the Python
// loader; shared-memory addresses and cp.async copies are common.cuh's): the tensor-core prefill's pieces
// that attention_mma.cu and attention_wgmma.cu share: fp16 packing, the base-2 exponent, the masked online
// softmax of one score tile, and the Q / output fragment layouts (mma.sync's C and A layouts, which the
// wgmma accumulators also have per 8 columns).
#pragma once
#include "common.cuh"

__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // upper half <- hi, lower <- lo
    return r;
}

// Eight q8_0 codes (bytes of int8) times their block's fp16 scale s16 -> eight fp16 values (16 bytes): each byte
// offset by 128 becomes the low bits of the fp16 1024 + 128 + code (exponent byte 0x64 by a byte permute), minus
// 1152 is the code exactly, times the scale one fp16 rounding of d x code (the same value as rounding the f32
// product, which is exact).
__device__ __forceinline__ uint4 dequant8_q8(uint2 c, u16 s16) {
    const u32 s2 = (u32)s16 * 0x10001u, off = 0x64806480u;  // (s, s); (1152, 1152)
    const u32 w[2] = {c.x ^ 0x80808080u, c.y ^ 0x80808080u};
    uint4 r;
    u32* o = &r.x;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u32 h = __byte_perm(w[k >> 1], 0x64646464u, (k & 1) ? 0x7362 : 0x5140);
        asm("sub.rn.f16x2 %0, %0, %1;" : "+r"(h) : "r"(off));
        asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(h) : "r"(s2));
        o[k] = h;
    }
    return r;
}

// mma.sync m16n8k16 (fp16 in, fp32 accumulate) and its ldmatrix loads (attention_mma.cu, moe.cu).
__device__ __forceinline__ void mma_16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// One tile of scores in the mma C layout, s[4n + c] for n < NS: row g (c < 2) or g + 8 of the m-tile, key
// k0 + 8n + 2tg + (c & 1). Masks keys past each row's position qp[0..1] (only where the tile reaches past
// wmin, the lowest position of the warp), then the online softmax step (the 4 lanes of a quad hold a row):
// m[i] takes the tile's max, alpha[i] = 2^(m_old - m_new) rescales what was summed before, and s becomes
// 2^(s - m_new); a row with no key yet keeps m = -inf and P = 0.
template <int NS>
__device__ __forceinline__ void tile_softmax(float* s, float* m, float* alpha, const int* qp, int k0, int wmin,
                                             int tg) {
    if (k0 + 8 * NS - 1 > wmin) {
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (k0 + n * 8 + 2 * tg + (c & 1) > qp[c >> 1]) s[4 * n + c] = -INFINITY;
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < NS; ++n) mx = fmaxf(mx, fmaxf(s[4 * n + 2 * i], s[4 * n + 2 * i + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
        const float m_new = fmaxf(m[i], mx);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        alpha[i] = ex2(m[i] - m_use);
        m[i] = m_new;
#pragma unroll
        for (int n = 0; n < NS; ++n) {
            s[4 * n + 2 * i] = ex2(s[4 * n + 2 * i] - m_use);
            s[4 * n + 2 * i + 1] = ex2(s[4 * n + 2 * i + 1] - m_use);
        }
    }
}

// Before tile_softmax, for the windowed / soft-capped kernels: s -> cap2 tanh(s / cap2) where cap2 > 0 (base-2
// scores: cap2 = c log2(e)), then the causal mask (where the tile reaches past wmin) and the window's (keys at
// or before qp - window, where the tile reaches below wmax - window) -> -inf; tile_softmax then runs unmasked.
template <int NS>
__device__ __forceinline__ void tile_cap_window(float* s, const int* qp, int k0, int wmin, int wmax, int window,
                                                float cap2, int tg) {
    if (cap2 > 0.0f) {
        const float inv = 1.0f / cap2;
#pragma unroll
        for (int e = 0; e < 4 * NS; ++e) s[e] = cap2 * tanhf(s[e] * inv);
    }
    const bool win = window > 0 && k0 <= wmax - window;
    if (k0 + 8 * NS - 1 > wmin || win) {
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int key = k0 + n * 8 + 2 * tg + (c & 1), p = qp[c >> 1];
                if (key > p || (win && key <= p - window)) s[4 * n + c] = -INFINITY;
            }
    }
}

// This lane's Q fragments (the MMA's A operand, row-major 16 x 16 per k step): a0 (row g, dims 2tg, 2tg+1),
// a1 (g+8, 2tg), a2 (g, 2tg+8), a3 (g+8, 2tg+8) of k step k; rows tt[i] past T read as zeros.
template <int D>
__device__ __forceinline__ void load_q_frags(u32 (&qa)[D / 16][4], const u16* __restrict__ q, int q_stride,
                                             const int* tt, const int* hh, int T, int tg) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const u16* qr = q + (long long)(tt[i] < T ? tt[i] : 0) * q_stride + hh[i] * D + 2 * tg;
#pragma unroll
        for (int k = 0; k < D / 16; ++k) {
            qa[k][i] = tt[i] < T ? *reinterpret_cast<const u32*>(qr + 16 * k) : 0u;
            qa[k][2 + i] = tt[i] < T ? *reinterpret_cast<const u32*>(qr + 16 * k + 8) : 0u;
        }
    }
}

// This lane's part of the output rows: o[4n + c] (the MMA C layout: dims 8n + 2tg + (c & 1) of row g, c < 2,
// or g + 8) divided by the row sum l[0] (row g) or l[2] (row g + 8), as fp16 (OUT16) or f32.
template <int D, bool OUT16>
__device__ __forceinline__ void store_rows(void* __restrict__ out, int out_stride, const float* o, const float* l,
                                           const int* tt, const int* hh, int T, int tg) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (tt[i] >= T) continue;
        const float inv = 1.0f / l[2 * i];
        const long long at = (long long)tt[i] * out_stride + hh[i] * D + 2 * tg;
        if (OUT16) {  // |out| <= max |V| (a convex combination of fp16 rows): fp16 cannot overflow
            u16* orow = static_cast<u16*>(out) + at;
#pragma unroll
            for (int n = 0; n < D / 8; ++n)
                *reinterpret_cast<u32*>(orow + 8 * n) = pack_h2(o[4 * n + 2 * i] * inv, o[4 * n + 2 * i + 1] * inv);
        } else {
            float* orow = static_cast<float*>(out) + at;
#pragma unroll
            for (int n = 0; n < D / 8; ++n)
                *reinterpret_cast<float2*>(orow + 8 * n) =
                    make_float2(o[4 * n + 2 * i] * inv, o[4 * n + 2 * i + 1] * inv);
        }
    }
}
