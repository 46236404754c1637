// attention_mma.cu: causal prefill attention on tensor cores (mma.sync), for any GPU of sm_80 or later.
//
// attention_tc_d<D>(...): the same math as attention_npl (attention_simt.cu) with n_split == 1,
// FlashAttention-2 style (Dao 2023) on mma.sync.m16n8k16 (fp16 inputs, fp32 accumulate; softmax in fp32
// with exp2).
// q: fp16 rows [T, Hq, D] (token stride q_stride halves) already multiplied by log2(e)/sqrt(D): the fused
// prefill's RoPE epilogue (rope_store_pf_*) writes them so, and the op-by-op path converts its f32 q once.
// grid (ceil(T*G / 64), Hkv), block 128 = 4 warps; each warp owns 16 query rows (row r -> (t, h) as in
// attention_npl), so the 64 rows of a block share every K/V tile: a KV head is read once per 64 rows. (Two
// m-tiles of 16 rows per warp, each K or V fragment feeding both, measured no faster on the H100 at
// B16 H32 T512 D64 and halve a model's few blocks.)
// Keys go in tiles of 64 through shared memory, three stages deep (two for D > 64) with cp.async (16-byte
// copies, zero-filled past the last key any row sees). Rows are padded by 8 halves (16 bytes): the ldmatrix
// row reads (K plain, V transposed) are conflict-free for D = 64, 96, 128.
// Per tile and warp: S[16 x 64] = Q K^T (Q fragments held in registers for the whole kernel),
// causal mask key > pos[t] -> -inf, running max / rescale, P rounded to fp16 and fed straight from the S
// accumulators as the A operand of O += P V (the C layout of two n8 tiles is the A layout of one k16 step).
// The row sum l is one more MMA per k16 step, P times a column of ones: it adds the rounded P in fp32, so
// O / l is a convex combination of V rows even with fp16 weights (fp16 output cannot overflow).
// Dynamic shared memory: stages x (K + V) x 64 x (D + 8) x 2 bytes + 16 (D = 64: 55.3 KB, 128: 69.6 KB),
// and for D = 256 the warps' Q rows, 4 x 16 x (D + 8) x 2 more (169.0 KB).
// attention_tcx*_d<D>(..., out_stride, window, cap2, sinks, ring): the same with gemma's sliding window and
// attention soft-cap (see EXT below) and gpt-oss's attention sinks ([Hq] or null), over caches of `ring` rows:
// position k at row k mod ring (ctx for a full cache; a sliding-window layer's ring is a multiple of 64,
// llamacli/models/kv_cache.py, so a tile's rows are contiguous).
// attention_tc16_d<D>: the same, output stored as fp16 (the fused prefill's O-projection GEMM input).
// Accuracy vs the fp32 reference: fp16 Q and P, |err| ~ 1e-3 at unit-variance inputs (tests: atol 4e-3,
// rtol 1e-2). The CUDA-core kernels (attention_simt.cu) serve short chunks and
// head dims not a multiple of 16.
// Best measured configuration (B16 H32 T512 D64 causal, fp16 q/K/V/out): attention_tc16_d64, ahead of
// FlashAttention-2 (also mma.sync); the figures are in docs/perf-log.md. On a Hopper GPU attention_wgmma.cu's
// kernel serves D 64 and 128.

#include "attention_common.cuh"

// TC_WARPS, TC_BC, TC_STAGES(D): llamacli/backends/cuda/constants.py (the loader puts them in front)
#define TC_BR (TC_WARPS * 16)  // query rows per block

// EXT (attention_tcx*): a sliding window (keys k > pos - window seen; 0: all) and a soft-cap of the base-2
// scores (s -> cap2 tanh(s / cap2), cap2 = c log2(e); 0: none), tiles wholly before every row's window neither
// loaded nor multiplied. D > 128 keeps each warp's Q rows in shared memory (ldmatrix per k step) instead of
// registers: 64 registers of Q fragments more would spill beside the 128 of the output accumulators.
template <int D, bool OUT16, bool EXT = false>
__device__ __forceinline__ void attention_tc_body(const u16* __restrict__ q, int q_stride,
                                                  const u16* __restrict__ kc, const u16* __restrict__ vc,
                                                  const int* __restrict__ pos, int T, int Hq, int Hkv,
                                                  void* __restrict__ out, int out_stride, int window = 0,
                                                  float cap2 = 0.0f, const float* __restrict__ sinks = nullptr,
                                                  int ring = 0) {
    constexpr int NST = TC_STAGES(D);  // K/V tiles in flight
    constexpr int KS = D / 16;       // k16 steps over the head dim (S = Q K^T)
    constexpr int NO = D / 8;        // n8 tiles of the output row
    constexpr int NS = TC_BC / 8;    // n8 tiles of a score row
    constexpr int RS = D + 8;        // shared row stride in halves
    constexpr int CPR = D / 8;       // 16-byte chunks per key row
    constexpr u32 ONES = 0x3c003c00u;  // half2(1, 1): B operand of the row-sum MMA
    constexpr bool QSM = D > 128;      // Q fragments from shared memory (see above)
    extern __shared__ __align__(16) u16 tc_smem[];
    u16* ks = tc_smem;                      // [NST][TC_BC][RS]
    u16* vs = ks + NST * TC_BC * RS;        // [NST][TC_BC][RS]
    int* s_kend = reinterpret_cast<int*>(vs + NST * TC_BC * RS);
    u16* qsm = vs + NST * TC_BC * RS + 8;   // QSM: [TC_WARPS][16][RS] (after s_kend and s_kbeg, 16 bytes)

    const int G = Hq / Hkv, kvh = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tg = lane & 3;

    // This lane's rows: g and g + 8 of the warp's 16.
    int tt[2], hh[2], qp[2];
    int wmax = -1, wmin = 0x7fffffff;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        // ((r >> 1) * 16 is 0 here; written so the compiled code stays the one measured and GPU-tested.)
        const int gr = (gridDim.x - 1 - blockIdx.x) * TC_BR + warp * 16 + (r >> 1) * 16 + g + 8 * (r & 1);
        tt[r] = gr / G;  // longest rows first: the last block of rows starts first
        hh[r] = kvh * G + gr % G;
        qp[r] = tt[r] < T ? pos[tt[r]] : -1;
        wmax = max(wmax, qp[r]);
        wmin = min(wmin, qp[r]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        wmax = max(wmax, __shfl_xor_sync(FULL_MASK, wmax, o));
        wmin = min(wmin, __shfl_xor_sync(FULL_MASK, wmin, o));
    }
    // EXT: the lowest position of the warp's rows past T excluded (they see nothing), and of the block's.
    int wvmin = 0x7fffffff;
    if (EXT) {
#pragma unroll
        for (int r = 0; r < 2; ++r) wvmin = qp[r] >= 0 ? min(wvmin, qp[r]) : wvmin;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) wvmin = min(wvmin, __shfl_xor_sync(FULL_MASK, wvmin, o));
    }
    if (threadIdx.x == 0) {
        *s_kend = 0;
        if (EXT) s_kend[1] = 0x7fffffff;
    }
    __syncthreads();
    if (lane == 0) {
        atomicMax(s_kend, wmax + 1);
        if (EXT) atomicMin(s_kend + 1, wvmin);
    }
    __syncthreads();
    const int kend = *s_kend;  // keys [0, kend) hold every key a row of this block sees
    // The first tile holding a key some row of the block sees (EXT with a window: the lowest position's).
    const int t0 = EXT && window > 0 ? max(0, s_kend[1] - window + 1) / TC_BC : 0;

    u32 qa[QSM ? 1 : KS][4];
    u32 q_lds = 0;  // QSM: this lane's ldmatrix row address in its warp's Q rows
    if constexpr (QSM) {
        u16* qw = qsm + warp * 16 * RS;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const u16* qr = q + (long long)(tt[i] < T ? tt[i] : 0) * q_stride + hh[i] * D + 2 * tg;
            u16* qd = qw + (g + 8 * i) * RS + 2 * tg;
#pragma unroll 4
            for (int k = 0; k < KS; ++k) {
                *reinterpret_cast<u32*>(qd + 16 * k) = tt[i] < T ? *reinterpret_cast<const u32*>(qr + 16 * k) : 0u;
                *reinterpret_cast<u32*>(qd + 16 * k + 8) =
                    tt[i] < T ? *reinterpret_cast<const u32*>(qr + 16 * k + 8) : 0u;
            }
        }
        __syncwarp();
        // matrix lane / 8: rows 8 (mi & 1) + [0, 8) at dims 8 (mi >> 1): a0..a3 of a k step.
        q_lds = smem_addr(qw + (((lane >> 3) & 1) * 8 + (lane & 7)) * RS + ((lane >> 4) << 3));
    } else {
        load_q_frags<D>(reinterpret_cast<u32(&)[KS][4]>(qa), q, q_stride, tt, hh, T, tg);
    }

    float o[NO][4], l[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY};

    const int n_tiles = (kend + TC_BC - 1) / TC_BC;
    auto load_tile = [&](int tile) {  // one cp.async group per call, empty past the last tile
        const int k0 = tile * TC_BC, buf = tile % NST, r0 = EXT ? k0 % ring : k0;  // r0: key k0's cache row
        u16* kd = ks + buf * TC_BC * RS;
        u16* vd = vs + buf * TC_BC * RS;
        for (int e = threadIdx.x; tile < n_tiles && e < TC_BC * CPR; e += TC_WARPS * 32) {
            const int j = e / CPR, c = e - j * CPR, key = k0 + j;
            const bool ok = key < kend;
            const long long off = ((long long)(ok ? r0 + j : 0) * Hkv + kvh) * D + c * 8;
            cp_async16(smem_addr(kd + j * RS + c * 8), kc + off, ok ? 16 : 0);
            cp_async16(smem_addr(vd + j * RS + c * 8), vc + off, ok ? 16 : 0);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
#pragma unroll
    for (int i = 0; i < NST - 1; ++i) load_tile(t0 + i);

    // ldmatrix row addresses: lane supplies row lane % 8 of matrix mi = lane / 8.
    // K (plain): matrix mi = keys 8 (mi >> 1) + [0, 8) at dims 8 (mi & 1) + [0, 8) of a 16-key, 16-dim step:
    //   registers b0, b1 of n8 tile 2np and b0, b1 of tile 2np + 1.
    // V (transposed): matrix mi = keys 8 (mi & 1) + [0, 8) at dims 8 (mi >> 1) + [0, 8): b0, b1 of the
    //   output n8 tile 2nd and b0, b1 of tile 2nd + 1.
    const int mi = lane >> 3, r8 = lane & 7;
    const int koff = (((mi >> 1) << 3) + r8) * RS + ((mi & 1) << 3);
    const int voff = (((mi & 1) << 3) + r8) * RS + ((mi >> 1) << 3);

    for (int it = t0; it < n_tiles; ++it) {
        const int buf = it % NST, k0 = it * TC_BC;
        // Groups 0..it+1 are committed (group j = tile j): tile it has landed when at most one is pending.
        asm volatile("cp.async.wait_group %0;" ::"n"(NST - 2) : "memory");
        // Every thread's copies of tile it are visible, and every warp is done with tile it - 1, whose
        // buffer the next load refills.
        __syncthreads();
        load_tile(it + NST - 1);
        // Warp-uniform: some row of this warp sees a key of the tile (EXT: and not all before its window).
        if (k0 <= wmax && (!EXT || window <= 0 || k0 + TC_BC - 1 > wvmin - window)) {
            const u32 kt = smem_addr(ks + buf * TC_BC * RS + koff);
            const u32 vt = smem_addr(vs + buf * TC_BC * RS + voff);
            float s[NS][4];
#pragma unroll
            for (int n = 0; n < NS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            // S = Q K^T: B (16 x 8, col-major) = K rows n*8 + g, dims 16k + 2tg (b0) and + 8 (b1).
#pragma unroll
            for (int k = 0; k < KS; ++k) {
                u32* qk = qa[QSM ? 0 : k];
                if constexpr (QSM) ldsm_x4(q_lds + (u32)(k * 32), qk[0], qk[1], qk[2], qk[3]);
#pragma unroll
                for (int np = 0; np < NS / 2; ++np) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4(kt + (u32)((np * 16 * RS + k * 16) * 2), b0, b1, b2, b3);
                    mma_16816(s[2 * np], qk, b0, b1);
                    mma_16816(s[2 * np + 1], qk, b2, b3);
                }
            }
            float alpha[2];
            if (EXT) {
                tile_cap_window<NS>(&s[0][0], qp, k0, wmin, wmax, window, cap2, tg);
                tile_softmax<NS>(&s[0][0], m, alpha, qp, k0, 0x7fffffff, tg);  // (masked above)
            } else {
                tile_softmax<NS>(&s[0][0], m, alpha, qp, k0, wmin, tg);
            }
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                l[c] *= alpha[c >> 1];
#pragma unroll
                for (int n = 0; n < NO; ++n) o[n][c] *= alpha[c >> 1];
            }
            // O += P V and l += P 1, 16 keys per k step.
#pragma unroll
            for (int kk = 0; kk < TC_BC / 16; ++kk) {
                u32 pa[4];
                pa[0] = pack_h2(s[2 * kk][0], s[2 * kk][1]);
                pa[1] = pack_h2(s[2 * kk][2], s[2 * kk][3]);
                pa[2] = pack_h2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[3] = pack_h2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
                mma_16816(l, pa, ONES, ONES);
#pragma unroll
                for (int nd = 0; nd < D / 16; ++nd) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4_trans(vt + (u32)((kk * 16 * RS + nd * 16) * 2), b0, b1, b2, b3);
                    mma_16816(o[2 * nd], pa, b0, b1);
                    mma_16816(o[2 * nd + 1], pa, b2, b3);
                }
            }
        }
    }

    // l[c]: every column of the ones-MMA holds the full row sum (c = 0 row g, c = 2 row g + 8). Sinks (EXT,
    // gpt-oss): exp(sink) joins the denominator, in the base-2 units of m.
    if (EXT && sinks) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (tt[r] < T) l[2 * r] += exp2f(sinks[hh[r]] * 1.4426950408889634f - m[r]);
    }
    store_rows<D, OUT16>(out, out_stride, &o[0][0], l, tt, hh, T, tg);
}

#define ATTENTION_TC_KERNEL(D)                                                                                \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32) attention_tc_d##D(                            \
        const u16* q, int q_stride, const u16* kc, const u16* vc, const int* pos, int T, int Hq, int Hkv,     \
        float* out, int out_stride) {                                                                         \
        attention_tc_body<D, false>(q, q_stride, kc, vc, pos, T, Hq, Hkv, out, out_stride);                   \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32) attention_tc16_d##D(                          \
        const u16* q, int q_stride, const u16* kc, const u16* vc, const int* pos, int T, int Hq, int Hkv,     \
        u16* out, int out_stride) {                                                                           \
        attention_tc_body<D, true>(q, q_stride, kc, vc, pos, T, Hq, Hkv, out, out_stride);                    \
    }
#define ATTENTION_TCX_KERNEL(D)                                                                               \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32) attention_tcx_d##D(                           \
        const u16* q, int q_stride, const u16* kc, const u16* vc, const int* pos, int T, int Hq, int Hkv,     \
        float* out, int out_stride, int window, float cap2, const float* sinks, int ring) {                   \
        attention_tc_body<D, false, true>(q, q_stride, kc, vc, pos, T, Hq, Hkv, out, out_stride, window, cap2,  \
                                          sinks, ring);                                                             \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32) attention_tcx16_d##D(                         \
        const u16* q, int q_stride, const u16* kc, const u16* vc, const int* pos, int T, int Hq, int Hkv,     \
        u16* out, int out_stride, int window, float cap2, const float* sinks, int ring) {                     \
        attention_tc_body<D, true, true>(q, q_stride, kc, vc, pos, T, Hq, Hkv, out, out_stride, window, cap2,   \
                                         sinks, ring);                                                              \
    }
ATTENTION_TC_KERNEL(64)
ATTENTION_TC_KERNEL(80)
ATTENTION_TC_KERNEL(96)
ATTENTION_TC_KERNEL(112)
ATTENTION_TC_KERNEL(128)
ATTENTION_TC_KERNEL(256)
ATTENTION_TCX_KERNEL(64)
ATTENTION_TCX_KERNEL(80)
ATTENTION_TCX_KERNEL(96)
ATTENTION_TCX_KERNEL(112)
ATTENTION_TCX_KERNEL(128)
ATTENTION_TCX_KERNEL(256)
