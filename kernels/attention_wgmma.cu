// attention_wgmma.cu: causal prefill attention on Hopper's warpgroup MMA. The only family built for sm_90a
// (the Python loader's FEATURE_ARCH: its own NVRTC call into a cached cubin on a compute capability 9.0 GPU);
// elsewhere it builds like the others and its kernels trap.
//
// attention_wg_d<D> / attention_wg16_d<D> (D = 64, 128): the contract of attention_tc*_d<D> (fp16 q times
// log2(e)/sqrt(D), f32 or fp16 output) with the caches given as TMA descriptors kmap / vmap instead of
// pointers (below), on wgmma.mma_async (m64nNk16, fp16 in, fp32 accumulate):
// twice mma.sync's tensor throughput on the H100, and asynchronous (well ahead of attention_tc at B16 H32
// T512 D64: docs/perf-log.md).
// grid (ceil(T*G / 64), Hkv), block 128 = one warpgroup; warp w owns query rows 16w..16w+15 of the
// block's 64 (row r -> (t, h) as in attention_npl, longest rows first). Per 64-key tile:
//   S[64 x 64] = Q K^T: D/16 wgmma with A = the Q fragments in registers (the mma.sync A layout), B = the
//   K tile in shared memory (K-major: key rows, dims contiguous);
//   mask, online softmax in fp32 with ex2 exactly as attention_tc (the accumulators have mma.sync's C
//   layout per 8 columns), P rounded to fp16 in registers;
//   O += P V and l += P 1 in the same MMAs, A = P in registers, so l sums the rounded P (O / l a convex
//   combination of V rows, as attention_tc): D = 64, 4 wgmma m64n72k16 whose B is the V tile (transposed:
//   dims contiguous) with 8 columns of ones beside it; D = 128, 4 m64n128k16 on V and 4 m64n8k16 on ones.
// Shared tiles: K and V as [64 keys][64 dims] regions (one, or two for D = 128: dims 0-63 and 64-127), a
// 128-byte key row per region with its 16-byte chunks XOR-swizzled by key % 8 (the 128-byte swizzle of the
// MMA descriptors), each region 1024-byte aligned. Descriptors: K, k16 step k: region k / 4, start + 32
// (k % 4) bytes, 1024 bytes per 8 keys; V, k16 step kk: start + 2048 kk, 1024 bytes per 8 keys, the next 64
// dims one "leading" offset further (the next region, or at D = 64 the ones: 16 rows of 128 bytes of ones).
// The tensor copy engine (TMA) fills them, swizzling as it writes: one cp.async.bulk.tensor per 64 dims of
// K and of V per tile, issued by thread 0 NST - 1 tiles ahead on the stage's mbarrier, from the host-made
// descriptors kmap / vmap (the caches as [rows, Hkv*D] matrices in [64 x 64] boxes, passed by value).
// Dynamic shared memory: 1024 (alignment) + stages x 2 x 64 x D x 2 + WG_ONES(D) + 8 (one int) + 8 bytes
// per stage (the mbarriers).
// On anything but sm_90a the entries exist (the kernel list is the same everywhere) but trap.
// Best measured configuration (B16 H32 T512 D64 causal, fp16 q/K/V/out): attention_wg16_d64, level with or a
// little ahead of torch SDPA fp16 (cuDNN's sm90 flash kernel); the figures are in docs/perf-log.md.

#include "attention_common.cuh"

// WG_BC, WG_STAGES(D), WG_ONES(D): llamacli/backends/cuda/constants.py (the loader puts them in front)

// A TMA descriptor (cuda.h's CUtensorMap: 128 opaque bytes), made on the host by cuTensorMapEncodeTiled.
struct __align__(64) TmaMap {
    unsigned long long w[16];
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
typedef unsigned long long u64;

// Shared-memory matrix descriptor: start address, leading and stride byte offsets, swizzle mode (1: 128 B).
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lead, u32 stride, u32 swizzle) {
    return (u64)((addr & 0x3ffff) >> 4) | ((u64)(lead >> 4) << 16) | ((u64)(stride >> 4) << 32) |
           ((u64)swizzle << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// A shared-memory mbarrier (8 bytes): the tensor copies complete on it.
__device__ __forceinline__ void mbar_init(u32 bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
// One arrival that also expects `bytes` more from copies: the phase completes when they have landed.
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {  // until the phase of that parity completed
    u32 done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// The tensor copy engine (TMA): the [64 x 64] fp16 box at column x, row y of the matrix `map` describes into
// shared memory at dst (1024-byte aligned), 128-byte swizzled as the MMA descriptors read it; rows past the
// matrix's end arrive as zeros; completes on bar.
__device__ __forceinline__ void tma_load(u32 dst, const TmaMap* map, int x, int y, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(map), "r"(x), "r"(y), "r"(bar)
        : "memory");
}

// d[N/2] (+)= a (64 x 16, registers) * B (16 x N, shared memory descriptor b); d scaled by 0 when !acc.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_n8(float* d, const u32* a, u64 b, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 "
        "{"
        "%0, %1, %2, %3"
        "}, {%4, %5, %6, %7}, %8, p, 1, 1, %10;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(TRANS_B));
}

template <int TRANS_B>
__device__ __forceinline__ void wgmma_n64(float* d, const u32* a, u64 b, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(TRANS_B));
}

template <int TRANS_B>
__device__ __forceinline__ void wgmma_n72(float* d, const u32* a, u64 b, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %41, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n72k16.f32.f16.f16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35"
        "}, {%36, %37, %38, %39}, %40, p, 1, 1, %42;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(TRANS_B));
}

template <int TRANS_B>
__device__ __forceinline__ void wgmma_n128(float* d, const u32* a, u64 b, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(TRANS_B));
}

template <int N>
__device__ __forceinline__ void wgmma_s(float* d, const u32* a, u64 b, int acc) {  // S: N keys, K-major
    if constexpr (N == 128) wgmma_n128<0>(d, a, b, acc);
    else wgmma_n64<0>(d, a, b, acc);
}

// Keep the compiler from moving accumulator reads or writes across the asynchronous MMAs.
template <int N>
__device__ __forceinline__ void wg_pin(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int D, bool OUT16>
__device__ __forceinline__ void attention_wg_body(const u16* __restrict__ q, int q_stride, const TmaMap* kmap,
                                                  const TmaMap* vmap, const int* __restrict__ pos, int T, int Hq,
                                                  int Hkv,
                                                  void* __restrict__ out, int out_stride) {
    constexpr int KS = D / 16;        // k16 steps of S = Q K^T
    constexpr int CPR = D / 8;        // 16-byte chunks per key row
    constexpr int NST = WG_STAGES(D);
    constexpr int BC = WG_BC;         // keys per tile
    constexpr int NS = BC / 8;        // n8 column blocks of S
    constexpr u32 REGION = BC * 128;  // bytes of a [BC keys][64 dims] region
    constexpr u32 TILE = BC * D * 2;  // bytes of a K (or V) tile
    extern __shared__ __align__(16) u8 wg_smem[];
    const u32 base = (smem_addr(wg_smem) + 1023) & ~1023u;
    const u32 ksm = base, vsm = base + NST * TILE, ones = base + 2 * NST * TILE;
    u8* ones_p = wg_smem + (ones - smem_addr(wg_smem));
    int* s_kend = reinterpret_cast<int*>(ones_p + WG_ONES(D));
    const u32 full = ones + WG_ONES(D) + 8;  // NST mbarriers, 8 bytes each: stage s's K and V tiles landed

    const int G = Hq / Hkv, kvh = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tg = lane & 3;

    // K and V tiles come by the tensor copy engine: thread 0 issues a tile's copies (one per 64 dims of K and
    // of V) on its stage's mbarrier, NST - 1 tiles ahead; every thread waits on that mbarrier. Rows past the
    // cache's end arrive as zeros; the last tile's V rows past kend (cache rows that may hold anything) are
    // zeroed below, as P V needs (their P is 0; 0 x NaN is not).
    auto issue_tile = [&](int tile) {
        const u32 st = (tile % NST) * TILE, bar = full + 8 * (tile % NST);
        mbar_expect(bar, 2 * TILE);
#pragma unroll
        for (int r = 0; r < D / 64; ++r) {
            tma_load(ksm + st + r * REGION, kmap, kvh * D + 64 * r, tile * BC, bar);
            tma_load(vsm + st + r * REGION, vmap, kvh * D + 64 * r, tile * BC, bar);
        }
    };
    if (threadIdx.x == 0) {  // tile 0 at once (every block has a key): it lands while Q and kend load
#pragma unroll
        for (int i = 0; i < NST; ++i) mbar_init(full + 8 * i);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        issue_tile(0);
        *s_kend = 0;
    }

    int tt[2], hh[2], qp[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int gr = (gridDim.x - 1 - blockIdx.x) * 64 + warp * 16 + g + 8 * i;  // longest rows first
        tt[i] = gr / G;
        hh[i] = kvh * G + gr % G;
    }
    // The Q fragments first: their loads run during the position loads and the barriers below.
    u32 qa[KS][4];
    load_q_frags<D>(qa, q, q_stride, tt, hh, T, tg);
#pragma unroll
    for (int i = 0; i < 2; ++i) qp[i] = tt[i] < T ? pos[tt[i]] : -1;
    int wmin = min(qp[0], qp[1]), bmax = max(qp[0], qp[1]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        wmin = min(wmin, __shfl_xor_sync(FULL_MASK, wmin, o));
        bmax = max(bmax, __shfl_xor_sync(FULL_MASK, bmax, o));
    }
#pragma unroll
    for (int i = threadIdx.x; i < WG_ONES(D) / 4; i += 128) reinterpret_cast<u32*>(ones_p)[i] = 0x3c003c00u;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the ones, visible to the MMA
    __syncthreads();
    if (lane == 0) atomicMax(s_kend, bmax + 1);
    __syncthreads();
    const int kend = *s_kend;  // keys [0, kend) hold every key a row of this block sees

    // The accumulators: o[D / 2] (this lane's part of the 16 x D output rows, unnormalized), then l[4] (the
    // row sums; l[0] row g, l[2] row g + 8), summed by the same MMAs as o: at D = 64 one m64n72k16 per k16
    // step against V with 8 columns of ones beside it, at D = 128 an m64n8k16 beside each m64n128k16.
    float acc[D / 2 + 4];
    float* const o = acc;
    float* const l = acc + D / 2;
#pragma unroll
    for (int n = 0; n < D / 2 + 4; ++n) acc[n] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY};

    const int n_tiles = (kend + BC - 1) / BC;
    auto load_tile = [&](int tile) {
        if (threadIdx.x == 0 && tile < n_tiles) issue_tile(tile);
    };
    const u64 ones_desc = wg_desc(ones, 128, 256, 0);  // (D = 128) 16 x 8, no swizzle: 8 x 8 cores 128 B apart
#pragma unroll
    for (int i = 1; i < NST - 1; ++i) load_tile(i);
    if (n_tiles == 0) mbar_wait(full, 0);  // (no key at all) no copy may land after the block ended
    // The last tile's V rows past kend are zeroed once it has landed, a tile ahead (the block barrier at the
    // top of its iteration orders the stores before every warp's MMA).
    auto zero_tail = [&](int tile) {
        if (tile != n_tiles - 1 || kend % BC == 0) return;
        const u32 vb = vsm + (tile % NST) * TILE;
        mbar_wait(full + 8 * (tile % NST), (tile / NST) & 1);
        for (int c = (kend % BC) * CPR + threadIdx.x; c < BC * CPR; c += 128) {  // 16-byte stores
            const u32 at = vb + (c % CPR >> 3) * REGION + (c / CPR) * 128 + (c & 7) * 16;
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(at), "r"(0) : "memory");
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    };
    zero_tail(0);

    for (int it = 0; it < n_tiles; ++it) {
        const int buf = it % NST, k0 = it * BC;
        // Every warp is done with tile it - 1 (its MMAs waited on), whose stage refills below, and the zeroed
        // rows are in place; then tile it lands.
        __syncthreads();
        mbar_wait(full + 8 * buf, (it / NST) & 1);
        const u32 kb = ksm + buf * TILE, vb = vsm + buf * TILE;
        const u64 v1 = wg_desc(vb, ones - vb, 1024, 1);

        float s[4 * NS];
        wg_fence();
#pragma unroll
        for (int k = 0; k < KS; ++k)
            wgmma_s<BC>(s, qa[k], wg_desc(kb + (k >> 2) * REGION + (k & 3) * 32, 16, 1024, 1), k);
        wg_commit();
        load_tile(it + NST - 1);  // while the MMAs run
        wg_wait0();
        wg_pin(s);

        float alpha[2];
        tile_softmax<NS>(s, m, alpha, qp, k0, wmin, tg);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            l[c] *= alpha[c >> 1];
#pragma unroll
            for (int n = 0; n < D / 8; ++n) o[4 * n + c] *= alpha[c >> 1];
        }
        u32 pa[BC / 16][4];
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            pa[kk][0] = pack_h2(s[8 * kk + 0], s[8 * kk + 1]);
            pa[kk][1] = pack_h2(s[8 * kk + 2], s[8 * kk + 3]);
            pa[kk][2] = pack_h2(s[8 * kk + 4], s[8 * kk + 5]);
            pa[kk][3] = pack_h2(s[8 * kk + 6], s[8 * kk + 7]);
        }
        wg_pin(acc);  // the rescale stays before the fence
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            const u32 vk = vb + kk * 2048;  // V rows 16 kk.. (dims contiguous: the MMA's transposed B)
            if constexpr (D == 64) {        // dims 64..71 one "leading" step further: the ones
                // = wg_desc(vk, ones - vk, 1024, 1): the start field kk * 128 up, the leading one down
                const u64 vd = v1 + (u64)(kk * 128) - ((u64)(kk * 128) << 16);
                wgmma_n72<1>(acc, pa[kk], vd, 1);
            } else {
                wgmma_n128<1>(o, pa[kk], wg_desc(vk, REGION, 1024, 1), 1);
                wgmma_n8<0>(l, pa[kk], ones_desc, 1);
            }
        }
        wg_commit();
        zero_tail(it + 1);
        wg_wait0();
        wg_pin(acc);
    }

    store_rows<D, OUT16>(out, out_stride, o, l, tt, hh, T, tg);
}
#define WG_BODY(D, OUT16) attention_wg_body<D, OUT16>(q, q_stride, &kmap, &vmap, pos, T, Hq, Hkv, out, out_stride)
#else
#define WG_BODY(D, OUT16) __trap()
#endif

#define ATTENTION_WG_KERNEL(D)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) attention_wg_d##D(                                      \
        const u16* q, int q_stride, const __grid_constant__ TmaMap kmap, const __grid_constant__ TmaMap vmap,  \
        const int* pos, int T, int Hq, int Hkv, float* out, int out_stride) {                                 \
        WG_BODY(D, false);                                                                                    \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) attention_wg16_d##D(                                    \
        const u16* q, int q_stride, const __grid_constant__ TmaMap kmap, const __grid_constant__ TmaMap vmap,  \
        const int* pos, int T, int Hq, int Hkv, u16* out, int out_stride) {                                   \
        WG_BODY(D, true);                                                                                     \
    }
ATTENTION_WG_KERNEL(64)
ATTENTION_WG_KERNEL(128)
