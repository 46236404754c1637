// sampling.cu: choosing the next token on the GPU, so that one int32 (not 600 KB of logits) crosses.
//
//   argmax_f32(x [V], V, out [2] i32 = (id, 1 if NaN/+inf seen), pos_inc i32* or null): one block of 1024 threads; ties go to the
//       lowest id (each thread scans ascending ids with a strict >, the merge prefers the lower id).
//       With pos_inc, thread 0 also advances the decode position, so a captured greedy step replays
//       itself: embed reads out[0], every kernel reads pos, argmax writes both for the next replay.
//   penalties_f32(x [V], hist [n] i32, n, repeat, freq, present): llama.cpp's penalties sampler on the
//       last-n token window: for each distinct token c (count n_c): x[c] = x[c] > 0 ? x[c] / repeat :
//       x[c] * repeat; x[c] -= n_c * freq + present. One block, 256 threads.
//   topk_f32(x [V], V, k, vals [k] f32, ids [k] i32): the k largest logits (unordered) by a 4-pass
//       8-bit radix select on order-preserving keys, then one collecting pass. One block, 1024 threads.
//       Ties at the k-th value keep the lowest ids (sampling.py's ranking).
//   sample_topk_f32(vals [k], ids [k], k, top_p, log_min_p, temperature, u, out [2] i32): the rest of
//       sampling.py's chain over the top-k candidates, so that only the chosen id crosses to the host:
//       drop -inf; top-p on the ranking (logit desc, id asc) with weights exp(l - l_max) summed in rank
//       order; min-p (l >= l_max + ln min_p); then weights exp((l - l_max) / T) summed in ascending id
//       order, the first token whose running sum exceeds u * sum (u: the host generator's number).
//       float64 like sampling.py, and the sums run on one thread in numpy's cumsum order.
//       out = (id, flag): flag 1 = NaN/+inf among the candidates, 2 = no candidate (all -inf).
//       One block of >= k threads (k <= 1024).
// Best measured on H100: not yet tuned (single-block kernels: ~5-30 us for a 150k vocabulary).

#include "common.cuh"

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
            out[1] = bad;
            if (pos_inc) pos_inc[0] += 1;
        }
    }
}

extern "C" __global__ void penalties_f32(float* x, const int* __restrict__ hist, int n, float repeat, float freq,
                                         float present) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int tok = hist[i];
        bool first = true;
        for (int j = 0; j < i && first; ++j) first = hist[j] != tok;
        if (!first || tok < 0) continue;
        int count = 0;
        for (int j = 0; j < n; ++j) count += hist[j] == tok;
        float v = x[tok];
        v = v > 0.0f ? v / repeat : v * repeat;
        x[tok] = v - (float)((double)count * (double)freq + (double)present);  // sampling.py's rounding
    }
}

__device__ __forceinline__ u32 order_key(float f) {
    const u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

extern "C" __global__ void __launch_bounds__(1024) topk_f32(const float* __restrict__ x, int V, int k, float* vals,
                                                           int* ids) {
    __shared__ u32 hist[256];
    __shared__ u32 s_prefix, s_mask, s_need, s_gt, s_eq;
    if (threadIdx.x == 0) { s_prefix = 0; s_mask = 0; s_need = (u32)min(k, V); s_gt = 0; s_eq = 0; }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        const u32 prefix = s_prefix, mask = s_mask;
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const u32 key = order_key(x[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 need = s_need;
            int b = 255;
            for (; b > 0; --b) {
                if (hist[b] >= need) break;
                need -= hist[b];
            }
            s_need = need;  // how many keys equal to the final prefix still to take (after the pass)
            s_prefix = prefix | ((u32)b << shift);
            s_mask = mask | (255u << shift);
        }
        __syncthreads();
    }
    const u32 kth = s_prefix, need_eq = s_need;
    const u32 n_gt = (u32)min(k, V) - need_eq;
    // Keys above the k-th go anywhere in [0, n_gt); keys equal to it fill [n_gt, k) in ascending id order
    // (a block-wide ordered count per 1024 ids), so ties at the cut keep the lowest ids, as sampling.py does.
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
            ids[slot] = i;
        }
        const u32 ballot = __ballot_sync(FULL_MASK, eq);
        if (lane == 0) warp_ties[warp] = __popc(ballot);
        __syncthreads();
        u32 before = s_base;
        for (int w = 0; w < warp; ++w) before += warp_ties[w];
        before += __popc(ballot & ((1u << lane) - 1u));
        if (eq && before < need_eq) {
            vals[n_gt + before] = v;
            ids[n_gt + before] = i;
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

extern "C" __global__ void __launch_bounds__(1024) sample_topk_f32(const float* __restrict__ vals,
                                                                  const int* __restrict__ ids, int k, double top_p,
                                                                  double log_min_p, double temperature, double u,
                                                                  int* out) {
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
