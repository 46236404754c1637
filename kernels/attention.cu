// attention.cu: causal grouped-query attention over the fp16 KV cache, flash style (online softmax; the
// [T, ctx] score matrix never exists in global memory).
//
// Math: for query row (t, h), kv head g = h / G (G = Hq/Hkv), keys 0..pos[t]:
//   o = sum_j softmax_j(q . k_j / sqrt(Dh)) v_j,   running max m, running sum l, rescale by exp(m_old - m).
// Shapes: q rows [T, Hq, Dh] f32 with token stride q_stride floats; kc, vc = one layer's cache
//   [ctx, Hkv, Dh] fp16; pos [T] i32 in device memory (so one captured graph serves every position).
//
// attention_npl<N>(...): grid (ceil(T*G / 32), Hkv, n_split), block 256 = 8 warps, 32 query rows per block
//   (row r -> (t, h) = divmod(blockIdx.x*32 + r, G) within kv head blockIdx.y): the 32 rows share every
//   K/V tile, so a KV head is read once per group of query heads. Keys go in tiles of 32 through shared
//   memory (K as half2 with a one-word pad per key row: conflict-free when lane j reads key j; V as fp16).
//   Lane j scores key j against the row's q (broadcast from shared memory), the warp takes the tile max,
//   and each lane accumulates its N = ceil(Dh/32) output dims with the probabilities shuffled from lane j.
//   Split s covers keys [s*chunk, (s+1)*chunk): n_split == 1 writes o normalised (prefill); n_split > 1
//   writes partial (o, m, l) for attention_combine (flash-decoding: decode has one query row per head, so
//   the keys are what must spread over the SMs). Dynamic shared memory: 32*Dh*4 + 32*(Dh/2+1)*4 + 32*Dh*2.
// attention_combine: grid T*Hq, block Dh rounded up to 32: merges the ceil((pos[t]+1)/chunk) partials.
// kv_store: k, v [T, Hkv, Dh] f32 (token strides k_stride, v_stride) -> cache rows pos[t] as fp16.
// Prefill chunks of >= 16 rows with D in {64, 80, 96, 112, 128} run attention_tc_d<D> (tensor cores, below),
// or on a Hopper GPU with D 64 or 128 attention_wg_d<D> (its warpgroup MMA, built for sm_90a; last below);
// decode with G <= 8 and D % 8 == 0 runs attention_decode_npl<N> (keys over all 8 warps, below), and the
// fused decode step its STEP form attention_step_<mode>_npl<N> (RoPE + K/V store + split + combine in one;
// a programmatic dependent in the captured step: the K/V prefetch runs before pdl_wait, `early` as in mv1).
// Best measured on H100 (2026-11-24, B16 H32 T512 D64 causal, fp16 q/K/V/out): attention_wg16_d64 67 us
// (256 TFLOP/s), attention_tc16_d64 103-105 us; this kernel (f32 q and out) ~2,100 us; torch SDPA fp16
// (cuDNN's sm90 flash kernel) 68-72 us, FlashAttention-2 (mma.sync) 119 us.

#include "common.cuh"
#include "rope.cuh"

#define ATT_WARPS 8
#define ATT_RPW 4
#define ATT_ROWS (ATT_WARPS * ATT_RPW)
#define ATT_TILE 32

template <int NPL>
__device__ __forceinline__ void attention_body(const float* __restrict__ q, int q_stride, const u16* __restrict__ kc,
                                               const u16* __restrict__ vc, const int* __restrict__ pos, int T,
                                               int Hq, int Hkv, int Dh, float scale, int chunk, float* out,
                                               int out_stride, float* part_o, float* part_ml, int n_split) {
    extern __shared__ float smem[];
    const int G = Hq / Hkv;
    const int kvh = blockIdx.y, split = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int half = Dh / 2, kw = half + 1;  // K row stride in 32-bit words (padded)
    float* qs = smem;                                                  // [ROWS][Dh]
    u32* ks = reinterpret_cast<u32*>(qs + ATT_ROWS * Dh);              // [TILE][kw]
    u16* vs = reinterpret_cast<u16*>(ks + ATT_TILE * kw);              // [TILE][Dh]
    __shared__ int s_kend;

    // Find the last key any of this block's rows may see; leave at once if this split holds none of them
    // (decode launches a fixed grid of splits, most of them past the current position), then stage the
    // query rows (pre-scaled).
    if (threadIdx.x == 0) s_kend = 0;
    __syncthreads();
    if (threadIdx.x < ATT_ROWS) {
        const int t = (blockIdx.x * ATT_ROWS + threadIdx.x) / G;
        if (t < T) atomicMax(&s_kend, pos[t] + 1);
    }
    __syncthreads();
    const int begin = split * chunk;
    const int end = min(begin + chunk, s_kend);
    if (begin >= end) return;  // whole block uniform: nothing to do for this split
    for (int e = threadIdx.x; e < ATT_ROWS * Dh; e += blockDim.x) {
        const int r = e / Dh, d = e - r * Dh;
        const int gr = blockIdx.x * ATT_ROWS + r, t = gr / G, h = kvh * G + gr % G;
        qs[e] = t < T ? q[(long long)t * q_stride + h * Dh + d] * scale : 0.0f;
    }
    __syncthreads();

    int qpos[ATT_RPW];
    float m[ATT_RPW], l[ATT_RPW], acc[ATT_RPW][NPL];
#pragma unroll
    for (int rr = 0; rr < ATT_RPW; ++rr) {
        const int gr = blockIdx.x * ATT_ROWS + rr * ATT_WARPS + warp, t = gr / G;
        qpos[rr] = t < T ? pos[t] : -1;
        m[rr] = -INFINITY;
        l[rr] = 0.0f;
#pragma unroll
        for (int i = 0; i < NPL; ++i) acc[rr][i] = 0.0f;
    }

    for (int kt = begin; kt < end; kt += ATT_TILE) {
        // K and V tile: 32 keys x Dh fp16, 32-bit words; keys past `end` are zero (masked below anyway).
        for (int e = threadIdx.x; e < ATT_TILE * half; e += blockDim.x) {
            const int j = e / half, d2 = e - j * half, key = kt + j;
            u32 kv = 0, vv = 0;
            if (key < end) {
                const long long off = ((long long)key * Hkv + kvh) * Dh + 2 * d2;
                kv = *reinterpret_cast<const u32*>(kc + off);
                vv = *reinterpret_cast<const u32*>(vc + off);
            }
            ks[j * kw + d2] = kv;
            reinterpret_cast<u32*>(vs)[j * half + d2] = vv;
        }
        __syncthreads();
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; ++rr) {
            if (qpos[rr] < kt) continue;  // warp-uniform: this row sees no key of the tile
            const float* qr = qs + (rr * ATT_WARPS + warp) * Dh;
            const u32* kr = ks + lane * kw;
            float s = 0.0f;
            for (int d2 = 0; d2 < half; ++d2) {
                const u32 kk = kr[d2];
                const float2 qq = *reinterpret_cast<const float2*>(qr + 2 * d2);
                s = fmaf(qq.x, h2f((u16)(kk & 0xffffu)), s);
                s = fmaf(qq.y, h2f((u16)(kk >> 16)), s);
            }
            const int key = kt + lane;
            if (key >= end || key > qpos[rr]) s = -INFINITY;
            const float m_new = fmaxf(m[rr], warp_max(s));
            const float alpha = __expf(m[rr] - m_new);
            const float p = __expf(s - m_new);
            m[rr] = m_new;
            l[rr] = l[rr] * alpha + p;
#pragma unroll
            for (int i = 0; i < NPL; ++i) acc[rr][i] *= alpha;
            const int n_keys = min(ATT_TILE, min(end, qpos[rr] + 1) - kt);
            for (int j = 0; j < n_keys; ++j) {
                const float pj = __shfl_sync(FULL_MASK, p, j);
#pragma unroll
                for (int i = 0; i < NPL; ++i) {
                    const int d = lane + 32 * i;
                    if (d < Dh) acc[rr][i] = fmaf(pj, h2f(vs[j * Dh + d]), acc[rr][i]);
                }
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int rr = 0; rr < ATT_RPW; ++rr) {
        const int gr = blockIdx.x * ATT_ROWS + rr * ATT_WARPS + warp, t = gr / G, h = kvh * G + gr % G;
        if (t >= T || qpos[rr] < begin) continue;
        const float lt = warp_sum(l[rr]);
        if (n_split == 1) {
            const float inv = 1.0f / lt;
#pragma unroll
            for (int i = 0; i < NPL; ++i) {
                const int d = lane + 32 * i;
                if (d < Dh) out[(long long)t * out_stride + h * Dh + d] = acc[rr][i] * inv;
            }
        } else {
            const long long row = ((long long)split * T + t) * Hq + h;
#pragma unroll
            for (int i = 0; i < NPL; ++i) {
                const int d = lane + 32 * i;
                if (d < Dh) part_o[row * Dh + d] = acc[rr][i];
            }
            if (lane == 0) {
                part_ml[2 * row] = m[rr];
                part_ml[2 * row + 1] = lt;
            }
        }
    }
}

#define ATTENTION_KERNEL(N)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) attention_npl##N(                                     \
        const float* q, int q_stride, const u16* kc, const u16* vc, const int* pos, int T, int Hq, int Hkv,   \
        int Dh, float scale, int chunk, float* out, int out_stride, float* part_o, float* part_ml,            \
        int n_split) {                                                                                       \
        attention_body<N>(q, q_stride, kc, vc, pos, T, Hq, Hkv, Dh, scale, chunk, out, out_stride, part_o,    \
                          part_ml, n_split);                                                                 \
    }
ATTENTION_KERNEL(1)
ATTENTION_KERNEL(2)
ATTENTION_KERNEL(3)
ATTENTION_KERNEL(4)
ATTENTION_KERNEL(8)

// ---- Decode: keys spread over all 8 warps ------------------------------------------------------------------
// attention_decode_npl<N>(...): one query token (T == 1), its G = Hq / Hkv rows (G <= 8) of kv head
// blockIdx.x, keys [s*chunk, min((s+1)*chunk, pos[0]+1)) of split s = blockIdx.y; grid (Hkv, n_split) fixed
// (one captured graph serves every position: splits past the current key leave at once), block 256.
// Warp w takes keys kb + 32w + lane of each 256-key pass kb (chunk is a multiple of 256): lane = key for
// the scores (its whole K row loaded to registers as 16-byte words up front, all G rows against it, q
// broadcast from shared memory), lane = output dims lane + 32i for P V (the warp's 32 V rows staged in
// its own shared tile by cp.async, issued before the scores; the probabilities shuffled from lane j).
// Each warp keeps a running (m, l, o) per row; the 8 warps merge through shared memory and the block
// writes the split's partial (o, m, l) for attention_combine. Needs Dh % 8 == 0.
// Dynamic shared memory: (G*Dh + 8*G*Dh + 16*G) * 4 + 8*32*Dh*2 bytes (G = 8, Dh = 128: 100.4 KB).
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

#define DEC_WARPS 8
#define DEC_PASS (DEC_WARPS * 32)
#define DEC_GMAX 8
#define DEC_WIDE_POS 2048

// STEP (attention_step_<mode>_npl<N>, the fused decode step): q is the QKV matvec's raw output and kv_src
// its K and V part; every block rotates its G query heads into shared memory itself, the block whose split
// holds position p rotates this token's K and stores K and V into the cache first (the old rope_store
// kernel), and the splits' results are merged by the last block of each KV head to finish (an atomic
// counter per KV head, reset by that block), or written directly when one split holds every key (the old
// attention_combine kernel). Two launches fewer per layer.
template <int NPL, bool STEP, bool NEOX>
__device__ __forceinline__ void attention_decode_body(const float* __restrict__ q, u16* kc, u16* vc,
                                                      const int* __restrict__ pos, int Hq, int Hkv, int Dh,
                                                      float scale, int chunk, float* part_o, float* part_ml,
                                                      const float* __restrict__ kv_src, int rope_dim,
                                                      const double* __restrict__ inv_freq, float attn,
                                                      unsigned int* counters, float* __restrict__ out, int early) {
    extern __shared__ float dsm[];
    __shared__ int s_last;
    const int G = Hq / Hkv, kvh = blockIdx.x, split = blockIdx.y;
    const int p = pos[0];
    // Query rows of this block: up to gridDim.z blocks share the KV head's G rows (r0 .. r0 + gn - 1): fewer
    // rows per lane is a shorter chain of dependent score/softmax/PV steps, at the price of re-reading the
    // split's K/V (from L2) once per block. That pays while few splits hold keys; from DEC_WIDE_POS on, the
    // splits give parallelism enough and one block per split takes all G rows (measured on the H100,
    // Qwen2.5-0.5B shape: at position 1000 one row per block 0.98 ms per step vs 1.12 all rows; at 8000
    // 1.67 vs 1.25).
    const int zs = p < DEC_WIDE_POS ? (int)gridDim.z : 1;
    if ((int)blockIdx.z >= zs) return;
    const int rg = (G + zs - 1) / zs, r0 = blockIdx.z * rg, gn = min(rg, G - r0);
    if (gn <= 0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int begin = split * chunk, end = min(begin + chunk, p + 1);
    if (begin >= end) return;  // whole block: this split is past the current position
    float* qs = dsm;                      // [gn][Dh], pre-scaled
    float* ro = qs + G * Dh;              // [8 warps][gn][Dh] per-warp o
    float* rml = ro + DEC_WARPS * G * Dh;  // [8 warps][gn][2] per-warp (m, l)
    // Start this split's K and V rows on their way to L2 while q is prepared.
    for (int j = threadIdx.x; j < end - begin; j += blockDim.x) {
        const long long off = ((long long)(begin + j) * Hkv + kvh) * Dh;
        for (int b = 0; b < Dh * 2; b += 128) {
            asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const u8*>(kc + off) + b));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const u8*>(vc + off) + b));
        }
    }
    pdl_wait();  // q, kv_src, the partials and the counters belong to earlier kernels of the step (the
                 // position and the cache rows before it do not)
    if (early) pdl_launch_dependents();
    if (STEP) {
        const int half = Dh / 2;
        for (int e = threadIdx.x; e < gn * half; e += blockDim.x) {
            const int r = e / half, i = e - r * half;
            int da, db;
            float oa, ob;
            rope_pair<NEOX>(q + (kvh * G + r0 + r) * Dh, i, Dh, rope_dim, p, inv_freq, attn, da, db, oa, ob);
            qs[r * Dh + da] = oa * scale;
            qs[r * Dh + db] = ob * scale;
        }
        if (end == p + 1) {  // this split holds the new token: its K (rotated) and V into the cache (every
                             // block of the split stores the same bits, so none reads a half-written row)
            for (int i = threadIdx.x; i < half; i += blockDim.x) {
                int da, db;
                float oa, ob;
                rope_pair<NEOX>(kv_src + kvh * Dh, i, Dh, rope_dim, p, inv_freq, attn, da, db, oa, ob);
                const long long at = ((long long)p * Hkv + kvh) * Dh;
                kc[at + da] = f2h(oa);
                kc[at + db] = f2h(ob);
                const float* v = kv_src + (Hkv + kvh) * Dh;
                vc[at + 2 * i] = f2h(v[2 * i]);
                vc[at + 2 * i + 1] = f2h(v[2 * i + 1]);
            }
        }
    } else {
        for (int e = threadIdx.x; e < gn * Dh; e += blockDim.x) qs[e] = q[(kvh * G + r0) * Dh + e] * scale;
    }
    __syncthreads();  // (also orders this block's cache stores before its loads of the same row)

    float m[DEC_GMAX], l[DEC_GMAX], acc[DEC_GMAX][NPL];
#pragma unroll
    for (int r = 0; r < DEC_GMAX; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < NPL; ++i) acc[r][i] = 0.0f;
    }
    const int n8 = Dh / 8;
    u16* vt = reinterpret_cast<u16*>(rml + DEC_WARPS * G * 2) + warp * 32 * Dh;  // this warp's V rows [32][Dh]
    for (int kb = begin + warp * 32; kb < end; kb += DEC_PASS) {
        const int key = kb + lane;
        const bool valid = key < end;
        // Issue every load of the pass at once: the warp's 32 V rows to its shared tile (cp.async, rows past
        // `end` zero-filled) and this lane's K row to registers; then one memory latency, not one per key.
        for (int e = lane; e < 32 * n8; e += 32) {
            const int j = e / n8, c = e - j * n8;
            const bool ok = kb + j < end;
            cp_async16(smem_addr(vt + j * Dh + c * 8), vc + ((long long)(ok ? kb + j : kb) * Hkv + kvh) * Dh + c * 8,
                       ok ? 16 : 0);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
        const uint4* kr = reinterpret_cast<const uint4*>(kc + ((long long)(valid ? key : kb) * Hkv + kvh) * Dh);
        uint4 kw[4 * NPL];
#pragma unroll
        for (int c = 0; c < 4 * NPL; ++c)
            if (c < n8) kw[c] = kr[c];
        // Scores of this lane's key against the G rows.
        float s[DEC_GMAX];
#pragma unroll
        for (int r = 0; r < DEC_GMAX; ++r) s[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < 4 * NPL; ++c) {
            if (c >= n8) break;
            const u32 w[4] = {kw[c].x, kw[c].y, kw[c].z, kw[c].w};
#pragma unroll
            for (int h = 0; h < 4; ++h) {
                const float k0 = h2f((u16)(w[h] & 0xffffu)), k1 = h2f((u16)(w[h] >> 16));
#pragma unroll
                for (int r = 0; r < DEC_GMAX; ++r) {
                    if (r < gn) {
                        const float2 qq = *reinterpret_cast<const float2*>(qs + r * Dh + 8 * c + 2 * h);
                        s[r] = fmaf(qq.x, k0, fmaf(qq.y, k1, s[r]));
                    }
                }
            }
        }
        float p[DEC_GMAX];
#pragma unroll
        for (int r = 0; r < DEC_GMAX; ++r) {
            if (r >= gn) break;
            const float sv = valid ? s[r] : -INFINITY;
            const float m_new = fmaxf(m[r], warp_max(sv));  // finite: lane 0's key kb < end
            const float alpha = __expf(m[r] - m_new);
            p[r] = __expf(sv - m_new);
            m[r] = m_new;
            l[r] = l[r] * alpha + warp_sum(p[r]);
#pragma unroll
            for (int i = 0; i < NPL; ++i) acc[r][i] *= alpha;
        }
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncwarp();
        // O += P V over the 32 keys (a key past `end` has p = 0 and a zero row).
#pragma unroll 8
        for (int j = 0; j < 32; ++j) {
            float vv[NPL];
#pragma unroll
            for (int i = 0; i < NPL; ++i) {
                const int d = lane + 32 * i;
                vv[i] = d < Dh ? h2f(vt[j * Dh + d]) : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < DEC_GMAX; ++r) {
                if (r >= gn) break;
                const float pj = __shfl_sync(FULL_MASK, p[r], j);
#pragma unroll
                for (int i = 0; i < NPL; ++i) acc[r][i] = fmaf(pj, vv[i], acc[r][i]);
            }
        }
        __syncwarp();  // the next pass refills vt
    }
    if (!early) pdl_launch_dependents();
    // Merge the 8 warps (a warp that saw no key has m = -inf and weight 0).
#pragma unroll
    for (int r = 0; r < DEC_GMAX; ++r) {
        if (r >= gn) break;
#pragma unroll
        for (int i = 0; i < NPL; ++i) {
            const int d = lane + 32 * i;
            if (d < Dh) ro[(warp * gn + r) * Dh + d] = acc[r][i];
        }
        if (lane == 0) {
            rml[2 * (warp * gn + r)] = m[r];
            rml[2 * (warp * gn + r) + 1] = l[r];
        }
    }
    __syncthreads();
    const int n_active = min((int)gridDim.y, (p + chunk) / chunk);  // splits holding keys: ceil((p+1)/chunk)
    for (int e = threadIdx.x; e < gn * Dh; e += blockDim.x) {
        const int r = e / Dh, d = e - r * Dh;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) M = fmaxf(M, rml[2 * (w * gn + r)]);
        float L = 0.0f, o = 0.0f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) {
            const float wt = __expf(rml[2 * (w * gn + r)] - M);
            L += rml[2 * (w * gn + r) + 1] * wt;
            o += ro[(w * gn + r) * Dh + d] * wt;
        }
        if (STEP && n_active == 1) {
            out[(kvh * G + r0 + r) * Dh + d] = o / L;
            continue;
        }
        const long long row = (long long)split * Hq + kvh * G + r0 + r;
        part_o[row * Dh + d] = o;
        if (d == 0) {
            part_ml[2 * row] = M;
            part_ml[2 * row + 1] = L;
        }
    }
    if (!STEP || n_active == 1) return;
    // The last block of this KV head to finish (of n_active x gridDim.z) merges the splits for all G rows
    // (attention_combine's math).
    __threadfence();
    __syncthreads();
    const int blocks = n_active * ((G + rg - 1) / rg);  // the blocks of this KV head that hold rows and keys
    if (threadIdx.x == 0) s_last = atomicAdd(counters + kvh, 1u) == (unsigned int)(blocks - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int e = threadIdx.x; e < G * Dh; e += blockDim.x) {
        const int r = e / Dh, d = e - r * Dh;
        const int h = kvh * G + r;
        float M = -INFINITY;
        for (int sp = 0; sp < n_active; ++sp) M = fmaxf(M, __ldcg(part_ml + 2 * (sp * Hq + h)));
        float L = 0.0f, o = 0.0f;
        for (int sp = 0; sp < n_active; ++sp) {
            const int row = sp * Hq + h;
            const float w = __expf(__ldcg(part_ml + 2 * row) - M);
            L += __ldcg(part_ml + 2 * row + 1) * w;
            o += __ldcg(part_o + (long long)row * Dh + d) * w;
        }
        out[h * Dh + d] = o / L;
    }
    if (threadIdx.x == 0) counters[kvh] = 0u;
}

#define ATTENTION_STEP_KERNEL(N, MODE, NEOX)                                                                 \
    extern "C" __global__ void __launch_bounds__(256, 1) attention_step_##MODE##_npl##N(                     \
        const float* qkv, u16* kc, u16* vc, const int* pos, int Hq, int Hkv, int Dh, float scale, int chunk,  \
        float* part_o, float* part_ml, const float* kv_src, int rope_dim, const double* inv_freq, float attn, \
        unsigned int* counters, float* out, int early) {                                                     \
        attention_decode_body<N, true, NEOX>(qkv, kc, vc, pos, Hq, Hkv, Dh, scale, chunk, part_o, part_ml,   \
                                             kv_src, rope_dim, inv_freq, attn, counters, out, early);        \
    }
#define ATTENTION_DECODE_KERNEL(N)                                                                           \
    extern "C" __global__ void __launch_bounds__(256, 1) attention_decode_npl##N(                            \
        const float* q, u16* kc, u16* vc, const int* pos, int Hq, int Hkv, int Dh, float scale,               \
        int chunk, float* part_o, float* part_ml) {                                                          \
        attention_decode_body<N, false, false>(q, kc, vc, pos, Hq, Hkv, Dh, scale, chunk, part_o, part_ml,   \
                                               nullptr, 0, nullptr, 1.0f, nullptr, nullptr, 0);              \
    }                                                                                                        \
    ATTENTION_STEP_KERNEL(N, normal, false)                                                                  \
    ATTENTION_STEP_KERNEL(N, neox, true)

ATTENTION_DECODE_KERNEL(1)
ATTENTION_DECODE_KERNEL(2)
ATTENTION_DECODE_KERNEL(3)
ATTENTION_DECODE_KERNEL(4)

extern "C" __global__ void attention_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                             const int* __restrict__ pos, int T, int Hq, int Dh, int n_split,
                                             int chunk, float* out, int out_stride) {
    const int row = blockIdx.x, t = row / Hq, h = row - t * Hq, d = threadIdx.x;
    const int n = min(n_split, (pos[t] + chunk) / chunk);  // splits that saw keys: ceil((pos+1)/chunk)
    const long long stride = (long long)T * Hq;
    float M = -INFINITY;
    for (int s = 0; s < n; ++s) M = fmaxf(M, part_ml[2 * (s * stride + row)]);
    float L = 0.0f, o = 0.0f;
    for (int s = 0; s < n; ++s) {
        const long long r = s * stride + row;
        const float w = __expf(part_ml[2 * r] - M);
        L += part_ml[2 * r + 1] * w;
        if (d < Dh) o += part_o[r * Dh + d] * w;
    }
    if (d < Dh) out[(long long)t * out_stride + h * Dh + d] = o / L;
}

extern "C" __global__ void kv_store(const float* k, int k_stride, const float* v, int v_stride, int T, int Hkv,
                                    int Dh, const int* pos, u16* kc, u16* vc) {
    const long long n = (long long)T * Hkv * Dh;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const int t = (int)(e / (Hkv * Dh));
        const int rest = (int)(e - (long long)t * Hkv * Dh);
        const long long dst = (long long)pos[t] * Hkv * Dh + rest;
        kc[dst] = f2h(k[(long long)t * k_stride + rest]);
        vc[dst] = f2h(v[(long long)t * v_stride + rest]);
    }
}

// ---- Prefill on tensor cores ----------------------------------------------------------------------------
// attention_tc_d<D>(...): the same math as attention_npl with n_split == 1, FlashAttention-2 style
// (Dao 2023) on mma.sync.m16n8k16 (fp16 inputs, fp32 accumulate; softmax in fp32 with exp2).
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
// Dynamic shared memory: stages x (K + V) x 64 x (D + 8) x 2 bytes + 16 (D = 64: 55.3 KB, 128: 69.6 KB).
// attention_tc16_d<D>: the same, output stored as fp16 (the fused prefill's O-projection GEMM input).
// Accuracy vs the fp32 reference: fp16 Q and P, |err| ~ 1e-3 at unit-variance inputs (tests: atol 4e-3,
// rtol 1e-2). The CUDA-core kernel above stays for decode, short chunks and head dims not a multiple of 16.

#define TC_WARPS 4
#define TC_BC 64
#define TC_STAGES(D) ((D) <= 64 ? 3 : 2)  // D = 128 at 3 stages (104 KB) fits 2 blocks per SM, not 3
#define TC_BR (TC_WARPS * 16)  // query rows per block


__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // upper half <- hi, lower <- lo
    return r;
}

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

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

template <int D, bool OUT16>
__device__ __forceinline__ void attention_tc_body(const u16* __restrict__ q, int q_stride,
                                                  const u16* __restrict__ kc, const u16* __restrict__ vc,
                                                  const int* __restrict__ pos, int T, int Hq, int Hkv,
                                                  void* __restrict__ out, int out_stride) {
    constexpr int NST = TC_STAGES(D);  // K/V tiles in flight
    constexpr int KS = D / 16;       // k16 steps over the head dim (S = Q K^T)
    constexpr int NO = D / 8;        // n8 tiles of the output row
    constexpr int NS = TC_BC / 8;    // n8 tiles of a score row
    constexpr int RS = D + 8;        // shared row stride in halves
    constexpr int CPR = D / 8;       // 16-byte chunks per key row
    constexpr u32 ONES = 0x3c003c00u;  // half2(1, 1): B operand of the row-sum MMA
    extern __shared__ __align__(16) u16 tc_smem[];
    u16* ks = tc_smem;                      // [NST][TC_BC][RS]
    u16* vs = ks + NST * TC_BC * RS;        // [NST][TC_BC][RS]
    int* s_kend = reinterpret_cast<int*>(vs + NST * TC_BC * RS);

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
    if (threadIdx.x == 0) *s_kend = 0;
    __syncthreads();
    if (lane == 0) atomicMax(s_kend, wmax + 1);
    __syncthreads();
    const int kend = *s_kend;  // keys [0, kend) hold every key a row of this block sees

    u32 qa[KS][4];
    load_q_frags<D>(qa, q, q_stride, tt, hh, T, tg);

    float o[NO][4], l[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY};

    const int n_tiles = (kend + TC_BC - 1) / TC_BC;
    auto load_tile = [&](int tile) {  // one cp.async group per call, empty past the last tile
        const int k0 = tile * TC_BC, buf = tile % NST;
        u16* kd = ks + buf * TC_BC * RS;
        u16* vd = vs + buf * TC_BC * RS;
        for (int e = threadIdx.x; tile < n_tiles && e < TC_BC * CPR; e += TC_WARPS * 32) {
            const int j = e / CPR, c = e - j * CPR, key = k0 + j;
            const bool ok = key < kend;
            const long long off = ((long long)(ok ? key : 0) * Hkv + kvh) * D + c * 8;
            cp_async16(smem_addr(kd + j * RS + c * 8), kc + off, ok ? 16 : 0);
            cp_async16(smem_addr(vd + j * RS + c * 8), vc + off, ok ? 16 : 0);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
#pragma unroll
    for (int i = 0; i < NST - 1; ++i) load_tile(i);

    // ldmatrix row addresses: lane supplies row lane % 8 of matrix mi = lane / 8.
    // K (plain): matrix mi = keys 8 (mi >> 1) + [0, 8) at dims 8 (mi & 1) + [0, 8) of a 16-key, 16-dim step:
    //   registers b0, b1 of n8 tile 2np and b0, b1 of tile 2np + 1.
    // V (transposed): matrix mi = keys 8 (mi & 1) + [0, 8) at dims 8 (mi >> 1) + [0, 8): b0, b1 of the
    //   output n8 tile 2nd and b0, b1 of tile 2nd + 1.
    const int mi = lane >> 3, r8 = lane & 7;
    const int koff = (((mi >> 1) << 3) + r8) * RS + ((mi & 1) << 3);
    const int voff = (((mi & 1) << 3) + r8) * RS + ((mi >> 1) << 3);

    for (int it = 0; it < n_tiles; ++it) {
        const int buf = it % NST, k0 = it * TC_BC;
        // Groups 0..it+1 are committed (group j = tile j): tile it has landed when at most one is pending.
        asm volatile("cp.async.wait_group %0;" ::"n"(NST - 2) : "memory");
        // Every thread's copies of tile it are visible, and every warp is done with tile it - 1, whose
        // buffer the next load refills.
        __syncthreads();
        load_tile(it + NST - 1);
        if (k0 <= wmax) {  // warp-uniform: some row of this warp sees a key of the tile
            const u32 kt = smem_addr(ks + buf * TC_BC * RS + koff);
            const u32 vt = smem_addr(vs + buf * TC_BC * RS + voff);
            float s[NS][4];
#pragma unroll
            for (int n = 0; n < NS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            // S = Q K^T: B (16 x 8, col-major) = K rows n*8 + g, dims 16k + 2tg (b0) and + 8 (b1).
#pragma unroll
            for (int k = 0; k < KS; ++k) {
#pragma unroll
                for (int np = 0; np < NS / 2; ++np) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4(kt + (u32)((np * 16 * RS + k * 16) * 2), b0, b1, b2, b3);
                    mma_16816(s[2 * np], qa[k], b0, b1);
                    mma_16816(s[2 * np + 1], qa[k], b2, b3);
                }
            }
            float alpha[2];
            tile_softmax<NS>(&s[0][0], m, alpha, qp, k0, wmin, tg);
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

    // l[c]: every column of the ones-MMA holds the full row sum (c = 0 row g, c = 2 row g + 8).
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
ATTENTION_TC_KERNEL(64)
ATTENTION_TC_KERNEL(80)
ATTENTION_TC_KERNEL(96)
ATTENTION_TC_KERNEL(112)
ATTENTION_TC_KERNEL(128)

// ---- Prefill on Hopper's warpgroup MMA (sm_90a only) -----------------------------------------------------
// attention_wg_d<D> / attention_wg16_d<D> (D = 64, 128): the contract of attention_tc*_d<D> (fp16 q times
// log2(e)/sqrt(D), f32 or fp16 output) with the caches given as TMA descriptors kmap / vmap instead of
// pointers (below), on wgmma.mma_async (m64nNk16, fp16 in, fp32 accumulate):
// twice mma.sync's tensor throughput on the H100, and asynchronous (B16 H32 T512 D64: 67 us vs 104 us).
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
#define WG_BC 64  // keys per tile
#define WG_STAGES(D) ((D) <= 64 ? 3 : 2)  // D = 128 at 3 stages (97 KB) fits 2 blocks per SM, not 3
#define WG_ONES(D) ((D) <= 64 ? 2048 : 256)  // bytes of fp16 ones: 16 swizzled rows of 64, or 16 x 8

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
