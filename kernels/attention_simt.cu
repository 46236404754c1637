// attention_simt.cu: causal grouped-query attention over the fp16 KV cache on CUDA cores, flash style (online
// softmax; the [T, ctx] score matrix never exists in global memory), and the two small kernels around it.
//
// Math: for query row (t, h), kv head g = h / G (G = Hq/Hkv), keys 0..pos[t]:
//   o = sum_j softmax_j(q . k_j / sqrt(Dh)) v_j,   running max m, running sum l, rescale by exp(m_old - m).
// Shapes: q rows [T, Hq, Dh] f32 with token stride q_stride floats; kc, vc = one layer's cache
//   [ctx, Hkv, Dh] fp16 (the _w forms: [ring, Hkv, Dh], see below); pos [T] i32 in device memory (so one
//   captured graph serves every position).
//
// attention_npl<N>(...): grid (ceil(T*G / 32), Hkv, n_split), block 256 = 8 warps, 32 query rows per block
//   (row r -> (t, h) = divmod(blockIdx.x*32 + r, G) within kv head blockIdx.y): the 32 rows share every
//   K/V tile, so a KV head is read once per group of query heads. Keys go in tiles of 32 through shared
//   memory (K as half2 with a one-word pad per key row: conflict-free when lane j reads key j; V as fp16).
//   Lane j scores key j against the row's q (broadcast from shared memory), the warp takes the tile max,
//   and each lane accumulates its N = ceil(Dh/32) output dims with the probabilities shuffled from lane j.
//   Split s covers keys [s*chunk, (s+1)*chunk): n_split == 1 writes o normalised (prefill); n_split > 1
//   writes partial (o, m, l) for attention_combine (flash-decoding: decode has one query row per head, so
//   the keys are what must spread over the SMs). Dynamic shared memory: 32*Dh*4 + 32*(Dh/2+1)*4 + 32*Dh*2
//   (N = 16, Dh up to 512, gemma4's global layers: 128 KiB, past the 48 KiB default: the loader raises it).
// attention_combine: grid T*Hq, block Dh rounded up to 32: merges the ceil((pos[t]+1)/chunk) partials.
// attention_w_npl<N>(..., n_split, window, softcap, sinks, ring) and attention_combine_w(..., window, sinks):
// the same with a sliding window (keys k > pos - window; 0: all) and soft-capped scores (gemma; see EXT
// below), attention sinks (gpt-oss: sinks [Hq] or null, exp(sinks[h]) added to each softmax denominator),
// over caches of `ring` rows [ring, Hkv, Dh]: position k at row k mod ring (ctx for a full cache; a
// sliding-window layer's ring is a multiple of 32, llamacli/models/kv_cache.py, so a tile's rows are contiguous).
// kv_store(..., kc, vc, ring): k, v [T, Hkv, Dh] f32 (token strides k_stride, v_stride) -> cache rows
// pos[t] mod ring as fp16.
// kv_store_q8(...): the same into an 8-bit cache (-ctk/-ctv q8_0: codes [ring, Hkv, Dh] then scales [Hkv, ring,
// Dh/32], attention_split.cu's layout), a warp per 32-value block (common.cuh quantize_q8_lane).
// kv_dequant_q8(kc, vc, ring, Hkv, Dh, pos, T, k16, v16): an 8-bit cache's rows up to the highest position in
// pos[0..T) (every row once that passes the ring) -> fp16 [ring, Hkv, Dh], the form the prefill kernels and
// this family read (cuda/attention.py readable).
// attention_batch_npl<N>, attention_combine_batch: the batched decode step's forms (one token of
// each of B sequences, each over its own cache slot; described where they are defined, below).
// The other families: attention_mma.cu (prefill chunks of >= 16 rows with D in {64, 80, 96, 112, 128}, tensor
// cores), attention_wgmma.cu (the same on a Hopper GPU with D 64 or 128, built for sm_90a) and
// attention_split.cu (decode with G <= 16 and those head dims or 256, and the fused decode step's attention).
// Best measured (B16 H32 T512 D64 causal; the figures are in docs/perf-log.md): this kernel (f32 q and out) is
// far slower than the tensor-core prefill kernels (attention_wg16_d64, attention_tc16_d64); it serves what they
// do not.

#include "attention_common.cuh"

// ATT_WARPS, ATT_RPW: llamacli/backends/cuda/constants.py (the loader puts them in front)
#define ATT_ROWS (ATT_WARPS * ATT_RPW)
#define ATT_TILE 32

// EXT (attention_w_npl<N>): keys k > pos - window only (window 0: all) and scores soft-capped,
// s -> softcap tanh(s / softcap) after the scale (0: none); the block reads no tile before its rows' windows.
template <int NPL, bool EXT = false>
__device__ __forceinline__ void attention_body(const float* __restrict__ q, int q_stride, const u16* __restrict__ kc,
                                               const u16* __restrict__ vc, const int* __restrict__ pos, int T,
                                               int Hq, int Hkv, int Dh, float scale, int chunk, float* out,
                                               int out_stride, float* part_o, float* part_ml, int n_split,
                                               int window = 0, float softcap = 0.0f,
                                               const float* __restrict__ sinks = nullptr, int ring = 0,
                                               int rb = -1) {
    extern __shared__ float smem[];
    if (rb < 0) rb = blockIdx.x;  // the block's group of ATT_ROWS query rows
    const int G = Hq / Hkv;
    const int kvh = blockIdx.y, split = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int half = Dh / 2, kw = half + 1;  // K row stride in 32-bit words (padded)
    float* qs = smem;                                                  // [ROWS][Dh]
    u32* ks = reinterpret_cast<u32*>(qs + ATT_ROWS * Dh);              // [TILE][kw]
    u16* vs = reinterpret_cast<u16*>(ks + ATT_TILE * kw);              // [TILE][Dh]
    __shared__ int s_kend, s_pmin;

    // Find the last key any of this block's rows may see (EXT: and the lowest row position); leave at once if
    // this split holds none of them (decode launches a fixed grid of splits, most of them past the current
    // position), then stage the query rows (pre-scaled).
    if (threadIdx.x == 0) s_kend = 0, s_pmin = 0x7fffffff;
    __syncthreads();
    if (threadIdx.x < ATT_ROWS) {
        const int t = (rb * ATT_ROWS + threadIdx.x) / G;
        if (t < T) atomicMax(&s_kend, pos[t] + 1);
        if (EXT && t < T) atomicMin(&s_pmin, pos[t]);
    }
    __syncthreads();
    const int begin = split * chunk;
    const int end = min(begin + chunk, s_kend);
    if (begin >= end) return;  // whole block uniform: nothing to do for this split
    // EXT with a window: the first 32-key tile of the split holding a key some row sees (>= end: none)
    const int first = EXT && window > 0 ? max(begin, max(0, s_pmin - window + 1) / ATT_TILE * ATT_TILE) : begin;
    for (int e = threadIdx.x; e < ATT_ROWS * Dh; e += blockDim.x) {
        const int r = e / Dh, d = e - r * Dh;
        const int gr = rb * ATT_ROWS + r, t = gr / G, h = kvh * G + gr % G;
        qs[e] = t < T ? q[(long long)t * q_stride + h * Dh + d] * scale : 0.0f;
    }
    __syncthreads();

    int qpos[ATT_RPW];
    float m[ATT_RPW], l[ATT_RPW], acc[ATT_RPW][NPL];
#pragma unroll
    for (int rr = 0; rr < ATT_RPW; ++rr) {
        const int gr = rb * ATT_ROWS + rr * ATT_WARPS + warp, t = gr / G;
        qpos[rr] = t < T ? pos[t] : -1;
        m[rr] = -INFINITY;
        l[rr] = 0.0f;
#pragma unroll
        for (int i = 0; i < NPL; ++i) acc[rr][i] = 0.0f;
    }

    for (int kt = first; kt < end; kt += ATT_TILE) {
        // K and V tile: 32 keys x Dh fp16, 32-bit words; keys past `end` are zero (masked below anyway).
        const int r0 = EXT ? kt % ring : kt;  // key kt's cache row
        for (int e = threadIdx.x; e < ATT_TILE * half; e += blockDim.x) {
            const int j = e / half, d2 = e - j * half, key = kt + j;
            u32 kv = 0, vv = 0;
            if (key < end) {
                const long long off = ((long long)(r0 + j) * Hkv + kvh) * Dh + 2 * d2;
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
            if (EXT && window > 0 && min(kt + ATT_TILE, end) - 1 <= qpos[rr] - window) continue;  // nor here
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
            if (EXT && softcap > 0.0f) s = softcap * tanhf(s / softcap);
            if (key >= end || key > qpos[rr] || (EXT && window > 0 && key <= qpos[rr] - window)) s = -INFINITY;
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
        const int gr = rb * ATT_ROWS + rr * ATT_WARPS + warp, t = gr / G, h = kvh * G + gr % G;
        if (t >= T || qpos[rr] < begin) continue;
        const float lt = warp_sum(l[rr]);
        if (n_split == 1) {
            const float inv = 1.0f / (EXT && sinks ? lt + __expf(sinks[h] - m[rr]) : lt);
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
ATTENTION_KERNEL(16)  // (Dh up to 512: gemma4's global layers, op by op)

#define ATTENTION_W_KERNEL(N)                                                                                \
    extern "C" __global__ void __launch_bounds__(256) attention_w_npl##N(                                   \
        const float* q, int q_stride, const u16* kc, const u16* vc, const int* pos, int T, int Hq, int Hkv,   \
        int Dh, float scale, int chunk, float* out, int out_stride, float* part_o, float* part_ml,            \
        int n_split, int window, float softcap, const float* sinks, int ring) {                              \
        attention_body<N, true>(q, q_stride, kc, vc, pos, T, Hq, Hkv, Dh, scale, chunk, out, out_stride,      \
                                part_o, part_ml, n_split, window, softcap, sinks, ring);                     \
    }
ATTENTION_W_KERNEL(1)
ATTENTION_W_KERNEL(2)
ATTENTION_W_KERNEL(3)
ATTENTION_W_KERNEL(4)
ATTENTION_W_KERNEL(8)
ATTENTION_W_KERNEL(16)

template <bool EXT>
__device__ __forceinline__ void combine_body(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                             const int* __restrict__ pos, int T, int Hq, int Dh, int n_split,
                                             int chunk, float* out, int out_stride, int window,
                                             const float* __restrict__ sinks, int row = -1) {
    if (row < 0) row = blockIdx.x;
    const int t = row / Hq, h = row - t * Hq, d = threadIdx.x;
    const int n = min(n_split, (pos[t] + chunk) / chunk);  // splits that saw keys: ceil((pos+1)/chunk)
    // EXT: the first split holding a key of the window (the ones before wrote nothing)
    const int s0 = EXT && window > 0 ? max(0, pos[t] - window + 1) / chunk : 0;
    const long long stride = (long long)T * Hq;
    float M = -INFINITY;
    for (int s = s0; s < n; ++s) M = fmaxf(M, part_ml[2 * (s * stride + row)]);
    float L = 0.0f, o = 0.0f;
    for (int s = s0; s < n; ++s) {
        const long long r = s * stride + row;
        const float w = __expf(part_ml[2 * r] - M);
        L += part_ml[2 * r + 1] * w;
        if (d < Dh) o += part_o[r * Dh + d] * w;
    }
    if (EXT && sinks) L += __expf(sinks[h] - M);
    if (d < Dh) out[(long long)t * out_stride + h * Dh + d] = o / L;
}

extern "C" __global__ void attention_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                             const int* __restrict__ pos, int T, int Hq, int Dh, int n_split,
                                             int chunk, float* out, int out_stride) {
    combine_body<false>(part_o, part_ml, pos, T, Hq, Dh, n_split, chunk, out, out_stride, 0, nullptr);
}

// attention_combine_w(..., out_stride, window, sinks): the merge of attention_w_npl splits
// (sinks [Hq] or null: exp(sinks[h]) joins the denominator, gpt-oss).
extern "C" __global__ void attention_combine_w(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                               const int* __restrict__ pos, int T, int Hq, int Dh, int n_split,
                                               int chunk, float* out, int out_stride, int window,
                                               const float* sinks) {
    combine_body<true>(part_o, part_ml, pos, T, Hq, Dh, n_split, chunk, out, out_stride, window, sinks);
}

// The batched decode step (cuda/batch.py): B sequences, one query token each, each in its own cache slot.
// attention_batch_npl<N>(q, q_stride, kt, vt, slot, pos, B, Hq, Hkv, Dh, scale, chunk, out, out_stride, part_o,
//   part_ml, n_split, window, softcap, sinks, ring): grid (B * ceil(G / ATT_ROWS), Hkv, n_split); block x -> the
//   sequence b = x / ceil(G / ATT_ROWS) and its group of query rows; row b's cache is kt[slot[b]], vt[slot[b]]
//   (device addresses of each slot's [ring, Hkv, Dh] fp16 arrays for this layer), its keys 0..pos[b] (window,
//   soft-cap, sinks and ring as attention_w_npl). Partials per sequence: part_o [B][n_split][Hq][Dh], part_ml
//   [B][n_split][Hq][2]; attention_combine_batch merges them (grid B * Hq).
#define ATTENTION_BATCH_KERNEL(N)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) attention_batch_npl##N(                               \
        const float* q, int q_stride, const unsigned long long* kt, const unsigned long long* vt,             \
        const int* slot, const int* pos, int B, int Hq, int Hkv, int Dh, float scale, int chunk, float* out,   \
        int out_stride, float* part_o, float* part_ml, int n_split, int window, float softcap,                \
        const float* sinks, int ring) {                                                                      \
        const int groups = (Hq / Hkv + ATT_ROWS - 1) / ATT_ROWS;                                              \
        const int b = blockIdx.x / groups, rb = blockIdx.x - b * groups;                                      \
        if (b >= B) return;                                                                                   \
        const u16* kc = reinterpret_cast<const u16*>(kt[slot[b]]);                                           \
        const u16* vc = reinterpret_cast<const u16*>(vt[slot[b]]);                                           \
        const long long po = (long long)b * n_split * Hq;                                                     \
        attention_body<N, true>(q + (long long)b * q_stride, q_stride, kc, vc, pos + b, 1, Hq, Hkv, Dh, scale, \
                                chunk, out + (long long)b * out_stride, out_stride,                           \
                                part_o ? part_o + po * Dh : nullptr, part_ml ? part_ml + 2 * po : nullptr,    \
                                n_split, window, softcap, sinks, ring, rb);                                   \
    }
ATTENTION_BATCH_KERNEL(1)
ATTENTION_BATCH_KERNEL(2)
ATTENTION_BATCH_KERNEL(3)
ATTENTION_BATCH_KERNEL(4)
ATTENTION_BATCH_KERNEL(8)

extern "C" __global__ void attention_combine_batch(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                   const int* __restrict__ pos, int B, int Hq, int Dh, int n_split,
                                                   int chunk, float* out, int out_stride, int window,
                                                   const float* sinks) {
    const int b = blockIdx.x / Hq, h = blockIdx.x - b * Hq;
    const long long po = (long long)b * n_split * Hq;
    combine_body<true>(part_o + po * Dh, part_ml + 2 * po, pos + b, 1, Hq, Dh, n_split, chunk,
                       out + (long long)b * out_stride, out_stride, window, sinks, h);
}

extern "C" __global__ void kv_store(const float* k, int k_stride, const float* v, int v_stride, int T, int Hkv,
                                    int Dh, const int* pos, u16* kc, u16* vc, int ring) {
    const long long n = (long long)T * Hkv * Dh;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const int t = (int)(e / (Hkv * Dh));
        const int rest = (int)(e - (long long)t * Hkv * Dh);
        const long long dst = (long long)(pos[t] % ring) * Hkv * Dh + rest;
        kc[dst] = f2h(k[(long long)t * k_stride + rest]);
        vc[dst] = f2h(v[(long long)t * v_stride + rest]);
    }
}

extern "C" __global__ void kv_store_q8(const float* k, int k_stride, const float* v, int v_stride, int T, int Hkv,
                                       int Dh, const int* pos, u8* kc, u8* vc, int ring) {
    const int nsc = Dh / 32, lane = threadIdx.x & 31;
    const long long blocks = (long long)T * Hkv * nsc;  // 32-value blocks per cache
    const long long nw = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long w = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5; w < 2 * blocks; w += nw) {
        const bool isv = w >= blocks;
        const long long b = isv ? w - blocks : w;
        const int t = (int)(b / (Hkv * nsc)), rest = (int)(b - (long long)t * Hkv * nsc);
        const int h = rest / nsc, c = rest - h * nsc, row = pos[t] % ring;
        const float x = isv ? v[(long long)t * v_stride + h * Dh + c * 32 + lane]
                            : k[(long long)t * k_stride + h * Dh + c * 32 + lane];
        u8 code;
        u16 d;
        quantize_q8_lane(x, code, d);
        u8* cache = isv ? vc : kc;
        cache[((long long)row * Hkv + h) * Dh + c * 32 + lane] = code;
        if (lane == 0) reinterpret_cast<u16*>(cache + (long long)ring * Hkv * Dh)[((long long)h * ring + row) * nsc + c] = d;
    }
}

extern "C" __global__ void kv_dequant_q8(const u8* kc, const u8* vc, int ring, int Hkv, int Dh, const int* pos, int T,
                                         u16* k16, u16* v16) {
    float hi = -1.0f;
    for (int i = threadIdx.x; i < T; i += blockDim.x) hi = fmaxf(hi, (float)pos[i]);
    const long long n = min((long long)ring, (long long)block_max(hi) + 1);  // rows to convert
    const int nsc = Dh / 32;
    const long long units = n * Hkv * Dh / 8, row_len = (long long)Hkv * Dh;
    const u16* ks = reinterpret_cast<const u16*>(kc + (long long)ring * row_len);
    const u16* vs = reinterpret_cast<const u16*>(vc + (long long)ring * row_len);
    for (long long u = blockIdx.x * (long long)blockDim.x + threadIdx.x; u < units; u += (long long)gridDim.x * blockDim.x) {
        const long long e = u * 8, row = e / row_len;
        const int rest = (int)(e - row * row_len), h = rest / Dh, c = rest - h * Dh;
        const long long si = ((long long)h * ring + row) * nsc + c / 32;
        *reinterpret_cast<uint4*>(k16 + e) = dequant8_q8(*reinterpret_cast<const uint2*>(kc + e), ks[si]);
        *reinterpret_cast<uint4*>(v16 + e) = dequant8_q8(*reinterpret_cast<const uint2*>(vc + e), vs[si]);
    }
}
