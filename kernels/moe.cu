// moe.cu: the mixture-of-experts FFN (qwen3moe, gpt-oss; gemma4's GeGLU experts op by op: the _geglu forms): routing, grouping tokens by expert, the experts'
// matvecs reading the chosen experts' GGUF blocks in place, and the weighted sum. Compiled only for models
// with experts (cuda.moe.moe_family_needed).
//
// Shapes: E experts, k chosen per token, T tokens, P = T k (token, slot) pairs, pair p = t k + j. An expert
// tensor is one [E * rows, cols] matrix of GGUF rows, expert e's rows at e * expert_bytes.
//
//   moe_route_f32(logits [T, E], T, E, k, gating, norm, ids [P], wts [P])
//       llamacli/models/moe.py route(): gating 0 ("softmax": softmax over all E, the k largest, renormalised to sum 1
//       when norm) or 1 ("topk_softmax": the k largest logits, softmax over them); ties to the lower id,
//       experts in descending order. A block of 32 per token (grid T): route_block. Selection compares logits
//       (softmax keeps their order), so it matches the reference wherever the logits are not tied.
//   mv1_route_<t>(w, E, K, x, logits, bias, norm_w, eps, k, gating, norm, done, ids, wts), t = f32 / f16 /
//       bf16: the decode step's router, one launch of ceil(E / 8) blocks of 256 threads, mv1_smem bytes: the
//       logits of x RMS-normalised (a warp a row, the row's 16-byte chunks across its lanes), then the block
//       that finishes last (`done`: a zeroed counter it resets) routes them as moe_route_f32 does
//       (route_block, 256 threads).
//   moe_group(ids [P], P, E, tile, list [P], items [3 * max_items], n_items [1])
//       the pairs grouped by expert: list holds pair ids, expert by expert (in any order within one);
//       items (e, start, count) cut each expert's pairs into tiles of at most `tile` (MATVEC_TMAX for
//       matvec_moe, MG_BM for moe_gemm); n_items the number of items. One block of 1024 threads; E <= MOE_EMAX.
//   matvec_moe_<t>(w, expert_bytes, list, items, n_items, k, N, K, x, x_per_pair, y, bias, lpr)
//   matvec_moe_<t>_swiglu / _oai / _geglu(wg, wu, expert_bytes, list, items, n_items, k, N, K, x, y, bg, bu, lpr)
//       matvec_<t>'s body for one item per blockIdx.y: expert e's rows times the x rows of its pairs (token
//       t = p / k, or pair p itself when x_per_pair: the down projection's input) -> y rows p [P, N]; biases
//       [E, N] taken at row e. Grid (row blocks as matvec_<t>, max_items); blocks past n_items return.
//   mv1_moe_<t>_sum(w, expert_bytes, ids, N, K, x [k, K], y [k, N], bias, lpr, groups, early, wts [k], out [N],
//                   cnt): the down projection of one token: mv1_<t>'s body for slot j = blockIdx.y, expert
//                   ids[j], x row j -> y row j; then the last block of each row range adds out += sum_j wts[j]
//                   y[j] (moe_combine_f32 for one token; cnt: a zeroed counter per row range, reset by it)
//   mv1_moe_<t>_swiglu / _oai(wg, wu, expert_bytes, ids, N, K, x [K], y [k, N], norm_w, eps, lpr, groups,
//                             bg, bu, early)
//       one token (the decode step's gate/up): mv1_<t>'s body for slot j = blockIdx.y, expert ids[j], x
//       normalised with norm_w first as mv1 does.
//   moe_gemm_<t>(w, expert_bytes, list, items, n_items, k, N, K, x16, xsc, x_per_pair, y, bias)
//   moe_gemm_<t>_swiglu / _oai / _geglu(wg, wu, expert_bytes, list, items, n_items, k, N, K, x16, xsc, y, bg, bu)
//       many tokens (prefill): matvec_moe's results on tensor cores (mma.sync m16n8k16, fp16 in, fp32 sums)
//       for items of up to MG_BM pairs: x16 fp16 rows (tokens, or pairs when x_per_pair) times their row
//       scale xsc, expert e's weight rows decoded unit by unit into shared memory as fp16. A block computes
//       MG_BM pairs x MG_BN weight rows (the GLU forms: MG_BN / 2 gate rows and the same up rows, so the
//       activation is applied in the epilogue). Grid (ceil(N / columns per block), max_items); K % 32 == 0.
//   moe_combine_f32(y [P, N], wts [P], x [T, N], T, N, k): x[t] += sum_j wts[t k + j] y[t k + j].

#define MATVEC_BODIES_ONLY
#include "matvec.cu"
#include "attention_common.cuh"

// MOE_EMAX, MOE_KMAX: llamacli/backends/cuda/constants.py (the loader puts them in front)

// One token's routing by a block (every thread of it calls this, blockDim a multiple of 32): the row's E
// logits -> ids[0..k), wts[0..k). Each logit's rank (larger first, the lower id on ties, NaN as -inf) is
// counted against the whole row at once, not by k passes of warp reductions, which measured slow in
// Qwen3-30B-A3B's decode router (128 experts, 8 chosen; docs/perf-log.md). The row is read through L2
// (mv1_route: written by other blocks of the same kernel).
__device__ __forceinline__ void route_block(const float* row, int E, int k, int gating, int norm, int* ids,
                                            float* wts) {
    __shared__ float4 v4[MOE_EMAX / 4];  // the row, padded with -inf to whole float4s (pads never rank ahead)
    __shared__ float s_top[MOE_KMAX];
    __shared__ int s_sel[MOE_KMAX];
    float* v = reinterpret_cast<float*>(v4);
    const int n4 = (E + 3) >> 2;
    for (int e = threadIdx.x; e < 4 * n4; e += blockDim.x) {
        const float x = e < E ? __ldcg(row + e) : -INFINITY;  // written by the other blocks: through L2
        v[e] = x != x ? -INFINITY : x;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const float x = v[e];
        int r = 0;  // logits ahead of e: larger, or equal with a lower id (pads: -inf at ids past E)
#pragma unroll 4
        for (int f4 = 0; f4 < n4; ++f4) {
            const float4 y = v4[f4];
            const int f = 4 * f4;
            r += (y.x > x || (y.x == x && f < e)) + (y.y > x || (y.y == x && f + 1 < e)) +
                 (y.z > x || (y.z == x && f + 2 < e)) + (y.w > x || (y.w == x && f + 3 < e));
        }
        if (r < k) {  // ranks are distinct: one writer per slot
            s_top[r] = x;
            s_sel[r] = e;
        }
    }
    __syncthreads();
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    const float mx = s_top[0];  // the largest logit
    __syncwarp();                // (read by every lane before lane 0 overwrites it below)
    float sum = 0.0f;
    if (gating == 0) {  // softmax over every expert: its denominator
        for (int e = lane; e < E; e += 32) sum += __expf(v[e] - mx);
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
    }
    if (lane < k) s_top[lane] = gating == 0 ? __expf(s_top[lane] - mx) / sum : __expf(s_top[lane] - mx);
    __syncwarp();
    float s = 0.0f;
    for (int j = 0; j < k; ++j) s += s_top[j];  // every lane the same sum, in one order
    const float inv = gating == 1 || norm ? 1.0f / s : 1.0f;
    if (lane < k) {
        ids[lane] = s_sel[lane];
        wts[lane] = s_top[lane] * inv;
    }
}

extern "C" __global__ void moe_route_f32(const float* __restrict__ logits, int T, int E, int k, int gating,
                                         int norm, int* __restrict__ ids, float* __restrict__ wts) {
    const int t = blockIdx.x;
    if (t >= T) return;
    pdl_wait();  // the logits come from the router's matvec
    route_block(logits + (long long)t * E, E, k, gating, norm, ids + t * k, wts + t * k);
}

// The decode step's router logits of one token: one warp a row, its lanes reading the row's 16-byte chunks
// lane, lane + 32, ... so that a warp's load is 512 contiguous bytes (mv1's lane-per-32-value-unit layout
// spreads one F32 load over 32 lines, and read Qwen3-30B-A3B's 1 MB of rows far below memory speed:
// docs/perf-log.md); x is normalised and staged as mv1 stages it; logits[n] = row n . x (+ bias[n]).
template <class Q>
__device__ __forceinline__ void route_logits(const u8* w, int E, int K, const float* x, float* logits,
                                             const float* bias, const float* norm_w, float eps) {
    extern __shared__ float4 xs4[];
    constexpr int C = 16 / Q::BYTES;  // values per 16-byte chunk
    const int lane = threadIdx.x & 31;
    const int n = (int)blockIdx.x * (int)(blockDim.x >> 5) + (int)(threadIdx.x >> 5);
    const long long row_bytes = (long long)K * Q::BYTES;
    const u8* row = w + n * row_bytes;
    if (n < E)  // the row on its way to L2 while the previous kernel runs (weights only: before pdl_wait)
        for (long long off = lane * 128ll; off < row_bytes; off += 32 * 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
    pdl_wait();  // x comes from the step's previous kernels
    stage_x<false>(x, K, norm_w, eps, xs4);
    float acc = 0.0f;
    if (n < E) {
        if (K % C == 0) {  // whole 16-byte chunks (and rows at 16-byte offsets)
            const uint4* r4 = reinterpret_cast<const uint4*>(row);
#pragma unroll 8
            for (int c = lane; c < K / C; c += 32) {
                const uint4 q = __ldg(r4 + c);
                const u32 wd[4] = {q.x, q.y, q.z, q.w};
                if constexpr (Q::BYTES == 4) {
                    const float4 xv = xs4[xslot(c >> 3, c & 7)];
                    acc = fmaf(__uint_as_float(wd[0]), xv.x, acc);
                    acc = fmaf(__uint_as_float(wd[1]), xv.y, acc);
                    acc = fmaf(__uint_as_float(wd[2]), xv.z, acc);
                    acc = fmaf(__uint_as_float(wd[3]), xv.w, acc);
                } else {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int j = 2 * c + h;
                        const float4 xv = xs4[xslot(j >> 3, j & 7)];
                        acc = fmaf(Q::cvt(wd[2 * h] & 0xffffu), xv.x, acc);
                        acc = fmaf(Q::cvt(wd[2 * h] >> 16), xv.y, acc);
                        acc = fmaf(Q::cvt(wd[2 * h + 1] & 0xffffu), xv.z, acc);
                        acc = fmaf(Q::cvt(wd[2 * h + 1] >> 16), xv.w, acc);
                    }
                }
            }
        } else {
            const float* xf = reinterpret_cast<const float*>(xs4);
            for (int i = lane; i < K; i += 32) {
                const int j = i >> 2;
                float wv;
                if constexpr (Q::BYTES == 4)
                    wv = __ldg(reinterpret_cast<const float*>(row) + i);
                else
                    wv = Q::cvt(__ldg(reinterpret_cast<const u16*>(row) + i));
                acc = fmaf(wv, xf[4 * xslot(j >> 3, j & 7) + (i & 3)], acc);
            }
        }
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(FULL_MASK, acc, o);
    if (n < E && lane == 0) logits[n] = bias ? acc + bias[n] : acc;
    pdl_launch_dependents();
}

// The decode step's router: the logits of one token (route_logits), then the last block to finish ranks them
// (route_block) and resets `done` for the next step: one launch instead of two. Grid ceil(E / warps a block).
template <class Q>
__device__ __forceinline__ void mv1_route_body(const u8* w, int E, int K, const float* x, float* logits,
                                               const float* bias, const float* norm_w, float eps, int k,
                                               int gating, int norm, unsigned int* done, int* ids, float* wts) {
    route_logits<Q>(w, E, K, x, logits, bias, norm_w, eps);
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    route_block(logits, E, k, gating, norm, ids, wts);
    if (threadIdx.x == 0) *done = 0u;
}

#define MV1_ROUTE_KERNEL(name, Q)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) mv1_route_##name(                                     \
        const u8* w, int E, int K, const float* x, float* logits, const float* bias, const float* norm_w,     \
        float eps, int k, int gating, int norm, unsigned int* done, int* ids, float* wts) {                  \
        mv1_route_body<Q>(w, E, K, x, logits, bias, norm_w, eps, k, gating, norm, done, ids, wts);           \
    }
MV1_ROUTE_KERNEL(f32, QF32)
MV1_ROUTE_KERNEL(f16, QF16)
MV1_ROUTE_KERNEL(bf16, QBF16)

extern "C" __global__ void __launch_bounds__(1024) moe_group(const int* __restrict__ ids, int P, int E, int tile,
                                                             int* __restrict__ list, int* __restrict__ items,
                                                             int* __restrict__ n_items) {
    __shared__ int count[MOE_EMAX], start[MOE_EMAX], fill[MOE_EMAX];
    pdl_wait();
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = fill[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) atomicAdd(&count[ids[p]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {  // offsets and the tiles of every expert (E small: one thread)
        int at = 0, n = 0;
        for (int e = 0; e < E; ++e) {
            start[e] = at;
            for (int c = 0; c < count[e]; c += tile) {
                items[3 * n] = e;
                items[3 * n + 1] = at + c;
                items[3 * n + 2] = min(tile, count[e] - c);
                ++n;
            }
            at += count[e];
        }
        *n_items = n;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const int e = ids[p];
        list[start[e] + atomicAdd(&fill[e], 1)] = p;
    }
}

// The rows of one item: xrow / yrow of its pairs in shared memory; false when the block has no item.
__device__ __forceinline__ bool moe_item(const int* __restrict__ list, const int* __restrict__ items,
                                         const int* __restrict__ n_items, int k, bool x_per_pair, int* xrow,
                                         int* yrow, int& e, int& cnt) {
    const int it = blockIdx.y;
    pdl_wait();  // the tiles come from moe_group
    if (it >= *n_items) return false;
    e = items[3 * it];
    const int s = items[3 * it + 1];
    cnt = items[3 * it + 2];
    if (threadIdx.x < cnt) {
        const int p = list[s + threadIdx.x];
        xrow[threadIdx.x] = x_per_pair ? p : p / k;
        yrow[threadIdx.x] = p;
    }
    __syncthreads();
    return true;
}

template <class Q>
__device__ __forceinline__ void matvec_moe_plain(const u8* w, long long eb, const int* list, const int* items,
                                                 const int* n_items, int k, int N, int K, const float* x,
                                                 int x_per_pair, float* y, const float* bias, int lpr) {
    __shared__ int xrow[MATVEC_TMAX], yrow[MATVEC_TMAX];
    int e, cnt;
    if (!moe_item(list, items, n_items, k, x_per_pair != 0, xrow, yrow, e, cnt)) return;
    matvec_body<Q, false>(w + e * eb, nullptr, nullptr, N, 0, N, K, x, cnt, y, bias ? bias + (long long)e * N : nullptr,
                          nullptr, lpr, xrow, yrow);
}

template <class Q, int ACT>
__device__ __forceinline__ void matvec_moe_glu(const u8* wg, const u8* wu, long long eb, const int* list,
                                               const int* items, const int* n_items, int k, int N, int K,
                                               const float* x, float* y, const float* bg, const float* bu,
                                               int lpr) {
    __shared__ int xrow[MATVEC_TMAX], yrow[MATVEC_TMAX];
    int e, cnt;
    if (!moe_item(list, items, n_items, k, false, xrow, yrow, e, cnt)) return;
    matvec_body<Q, true, ACT>(wg + e * eb, wu + e * eb, nullptr, N, 0, N, K, x, cnt, y,
                              bg ? bg + (long long)e * N : nullptr, bu ? bu + (long long)e * N : nullptr, lpr,
                              xrow, yrow);
}

template <class Q, int ACT>
__device__ __forceinline__ void mv1_moe_glu(const u8* wg, const u8* wu, long long eb, const int* ids, int N, int K,
                                            const float* x, float* y, const float* norm_w, float eps, int lpr,
                                            int groups, const float* bg, const float* bu, int early) {
    pdl_wait();  // the ids come from the route kernel: before mv1's weight prefetch
    const int j = blockIdx.y, e = ids[j];
    mv1_body<Q, Q, true, ACT>(wg + e * eb, wu + e * eb, nullptr, N, 0, N, K, x, y + (long long)j * N,
                              bg ? bg + (long long)e * N : nullptr, bu ? bu + (long long)e * N : nullptr, norm_w,
                              eps, lpr, groups, nullptr, early);
}

// The decode step's down projection with the weighted sum: slot j = blockIdx.y's rows as mv1_moe_<t>, into
// y [k, N]; the last of the k blocks of a row range to finish (cnt [gridDim.x], zero between steps, reset by
// it) adds x[n] += sum_j wts[j] y[j, n] for its rows, in slot order: moe_combine_f32's sums, one launch fewer.
template <class Q>
__device__ __forceinline__ void mv1_moe_sum(const u8* w, long long eb, const int* ids, int N, int K, const float* x,
                                            float* y, const float* bias, int lpr, int groups, int early,
                                            const float* wts, float* out, unsigned int* cnt) {
    pdl_wait();
    const int j = blockIdx.y, e = ids[j];
    mv1_body<Q, Q, false>(w + e * eb, nullptr, nullptr, N, 0, N, K, x + (long long)j * K, y + (long long)j * N,
                          bias ? bias + (long long)e * N : nullptr, nullptr, nullptr, 0.0f, lpr, groups, nullptr,
                          early);
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(cnt + blockIdx.x, 1u) == gridDim.y - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const int rows = groups * (int)(blockDim.x >> 5) * (32 / lpr), n0 = (int)blockIdx.x * rows;
    for (int n = n0 + (int)threadIdx.x; n < min(N, n0 + rows); n += blockDim.x) {
        float s = 0.0f;
        for (int i = 0; i < (int)gridDim.y; ++i) s = fmaf(wts[i], __ldcg(y + (long long)i * N + n), s);
        out[n] += s;
    }
    if (threadIdx.x == 0) cnt[blockIdx.x] = 0u;
}

#define MOE_KERNELS(name, Q)                                                                                 \
    extern "C" __global__ void __launch_bounds__(128) matvec_moe_##name(                                    \
        const u8* w, long long eb, const int* list, const int* items, const int* n_items, int k, int N, int K, \
        const float* x, int x_per_pair, float* y, const float* bias, int lpr) {                              \
        matvec_moe_plain<Q>(w, eb, list, items, n_items, k, N, K, x, x_per_pair, y, bias, lpr);              \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) matvec_moe_##name##_swiglu(                           \
        const u8* wg, const u8* wu, long long eb, const int* list, const int* items, const int* n_items,     \
        int k, int N, int K, const float* x, float* y, const float* bg, const float* bu, int lpr) {          \
        matvec_moe_glu<Q, ACT_SILU>(wg, wu, eb, list, items, n_items, k, N, K, x, y, bg, bu, lpr);                \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) matvec_moe_##name##_oai(                              \
        const u8* wg, const u8* wu, long long eb, const int* list, const int* items, const int* n_items,     \
        int k, int N, int K, const float* x, float* y, const float* bg, const float* bu, int lpr) {          \
        matvec_moe_glu<Q, ACT_OAI>(wg, wu, eb, list, items, n_items, k, N, K, x, y, bg, bu, lpr);                 \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) matvec_moe_##name##_geglu(                            \
        const u8* wg, const u8* wu, long long eb, const int* list, const int* items, const int* n_items,     \
        int k, int N, int K, const float* x, float* y, const float* bg, const float* bu, int lpr) {          \
        matvec_moe_glu<Q, ACT_GELU>(wg, wu, eb, list, items, n_items, k, N, K, x, y, bg, bu, lpr);                \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256, act8<Q>::value ? MV1_MINB8 : 0) mv1_moe_##name##_sum(    \
        const u8* w, long long eb, const int* ids, int N, int K, const float* x, float* y, const float* bias, \
        int lpr, int groups, int early, const float* wts, float* out, unsigned int* cnt) {                   \
        mv1_moe_sum<Q>(w, eb, ids, N, K, x, y, bias, lpr, groups, early, wts, out, cnt);                    \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256, act8<Q>::value ? MV1_MINB8 : 0) mv1_moe_##name##_swiglu( \
        const u8* wg, const u8* wu, long long eb, const int* ids, int N, int K, const float* x, float* y,    \
        const float* norm_w, float eps, int lpr, int groups, const float* bg, const float* bu, int early) {  \
        mv1_moe_glu<Q, ACT_SILU>(wg, wu, eb, ids, N, K, x, y, norm_w, eps, lpr, groups, bg, bu, early);      \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256, act8<Q>::value ? MV1_MINB8 : 0) mv1_moe_##name##_oai(  \
        const u8* wg, const u8* wu, long long eb, const int* ids, int N, int K, const float* x, float* y,    \
        const float* norm_w, float eps, int lpr, int groups, const float* bg, const float* bu, int early) {  \
        mv1_moe_glu<Q, ACT_OAI>(wg, wu, eb, ids, N, K, x, y, norm_w, eps, lpr, groups, bg, bu, early);       \
    }

FOR_EACH_QTYPE(MOE_KERNELS)

// ---- many tokens: the grouped GEMM on tensor cores ------------------------------------------------------
// MG_BM, MG_BN: llamacli/backends/cuda/constants.py (the loader puts them in front)
#define MG_RS (32 + 8)    // shared row stride in halves: 80 bytes, 16-byte aligned, ldmatrix conflict-free

template <class Q, bool GLU, int ACT>
__device__ __forceinline__ void moe_gemm_body(const u8* __restrict__ wa, const u8* __restrict__ wb, long long eb,
                                              const int* __restrict__ list, const int* __restrict__ items,
                                              const int* __restrict__ n_items, int k, int N, int K,
                                              const u16* __restrict__ x16, const float* __restrict__ xsc,
                                              int x_per_pair, float* __restrict__ y, const float* __restrict__ ba,
                                              const float* __restrict__ bb) {
    __shared__ __align__(16) u16 as[MG_BM * MG_RS];
    __shared__ __align__(16) u16 ws[MG_BN * MG_RS];
    __shared__ int xrow[MG_BM], yrow[MG_BM];
    const int it = blockIdx.y;
    pdl_wait();  // the tiles come from moe_group
    if (it >= *n_items) return;
    const int e = items[3 * it], s0 = items[3 * it + 1], cnt = items[3 * it + 2];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid < MG_BM) {
        const int p = tid < cnt ? list[s0 + tid] : -1;
        xrow[tid] = p < 0 ? -1 : (x_per_pair ? p : p / k);
        yrow[tid] = p;
    }
    constexpr int NH = GLU ? MG_BN / 2 : MG_BN;  // output columns of the block
    const int n0 = blockIdx.x * NH;
    const long long row_bytes = (long long)((K + Q::QK - 1) / Q::QK) * Q::BYTES;
    const int wn = n0 + (GLU ? (tid & (NH - 1)) : tid);  // the weight row this thread decodes
    const bool wok = wn < N;
    const u8* wrow = (GLU && tid >= NH ? wb : wa) + e * eb + (long long)(wok ? wn : 0) * row_bytes;
    __syncthreads();

    float c[MG_BN / 8][4];
#pragma unroll
    for (int n = 0; n < MG_BN / 8; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
    const int mi = lane >> 3, r8 = lane & 7;
    const u32 a_lds = smem_addr(as + (warp * 16 + (mi & 1) * 8 + r8) * MG_RS + (mi >> 1) * 8);
    const u32 b_lds = smem_addr(ws + ((mi >> 1) * 8 + r8) * MG_RS + (mi & 1) * 8);
    const int units = K / 32;
    for (int u = 0; u < units; ++u) {
        float w[32];
        if (wok) {
            Q::unit(wrow, u, K, w);
        } else {
#pragma unroll
            for (int i = 0; i < 32; ++i) w[i] = 0.0f;
        }
        uint4* wd = reinterpret_cast<uint4*>(ws + tid * MG_RS);
#pragma unroll
        for (int q = 0; q < 4; ++q)
            wd[q] = make_uint4(pack_h2(w[8 * q], w[8 * q + 1]), pack_h2(w[8 * q + 2], w[8 * q + 3]),
                               pack_h2(w[8 * q + 4], w[8 * q + 5]), pack_h2(w[8 * q + 6], w[8 * q + 7]));
        for (int j = tid; j < MG_BM * 4; j += 128) {  // the pairs' 32 activations: 4 chunks of 16 bytes a row
            const int m = j >> 2, ch = j & 3, xr = xrow[m];
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (xr >= 0) v = __ldg(reinterpret_cast<const uint4*>(x16 + (long long)xr * K + u * 32 + ch * 8));
            *reinterpret_cast<uint4*>(as + m * MG_RS + ch * 8) = v;
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
            u32 a[4];
            ldsm_x4(a_lds + ks * 32, a[0], a[1], a[2], a[3]);
#pragma unroll
            for (int np = 0; np < MG_BN / 16; ++np) {
                u32 b0, b1, b2, b3;
                ldsm_x4(b_lds + (u32)((np * 16 * MG_RS + ks * 16) * 2), b0, b1, b2, b3);
                mma_16816(c[2 * np], a, b0, b1);
                mma_16816(c[2 * np + 1], a, b2, b3);
            }
        }
        __syncthreads();
    }
    // c[n][i]: pair row warp*16 + g (i < 2) or + 8, weight column 8n + 2tg + (i & 1) of the tile.
    const int g = lane >> 2, tg = lane & 3;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int m = warp * 16 + g + (i >> 1) * 8;
        if (m >= cnt) continue;
        const float sc = xsc[xrow[m]];
        float* yr = y + (long long)yrow[m] * N;
#pragma unroll
        for (int n = 0; n < NH / 8; ++n) {
            const int col = n0 + n * 8 + 2 * tg + (i & 1);
            if (col >= N) continue;
            float a = c[n][i] * sc;
            if (ba) a += ba[(long long)e * N + col];
            if constexpr (GLU) {
                float b = c[n + NH / 8][i] * sc;
                if (bb) b += bb[(long long)e * N + col];
                yr[col] = glu_act<ACT>(a, b);
            } else {
                yr[col] = a;
            }
        }
    }
}

#define MOE_GEMM_KERNELS(name, Q)                                                                            \
    extern "C" __global__ void __launch_bounds__(128) moe_gemm_##name(                                      \
        const u8* w, long long eb, const int* list, const int* items, const int* n_items, int k, int N, int K, \
        const u16* x16, const float* xsc, int x_per_pair, float* y, const float* bias) {                     \
        moe_gemm_body<Q, false, ACT_SILU>(w, nullptr, eb, list, items, n_items, k, N, K, x16, xsc, x_per_pair, \
                                          y, bias, nullptr);                                                 \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) moe_gemm_##name##_swiglu(                             \
        const u8* wg, const u8* wu, long long eb, const int* list, const int* items, const int* n_items,     \
        int k, int N, int K, const u16* x16, const float* xsc, float* y, const float* bg, const float* bu) {  \
        moe_gemm_body<Q, true, ACT_SILU>(wg, wu, eb, list, items, n_items, k, N, K, x16, xsc, 0, y, bg, bu); \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) moe_gemm_##name##_oai(                                \
        const u8* wg, const u8* wu, long long eb, const int* list, const int* items, const int* n_items,     \
        int k, int N, int K, const u16* x16, const float* xsc, float* y, const float* bg, const float* bu) {  \
        moe_gemm_body<Q, true, ACT_OAI>(wg, wu, eb, list, items, n_items, k, N, K, x16, xsc, 0, y, bg, bu);  \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) moe_gemm_##name##_geglu(                              \
        const u8* wg, const u8* wu, long long eb, const int* list, const int* items, const int* n_items,     \
        int k, int N, int K, const u16* x16, const float* xsc, float* y, const float* bg, const float* bu) {  \
        moe_gemm_body<Q, true, ACT_GELU>(wg, wu, eb, list, items, n_items, k, N, K, x16, xsc, 0, y, bg, bu); \
    }

FOR_EACH_QTYPE(MOE_GEMM_KERNELS)

extern "C" __global__ void moe_combine_f32(const float* __restrict__ y, const float* __restrict__ wts, float* x,
                                           int T, int N, int k) {
    const int t = blockIdx.y;
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T || n >= N) return;
    pdl_wait();
    float s = 0.0f;
    for (int j = 0; j < k; ++j) s = fmaf(wts[t * k + j], y[((long long)t * k + j) * N + n], s);
    x[(long long)t * N + n] += s;
}
