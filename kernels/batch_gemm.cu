// batch_gemm.cu: a few rows of fp16 activations times a quantized weight, on tensor cores, the weight read
// once for all of them (the batched decode step's linear layers and short prefill chunks: up to BG_NMAX rows
// a launch, where mv1's one-row dots would read the weight B times and prefill's dequantize-then-cuBLAS writes
// and reads an fp16 copy of it every step).
//
//   bgemm_<t>_n<NT>(w, N, K, x, ldx, B, y, ldy, rs, accumulate, splits, part, counters)
//       y[b, n] = (accumulate ? y[b, n] : 0) + (rs ? rs[b] : 1) * sum_k W[n, k] x[b, k] for b < B <= NT,
//       n < N: W [N, K] in its GGUF blocks (rows (K / QK) * BYTES apart), x fp16 bits [B, ldx], y float32
//       rows ldy apart. K % 32 == 0 and ldx % 8 == 0 (16-byte rows of x). Grid (ceil(N / 32), splits), block
//       128 (BG_WARPS warps).
//
// The work: a block owns 32 weight rows (two mma.sync m16n8k16 row tiles) and every column b; its warps take
// the K range's groups of four 32-value units in turn (group j goes to warp j mod 4). A thread never stages
// the weight through shared memory: lane (g, t) (g = lane / 4, t = lane % 4) decodes unit 4j + t of rows g,
// g + 8, g + 16, g + 24 into fp16 pairs that are its A fragments as they stand. That works because a dot
// product does not care in which order its k run: in the eight k16 steps s of a group, the fragment slots
// {2t, 2t+1} of lane (g, t) hold values 4s and 4s+2 of its unit and the slots {2t+8, 2t+9} values 4s+1 and
// 4s+3 (the pairs a byte-wise decode gives: see Dec), and the B fragments of x are read with the same map
// (x[b, 32 (4j + t) + 4s .. + 3], 8 bytes, halves 0 and 2, 1 and 3 paired by a byte permute), so both sides
// agree on which k each slot is.
//
// Decoding (Dec<Q>::unit): the common types in fp16 arithmetic without conversions, as Marlin and llama.cpp's
// dequantizers do: a 4-, 5-, 6- or 8-bit code c placed in the mantissa of the fp16 1024 + c (a mask and an OR
// on two codes at once), 1024 (plus the code's offset) subtracted exactly, then one fused multiply-add by the
// block's scale and minimum, rounded once, taken to fp16 first (the fp32 path rounds only the result: the
// weights may differ from it by an fp16 ulp of the scale). Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; the other types
// through quants.cuh's float unit() and a conversion per pair.
//
// Sums: fp32 in the mma; the four warps' partial tiles added in shared memory in warp order; with splits > 1
// (grid.y: the K range cut in `splits` runs of whole groups so that the grid fills the GPU) each block writes
// its tile to part [splits, B, N] and the last block of a row tile to finish (counters: a zeroed uint per row
// tile, reset by that block) adds the splits in order 0, 1, ... So a column's result depends on its own x
// row, the weight and `splits` only (the launcher chooses splits from N, K and the GPU, never from B): a
// sequence gets the same bits in any batch.
// Best measured: see docs/perf-log.md (batched decode).

#include "common.cuh"
#include "quants.cuh"
#include "attention_common.cuh"

// BG_NMAX, BG_ROWS (weight rows per block: two m16 tiles), BG_WARPS: llamacli/backends/cuda/constants.py (the
// loader puts them in front)

__device__ __forceinline__ u32 h2_sub(u32 a, u32 b) {
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 h2_fma(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
__device__ __forceinline__ u32 h2_mul(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
#define H2_1024 0x64006400u  // the fp16 pair (1024, 1024): codes below 1024 OR-ed into its mantissas

// Four codes of up to 8 bits in the bytes of c -> the pairs (1024 + c0, 1024 + c2) and (1024 + c1, 1024 + c3).
__device__ __forceinline__ void byte_pairs(u32 c, u32& lo, u32& hi) {
    lo = (c & 0x00ff00ffu) | H2_1024;
    hi = ((c >> 8) & 0x00ff00ffu) | H2_1024;
}

// One 32-value unit of a row as 16 fp16 pairs in the fragment order: h[2s] = (v[4s], v[4s+2]), h[2s+1] =
// (v[4s+1], v[4s+3]), in two parts: fetch(row, u, raw) does every load of the unit (so that a thread's units
// of a group all go to memory before any is decoded: one round trip a group, not one a unit) and decode(raw, u,
// K, h) the arithmetic. Generic: quants.cuh's float decoder (its loads in decode), each value converted.
template <class Q>
struct Dec {
    struct Raw {
        const u8* row;
    };
    __device__ static void fetch(const u8* row, int, Raw& r) { r.row = row; }
    __device__ static void decode(const Raw& r, int u, int K, u32 (&h)[16]) {
        float v[32];
        Q::unit(r.row, u, K, v);
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            h[2 * s] = pack_h2(v[4 * s], v[4 * s + 2]);
            h[2 * s + 1] = pack_h2(v[4 * s + 1], v[4 * s + 3]);
        }
    }
};

// Codes c in bytes (8 words: values 4s .. 4s+3 in word s) -> h = (c - off) * scale (+ add): scale and add fp16
// pairs, the scale by halves of the unit (sc0: values 0-15, sc1: 16-31).
__device__ __forceinline__ void scale_codes(const u32 (&c)[8], u32 off, u32 sc0, u32 sc1, u32 add, bool fma,
                                            u32 (&h)[16]) {
#pragma unroll
    for (int s = 0; s < 8; ++s) {
        u32 lo, hi;
        byte_pairs(c[s], lo, hi);
        const u32 sc = s < 4 ? sc0 : sc1;
        lo = h2_sub(lo, off);
        hi = h2_sub(hi, off);
        h[2 * s] = fma ? h2_fma(lo, sc, add) : h2_mul(lo, sc);
        h[2 * s + 1] = fma ? h2_fma(hi, sc, add) : h2_mul(hi, sc);
    }
}

// 32 bytes from a 2-byte aligned p in three aligned 16-byte loads (the 34- and 210-byte blocks of Q8_0 and
// Q6_K keep only 2-byte alignment; 4-byte loads would take nine instructions, each touching as many cache
// lines): fetch32 loads, take32 shifts them into place.
struct Bytes32 {
    uint4 v0, v1, v2;
    u32 off;
};
__device__ __forceinline__ void fetch32(const u8* p, Bytes32& b) {
    const unsigned long long a = reinterpret_cast<unsigned long long>(p);
    const uint4* q = reinterpret_cast<const uint4*>(a & ~15ull);
    b.off = (u32)(a & 15);
    b.v0 = __ldg(q);
    b.v1 = __ldg(q + 1);
    b.v2 = b.off ? __ldg(q + 2) : make_uint4(0u, 0u, 0u, 0u);
}
__device__ __forceinline__ void take32(const Bytes32& b, u32 (&w)[8]) {
    const u32 v[12] = {b.v0.x, b.v0.y, b.v0.z, b.v0.w, b.v1.x, b.v1.y, b.v1.z, b.v1.w, b.v2.x, b.v2.y, b.v2.z, b.v2.w};
    const u32 ws = b.off >> 2, sh = (b.off & 3) * 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 a0 = ws == 0 ? v[i] : ws == 1 ? v[i + 1] : ws == 2 ? v[i + 2] : v[i + 3];
        const u32 a1 = ws == 0 ? v[i + 1] : ws == 1 ? v[i + 2] : ws == 2 ? v[i + 3] : v[i + 4];
        w[i] = __funnelshift_r(a0, a1, sh);
    }
}

// 16 bytes of nibbles (32-value blocks: value i the low nibble of byte i, value i + 16 its high one) -> the codes
// as bytes, values 4s .. 4s+3 in word s.
__device__ __forceinline__ void nibble_codes(const u32 (&q)[4], u32 (&c)[8]) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        c[s] = q[s] & 0x0f0f0f0fu;
        c[s + 4] = (q[s] >> 4) & 0x0f0f0f0fu;
    }
}

template <>
struct Dec<QQ4_0> {  // v[i] = d (lo(qs[i]) - 8), v[i + 16] = d (hi(qs[i]) - 8)
    struct Raw {
        u32 d, q[4];
    };
    __device__ static void fetch(const u8* row, int u, Raw& r) {
        const u8* p = row + u * QQ4_0::BYTES;
        r.d = __ldg(reinterpret_cast<const u16*>(p));
        load_words<2, 4>(p + 2, r.q);
    }
    __device__ static void decode(const Raw& r, int, int, u32 (&h)[16]) {
        u32 c[8];
        nibble_codes(r.q, c);
        scale_codes(c, 0x64086408u, r.d * 0x10001u, r.d * 0x10001u, 0u, false, h);  // (1024 + c) - 1032 = c - 8
    }
};

template <>
struct Dec<QQ4_1> {  // v = d q + m
    struct Raw {
        u32 dm, q[4];
    };
    __device__ static void fetch(const u8* row, int u, Raw& r) {
        const u8* p = row + u * QQ4_1::BYTES;
        r.dm = __ldg(reinterpret_cast<const u32*>(p));
        load_words<4, 4>(p + 4, r.q);
    }
    __device__ static void decode(const Raw& r, int, int, u32 (&h)[16]) {
        const u32 d = __byte_perm(r.dm, 0, 0x1010), m = __byte_perm(r.dm, 0, 0x3232);
        u32 c[8];
        nibble_codes(r.q, c);
        scale_codes(c, H2_1024, d, d, m, true, h);
    }
};

template <>
struct Dec<QQ8_0> {  // v = d q, q int8: its byte + 128 as the code
    struct Raw {
        u32 d;
        Bytes32 q;
    };
    __device__ static void fetch(const u8* row, int u, Raw& r) {
        const u8* p = row + u * QQ8_0::BYTES;
        r.d = __ldg(reinterpret_cast<const u16*>(p));
        fetch32(p + 2, r.q);
    }
    __device__ static void decode(const Raw& r, int, int, u32 (&h)[16]) {
        u32 c[8];
        take32(r.q, c);
#pragma unroll
        for (int s = 0; s < 8; ++s) c[s] ^= 0x80808080u;
        scale_codes(c, 0x64806480u, r.d * 0x10001u, r.d * 0x10001u, 0u, false, h);  // (1024 + q + 128) - 1152
    }
};

// Q4_K / Q5_K: the block's header (d, dmin, the 12 scale bytes) in one 16-byte load (144- and 176-byte blocks
// keep 16-byte alignment); -> the unit's fp16 scale pair and its negated minimum pair.
__device__ __forceinline__ void k4_scales(const uint4& hd, int j, u32& dl, u32& ml) {
    int sc, m;
    scale_min_k4w(hd.y, hd.z, hd.w, j, sc, m);
    const float d = h2f((u16)(hd.x & 0xffffu)), dmin = h2f((u16)(hd.x >> 16));
    dl = pack_h2(d * (float)sc, d * (float)sc);
    ml = pack_h2(-dmin * (float)m, -dmin * (float)m);
}

template <>
struct Dec<QQ4_K> {  // v = d sc q - dmin m
    struct Raw {
        uint4 hd;
        u32 q[8];
    };
    __device__ static void fetch(const u8* row, int u, Raw& r) {
        const u8* p = row + (u >> 3) * QQ4_K::BYTES;
        r.hd = __ldg(reinterpret_cast<const uint4*>(p));
        load_words<16, 8>(p + 16 + ((u & 7) >> 1) * 32, r.q);
    }
    __device__ static void decode(const Raw& r, int u, int, u32 (&h)[16]) {
        const int j = u & 7, shift = 4 * (j & 1);
        u32 dl, ml, q[8];
        k4_scales(r.hd, j, dl, ml);
#pragma unroll
        for (int s = 0; s < 8; ++s) q[s] = (r.q[s] >> shift) & 0x0f0f0f0fu;
        scale_codes(q, H2_1024, dl, dl, ml, true, h);
    }
};

template <>
struct Dec<QQ5_K> {  // v = d sc q - dmin m, q = nibble | bit j of qh << 4
    struct Raw {
        uint4 hd;
        u32 hq[8], q[8];
    };
    __device__ static void fetch(const u8* row, int u, Raw& r) {
        const u8* p = row + (u >> 3) * QQ5_K::BYTES;
        r.hd = __ldg(reinterpret_cast<const uint4*>(p));
        load_words<16, 8>(p + 16, r.hq);
        load_words<16, 8>(p + 48 + ((u & 7) >> 1) * 32, r.q);
    }
    __device__ static void decode(const Raw& r, int u, int, u32 (&h)[16]) {
        const int j = u & 7, shift = 4 * (j & 1);
        u32 dl, ml, q[8];
        k4_scales(r.hd, j, dl, ml);
#pragma unroll
        for (int s = 0; s < 8; ++s)
            q[s] = ((r.q[s] >> shift) & 0x0f0f0f0fu) | (((r.hq[s] >> j) & 0x01010101u) << 4);
        scale_codes(q, H2_1024, dl, dl, ml, true, h);
    }
};

template <>
struct Dec<QQ6_K> {  // v = d sc (q - 32), q = 4 bits of ql | 2 bits of qh << 4; a scale per 16 values
    struct Raw {
        Bytes32 ql, qh;
        u32 sw, d;
    };
    __device__ static void fetch(const u8* row, int u, Raw& r) {
        const u8* p = row + (u >> 3) * QQ6_K::BYTES;
        const int j = u & 7, hh = j >> 2, s4 = j & 3;
        fetch32(p + hh * 64 + (s4 & 1) * 32, r.ql);
        fetch32(p + 128 + hh * 32, r.qh);
        r.sw = __ldg(reinterpret_cast<const u16*>(p + 192 + 2 * j));  // the unit's two scales
        r.d = __ldg(reinterpret_cast<const u16*>(p + 208));
    }
    __device__ static void decode(const Raw& r, int u, int, u32 (&h)[16]) {
        const int j = u & 7, s4 = j & 3;
        const int lshift = 4 * (s4 >> 1), hshift = 2 * s4;
        const float d = h2f((u16)r.d);
        const float d0 = d * (float)(i8)(r.sw & 0xffu), d1 = d * (float)(i8)((r.sw >> 8) & 0xffu);
        u32 ql[8], qh[8];
        take32(r.ql, ql);
        take32(r.qh, qh);
#pragma unroll
        for (int s = 0; s < 8; ++s) ql[s] = ((ql[s] >> lshift) & 0x0f0f0f0fu) | (((qh[s] >> hshift) & 0x03030303u) << 4);
        scale_codes(ql, 0x64206420u, pack_h2(d0, d0), pack_h2(d1, d1), 0u, false, h);  // (1024 + q) - 1056
    }
};

template <class Q, int NT>
__device__ __forceinline__ void bgemm_body(const u8* __restrict__ w, int N, int K, const u16* __restrict__ x,
                                           int ldx, int B, float* y, int ldy, const float* __restrict__ rs,
                                           int accumulate, int splits, float* part, unsigned* counters) {
    constexpr int NJ = NT / 8;  // n8 column tiles
    __shared__ float red[BG_WARPS][BG_ROWS][NT + 1];
    __shared__ int s_last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * BG_ROWS;
    const long long row_bytes = (long long)(K / Q::QK) * Q::BYTES;
    const int units = K / 32, groups = (units + 3) / 4;
    const int per = (groups + splits - 1) / splits;
    const int g0 = blockIdx.y * per, g1 = min(groups, g0 + per);

    const u8* wr[4];  // rows g, g + 8, g + 16, g + 24 of the tile (clamped: rows past N decode as zeros)
    bool rok[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int n = row0 + g + 8 * r;
        rok[r] = n < N;
        wr[r] = w + (long long)(rok[r] ? n : 0) * row_bytes;
    }
    const u16* xr[NJ];  // column 8j + g of x (rows past B read as zeros)
    bool cok[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        const int b = 8 * j + g;
        cok[j] = b < B;
        xr[j] = x + (long long)(cok[j] ? b : 0) * ldx;
    }

    float acc[2][NJ][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < NJ; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.0f;

    // The byte position of unit u in a row (the unit's own bytes lie about there): the next group's lines are
    // asked of L2 before this group's decode, so a warp keeps loads in flight without registers to hold them
    const long long unit_bytes_x8 = (long long)Q::BYTES * 256 / Q::QK;  // bytes per 32 values, times 8
    pdl_wait();  // x comes from the kernel before
    // Every load of a group's four units goes out before the first is decoded, with no branch around them (rows
    // past N read row 0, units past the row's end unit 0; their values are zeroed after): a branch per unit put
    // each unit's loads after the decoding of the one before, four memory round trips a group. With BG_PIPE
    // the loads of the warp's next group go out before this group is decoded (its raw words held meanwhile).
    constexpr int AHEAD = BG_PIPE ? 2 : 1;  // groups ahead that the L2 prefetch asks for
    typename Dec<Q>::Raw nxt[4];
#if BG_PIPE
    if (g0 + warp < g1) {
        const int u0 = 4 * (g0 + warp) + t;
#pragma unroll
        for (int r = 0; r < 4; ++r) Dec<Q>::fetch(wr[r], u0 < units ? u0 : 0, nxt[r]);
    }
#endif
    for (int gi = g0 + warp; gi < g1; gi += BG_WARPS) {
        const int u = 4 * gi + t;
        const bool uok = u < units;
        const int uf = uok ? u : 0;
        const int ua = u + 4 * AHEAD * BG_WARPS;
        if (gi + AHEAD * BG_WARPS < g1 && ua < units) {
#pragma unroll
            for (int r = 0; r < 4; ++r)
                if (rok[r]) asm volatile("prefetch.global.L2 [%0];" ::"l"(wr[r] + ua * unit_bytes_x8 / 8));
        }
        typename Dec<Q>::Raw raw[4];
#if BG_PIPE
#pragma unroll
        for (int r = 0; r < 4; ++r) raw[r] = nxt[r];
        if (gi + BG_WARPS < g1) {  // (warp-uniform)
            const int un = u + 4 * BG_WARPS;
#pragma unroll
            for (int r = 0; r < 4; ++r) Dec<Q>::fetch(wr[r], un < units ? un : 0, nxt[r]);
        }
#else
#pragma unroll
        for (int r = 0; r < 4; ++r) Dec<Q>::fetch(wr[r], uf, raw[r]);
#endif
        u32 a[4][16];  // rows g, g+8, g+16, g+24: unit u as 16 fp16 pairs in the fragment order (Dec)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            Dec<Q>::decode(raw[r], uf, K, a[r]);
            const bool live = uok && rok[r];
#pragma unroll
            for (int i = 0; i < 16; ++i) a[r][i] = live ? a[r][i] : 0u;
        }
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            u32 xb[16];  // x's values 4s .. 4s+3 of the unit as the pairs (4s, 4s+2), (4s+1, 4s+3)
            const bool xlive = uok && cok[j];  // (loaded regardless, as the weights, and zeroed where not)
            const uint4* p = reinterpret_cast<const uint4*>(xr[j] + 32 * uf);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const uint4 v = __ldg(p + q);
                xb[4 * q] = xlive ? __byte_perm(v.x, v.y, 0x5410) : 0u;
                xb[4 * q + 1] = xlive ? __byte_perm(v.x, v.y, 0x7632) : 0u;
                xb[4 * q + 2] = xlive ? __byte_perm(v.z, v.w, 0x5410) : 0u;
                xb[4 * q + 3] = xlive ? __byte_perm(v.z, v.w, 0x7632) : 0u;
            }
#pragma unroll
            for (int s = 0; s < 8; ++s) {
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    const u32 af[4] = {a[2 * m][2 * s], a[2 * m + 1][2 * s], a[2 * m][2 * s + 1],
                                       a[2 * m + 1][2 * s + 1]};
                    mma_16816(acc[m][j], af, xb[2 * s], xb[2 * s + 1]);
                }
            }
        }
    }

    // acc[m][j][i]: weight row 16m + g + 8 (i >> 1), column 8j + 2t + (i & 1) of the tile
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[warp][16 * m + g + 8 * (i >> 1)][8 * j + 2 * t + (i & 1)] = acc[m][j][i];
    __syncthreads();
    const int cells = BG_ROWS * NT;
    if (splits > 1) {
        for (int e = threadIdx.x; e < cells; e += blockDim.x) {
            const int r = e & (BG_ROWS - 1), b = e / BG_ROWS, n = row0 + r;
            float v = red[0][r][b];
#pragma unroll
            for (int k = 1; k < BG_WARPS; ++k) v += red[k][r][b];
            if (b < B && n < N) part[((long long)blockIdx.y * B + b) * N + n] = v;
        }
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            const unsigned done = atomicAdd(counters + blockIdx.x, 1u);
            s_last = done == (unsigned)(splits - 1);
            if (s_last) counters[blockIdx.x] = 0u;  // (every other block of the tile has counted)
        }
        __syncthreads();
        if (!s_last) return;
        __threadfence();
    }
    for (int e = threadIdx.x; e < cells; e += blockDim.x) {
        const int r = e & (BG_ROWS - 1), b = e / BG_ROWS, n = row0 + r;
        if (b >= B || n >= N) continue;
        float v;
        if (splits > 1) {
            v = __ldcg(part + (long long)b * N + n);
            for (int k = 1; k < splits; ++k) v += __ldcg(part + ((long long)k * B + b) * N + n);
        } else {
            v = red[0][r][b];
#pragma unroll
            for (int k = 1; k < BG_WARPS; ++k) v += red[k][r][b];
        }
        if (rs) v *= rs[b];
        float* o = y + (long long)b * ldy + n;
        *o = accumulate ? *o + v : v;
    }
}

#define BGEMM_KERNEL(name, Q, NT)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * BG_WARPS) bgemm_##name##_n##NT(                         \
        const u8* w, int N, int K, const u16* x, int ldx, int B, float* y, int ldy, const float* rs,          \
        int accumulate, int splits, float* part, unsigned* counters) {                                        \
        bgemm_body<Q, NT>(w, N, K, x, ldx, B, y, ldy, rs, accumulate, splits, part, counters);                \
    }
#define BGEMM_KERNELS(name, Q) BGEMM_KERNEL(name, Q, 8) BGEMM_KERNEL(name, Q, 16) BGEMM_KERNEL(name, Q, 32) \
    BGEMM_KERNEL(name, Q, 64)

FOR_EACH_QTYPE(BGEMM_KERNELS)
