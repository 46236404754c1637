// sampling.cu: choosing the next token on the GPU, so that one int32 (not 600 KB of logits) crosses.
//
// llamacli.sampling.sampling's chain, one kernel per stage (cuda/sampling.py DeviceSampler.sample launches them for one
// call of sample(); the captured decode step launches the _step forms, cuda/decode.py):
//   mask_logits_f32(x [V], words [ceil(V / 32)] u32, V, y [V]): y = x where bit i % 32 of word i / 32 is set,
//       else -inf (a constraint's allowed ids; cuda/sampling.py sample_allowed).
//   argmax_f32(x [V], V, out [2] i32 = (id, flag: 1 NaN/+inf seen, 2 all -inf), pos_inc i32* or null): one block of 1024 threads; ties go to the
//       lowest id (each thread scans ascending ids with a strict >, the merge prefers the lower id).
//       With pos_inc, thread 0 also advances the decode position, so a captured greedy step replays
//       itself: embed reads out[0], every kernel reads pos, argmax writes both for the next replay.
//   penalties_f32(x [V], hist [n] i32, n, V, cnt [V] i32, repeat, freq, present): llama.cpp's penalties sampler
//       on the token window hist: for each distinct token c (count n_c): x[c] = x[c] > 0 ? x[c] / repeat :
//       x[c] * repeat; x[c] -= n_c * freq + present; a finite logit stays finite (clamped, as sampling.py).
//       The counts go through cnt (zero before and after): one pass adds them up, a second takes each with an
//       atomic exchange, so exactly one thread applies each distinct token's penalty: O(n), n up to the context.
//       One block, 1024 threads.
//   topk_f32(x [V], V, k, vals [k] f32, ids [k] i32): the k largest logits (unordered) by a 4-pass
//       8-bit radix select on order-preserving keys (NaN above +inf, so that it is always a candidate and
//       flagged; -0 equal to +0), then one collecting pass. Histogram atomics are aggregated per warp and
//       bin (__match_any_sync: logits crowd into a few bins of the first passes); warp 0 finds each pass's
//       bin (suffix sums over 8 bins a lane). Ties at the k-th value keep the lowest ids (sampling.py's
//       ranking): where more keys equal the k-th than are taken, the collecting pass goes in id order (three
//       barriers per 1024 ids), else in one pass without barriers. One block, 1024 threads.
//   sample_topk_f32(vals [k], ids [k], k, top_p, log_min_p, temperature, u, out [2] i32): the rest of
//       sampling.py's chain over the top-k candidates, so that only the chosen id crosses to the host:
//       drop -inf; top-p on the ranking (logit desc, id asc) with weights exp(l - l_max) summed in rank
//       order; min-p (l >= l_max + ln min_p); then weights exp((l - l_max) / T) summed in ascending id
//       order, the first token whose running sum exceeds u * sum (u: the host generator's number);
//       temperature 0: the first candidate of the ranking (greedy with penalties: top-k 1).
//       float64 like sampling.py, and the sums run on one thread in numpy's cumsum order.
//       out = (id, flag): flag 1 = NaN/+inf among the candidates, 2 = no candidate (all -inf).
//       One block of >= k threads (k <= 1024).
//
// The same chain inside the captured decode step, after the LM head; the settings come from a SampleParams in
// device memory (the host writes it before a generation), so one graph serves every setting:
//   penalties_step_f32(x, hist [ctx] i32, pos*, ids*, V, cnt, p): hist[pos] = ids[0] (the step's input token:
//       hist holds the sequence by position), then penalties_f32 over positions [pos + 1 - p->window, pos]
//       (every position 0..pos when window = -1; nothing when 0).
//   topk_part_step_f32(x, V, p, cvals, cids): grid ceil(V / TOPK_PART): where p->top_k <= TOPK_PART_K, each block
//       takes the top k of its TOPK_PART logits (the same radix select on a shared-memory copy, ties to the
//       lowest ids) into cvals/cids [block * k ..), in ascending id order, padded with -inf where its slice
//       holds fewer than k; else nothing.
//   topk_step_f32(x, V, p, vals, ids, cvals, cids, n_part): topk_f32 with k = p->top_k over those n_part * k
//       candidates (their order is the ids' order, so ties keep the lowest ids as before), or over x where
//       top_k > TOPK_PART_K. One block reading all V logits four times was most of the sampled step's cost
//       over the greedy one (docs/perf-log.md).
//   sample_step_f32(vals, ids, p, uniforms [p->ring] f64, pos*, out [2] i32): sample_topk_f32 with the
//       uniform number of this position, uniforms[(pos - p->base) mod ring] (the host fills the ring ahead
//       from its seeded generator, in draw order: cuda/sampling.py UniformFeed); out = step_ids (id, flag)
//       and *pos += 1, so the next replay reads them, as the greedy step's fused argmax does.
// Measured (SmolLM2's 49,152 logits, un-captured; the figures are in docs/perf-log.md): topk_part_step_f32 +
// topk_step_f32 over the candidates take well under the time of topk_step_f32 over all the logits. The other
// kernels are one block each and launch-bound.

#include "common.cuh"

#define SAMPLING_FLT_MAX 3.402823466e+38f
#define TOPK_PART 4096   // logits per block of topk_part_step_f32 (4 a thread)
#define TOPK_PART_K 64   // top_k up to which the step's top-k goes through those blocks' candidates

// The sampler's settings for the captured step. cuda/sampling.py STEP_PARAMS mirrors this layout (56 bytes).
struct SampleParams {
    double top_p;        // 1 = off
    double log_min_p;    // ln(min_p); -inf = off
    double temperature;  // 0 = greedy: the first candidate of the ranking, no uniform number read
    float repeat, freq, present;
    int top_k;           // candidates: 1..min(TOPK_MAX, V)
    int window;          // penalty window: 0 = none, -1 = every position up to pos, n = the last n positions
    int base;            // the position whose step takes uniform number 0
    int ring;            // uniform numbers in the ring (a power of two)
};

extern "C" __global__ void mask_logits_f32(const float* __restrict__ x, const u32* __restrict__ words, int V,
                                           float* __restrict__ y) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < V) y[i] = (words[i >> 5] >> (i & 31)) & 1u ? x[i] : -INFINITY;
}

extern "C" __global__ void __launch_bounds__(1024) argmax_f32(const float* __restrict__ x, int V, int* out,
                                                             int* pos_inc) {
    __shared__ float sv[32];
    __shared__ int si[32];
    float best = -INFINITY;
    int bi = 0x7fffffff;
    int bad = 0;  // NaN or +inf seen: the host raises NumericalError as sampling.py does
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = x[i];
        bad |= (v != v) || (v == INFINITY);
        if (v > best || bi == 0x7fffffff) { best = v; bi = i; }
    }
    bad = __syncthreads_or(bad);
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(FULL_MASK, best, o);
        const int i = __shfl_xor_sync(FULL_MASK, bi, o);
        if (v > best || (v == best && i < bi)) { best = v; bi = i; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        best = lane < nw ? sv[lane] : -INFINITY;
        bi = lane < nw ? si[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            const float v = __shfl_xor_sync(FULL_MASK, best, o);
            const int i = __shfl_xor_sync(FULL_MASK, bi, o);
            if (v > best || (v == best && i < bi)) { best = v; bi = i; }
        }
        if (lane == 0) {
            out[0] = bi;
            out[1] = bad ? 1 : (best == -INFINITY ? 2 : 0);  // 2: every logit -inf (a mask that left none)
            if (pos_inc) pos_inc[0] += 1;
        }
    }
}

// The penalties over the window hist[lo..hi) (one block; cnt [V] is zero before and after).
__device__ __forceinline__ void penalize(float* x, const int* hist, int lo, int hi, int V, int* cnt, float repeat,
                                         float freq, float present) {
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const int tok = hist[i];
        if (tok >= 0 && tok < V) atomicAdd(&cnt[tok], 1);
    }
    __syncthreads();
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const int tok = hist[i];
        if (tok < 0 || tok >= V) continue;
        const int count = atomicExch(&cnt[tok], 0);  // the first thread to come takes the token's whole count
        if (count == 0) continue;
        const float old = x[tok];
        float v = old > 0.0f ? old / repeat : old * repeat;
        v -= (float)((double)count * (double)freq + (double)present);  // sampling.py's rounding
        // As sampling.py: any logit but -inf (masked) and NaN ends finite (+inf too: clipped to the largest float).
        if (old != -INFINITY && v == v) v = fminf(fmaxf(v, -SAMPLING_FLT_MAX), SAMPLING_FLT_MAX);
        x[tok] = v;
    }
}

extern "C" __global__ void __launch_bounds__(1024) penalties_f32(float* x, const int* hist, int n, int V, int* cnt,
                                                                float repeat, float freq, float present) {
    penalize(x, hist, 0, n, V, cnt, repeat, freq, present);
}

extern "C" __global__ void __launch_bounds__(1024) penalties_step_f32(float* x, int* hist, const int* pos_p,
                                                                     const int* ids, int V, int* cnt,
                                                                     const SampleParams* __restrict__ p) {
    const int pos = *pos_p;
    if (threadIdx.x == 0) hist[pos] = ids[0];
    __syncthreads();  // the block's later reads of hist[pos] see the write
    const int window = p->window;
    if (window == 0) return;
    const int lo = window < 0 ? 0 : max(0, pos + 1 - window);
    penalize(x, hist, lo, pos + 1, V, cnt, p->repeat, p->freq, p->present);
}

__device__ __forceinline__ u32 order_key(float f) {
    if (f != f) return 0xffffffffu;  // NaN above +inf: always a candidate, and flagged by the draw
    if (f == 0.0f) return 0x80000000u;  // -0 ties with +0, as in sampling.py's comparisons
    const u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The k-th largest order key of x[0..V) by the 4-pass radix select (one block; x in global or shared memory):
// kth, need_eq = how many keys equal to it the top k take, n_eq = how many there are.
__device__ __forceinline__ void radix_kth(const float* x, int V, int k, u32& kth, u32& need_eq, u32& n_eq) {
    __shared__ u32 hist[256];
    __shared__ u32 s_prefix, s_mask, s_need, s_eq;
    if (threadIdx.x == 0) { s_prefix = 0; s_mask = 0; s_need = (u32)min(k, V); s_eq = 0; }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        const u32 prefix = s_prefix, mask = s_mask;
        for (int i0 = 0; i0 < V; i0 += blockDim.x) {  // whole warps: __match_any_sync needs every lane
            const int i = i0 + (int)threadIdx.x;
            const u32 key = i < V ? order_key(x[i]) : 0u;
            const bool in = i < V && (key & mask) == prefix;
            const u32 bin = in ? (key >> shift) & 255u : 256u;
            const u32 peers = __match_any_sync(FULL_MASK, bin);
            if (in && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], (u32)__popc(peers));
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // The bin b holding the need-th key from the top: the highest b with (keys in bins >= b) >= need.
            // Warp 0, 8 bins a lane: suffix sums over the lanes, the lane where they reach need, its 8 bins.
            const int lane = threadIdx.x;
            u32 c8[8], own = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) own += c8[j] = hist[lane * 8 + j];
            u32 from = own;  // keys in bins >= lane * 8
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 v = __shfl_down_sync(FULL_MASK, from, o);
                if (lane + o < 32) from += v;
            }
            const u32 need = s_need;
            const u32 hit = __ballot_sync(FULL_MASK, from >= need);  // lane 0 always (the prefix holds >= need)
            if (lane == 31 - __clz(hit)) {
                u32 above = from - own;  // keys in the bins above this lane's: < need
                int found = 0;
                u32 left = 0, count = 0;
                bool done = false;
#pragma unroll
                for (int j = 7; j >= 0; --j) {
                    if (!done && (j == 0 || above + c8[j] >= need)) {
                        done = true;
                        found = j;
                        left = need - above;
                        count = c8[j];
                    }
                    above += c8[j];
                }
                s_need = left;  // how many keys of the chosen bin still to take (after the last pass: equal to kth)
                s_eq = count;   // keys in the chosen bin (after the last pass: all keys equal to kth)
                s_prefix = prefix | ((u32)(lane * 8 + found) << shift);
                s_mask = mask | (255u << shift);
            }
        }
        __syncthreads();
    }
    kth = s_prefix, need_eq = s_need, n_eq = s_eq;
    __syncthreads();  // (the shared words are read before any thread may call this again)
}

// The k largest of x[0..V) into vals/ids (unordered; ties at the k-th value keep the lowest positions), ids the
// positions, or in_ids[position] where given (candidates listed in ascending id order: topk_part_step_f32's).
__device__ __forceinline__ void topk_block(const float* __restrict__ x, int V, int k, float* vals, int* ids,
                                           const int* __restrict__ in_ids = nullptr) {
    u32 kth, need_eq, n_eq;
    radix_kth(x, V, k, kth, need_eq, n_eq);
    __shared__ u32 s_gt;
    if (threadIdx.x == 0) s_gt = 0;
    __syncthreads();
    const u32 n_gt = (u32)min(k, V) - need_eq;
    if (n_eq == need_eq) {  // every key equal to the k-th is taken: no order needed, one pass without barriers
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const float v = x[i];
            if (order_key(v) >= kth) {
                const u32 slot = atomicAdd(&s_gt, 1u);
                vals[slot] = v;
                ids[slot] = in_ids ? in_ids[i] : i;
            }
        }
        return;
    }
    // Ties at the cut: keys above the k-th go anywhere in [0, n_gt); keys equal to it fill [n_gt, k) in
    // ascending id order (a block-wide ordered count per 1024 ids), so the lowest ids stay, as in sampling.py.
    __shared__ u32 warp_ties[32];
    __shared__ u32 s_base;
    if (threadIdx.x == 0) s_base = 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int i0 = 0; i0 < V; i0 += blockDim.x) {
        const int i = i0 + threadIdx.x;
        const float v = i < V ? x[i] : 0.0f;
        const u32 key = order_key(v);
        const bool gt = i < V && key > kth, eq = i < V && key == kth;
        if (gt) {
            const u32 slot = atomicAdd(&s_gt, 1u);
            vals[slot] = v;
            ids[slot] = in_ids ? in_ids[i] : i;
        }
        const u32 ballot = __ballot_sync(FULL_MASK, eq);
        if (lane == 0) warp_ties[warp] = __popc(ballot);
        __syncthreads();
        u32 before = s_base;
        for (int w = 0; w < warp; ++w) before += warp_ties[w];
        before += __popc(ballot & ((1u << lane) - 1u));
        if (eq && before < need_eq) {
            vals[n_gt + before] = v;
            ids[n_gt + before] = in_ids ? in_ids[i] : i;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 total = 0;
            for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += warp_ties[w];
            s_base += total;
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(1024) topk_f32(const float* __restrict__ x, int V, int k, float* vals,
                                                           int* ids) {
    topk_block(x, V, k, vals, ids);
}

// The exclusive prefix sum of v over the block's threads in thread order (blockDim.x a multiple of 32).
__device__ __forceinline__ int block_exclusive_sum(int v) {
    __shared__ int s_warp[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(FULL_MASK, inc, o);
        if (lane >= o) inc += u;
    }
    if (lane == 31) s_warp[warp] = inc;
    __syncthreads();
    int before = 0;
    for (int w = 0; w < warp; ++w) before += s_warp[w];
    __syncthreads();  // (s_warp is free for the next call)
    return before + inc - v;
}

extern "C" __global__ void __launch_bounds__(1024) topk_part_step_f32(const float* __restrict__ x, int V,
                                                                     const SampleParams* __restrict__ p,
                                                                     float* cvals, int* cids) {
    const int k = p->top_k;
    if (k > TOPK_PART_K) return;  // topk_step_f32 reads the logits itself
    __shared__ float xs[TOPK_PART];
    const int i0 = blockIdx.x * TOPK_PART, n = min(TOPK_PART, V - i0);
    for (int i = threadIdx.x; i < n; i += blockDim.x) xs[i] = x[i0 + i];
    __syncthreads();
    u32 kth, need_eq, n_eq;
    radix_kth(xs, n, k, kth, need_eq, n_eq);
    // Thread t holds positions 4t .. 4t + 3: the keys above the k-th, then the first need_eq equal to it by
    // position, written in position order (two block scans).
    constexpr int PER = TOPK_PART / 1024;
    u32 key[PER];
    int n_eq_own = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = PER * threadIdx.x + j;
        key[j] = i < n ? order_key(xs[i]) : 0u;
        n_eq_own += i < n && key[j] == kth;
    }
    int eq_rank = block_exclusive_sum(n_eq_own);
    bool take[PER];
    int n_take = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = PER * threadIdx.x + j;
        const bool eq = i < n && key[j] == kth;
        take[j] = (i < n && key[j] > kth) || (eq && (u32)eq_rank < need_eq);
        eq_rank += eq;
        n_take += take[j];
    }
    int slot = block_exclusive_sum(n_take);
    float* cv = cvals + (long long)blockIdx.x * k;
    int* ci = cids + (long long)blockIdx.x * k;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        if (!take[j]) continue;
        const int i = PER * threadIdx.x + j;
        cv[slot] = xs[i];
        ci[slot] = i0 + i;
        ++slot;
    }
    for (int s = min(k, n) + threadIdx.x; s < k; s += blockDim.x) {  // a slice shorter than k: -inf, never drawn
        cv[s] = -INFINITY;
        ci[s] = 0x7fffffff;
    }
}

extern "C" __global__ void __launch_bounds__(1024) topk_step_f32(const float* __restrict__ x, int V,
                                                                const SampleParams* __restrict__ p, float* vals,
                                                                int* ids, const float* __restrict__ cvals,
                                                                const int* __restrict__ cids, int n_part) {
    const int k = p->top_k;
    if (k <= TOPK_PART_K) {
        topk_block(cvals, n_part * k, k, vals, ids, cids);  // the blocks' candidates, in ascending id order
    } else {
        topk_block(x, V, k, vals, ids);
    }
}

__device__ __forceinline__ void sample_block(const float* __restrict__ vals, const int* __restrict__ ids, int k,
                                             double top_p, double log_min_p, double temperature, double u, int* out) {
    __shared__ float sv[1024];          // candidate logits (-inf: not a candidate)
    __shared__ int sid[1024];
    __shared__ double w[1024];          // weights at rank positions (top-p), then at id positions (draw)
    __shared__ int slot[1024];          // thread at rank position, then at id position
    __shared__ unsigned char skept[1024];
    __shared__ int s_bad, s_n, s_keep;
    const int t = threadIdx.x;
    if (t == 0) { s_bad = 0; s_n = 0; }
    __syncthreads();
    float v = -INFINITY;
    int id = 0x7fffffff;
    if (t < k) {
        v = vals[t];
        id = ids[t];
        if (v != v || v == INFINITY) atomicOr(&s_bad, 1);
    }
    if (v != v) v = -INFINITY;
    sv[t] = v;
    sid[t] = id;
    const bool cand = t < k && v != -INFINITY;
    if (cand) atomicAdd(&s_n, 1);
    __syncthreads();
    const int n = s_n;
    if (s_bad || n == 0) {  // uniform across the block: every thread leaves here
        if (t == 0) { out[0] = 0; out[1] = s_bad ? 1 : 2; }
        return;
    }
    // Rank in the ranking: logit descending, then id ascending.
    int rank = 0;
    if (cand) {
        for (int j = 0; j < k; ++j) {
            const float o = sv[j];
            rank += (o != -INFINITY) && ((o > v) || (o == v && sid[j] < id));
        }
        slot[rank] = t;
    }
    __syncthreads();
    if (temperature == 0.0) {  // greedy: the first of the ranking (the argmax, lowest id on ties)
        if (t == 0) { out[0] = sid[slot[0]]; out[1] = 0; }
        return;
    }
    const double vmax = (double)sv[slot[0]];
    // top-p: keep ranks < 1 + (first r whose running weight reaches top_p * total).
    int keep = n;
    if (top_p < 1.0 && n > 1) {
        if (cand) w[rank] = exp((double)v - vmax);
        __syncthreads();
        if (t == 0) {
            double total = 0.0;
            for (int r = 0; r < n; ++r) total += w[r];
            const double target = top_p * total;
            double cum = 0.0;
            int r = 0;
            for (; r < n - 1; ++r) {
                cum += w[r];
                if (cum >= target) break;
            }
            s_keep = r + 1;
        }
        __syncthreads();
        keep = s_keep;
    }
    // min-p: l >= l_max + ln(min_p) (the best always passes); log_min_p = -inf turns it off.
    const bool kept = cand && rank < keep && (double)v >= vmax + log_min_p;
    skept[t] = kept;
    __syncthreads();
    // The draw walks the kept tokens in ascending id order.
    if (kept) {
        int pos = 0;
        for (int j = 0; j < k; ++j) pos += skept[j] && sid[j] < id;
        w[pos] = exp(((double)v - vmax) / temperature);
        slot[pos] = t;
    }
    __syncthreads();
    if (t == 0) {
        int m = 0;
        for (int j = 0; j < k; ++j) m += skept[j];
        double total = 0.0;
        for (int i = 0; i < m; ++i) total += w[i];
        const double target = u * total;
        double cum = 0.0;
        int i = 0;
        for (; i < m; ++i) {
            cum += w[i];
            if (cum > target) break;
        }
        if (i >= m) {  // u * total rounded up to total: the last token with weight
            i = m - 1;
            while (i > 0 && w[i] <= 0.0) --i;
        }
        out[0] = sid[slot[i]];
        out[1] = 0;
    }
}

extern "C" __global__ void __launch_bounds__(1024) sample_topk_f32(const float* __restrict__ vals,
                                                                  const int* __restrict__ ids, int k, double top_p,
                                                                  double log_min_p, double temperature, double u,
                                                                  int* out) {
    sample_block(vals, ids, k, top_p, log_min_p, temperature, u, out);
}

extern "C" __global__ void __launch_bounds__(1024) sample_step_f32(const float* __restrict__ vals,
                                                                  const int* __restrict__ ids,
                                                                  const SampleParams* __restrict__ p,
                                                                  const double* __restrict__ uniforms, int* pos_p,
                                                                  int* out) {
    const int pos = *pos_p;  // every thread reads it before the barriers in sample_block; thread 0 writes it last
    const double temperature = p->temperature;
    const double u = temperature == 0.0 ? 0.0 : uniforms[(pos - p->base) & (p->ring - 1)];
    sample_block(vals, ids, p->top_k, p->top_p, p->log_min_p, temperature, u, out);
    if (threadIdx.x == 0) pos_p[0] = pos + 1;
}
