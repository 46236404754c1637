// attention_split.cu: decode attention (one query token) on tensor cores, split over the keys (flash-decoding)
// in as many splits as the GPU holds blocks, so that it runs at memory speed at any depth.
//
// attention_split_d<D>(q, kc, vc, ring, pos, Hq, Hkv, qscale, window, cap2, sinks, part_o, part_ml, counters,
//   out): q [Hq * D] f32 (already rotated), the caches [ring, Hkv, D] fp16 -> out [Hq * D] f32. Position k is
//   cache row k mod ring: ring = ctx for a full cache, else a sliding-window layer's ring (llamacli/models/kv_cache.py:
//   a multiple of 64, so a 64-key tile's rows are contiguous; at least the window).
// attention_split_step_<mode>_d<D>(..., rope_dim, inv_freq, attn, qn, kn, eps, early): the fused decode step's
//   form: q is the QKV matvec's raw output [Hq*D | Hkv*D K | Hkv*D V]; each block normalises its query heads
//   per head (qn, kn: qwen3's and gemma3's q/k RMSNorm weights [D], or null) and rotates them itself, and the
//   block whose split holds position p also normalises and rotates this token's K and stores K and V into the
//   cache: one launch per layer where q/k norm, rope_store and attention would take three. A programmatic
//   dependent in the captured step (common.cuh pdl_wait): the first K/V tiles are requested before pdl_wait,
//   `early` as in mv1 (kernels/matvec.cu).
//
// grid (Hkv, S), block 128 (4 warps). S (gridDim.y) is fixed when the step is captured, from the SM count, the
// blocks an SM holds and the size of the merge (cuda/attention.py decode_splits), not from the position, so
// one captured graph serves every position and a long --ctx costs short sequences nothing: the query at
// position p sees keys [lo, p] (lo = p - window + 1 with a sliding window, else 0), i.e. 64-key tiles lo/64 ..
// p/64; up to SP_SOLO tiles are one split (the merge's chain of global round trips costs more than streaming
// them), more are shared as ceil(tiles / S) consecutive tiles a split; a split past the last tile leaves at
// once. Keys before the window are never read.
// The G = Hq / Hkv query heads of a KV head are the rows of one 16-row MMA tile (G <= 16; rows past G are
// zeros), so each K/V tile is read once for all of them. Tiles stream through shared memory NST deep
// (cp.async, 16-byte copies; the tile after those in flight is prefetched into L2); warp w takes keys
// 16w .. 16w + 15 of each tile: S = Q K^T (mma.sync m16n8k16, fp16 in, f32 accumulate; q pre-multiplied by
// qscale = log2(e) x the query scale, so the softmax is base 2),
// the soft-cap (cap2 = c log2(e), gemma2), the window and causal masks, the online softmax, O += P V with P
// in fp16 straight from the accumulators and l += P 1 by one more MMA (attention_mma.cu's scheme). The four
// warps merge through shared memory; a split that holds every key writes out itself, else it writes its
// partial (o, m, l; m in base-2 units) and the last block of the KV head to finish (an atomic counter per KV
// head, reset by that block) merges the partials of all active splits: weights per (split, row) once, then
// every output float4 as one dot product over the splits, its L2 reads issued eight at a time. Sinks
// (gpt-oss, [Hq] or null): exp(sink) joins each head's softmax denominator.
// Dynamic shared memory: 2 x NST x 64 x (D + 8) x 2 (K and V stages) + 16 x (D + 8) x 2 (q rows, fp16) +
// (G + 1) x D x 4 (q and k rows, f32, while normalised and rotated) bytes (cuda/attention.py split_smem).
// After the last tile the stages hold the four warps' partials (4 x G x D floats), then the merge's (m, l)
// pairs and weights (2 x splits x G floats, rounded up to float4s) and its group sums (SP_WARPS x 32 float4s):
// cuda/attention.py decode_splits bounds the splits so that these fit (SPLIT_MERGE_SUMS).
// Accuracy: fp16 q and P as the tensor-core prefill (tests: atol 4e-3, rtol 1e-2 against float64).
//
// The _q8 forms (attention_split_q8_d<D>, attention_split_step_q8_<mode>_d<D>; D a multiple of 32) read an
// 8-bit cache (-ctk/-ctv q8_0, llamacli/models/kv_cache.py): each layer's cache one byte buffer, int8 codes [ring, Hkv, D]
// then fp16 scales [Hkv, ring, D/32] (one per 32 values, GGUF's Q8_0 block: x = d * code), ring a multiple of
// 64, so that a tile's scales for one KV head are 4 D contiguous bytes. Codes and scales stream through the
// NST stages by cp.async as above (half the bytes of fp16); each tile is then converted to fp16 (d * code,
// zero outside the keys seen) into one K and one V tile, which the MMAs read as in the fp16 form. The holder
// quantizes this token's K and V itself (a warp per 32-value block: d = max|x| / 127, code = round(x / d)
// half away from zero, ggml's quantize_row_q8_0; a block with a non-finite value gets a NaN scale).
// Shared memory: the converted K and V tiles 2 x 64 x (D + 8) x 2, the stages 2 x NST x 64 x (D + D/16), then
// the q rows as above (cuda/attention.py split_stage_bytes).

#include "attention_common.cuh"
#include "rope.cuh"

// SP_WARPS, SP_BK, SP_SOLO, SP_STAGES(D): llamacli/backends/cuda/constants.py (the loader puts them in front)
#define SP_LOG2E 1.4426950408889634f

template <int D, bool STEP, bool NEOX, bool Q8>
__device__ __forceinline__ void attention_split_body(
    const float* __restrict__ q, u16* kc, u16* vc, int ring, const int* __restrict__ pos, int Hq, int Hkv, float qscale,
    int window, float cap2, const float* __restrict__ sinks, float* part_o, float* part_ml, unsigned int* counters,
    float* __restrict__ out, int rope_dim, const double* __restrict__ inv_freq, float attn,
    const float* __restrict__ qn, const float* __restrict__ kn, float eps, int early) {
    constexpr int NST = SP_STAGES(D);
    constexpr int KS = D / 16;  // k16 steps over the head dim
    constexpr int NO = D / 8;   // n8 tiles of an output row
    constexpr int RS = D + 8;   // shared row stride in halves (conflict-free ldmatrix rows)
    constexpr int CPR = D / 8;  // 16-byte chunks per key row
    constexpr bool QREG = D <= 128;  // q fragments in registers (D 256: from shared memory per k step)
    constexpr u32 ONES = 0x3c003c00u;
    constexpr int NSC = D / 32;  // Q8: scales per key row
    extern __shared__ __align__(16) u16 sp_smem[];
    // fp16: K and V stages [NST][64][RS]. Q8: one converted K and V tile [64][RS] each, then the stages of codes
    // [NST][64][D] bytes (K, then V) and of scales [NST][64][NSC] halves (K, then V).
    u16* ks = sp_smem;
    u16* vs = ks + (Q8 ? 1 : NST) * SP_BK * RS;
    u8* kr = reinterpret_cast<u8*>(vs + (Q8 ? 1 : NST) * SP_BK * RS);
    u8* vr = kr + (Q8 ? NST * SP_BK * D : 0);
    u16* ksc = reinterpret_cast<u16*>(vr + (Q8 ? NST * SP_BK * D : 0));
    u16* vsc = ksc + (Q8 ? NST * SP_BK * NSC : 0);
    u16* qsm = vsc + (Q8 ? NST * SP_BK * NSC : 0);         // [16][RS] q rows, fp16, scaled and rotated
    const u8* kb = reinterpret_cast<const u8*>(kc);       // Q8: codes [ring, Hkv, D], then scales [Hkv, ring, NSC]
    const u8* vb = reinterpret_cast<const u8*>(vc);
    const u16* kscale = reinterpret_cast<const u16*>(kb + (long long)ring * Hkv * D);
    const u16* vscale = reinterpret_cast<const u16*>(vb + (long long)ring * Hkv * D);
    float* qf = reinterpret_cast<float*>(qsm + 16 * RS);   // [G + 1][D] q rows (and k) while prepared
    __shared__ float s_ml[SP_WARPS][16][2];
    __shared__ float s_inv[16];
    __shared__ int s_last;

    const int G = Hq / Hkv, kvh = blockIdx.x, split = blockIdx.y, S = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int p = pos[0];  // written by an earlier step, not by the kernel before this one
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    const int t_lo = lo / SP_BK, t_hi = p / SP_BK, nt = t_hi - t_lo + 1;
    const int per = nt <= SP_SOLO ? nt : (nt + S - 1) / S, n_act = (nt + per - 1) / per;
    if (split >= n_act) return;  // whole block: no key for this split at this position
    const int ta = t_lo + split * per, tb = min(ta + per, t_hi + 1);  // this split's tiles [ta, tb)
    const bool holder = STEP && tb == t_hi + 1;  // the split holding p stores p's K and V

    auto load_tile = [&](int tile, int kmax) {  // keys [lo, kmax) of tile (zeros elsewhere); one cp.async group
        const int buf = (tile - ta) % NST, k0 = tile * SP_BK, r0 = tile < tb ? k0 % ring : 0;  // r0: key k0's row
        if constexpr (Q8) {  // codes (16 bytes = 16 values a copy), then the tile's scales (contiguous per KV head)
            constexpr int CC = D / 16;
            u8* kd = kr + buf * SP_BK * D;
            u8* vd = vr + buf * SP_BK * D;
            for (int e = threadIdx.x; tile < tb && e < SP_BK * CC; e += SP_WARPS * 32) {
                const int j = e / CC, c = e - j * CC, key = k0 + j;
                const bool ok = key < kmax && key >= lo;
                const long long off = ((long long)(ok ? r0 + j : 0) * Hkv + kvh) * D + c * 16;
                cp_async16(smem_addr(kd + j * D + c * 16), kb + off, ok ? 16 : 0);
                cp_async16(smem_addr(vd + j * D + c * 16), vb + off, ok ? 16 : 0);
            }
            const long long s0 = ((long long)kvh * ring + r0) * NSC;
            for (int e = threadIdx.x; tile < tb && e < SP_BK * NSC / 8; e += SP_WARPS * 32) {
                cp_async16(smem_addr(ksc + buf * SP_BK * NSC + e * 8), kscale + s0 + e * 8, 16);
                cp_async16(smem_addr(vsc + buf * SP_BK * NSC + e * 8), vscale + s0 + e * 8, 16);
            }
        } else {
            u16* kd = ks + buf * SP_BK * RS;
            u16* vd = vs + buf * SP_BK * RS;
            for (int e = threadIdx.x; tile < tb && e < SP_BK * CPR; e += SP_WARPS * 32) {
                const int j = e / CPR, c = e - j * CPR, key = k0 + j;
                const bool ok = key < kmax && key >= lo;
                const long long off = ((long long)(ok ? r0 + j : 0) * Hkv + kvh) * D + c * 8;
                cp_async16(smem_addr(kd + j * RS + c * 8), kc + off, ok ? 16 : 0);
                cp_async16(smem_addr(vd + j * RS + c * 8), vc + off, ok ? 16 : 0);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    // The first NST - 1 tiles go out before pdl_wait: the cache rows before p are earlier steps' (STEP: row p
    // is this step's, written below and patched into its stage).
#pragma unroll
    for (int i = 0; i < NST - 1; ++i) load_tile(ta + i, STEP ? p : p + 1);
    pdl_wait();  // q (the QKV matvec's output), the partials and the counters belong to earlier kernels
    if (early) pdl_launch_dependents();

    // q rows (and, for the holder, this token's k) -> qf, f32.
    const int nr = G + (holder ? 1 : 0);
    for (int e = threadIdx.x; e < nr * D; e += SP_WARPS * 32) {
        const int r = e / D, d = e - r * D;
        qf[e] = r < G ? q[(kvh * G + r) * D + d] : q[(Hq + kvh) * D + d];
    }
    __syncthreads();
    if (STEP && qn != nullptr) {  // per-head RMSNorm, a warp per row (q rows take qn, k takes kn)
        for (int r = warp; r < nr; r += SP_WARPS) {
            float ss = 0.0f;
            for (int d = lane; d < D; d += 32) ss = fmaf(qf[r * D + d], qf[r * D + d], ss);
            const float rr = rsqrtf(warp_sum(ss) / (float)D + eps);
            const float* w = r < G ? qn : kn;
            for (int d = lane; d < D; d += 32) qf[r * D + d] *= rr * w[d];
        }
        __syncthreads();
    }
    constexpr int HALF = D / 2;
    for (int e = threadIdx.x; e < 16 * HALF; e += SP_WARPS * 32) {  // q rows, rotated and scaled, as fp16
        const int r = e / HALF, i = e - r * HALF;
        u16* qd = qsm + r * RS;
        if (r >= G) {
            qd[2 * i] = qd[2 * i + 1] = 0;
        } else if (STEP) {
            int da, db;
            float oa, ob;
            rope_pair<NEOX>(qf + r * D, i, D, rope_dim, p, inv_freq, attn, da, db, oa, ob);
            qd[da] = f2h(oa * qscale);
            qd[db] = f2h(ob * qscale);
        } else {
            qd[2 * i] = f2h(qf[r * D + 2 * i] * qscale);
            qd[2 * i + 1] = f2h(qf[r * D + 2 * i + 1] * qscale);
        }
    }
    const long long at = ((long long)(p % ring) * Hkv + kvh) * D;  // position p of this KV head in the caches
    if (holder && !Q8) {  // this token's K (rotated) and V into the cache
        const float* v = q + (Hq + Hkv + kvh) * D;
        for (int i = threadIdx.x; i < HALF; i += SP_WARPS * 32) {
            int da, db;
            float oa, ob;
            rope_pair<NEOX>(qf + G * D, i, D, rope_dim, p, inv_freq, attn, da, db, oa, ob);
            kc[at + da] = f2h(oa);
            kc[at + db] = f2h(ob);
            vc[at + 2 * i] = f2h(v[2 * i]);
            vc[at + 2 * i + 1] = f2h(v[2 * i + 1]);
        }
        if (t_hi - ta < NST - 1) {  // p's tile went out before the store: patch row p into its stage
            asm volatile("cp.async.wait_group 0;" ::: "memory");
            __syncthreads();  // every copy (and zero fill) of the stage landed; the stores above are visible
            const int buf = (t_hi - ta) % NST, j = p - t_hi * SP_BK;
            for (int d = threadIdx.x; d < D; d += SP_WARPS * 32) {
                ks[(buf * SP_BK + j) * RS + d] = kc[at + d];
                vs[(buf * SP_BK + j) * RS + d] = vc[at + d];
            }
        }
    } else if (holder) {  // Q8: K rotated in place (each thread its own pair), then a warp per 32-value block
        for (int i = threadIdx.x; i < HALF; i += SP_WARPS * 32) {
            int da, db;
            float oa, ob;
            rope_pair<NEOX>(qf + G * D, i, D, rope_dim, p, inv_freq, attn, da, db, oa, ob);
            qf[G * D + da] = oa;
            qf[G * D + db] = ob;
        }
        __syncthreads();
        const float* v = q + (Hq + Hkv + kvh) * D;
        const long long srow = (long long)kvh * ring + p % ring;  // row p's scales
        for (int b = warp; b < 2 * NSC; b += SP_WARPS) {
            const bool isv = b >= NSC;
            const int c = (isv ? b - NSC : b) * 32 + lane;
            u8 code;
            u16 d;
            quantize_q8_lane(isv ? v[c] : qf[G * D + c], code, d);
            const_cast<u8*>(isv ? vb : kb)[at + c] = code;
            if (lane == 0) const_cast<u16*>(isv ? vscale : kscale)[srow * NSC + c / 32] = d;
        }
        if (t_hi - ta < NST - 1) {  // p's tile went out before the store: patch row p's codes and scales
            asm volatile("cp.async.wait_group 0;" ::: "memory");
            __syncthreads();
            const int buf = (t_hi - ta) % NST, j = p - t_hi * SP_BK;
            for (int d = threadIdx.x; d < D; d += SP_WARPS * 32) {
                kr[(buf * SP_BK + j) * D + d] = kb[at + d];
                vr[(buf * SP_BK + j) * D + d] = vb[at + d];
            }
            for (int c = threadIdx.x; c < NSC; c += SP_WARPS * 32) {
                ksc[(buf * SP_BK + j) * NSC + c] = kscale[srow * NSC + c];
                vsc[(buf * SP_BK + j) * NSC + c] = vscale[srow * NSC + c];
            }
        }
    }
    __syncthreads();  // qsm complete; the holder's cache rows visible to the block's later copies

    const u32 q_lds = smem_addr(qsm + (((lane >> 3) & 1) * 8 + (lane & 7)) * RS + ((lane >> 4) << 3));
    u32 qa[QREG ? KS : 1][4];
    if constexpr (QREG) {
#pragma unroll
        for (int k = 0; k < KS; ++k) ldsm_x4(q_lds + (u32)(k * 32), qa[k][0], qa[k][1], qa[k][2], qa[k][3]);
    }
    float o[NO][4], l[4] = {0.0f, 0.0f, 0.0f, 0.0f}, m[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    const int qp[2] = {p, p};
    // ldmatrix rows (attention_mma.cu): K plain, matrix mi = keys 8 (mi >> 1) + [0, 8) at dims 8 (mi & 1);
    // V transposed, matrix mi = keys 8 (mi & 1) + [0, 8) at dims 8 (mi >> 1); both from this warp's 16 keys.
    const int mi = lane >> 3, r8 = lane & 7;
    const int koff = (16 * warp + ((mi >> 1) << 3) + r8) * RS + ((mi & 1) << 3);
    const int voff = (16 * warp + ((mi & 1) << 3) + r8) * RS + ((mi >> 1) << 3);

    for (int it = ta; it < tb; ++it) {
        const int buf = (it - ta) % NST;
        asm volatile("cp.async.wait_group %0;" ::"n"(NST - 2) : "memory");
        __syncthreads();  // tile it landed for every thread; every warp is done with the buffer refilled next
        load_tile(it + NST - 1, p + 1);
        if (it + NST < tb) {  // the tile after those in flight on its way to L2 (twice the bytes in flight)
            const long long row0 = (long long)((it + NST) * SP_BK % ring) * Hkv + kvh;
            const int rows = min(SP_BK, p + 1 - (it + NST) * SP_BK);  // keys up to p: none past the cache
            constexpr int RB = Q8 ? D : 2 * D;  // bytes per key row
            constexpr int LPR = (RB + 127) / 128;  // 128-byte lines per row
            const u8* kp = reinterpret_cast<const u8*>(kc);
            const u8* vp = reinterpret_cast<const u8*>(vc);
            for (int e = threadIdx.x; e < rows * LPR; e += SP_WARPS * 32) {
                const int j = e / LPR, c = e - j * LPR;
                const long long off = (row0 + (long long)j * Hkv) * RB + c * 128;
                asm volatile("prefetch.global.L2 [%0];" ::"l"(kp + off));
                asm volatile("prefetch.global.L2 [%0];" ::"l"(vp + off));
            }
            if (Q8 && threadIdx.x < (SP_BK * NSC * 2 + 127) / 128) {  // the tile's scales
                const long long s0 = ((long long)kvh * ring + (it + NST) * SP_BK % ring) * NSC + threadIdx.x * 64;
                asm volatile("prefetch.global.L2 [%0];" ::"l"(kscale + s0));
                asm volatile("prefetch.global.L2 [%0];" ::"l"(vscale + s0));
            }
        }
        if constexpr (Q8) {  // codes x scales -> the fp16 K and V tiles (zeros outside the keys seen)
            const u8* kq = kr + buf * SP_BK * D;
            const u8* vq = vr + buf * SP_BK * D;
            const u16* kd = ksc + buf * SP_BK * NSC;
            const u16* vd = vsc + buf * SP_BK * NSC;
            for (int e = threadIdx.x; e < SP_BK * D / 8; e += SP_WARPS * 32) {
                const int j = e / (D / 8), c = (e - j * (D / 8)) * 8, key = it * SP_BK + j;
                const bool ok = key >= lo && key <= p;
                const u16 sk = ok ? kd[j * NSC + c / 32] : (u16)0;
                const u16 sv = ok ? vd[j * NSC + c / 32] : (u16)0;
                const uint2 kw = *reinterpret_cast<const uint2*>(kq + j * D + c);
                const uint2 vw = *reinterpret_cast<const uint2*>(vq + j * D + c);
                *reinterpret_cast<uint4*>(ks + j * RS + c) = dequant8_q8(kw, sk);
                *reinterpret_cast<uint4*>(vs + j * RS + c) = dequant8_q8(vw, sv);
            }
            __syncthreads();  // the converted tiles complete
        }
        const int k0 = it * SP_BK + 16 * warp;  // this warp's first key
        if (k0 > p || k0 + 15 < lo) continue;  // warp-uniform: none of its keys is seen
        const u32 kt = smem_addr(ks + (Q8 ? 0 : buf) * SP_BK * RS + koff);
        const u32 vt = smem_addr(vs + (Q8 ? 0 : buf) * SP_BK * RS + voff);
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int k = 0; k < KS; ++k) {
            u32 qt[4];
            if constexpr (QREG) {
                qt[0] = qa[k][0], qt[1] = qa[k][1], qt[2] = qa[k][2], qt[3] = qa[k][3];
            } else {
                ldsm_x4(q_lds + (u32)(k * 32), qt[0], qt[1], qt[2], qt[3]);
            }
            u32 b0, b1, b2, b3;
            ldsm_x4(kt + (u32)(k * 32), b0, b1, b2, b3);
            mma_16816(s[0], qt, b0, b1);
            mma_16816(s[1], qt, b2, b3);
        }
        if (cap2 > 0.0f) {
            const float inv = 1.0f / cap2;
#pragma unroll
            for (int e = 0; e < 8; ++e) (&s[0][0])[e] = cap2 * tanhf((&s[0][0])[e] * inv);
        }
        if (k0 < lo) {  // keys before the window (the causal mask is tile_softmax's)
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (k0 + 8 * (e >> 2) + 2 * tg + (e & 1) < lo) (&s[0][0])[e] = -INFINITY;
        }
        float alpha[2];
        tile_softmax<2>(&s[0][0], m, alpha, qp, k0, p, tg);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            l[c] *= alpha[c >> 1];
#pragma unroll
            for (int n = 0; n < NO; ++n) o[n][c] *= alpha[c >> 1];
        }
        u32 pa[4];
        pa[0] = pack_h2(s[0][0], s[0][1]);
        pa[1] = pack_h2(s[0][2], s[0][3]);
        pa[2] = pack_h2(s[1][0], s[1][1]);
        pa[3] = pack_h2(s[1][2], s[1][3]);
        mma_16816(l, pa, ONES, ONES);
#pragma unroll
        for (int nd = 0; nd < D / 16; ++nd) {
            u32 b0, b1, b2, b3;
            ldsm_x4_trans(vt + (u32)(nd * 32), b0, b1, b2, b3);
            mma_16816(o[2 * nd], pa, b0, b1);
            mma_16816(o[2 * nd + 1], pa, b2, b3);
        }
    }
    if (!early) pdl_launch_dependents();
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();  // the stages are free: the warps' (o, m, l) go there

    float* wo = reinterpret_cast<float*>(sp_smem);  // [4 warps][G][D]
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = g + 8 * i;
        if (r >= G) continue;
#pragma unroll
        for (int n = 0; n < NO; ++n)
            *reinterpret_cast<float2*>(wo + (warp * G + r) * D + 8 * n + 2 * tg) = make_float2(o[n][2 * i],
                                                                                               o[n][2 * i + 1]);
        if (tg == 0) {
            s_ml[warp][r][0] = m[i];
            s_ml[warp][r][1] = l[2 * i];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * D; e += SP_WARPS * 32) {
        const int r = e / D, d = e - r * D, h = kvh * G + r;
        float M = -INFINITY;  // finite: some warp saw a key of the split
#pragma unroll
        for (int w = 0; w < SP_WARPS; ++w) M = fmaxf(M, s_ml[w][r][0]);
        float L = 0.0f, acc = 0.0f;
#pragma unroll
        for (int w = 0; w < SP_WARPS; ++w) {
            const float wt = ex2(s_ml[w][r][0] - M);
            L = fmaf(s_ml[w][r][1], wt, L);
            acc = fmaf(wo[(w * G + r) * D + d], wt, acc);
        }
        if (n_act == 1) {
            if (sinks) L += ex2(sinks[h] * SP_LOG2E - M);
            out[h * D + d] = acc / L;
            continue;
        }
        const long long row = (long long)split * Hq + h;
        part_o[row * D + d] = acc;
        if (d == 0) {
            part_ml[2 * row] = M;
            part_ml[2 * row + 1] = L;
        }
    }
    if (n_act == 1) return;
    // The last of the KV head's n_act blocks to finish merges them.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(counters + kvh, 1u) == (unsigned int)(n_act - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // Each L2 round trip of the merge lies on the layer's critical path, so its reads go out together: each
    // split's (m, l) once (into shared memory, then the weights), and every output float4 of the KV head (NS =
    // G x D / 4 of them) as a dot product over the splits, MU loads in flight a thread. The float4s go in
    // passes of `pass` = min(NS, threads): in a pass, thread t takes float4 s0 + t % pass over the splits
    // t / pass, t / pass + NP, ... (NP = threads / pass groups: more than one where NS is at most half the
    // threads; threads past NP x pass idle), and the groups meet in shared memory.
    constexpr int MU = 8;
    float* wts = reinterpret_cast<float*>(sp_smem);  // [n_act][G] each split's m, then its weight, per row
    float* ls = wts + n_act * G;                      // [n_act][G] each split's l
    float4* red = reinterpret_cast<float4*>(sp_smem) + (2 * n_act * G + 3) / 4;  // [SP_WARPS * 32] the groups' sums
    for (int r = warp; r < G; r += SP_WARPS) {
        const int h = kvh * G + r;
        float M = -INFINITY;
        for (int sp = lane; sp < n_act; sp += 32) {
            const float2 ml = __ldcg(reinterpret_cast<const float2*>(part_ml) + (sp * Hq + h));
            wts[sp * G + r] = ml.x;
            ls[sp * G + r] = ml.y;
            M = fmaxf(M, ml.x);
        }
        M = warp_max(M);
        float L = 0.0f;
        for (int sp = lane; sp < n_act; sp += 32) {
            const float w = ex2(wts[sp * G + r] - M);
            wts[sp * G + r] = w;
            L = fmaf(ls[sp * G + r], w, L);
        }
        L = warp_sum(L);
        if (sinks) L += ex2(sinks[h] * SP_LOG2E - M);
        if (lane == 0) s_inv[r] = 1.0f / L;
    }
    __syncthreads();
    constexpr int T = SP_WARPS * 32, D4 = D / 4;
    const int NS = G * D4, pass = NS < T ? NS : T, NP = T / pass;  // float4s, float4s a pass, split groups
    const int grp = threadIdx.x / pass, sl = threadIdx.x - grp * pass;
    const long long stride = (long long)Hq * D4;  // float4s from one split's partial to the next's
    for (int s0 = 0; s0 < NS; s0 += pass) {
        const int slot = s0 + sl, r = slot / D4;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (grp < NP && slot < NS) {
            const float4* po = reinterpret_cast<const float4*>(part_o) + (long long)(kvh * G) * D4 + slot;
            int sp = grp;
            for (; sp + (MU - 1) * NP < n_act; sp += MU * NP) {
                float4 v[MU];
#pragma unroll
                for (int i = 0; i < MU; ++i) v[i] = __ldcg(po + (sp + i * NP) * stride);
#pragma unroll
                for (int i = 0; i < MU; ++i) {
                    const float w = wts[(sp + i * NP) * G + r];
                    acc = make_float4(fmaf(v[i].x, w, acc.x), fmaf(v[i].y, w, acc.y), fmaf(v[i].z, w, acc.z),
                                      fmaf(v[i].w, w, acc.w));
                }
            }
            for (; sp < n_act; sp += NP) {
                const float4 v = __ldcg(po + sp * stride);
                const float w = wts[sp * G + r];
                acc = make_float4(fmaf(v.x, w, acc.x), fmaf(v.y, w, acc.y), fmaf(v.z, w, acc.z), fmaf(v.w, w, acc.w));
            }
        }
        if (NP > 1) {  // (uniform: NP is the block's; then this is the only pass, and red is read once)
            red[threadIdx.x] = acc;
            __syncthreads();
            if (grp == 0 && slot < NS)
                for (int g2 = 1; g2 < NP; ++g2) {
                    const float4 o2 = red[g2 * pass + sl];
                    acc = make_float4(acc.x + o2.x, acc.y + o2.y, acc.z + o2.z, acc.w + o2.w);
                }
        }
        if (grp == 0 && slot < NS) {
            const float inv = s_inv[r];
            reinterpret_cast<float4*>(out)[(long long)(kvh * G) * D4 + slot] =
                make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
        }
    }
    if (threadIdx.x == 0) counters[kvh] = 0u;
}

#define ATTENTION_SPLIT_STEP(D, MODE, NEOX, Q8, SFX)                                                           \
    extern "C" __global__ void __launch_bounds__(SP_WARPS * 32) attention_split_step##SFX##_##MODE##_d##D(    \
        const float* qkv, u16* kc, u16* vc, int ring, const int* pos, int Hq, int Hkv, float qscale,           \
        int window, float cap2, const float* sinks, float* part_o, float* part_ml, unsigned int* counters,     \
        float* out, int rope_dim, const double* inv_freq, float attn, const float* qn, const float* kn,        \
        float eps, int early) {                                                                                \
        attention_split_body<D, true, NEOX, Q8>(qkv, kc, vc, ring, pos, Hq, Hkv, qscale, window, cap2, sinks,  \
                                                part_o, part_ml, counters, out, rope_dim, inv_freq, attn, qn,  \
                                                kn, eps, early);                                               \
    }
#define ATTENTION_SPLIT_FORMS(D, Q8, SFX)                                                                      \
    extern "C" __global__ void __launch_bounds__(SP_WARPS * 32) attention_split##SFX##_d##D(                   \
        const float* q, u16* kc, u16* vc, int ring, const int* pos, int Hq, int Hkv, float qscale, int window, \
        float cap2, const float* sinks, float* part_o, float* part_ml, unsigned int* counters, float* out) {   \
        attention_split_body<D, false, false, Q8>(q, kc, vc, ring, pos, Hq, Hkv, qscale, window, cap2, sinks,  \
                                                  part_o, part_ml, counters, out, 0, nullptr, 1.0f, nullptr,   \
                                                  nullptr, 0.0f, 0);                                           \
    }                                                                                                          \
    ATTENTION_SPLIT_STEP(D, normal, false, Q8, SFX)                                                            \
    ATTENTION_SPLIT_STEP(D, neox, true, Q8, SFX)
#define ATTENTION_SPLIT(D) ATTENTION_SPLIT_FORMS(D, false, )
#define ATTENTION_SPLIT_Q8(D) ATTENTION_SPLIT_FORMS(D, true, _q8)

ATTENTION_SPLIT(64)
ATTENTION_SPLIT(80)
ATTENTION_SPLIT(96)
ATTENTION_SPLIT(112)
ATTENTION_SPLIT(128)
ATTENTION_SPLIT(256)
ATTENTION_SPLIT_Q8(64)
ATTENTION_SPLIT_Q8(96)
ATTENTION_SPLIT_Q8(128)
ATTENTION_SPLIT_Q8(256)
