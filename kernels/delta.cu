// delta.cu: the Gated DeltaNet layers of the hybrid models (qwen35, qwen35moe, qwen3next; models/block.py Conv,
// DeltaRule, GatedNorm, Gate), fp32 throughout. The reference is llamacli/backends/numpy_backend.py (conv,
// delta_rule, gated_norm, sigmoid_gate) and numpy_delta.py (the rule token by token).
//
// conv_silu_f32(x, x_stride, w, win, out, T, C, K)
//     The causal depthwise convolution with SiLU: out[t, c] = silu(sum_j w[c, j] in(t - K + 1 + j, c)), j < K,
//     where in(s, c) = x[s, c] for s >= 0 and, before the pass's first token, the window win[K - 1 + s, c] (the
//     sequence's last K - 1 inputs, zeros at position 0). x [T, C] rows x_stride floats apart, w [C, K] (the oldest
//     input's tap first), win [K - 1, C], out [T, C]. grid (ceil(C / 256), min(T, 65535)), block 256: a thread per
//     channel and token (tokens grid-strided).
// conv_window_f32(x, x_stride, win, dst, C, K, at)
//     The window after `at` tokens of the pass: dst[i, c] = in(at - K + 1 + i, c), i < K - 1 (in() as above). dst
//     may be win itself (the window moved on in place: each thread copies its channel's values lowest i first, and
//     in() then reads win at K - 1 + s = at + i > i, not yet overwritten); else a stored snapshot. Only at >= 1.
//     grid ceil(C / 256), block 256: a thread per channel.
// delta_qk_f32(qkv, stride, Hk, dk, eps, qscale, qn, kn, kq)
//     q, k of each key head L2-normalised (x / sqrt(sum x^2 + eps)), q times qscale = 1 / sqrt(dk): from qkv rows
//     [q (Hk dk) | k (Hk dk) | v] -> qn, kn [T, Hk, dk], and their dot kq [T, Hk]. grid (T, Hk), block 128.
// delta_rule_f32(qn, kn, kq, qkv, stride, v_off, a, b, ssm_a, dt, S, out, T, Hk, Hv, dk, dv, grouped)
//     The gated delta rule over T tokens from the state S [Hv, dk, dv] (updated in place). Value head h reads key
//     head h / (Hv / Hk) (`grouped`) or h % Hk (tiled). Per token t and head h, with g = ssm_a[h] softplus(a[t, h]
//     + dt[h]), beta = sigmoid(b[t, h]), k, q = kn, qn [t, key head], v = qkv[t, v_off + h dv ..]:
//         S' = exp(g) S;  u = beta (v - S'^T k);  S = S' + k u^T;  out[t, h dv + j] = (S^T q)_j
//     Column j of S evolves on its own (u_j and the output read column j only), so a block takes DR_COLS columns
//     of one head and loops over the tokens, its [dk, DR_COLS] tile of S in shared memory, a thread per column and
//     row group of DR_THREADS / DR_COLS (rows i = r, r + groups, ..). The output is read in the same pass as the
//     recall: (S^T q)_j = exp(g) (S_old^T q)_j + u_j (k . q). a, b [T, Hv]; out [T, Hv dv].
//     grid (ceil(dv / DR_COLS), Hv), block DR_THREADS, dynamic shared (dk DR_COLS + 2 dk) floats.
// gated_norm_f32(x, g, w, y, d, eps)
//     y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w * silu(g[r, :]) over rows of d values (a value head of the
//     delta net's output, gated by z). x, g, y [rows, d], w [d]. grid rows, block 128.
// sigmoid_gate_f32(x, g, y, n, N, gn)
//     y[i] = x[i] sigmoid(g[i / N, i % N]) over x [n / N, N]; the gate has gn = N columns, or gn = 1 (one for the
//     whole row: the shared expert's). Grid-stride, block 256.
// Best measured: not tuned (a first correct form; the chunked rule of numpy_delta.py is the fast prefill's way).

#include "common.cuh"

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float softplusf_(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }

// in(s, c) of the convolution: x's row s, or the window's row K - 1 + s before the pass's first token.
__device__ __forceinline__ float conv_in(const float* x, int x_stride, const float* win, int C, int K, int s, int c) {
    return s >= 0 ? x[(long long)s * x_stride + c] : win[(long long)(K - 1 + s) * C + c];
}

extern "C" __global__ void conv_silu_f32(const float* __restrict__ x, int x_stride, const float* __restrict__ w,
                                         const float* __restrict__ win, float* __restrict__ out, int T, int C, int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const float* wc = w + (long long)c * K;
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        float acc = 0.0f;
        for (int j = 0; j < K; ++j) acc = fmaf(wc[j], conv_in(x, x_stride, win, C, K, t - K + 1 + j, c), acc);
        out[(long long)t * C + c] = acc * sigmoidf_(acc);
    }
}

extern "C" __global__ void conv_window_f32(const float* __restrict__ x, int x_stride, float* win, float* dst, int C,
                                           int K, int at) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int i = 0; i < K - 1; ++i)  // lowest first: dst may be win (see the header)
        dst[(long long)i * C + c] = conv_in(x, x_stride, win, C, K, at - K + 1 + i, c);
}

extern "C" __global__ void delta_qk_f32(const float* __restrict__ qkv, int stride, int Hk, int dk, float eps,
                                        float qscale, float* __restrict__ qn, float* __restrict__ kn,
                                        float* __restrict__ kq) {
    const int t = blockIdx.x, hk = blockIdx.y;
    const float* q = qkv + (long long)t * stride + (long long)hk * dk;
    const float* k = q + (long long)Hk * dk;
    float sq = 0.0f, sk = 0.0f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        sq = fmaf(q[i], q[i], sq);
        sk = fmaf(k[i], k[i], sk);
    }
    const float rq = qscale / sqrtf(block_sum(sq) + eps), rk = 1.0f / sqrtf(block_sum(sk) + eps);
    const long long o = ((long long)t * Hk + hk) * dk;
    float dot = 0.0f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        const float a = q[i] * rq, b = k[i] * rk;
        qn[o + i] = a;
        kn[o + i] = b;
        dot = fmaf(a, b, dot);
    }
    dot = block_sum(dot);
    if (threadIdx.x == 0) kq[(long long)t * Hk + hk] = dot;
}

#define DR_GROUPS (DR_THREADS / DR_COLS)  // row groups of a block

extern "C" __global__ void __launch_bounds__(DR_THREADS)
    delta_rule_f32(const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ kq,
                   const float* __restrict__ qkv, int stride, int v_off, const float* __restrict__ a,
                   const float* __restrict__ b, const float* __restrict__ ssm_a, const float* __restrict__ dt,
                   float* __restrict__ S, float* __restrict__ out, int T, int Hk, int Hv, int dk, int dv, int grouped) {
    extern __shared__ float smem[];
    float* st = smem;                 // [dk, DR_COLS] the block's columns of S
    float* qs = st + dk * DR_COLS;    // [dk] this token's q
    float* ks = qs + dk;              // [dk] and k
    __shared__ float red_k[DR_GROUPS][DR_COLS], red_q[DR_GROUPS][DR_COLS], us[DR_COLS];
    const int tid = threadIdx.x, jj = tid % DR_COLS, r = tid / DR_COLS;
    const int h = blockIdx.y, j0 = blockIdx.x * DR_COLS, j = j0 + jj;
    const int hk = grouped ? h / (Hv / Hk) : h % Hk;
    const long long s_base = (long long)h * dk * dv;
    for (int idx = tid; idx < dk * DR_COLS; idx += DR_THREADS) {
        const int i = idx / DR_COLS, c = j0 + idx % DR_COLS;
        st[idx] = c < dv ? S[s_base + (long long)i * dv + c] : 0.0f;
    }
    const float sa = ssm_a[h], bias = dt[h];
    for (int t = 0; t < T; ++t) {
        __syncthreads();  // the last token's readers of qs, ks, us (and the tile's load) are done
        const long long kb = ((long long)t * Hk + hk) * dk;
        for (int i = tid; i < dk; i += DR_THREADS) {
            qs[i] = qn[kb + i];
            ks[i] = kn[kb + i];
        }
        __syncthreads();
        const float decay = expf(sa * softplusf_(a[(long long)t * Hv + h] + bias));
        float pk = 0.0f, pq = 0.0f;
        for (int i = r; i < dk; i += DR_GROUPS) {
            const float s = st[i * DR_COLS + jj];
            pk = fmaf(s, ks[i], pk);
            pq = fmaf(s, qs[i], pq);
        }
        red_k[r][jj] = pk;
        red_q[r][jj] = pq;
        __syncthreads();
        if (r == 0) {
            float sk = 0.0f, sq = 0.0f;
#pragma unroll
            for (int g = 0; g < DR_GROUPS; ++g) {
                sk += red_k[g][jj];
                sq += red_q[g][jj];
            }
            const float beta = sigmoidf_(b[(long long)t * Hv + h]);
            const float v = j < dv ? qkv[(long long)t * stride + v_off + (long long)h * dv + j] : 0.0f;
            const float u = beta * (v - decay * sk);
            us[jj] = u;
            if (j < dv) out[(long long)t * Hv * dv + (long long)h * dv + j] = decay * sq + u * kq[(long long)t * Hk + hk];
        }
        __syncthreads();
        const float u = us[jj];
        for (int i = r; i < dk; i += DR_GROUPS) st[i * DR_COLS + jj] = fmaf(ks[i], u, decay * st[i * DR_COLS + jj]);
    }
    __syncthreads();
    for (int idx = tid; idx < dk * DR_COLS; idx += DR_THREADS) {
        const int i = idx / DR_COLS, c = j0 + idx % DR_COLS;
        if (c < dv) S[s_base + (long long)i * dv + c] = st[idx];
    }
}

extern "C" __global__ void gated_norm_f32(const float* __restrict__ x, const float* __restrict__ g,
                                          const float* __restrict__ w, float* __restrict__ y, int d, float eps) {
    const long long base = (long long)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss = fmaf(x[base + i], x[base + i], ss);
    const float rs = rsqrtf(block_sum(ss) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float z = g[base + i];
        y[base + i] = x[base + i] * rs * w[i] * (z * sigmoidf_(z));
    }
}

extern "C" __global__ void sigmoid_gate_f32(const float* __restrict__ x, const float* __restrict__ g,
                                            float* __restrict__ y, long long n, int N, int gn) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / N;
        y[i] = x[i] * sigmoidf_(g[row * gn + (gn == 1 ? 0 : i - row * N)]);
    }
}
