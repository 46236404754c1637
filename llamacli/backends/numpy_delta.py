"""The gated delta rule in NumPy (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks"): the reference the CUDA
kernels of Gated DeltaNet layers are to be tested against, in its two forms.

Per value head, with a state S [d_k, d_v], and per token: a log-decay g <= 0, a rate beta in (0, 1), an L2-normalised
key k and query q [d_k] (q already scaled by 1 / sqrt(d_k)), a value v [d_v]:

    S' = exp(g) S                      forget
    u  = beta (v - S'^T k)             the correction: how far what S' recalls for k is from v, at rate beta
    S  = S' + k u^T                    write it
    o  = S^T q                         read

`recurrent` runs that token by token (the definition, and the decode step). `chunked` runs whole chunks with
matrix products (what a prefill kernel does: flash-linear-attention's chunk_gated_delta_rule, chunks of 64).
Within a chunk starting from state S, with Gamma_i = exp(g_1 + ... + g_i) (the decay from the chunk's start
through token i) and the chunk's rows stacked (K, Q [C, d_k], V, U [C, d_v]):

    S_i = Gamma_i S + sum_{j <= i} (Gamma_i / Gamma_j) k_j u_j^T
    u_j = beta_j (v_j - Gamma_j S^T k_j - sum_{m < j} (Gamma_j / Gamma_m) (k_j . k_m) u_m)

so that (I + A) U = diag(beta) (V - diag(Gamma) K S), with A [C, C] strictly lower triangular, A_jm =
beta_j (Gamma_j / Gamma_m) (k_j . k_m): U = (I + A)^-1 (...) (the UT / WY transform; a triangular solve). Then

    O     = diag(Gamma) Q S + ((Q K^T) * D) U          D_ij = Gamma_i / Gamma_j for j <= i, else 0
    S_end = Gamma_C S + (K * (Gamma_C / Gamma))^T U

Only ratios Gamma_i / Gamma_j with j <= i (<= 1) and Gamma themselves (<= 1) are formed, so nothing overflows.
The two forms agree to float32 rounding (tests/backends/test_numpy_delta.py).

Arrays carry the value heads first: q, k [H, T, d_k], v [H, T, d_v], g and beta [H, T], S [H, d_k, d_v]; float32.
"""

from __future__ import annotations

import numpy as np

CHUNK = 64  # tokens per chunk (flash-linear-attention's and llama.cpp's chunk size)


def recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
              s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token by token -> (o [H, T, d_v], the state after the last token). `s` is not written (a new array is)."""
    out = np.empty_like(v)
    for t in range(q.shape[1]):
        s = s * np.exp(g[:, t])[:, None, None]  # forget
        recall = np.einsum("hk,hkv->hv", k[:, t], s)  # S'^T k [H, d_v]
        u = (v[:, t] - recall) * beta[:, t, None]
        s = s + k[:, t, :, None] * u[:, None, :]  # S' + k u^T
        out[:, t] = np.einsum("hk,hkv->hv", q[:, t], s)  # S^T q
    return out, s


def chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
            s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One chunk of T tokens (any T; a prefill takes CHUNK at a time) in matrix form -> (o [H, T, d_v], the state
    after the last token)."""
    t = q.shape[1]
    cum = np.cumsum(g.astype(np.float64), axis=1)  # [H, T] log Gamma
    gamma = np.exp(cum)  # [H, T], Gamma_i <= 1
    causal = np.tril(np.ones((t, t), dtype=bool))
    ratio = np.where(causal, np.exp(np.where(causal, cum[:, :, None] - cum[:, None, :], 0.0)), 0.0)  # [H, T, T]
    kk = k @ k.transpose(0, 2, 1)  # [H, T, T] k_j . k_m
    a = np.where(np.tril(causal, -1), beta[:, :, None] * ratio * kk, 0.0)  # strictly lower
    rhs = beta[:, :, None] * (v - gamma[:, :, None] * (k @ s))  # diag(beta) (V - diag(Gamma) K S)
    u = np.linalg.solve(np.eye(t) + a, rhs)  # (I + A) U = rhs
    o = gamma[:, :, None] * (q @ s) + ((q @ k.transpose(0, 2, 1)) * ratio) @ u
    tail = np.exp(cum[:, -1:] - cum)[:, :, None]  # Gamma_C / Gamma_j <= 1 [H, T, 1]
    end = gamma[:, -1, None, None] * s + (k * tail).transpose(0, 2, 1) @ u
    return o.astype(np.float32), end.astype(np.float32)
