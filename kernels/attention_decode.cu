// attention_decode.cu: decode attention (one query token) with the keys spread over all 8 warps of a block,
// and its STEP form for the fused decode step (RoPE + K/V store + splits + their merge in one kernel).
//
// attention_decode_npl<N>(...): one query token (T == 1), its G = Hq / Hkv rows (G <= 8) of kv head
// blockIdx.x, keys [s*chunk, min((s+1)*chunk, pos[0]+1)) of split s = blockIdx.y; grid (Hkv, n_split) fixed
// (one captured graph serves every position: splits past the current key leave at once), block 256.
// Warp w takes keys kb + 32w + lane of each 256-key pass kb (chunk is a multiple of 256): lane = key for
// the scores (its whole K row loaded to registers as 16-byte words up front, all G rows against it, q
// broadcast from shared memory), lane = output dims lane + 32i for P V (the warp's 32 V rows staged in
// its own shared tile by cp.async, issued before the scores; the probabilities shuffled from lane j).
// Each warp keeps a running (m, l, o) per row; the 8 warps merge through shared memory and the block
// writes the split's partial (o, m, l) for attention_combine. Needs Dh % 8 == 0.
// Dynamic shared memory: (G*Dh + 8*G*Dh + 16*G) * 4 + 8*32*Dh*2 bytes (G = 8, Dh = 128: 100.4 KB; Dh = 256:
// 200.7 KB). attention_decode_w_npl<N> / attention_step_w_<mode>_npl<N> (..., window, softcap): gemma's
// sliding window and attention soft-cap (EXT below); npl8 serves Dh 256.
//
// STEP (attention_step_<mode>_npl<N>, the fused decode step): q is the QKV matvec's raw output and kv_src
// its K and V part; every block rotates its G query heads into shared memory itself, the block whose split
// holds position p rotates this token's K and stores K and V into the cache first, and the splits' results
// are merged by the last block of each KV head to finish (an atomic counter per KV head, reset by that
// block), or written directly when one split holds every key: one launch per layer where rope_store,
// attention_decode and attention_combine would take three. A programmatic dependent in the captured step:
// the K/V prefetch runs before pdl_wait, `early` as in mv1 (kernels/matvec.cu).

#include "attention_common.cuh"
#include "rope.cuh"

#define DEC_WARPS 8
#define DEC_PASS (DEC_WARPS * 32)
#define DEC_GMAX 8
#define DEC_WIDE_POS 2048

// EXT (the _w_ kernels): keys k > p - window only (0: all; the splits and keys before the window are not
// read) and scores soft-capped after the scale, s -> softcap tanh(s / softcap) (0: none); with sinks (gpt-oss,
// [Hq], or null) the step's final normalisation adds exp(sinks[h]) to each head's softmax denominator (the
// split-only form leaves that to attention_combine_w).
template <int NPL, bool STEP, bool NEOX, bool EXT = false>
__device__ __forceinline__ void attention_decode_body(const float* __restrict__ q, u16* kc, u16* vc,
                                                      const int* __restrict__ pos, int Hq, int Hkv, int Dh,
                                                      float scale, int chunk, float* part_o, float* part_ml,
                                                      const float* __restrict__ kv_src, int rope_dim,
                                                      const double* __restrict__ inv_freq, float attn,
                                                      unsigned int* counters, float* __restrict__ out, int early,
                                                      int window = 0, float softcap = 0.0f,
                                                      const float* __restrict__ sinks = nullptr) {
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
    const int lo = EXT && window > 0 ? max(0, p - window + 1) : 0;  // the first key of the window
    const int s_lo = lo / chunk;                                       // the first split holding one
    const int begin = max(split * chunk, lo), end = min(split * chunk + chunk, p + 1);
    if (begin >= end) return;  // whole block: this split is past the current position (or before the window)
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
        // Scores of this lane's key against the G rows; the K row in registers, KW 16-byte words at a time (the
        // whole row up to Dh 128; Dh 256 in two halves, 128 registers of K beside the accumulators would spill).
        constexpr int KW = 4 * NPL > 16 ? 16 : 4 * NPL;
        float s[DEC_GMAX];
#pragma unroll
        for (int r = 0; r < DEC_GMAX; ++r) s[r] = 0.0f;
#pragma unroll
        for (int c0 = 0; c0 < 4 * NPL; c0 += KW) {
            if (c0 >= n8) break;
            uint4 kw[KW];
#pragma unroll
            for (int c = 0; c < KW; ++c)
                if (c0 + c < n8) kw[c] = kr[c0 + c];
#pragma unroll
            for (int c = 0; c < KW; ++c) {
                if (c0 + c >= n8) break;
                const u32 w[4] = {kw[c].x, kw[c].y, kw[c].z, kw[c].w};
#pragma unroll
                for (int h = 0; h < 4; ++h) {
                    const float k0 = h2f((u16)(w[h] & 0xffffu)), k1 = h2f((u16)(w[h] >> 16));
#pragma unroll
                    for (int r = 0; r < DEC_GMAX; ++r) {
                        if (r < gn) {
                            const float2 qq = *reinterpret_cast<const float2*>(qs + r * Dh + 8 * (c0 + c) + 2 * h);
                            s[r] = fmaf(qq.x, k0, fmaf(qq.y, k1, s[r]));
                        }
                    }
                }
            }
        }
        if (EXT && softcap > 0.0f) {
#pragma unroll
            for (int r = 0; r < DEC_GMAX; ++r) s[r] = softcap * tanhf(s[r] / softcap);
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
    const int n_held = n_active - s_lo;                               // ... of the window: splits s_lo ..
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
        if (STEP && n_held == 1) {
            if (EXT && sinks) L += __expf(sinks[kvh * G + r0 + r] - M);
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
    if (!STEP || n_held == 1) return;
    // The last block of this KV head to finish (of n_active x gridDim.z) merges the splits for all G rows
    // (attention_combine's math).
    __threadfence();
    __syncthreads();
    const int blocks = n_held * ((G + rg - 1) / rg);  // the blocks of this KV head that hold rows and keys
    if (threadIdx.x == 0) s_last = atomicAdd(counters + kvh, 1u) == (unsigned int)(blocks - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int e = threadIdx.x; e < G * Dh; e += blockDim.x) {
        const int r = e / Dh, d = e - r * Dh;
        const int h = kvh * G + r;
        float M = -INFINITY;
        for (int sp = s_lo; sp < n_active; ++sp) M = fmaxf(M, __ldcg(part_ml + 2 * (sp * Hq + h)));
        float L = 0.0f, o = 0.0f;
        for (int sp = s_lo; sp < n_active; ++sp) {
            const int row = sp * Hq + h;
            const float w = __expf(__ldcg(part_ml + 2 * row) - M);
            L += __ldcg(part_ml + 2 * row + 1) * w;
            o += __ldcg(part_o + (long long)row * Dh + d) * w;
        }
        if (EXT && sinks) L += __expf(sinks[h] - M);
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

#define ATTENTION_STEP_W_KERNEL(N, MODE, NEOX)                                                               \
    extern "C" __global__ void __launch_bounds__(256, 1) attention_step_w_##MODE##_npl##N(                   \
        const float* qkv, u16* kc, u16* vc, const int* pos, int Hq, int Hkv, int Dh, float scale, int chunk,  \
        float* part_o, float* part_ml, const float* kv_src, int rope_dim, const double* inv_freq, float attn, \
        unsigned int* counters, float* out, int early, int window, float softcap, const float* sinks) {      \
        attention_decode_body<N, true, NEOX, true>(qkv, kc, vc, pos, Hq, Hkv, Dh, scale, chunk, part_o,      \
                                                   part_ml, kv_src, rope_dim, inv_freq, attn, counters, out, \
                                                   early, window, softcap, sinks);                           \
    }
#define ATTENTION_DECODE_W_KERNEL(N)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 1) attention_decode_w_npl##N(                          \
        const float* q, u16* kc, u16* vc, const int* pos, int Hq, int Hkv, int Dh, float scale,               \
        int chunk, float* part_o, float* part_ml, int window, float softcap) {                               \
        attention_decode_body<N, false, false, true>(q, kc, vc, pos, Hq, Hkv, Dh, scale, chunk, part_o,      \
                                                     part_ml, nullptr, 0, nullptr, 1.0f, nullptr, nullptr, 0, \
                                                     window, softcap);                                       \
    }                                                                                                        \
    ATTENTION_STEP_W_KERNEL(N, normal, false)                                                                \
    ATTENTION_STEP_W_KERNEL(N, neox, true)

ATTENTION_DECODE_KERNEL(1)
ATTENTION_DECODE_KERNEL(2)
ATTENTION_DECODE_KERNEL(3)
ATTENTION_DECODE_KERNEL(4)
ATTENTION_DECODE_KERNEL(8)
ATTENTION_DECODE_W_KERNEL(1)
ATTENTION_DECODE_W_KERNEL(2)
ATTENTION_DECODE_W_KERNEL(3)
ATTENTION_DECODE_W_KERNEL(4)
ATTENTION_DECODE_W_KERNEL(8)
