// quants.cuh: ggml block formats, decoded 32 values at a time (one "unit").
//
// Every weight type gets a struct with
//   QK     values per block, BYTES bytes per block (ggml-common.h; gguf's quants.py is the reference),
//   unit(row, u, K, w)  -> w[0..31] = values u*32 .. u*32+31 of one row as float32.
// A row of K values is K/QK whole blocks (GGUF never splits a block across rows), so a unit never
// straddles rows; plain types (F32/F16/BF16) accept any K and zero-fill past its end.
// Matvec, dequantize-to-fp16 and the embedding gather all call the same unit() so one decoder is tested
// three ways. Byte loads use the widest access the block layout's alignment allows (uint4 for Q4_K and
// Q5_K whose 144/176-byte blocks keep 16-byte alignment; aligned 4-byte loads and funnel shifts for the
// 18/22/34/110/210-byte ones, which keep only 2).
#pragma once

// Load NW 32-bit words from p, which is ALIGN-byte aligned.
template <int ALIGN, int NW>
__device__ __forceinline__ void load_words(const u8* __restrict__ p, u32 (&w)[NW]) {
    if constexpr (ALIGN >= 16 && NW % 4 == 0) {
#pragma unroll
        for (int k = 0; k < NW / 4; ++k) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + k);
            w[4 * k] = v.x; w[4 * k + 1] = v.y; w[4 * k + 2] = v.z; w[4 * k + 3] = v.w;
        }
    } else if constexpr (ALIGN >= 8 && NW % 2 == 0) {
#pragma unroll
        for (int k = 0; k < NW / 2; ++k) {
            const uint2 v = __ldg(reinterpret_cast<const uint2*>(p) + k);
            w[2 * k] = v.x; w[2 * k + 1] = v.y;
        }
    } else if constexpr (ALIGN >= 4) {
#pragma unroll
        for (int k = 0; k < NW; ++k) w[k] = __ldg(reinterpret_cast<const u32*>(p) + k);
    } else {  // 2-byte (or 1-byte) aligned: NW (+ 1) aligned words from p rounded down to 4, shifted into
              // place by 0 or 16 bits (1-byte aligned: 0, 8, 16 or 24) (half the load instructions of 16-bit
              // loads; each instruction's lanes touch as many cache lines either way). The extra word is read
              // only when p is not 4-aligned; it then holds the last bytes asked for, so it never leaves
              // their (4-byte aligned) word's page.
        const unsigned long long a = reinterpret_cast<unsigned long long>(p);
        const u32* q = reinterpret_cast<const u32*>(a & ~3ull);
        const u32 sh = (u32)(a & (ALIGN >= 2 ? 2 : 3)) * 8;
        u32 v[NW + 1];
#pragma unroll
        for (int k = 0; k < NW; ++k) v[k] = __ldg(q + k);
        v[NW] = sh ? __ldg(q + NW) : 0u;
#pragma unroll
        for (int k = 0; k < NW; ++k) w[k] = __funnelshift_r(v[k], v[k + 1], sh);
    }
}

#define QBYTE(w, b) (((w)[(b) >> 2] >> (((b) & 3) * 8)) & 0xffu)

__device__ __forceinline__ float ldh(const u8* p) { return h2f(__ldg(reinterpret_cast<const u16*>(p))); }

// IQ4_NL's 16 non-linear levels (ggml-common.h kvalues_iq4nl), looked up with byte permutes, no memory.
__device__ __forceinline__ float iq4nl_value(u32 q) {
    const u32 lo = __byte_perm(0xBFAD9881u, 0xF6EADDCFu, q & 7);
    const u32 hi = __byte_perm(0x26190D01u, 0x71594535u, q & 7);
    return (float)(i8)((q & 8 ? hi : lo) & 0xffu);
}

// ---- plain types -----------------------------------------------------------------------------------------

struct QF32 {
    static constexpr int QK = 1, BYTES = 4;
    __device__ static void unit(const u8* row, int u, int K, float (&w)[32]) {
        const float* r = reinterpret_cast<const float*>(row) + u * 32;
        if ((K & 3) == 0 && u * 32 + 32 <= K) {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float4 v = __ldg(reinterpret_cast<const float4*>(r) + k);
                w[4 * k] = v.x; w[4 * k + 1] = v.y; w[4 * k + 2] = v.z; w[4 * k + 3] = v.w;
            }
        } else {
#pragma unroll
            for (int i = 0; i < 32; ++i) w[i] = u * 32 + i < K ? __ldg(r + i) : 0.0f;
        }
    }
};

template <bool BF>
struct QHalf {
    static constexpr int QK = 1, BYTES = 2;
    __device__ static float cvt(u32 bits) { return BF ? bf2f((u16)bits) : h2f((u16)bits); }
    __device__ static void unit(const u8* row, int u, int K, float (&w)[32]) {
        const u16* r = reinterpret_cast<const u16*>(row) + u * 32;
        if ((K & 7) == 0 && u * 32 + 32 <= K) {
            u32 v[16];
            load_words<16, 16>(reinterpret_cast<const u8*>(r), v);
#pragma unroll
            for (int k = 0; k < 16; ++k) { w[2 * k] = cvt(v[k] & 0xffffu); w[2 * k + 1] = cvt(v[k] >> 16); }
        } else {
#pragma unroll
            for (int i = 0; i < 32; ++i) w[i] = u * 32 + i < K ? cvt(__ldg(r + i)) : 0.0f;
        }
    }
};
typedef QHalf<false> QF16;
typedef QHalf<true> QBF16;

// ---- 32-value blocks ---------------------------------------------------------------------------------------

struct QQ4_0 {  // { f16 d; u8 qs[16]; }  v[i] = d*(lo(qs[i])-8), v[i+16] = d*(hi(qs[i])-8)
    static constexpr int QK = 32, BYTES = 18;
    __device__ static void unit(const u8* row, int u, int, float (&w)[32]) {
        const u8* p = row + u * BYTES;
        const float d = ldh(p);
        u32 q[4];
        load_words<2, 4>(p + 2, q);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const u32 b = QBYTE(q, i);
            w[i] = d * (float)((int)(b & 15) - 8);
            w[i + 16] = d * (float)((int)(b >> 4) - 8);
        }
    }
};

struct QQ4_1 {  // { f16 d, m; u8 qs[16]; }  v = d*q + m
    static constexpr int QK = 32, BYTES = 20;
    __device__ static void unit(const u8* row, int u, int, float (&w)[32]) {
        const u8* p = row + u * BYTES;
        const float d = ldh(p), m = ldh(p + 2);
        u32 q[4];
        load_words<4, 4>(p + 4, q);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const u32 b = QBYTE(q, i);
            w[i] = d * (float)(b & 15) + m;
            w[i + 16] = d * (float)(b >> 4) + m;
        }
    }
};

struct QQ5_0 {  // { f16 d; u32 qh; u8 qs[16]; }  q = nibble | bit(qh, i) << 4; v = d*(q-16)
    static constexpr int QK = 32, BYTES = 22;
    __device__ static void unit(const u8* row, int u, int, float (&w)[32]) {
        const u8* p = row + u * BYTES;
        const float d = ldh(p);
        const u32 qh = ld32_a2(p + 2);
        u32 q[4];
        load_words<2, 4>(p + 6, q);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const u32 b = QBYTE(q, i);
            w[i] = d * (float)((int)((b & 15) | (((qh >> i) & 1) << 4)) - 16);
            w[i + 16] = d * (float)((int)((b >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16);
        }
    }
};

struct QQ5_1 {  // { f16 d, m; u32 qh; u8 qs[16]; }  v = d*q + m
    static constexpr int QK = 32, BYTES = 24;
    __device__ static void unit(const u8* row, int u, int, float (&w)[32]) {
        const u8* p = row + u * BYTES;
        const float d = ldh(p), m = ldh(p + 2);
        const u32 qh = __ldg(reinterpret_cast<const u32*>(p + 4));
        u32 q[4];
        load_words<8, 4>(p + 8, q);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const u32 b = QBYTE(q, i);
            w[i] = d * (float)((b & 15) | (((qh >> i) & 1) << 4)) + m;
            w[i + 16] = d * (float)((b >> 4) | (((qh >> (i + 16)) & 1) << 4)) + m;
        }
    }
};

struct QQ8_0 {  // { f16 d; i8 qs[32]; }  v = d*q
    static constexpr int QK = 32, BYTES = 34;
    __device__ static void unit(const u8* row, int u, int, float (&w)[32]) {
        const u8* p = row + u * BYTES;
        const float d = ldh(p);
        u32 q[8];
        load_words<2, 8>(p + 2, q);
#pragma unroll
        for (int i = 0; i < 32; ++i) w[i] = d * (float)(i8)QBYTE(q, i);
    }
};

struct QIQ4_NL {  // { f16 d; u8 qs[16]; }  v = d*kvalues[nibble], nibble order as Q4_0
    static constexpr int QK = 32, BYTES = 18;
    __device__ static void unit(const u8* row, int u, int, float (&w)[32]) {
        const u8* p = row + u * BYTES;
        const float d = ldh(p);
        u32 q[4];
        load_words<2, 4>(p + 2, q);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const u32 b = QBYTE(q, i);
            w[i] = d * iq4nl_value(b & 15);
            w[i + 16] = d * iq4nl_value(b >> 4);
        }
    }
};

// MXFP4 (gpt-oss's experts): { u8 e; u8 qs[16]; } v = kvalues_mxfp4[nibble] * 2^(e - 128), nibble order as
// Q4_0. The table holds twice the E2M1 values (0, .5, 1, 1.5, 2, 3, 4, 6), hence e - 128 rather than e - 127
// (ggml's GGML_E8M0_TO_FP32_HALF; e = 0 and 1 give the subnormals 2^-128 and 2^-127). 17-byte blocks: byte
// aligned.
__device__ __forceinline__ float e8m0_half(u32 e) {
    return __int_as_float(e < 2 ? 0x00200000 << e : (e - 1) << 23);
}
__device__ __forceinline__ float mxfp4_value(u32 q) {  // 0, 1, 2, 3, 4, 6, 8, 12 and their negatives
    const float v = (float)(__byte_perm(0x03020100u, 0x0C080604u, q & 7) & 0xffu);
    return q & 8 ? -v : v;
}

struct QMXFP4 {
    static constexpr int QK = 32, BYTES = 17;
    __device__ static void unit(const u8* row, int u, int, float (&w)[32]) {
        const u8* p = row + u * BYTES;
        const float d = e8m0_half(__ldg(p));
        u32 q[4];
        load_words<1, 4>(p + 1, q);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const u32 b = QBYTE(q, i);
            w[i] = d * mxfp4_value(b & 15);
            w[i + 16] = d * mxfp4_value(b >> 4);
        }
    }
};

// ---- 256-value super-blocks (K quants, IQ4_XS); unit j = values 32j .. 32j+31 of the block ------------------

struct QQ2_K {  // { u8 scales[16]; u8 qs[64]; f16 d, dmin; }
    static constexpr int QK = 256, BYTES = 84;
    __device__ static void unit(const u8* row, int u, int, float (&w)[32]) {
        const u8* p = row + (u >> 3) * BYTES;
        const int j = u & 7;
        const float d = ldh(p + 80), dmin = ldh(p + 82);
        u32 q[8];
        load_words<4, 8>(p + 16 + (j >> 2) * 32, q);
        const int shift = 2 * (j & 3);
        const u32 s0 = p[2 * j], s1 = p[2 * j + 1];  // sub-blocks of 16
        const float dl0 = d * (float)(s0 & 15), ml0 = dmin * (float)(s0 >> 4);
        const float dl1 = d * (float)(s1 & 15), ml1 = dmin * (float)(s1 >> 4);
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const float qv = (float)((QBYTE(q, i) >> shift) & 3);
            w[i] = i < 16 ? dl0 * qv - ml0 : dl1 * qv - ml1;
        }
    }
};

struct QQ3_K {  // { u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d; }
    static constexpr int QK = 256, BYTES = 110;
    __device__ static int scale(const u8* sc, int sb) {
        const int lo = sb < 8 ? (sc[sb] & 15) : (sc[sb - 8] >> 4);
        const int hi = (sc[8 + (sb & 3)] >> (2 * (sb >> 2))) & 3;
        return (lo | (hi << 4)) - 32;
    }
    __device__ static void unit(const u8* row, int u, int, float (&w)[32]) {
        const u8* p = row + (u >> 3) * BYTES;
        const int j = u & 7;
        const float d = ldh(p + 108);
        u32 hm[8], q[8];
        load_words<2, 8>(p, hm);
        load_words<2, 8>(p + 32 + (j >> 2) * 32, q);
        const int shift = 2 * (j & 3);
        const float dl0 = d * (float)scale(p + 96, 2 * j), dl1 = d * (float)scale(p + 96, 2 * j + 1);
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const int ql = (QBYTE(q, i) >> shift) & 3;
            const int h = (QBYTE(hm, i) >> j) & 1;
            w[i] = (i < 16 ? dl0 : dl1) * (float)(ql - (h ? 0 : 4));
        }
    }
};

// Q4_K/Q5_K 6-bit scales and mins of sub-block j (ggml-quants.c get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(const u8* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// The same from the 12 scale bytes held as three words (s0 = bytes 0-3, s1 = 4-7, s2 = 8-11): no byte loads,
// no branch on j (the block header is one 16-byte load where the block keeps 16-byte alignment).
__device__ __forceinline__ void scale_min_k4w(u32 s0, u32 s1, u32 s2, int j, int& sc, int& m) {
    const int sh = 8 * (j & 3);
    const int b0 = (s0 >> sh) & 0xFF, b1 = (s1 >> sh) & 0xFF, b2 = (s2 >> sh) & 0xFF;
    sc = j < 4 ? b0 & 63 : (b2 & 15) | ((b0 >> 6) << 4);
    m = j < 4 ? b1 & 63 : (b2 >> 4) | ((b1 >> 6) << 4);
}

struct QQ4_K {  // { f16 d, dmin; u8 scales[12]; u8 qs[128]; }  v = d*sc*q - dmin*m
    static constexpr int QK = 256, BYTES = 144;
    __device__ static void unit(const u8* row, int u, int, float (&w)[32]) {
        const u8* p = row + (u >> 3) * BYTES;
        const int j = u & 7;
        const float d = ldh(p), dmin = ldh(p + 2);
        int sc, m;
        scale_min_k4(p + 4, j, sc, m);
        const float dl = d * (float)sc, ml = dmin * (float)m;
        u32 q[8];
        load_words<16, 8>(p + 16 + (j >> 1) * 32, q);
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int i = 0; i < 32; ++i) w[i] = dl * (float)((QBYTE(q, i) >> shift) & 15) - ml;
    }
};

struct QQ5_K {  // { f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; }
    static constexpr int QK = 256, BYTES = 176;
    __device__ static void unit(const u8* row, int u, int, float (&w)[32]) {
        const u8* p = row + (u >> 3) * BYTES;
        const int j = u & 7;
        const float d = ldh(p), dmin = ldh(p + 2);
        int sc, m;
        scale_min_k4(p + 4, j, sc, m);
        const float dl = d * (float)sc, ml = dmin * (float)m;
        u32 hq[8], q[8];
        load_words<16, 8>(p + 16, hq);
        load_words<16, 8>(p + 48 + (j >> 1) * 32, q);
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const u32 v = ((QBYTE(q, i) >> shift) & 15) | (((QBYTE(hq, i) >> j) & 1) << 4);
            w[i] = dl * (float)v - ml;
        }
    }
};

struct QQ6_K {  // { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }  v = d*sc*(q-32)
    static constexpr int QK = 256, BYTES = 210;
    __device__ static void unit(const u8* row, int u, int, float (&w)[32]) {
        const u8* p = row + (u >> 3) * BYTES;
        const int j = u & 7, h = j >> 2, s4 = j & 3;
        const float d = ldh(p + 208);
        u32 ql[8], qh[8];
        load_words<2, 8>(p + h * 64 + (s4 & 1) * 32, ql);
        load_words<2, 8>(p + 128 + h * 32, qh);
        const int lshift = 4 * (s4 >> 1), hshift = 2 * s4;
        const float dl0 = d * (float)(i8)p[192 + 2 * j], dl1 = d * (float)(i8)p[192 + 2 * j + 1];
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const int v = (int)(((QBYTE(ql, i) >> lshift) & 15) | (((QBYTE(qh, i) >> hshift) & 3) << 4)) - 32;
            w[i] = (i < 16 ? dl0 : dl1) * (float)v;
        }
    }
};

struct QIQ4_XS {  // { f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]; }
    static constexpr int QK = 256, BYTES = 136;
    __device__ static void unit(const u8* row, int u, int, float (&w)[32]) {
        const u8* p = row + (u >> 3) * BYTES;
        const int j = u & 7;
        const float d = ldh(p);
        const u32 sh = (ld16(p + 2) >> (2 * j)) & 3;
        const u32 sl = (p[4 + (j >> 1)] >> (4 * (j & 1))) & 15;
        const float dl = d * (float)((int)(sl | (sh << 4)) - 32);
        u32 q[4];
        load_words<8, 4>(p + 8 + 16 * j, q);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const u32 b = QBYTE(q, i);
            w[i] = dl * iq4nl_value(b & 15);
            w[i + 16] = dl * iq4nl_value(b >> 4);
        }
    }
};

// Instantiate MACRO(suffix, struct) once per weight type (the suffix is the ggml type name in lower case).
#define FOR_EACH_QTYPE(X) \
    X(f32, QF32) X(f16, QF16) X(bf16, QBF16) X(q8_0, QQ8_0) X(q4_0, QQ4_0) X(q4_1, QQ4_1) X(q5_0, QQ5_0) \
    X(q5_1, QQ5_1) X(q2_k, QQ2_K) X(q3_k, QQ3_K) X(q4_k, QQ4_K) X(q5_k, QQ5_K) X(q6_k, QQ6_K)          \
    X(iq4_nl, QIQ4_NL) X(iq4_xs, QIQ4_XS) X(mxfp4, QMXFP4)
