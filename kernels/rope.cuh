// rope.cuh: one rotary pair of a head vector (the math in rope.cu's header), shared by rope.cu and the fused
// decode attention in attention_split.cu.
#pragma once
#include "common.cuh"

template <bool NEOX>
__device__ __forceinline__ void pair_dims(int i, int half, int& a, int& b) {
    if (NEOX) { a = i; b = i + half; } else { a = 2 * i; b = 2 * i + 1; }
}

// Rotate (or pass) pair i of head vector h [Dh]; returns the two output values and their dims.
template <bool NEOX>
__device__ __forceinline__ void rope_pair(const float* h, int i, int Dh, int rope_dim, int p, const double* inv_freq,
                                          float attn, int& da, int& db, float& oa, float& ob) {
    const int half = rope_dim / 2;
    if (i < half) {
        pair_dims<NEOX>(i, half, da, db);
        double s, c;
        sincos((double)p * inv_freq[i], &s, &c);
        const float cs = (float)c * attn, sn = (float)s * attn;
        const float a = h[da], b = h[db];
        oa = a * cs - b * sn;
        ob = a * sn + b * cs;
    } else {
        da = rope_dim + 2 * (i - half);
        db = da + 1;
        oa = h[da];
        ob = h[db];
    }
}
