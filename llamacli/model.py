"""The transformer forward pass, written once against the backend operations (backends/base.py).

Pre-norm decoder blocks of grouped-query attention and a SwiGLU feed-forward (or a mixture of experts),
RMSNorm, rotary positions; what differs by architecture (fused matrices, biases, q/k norms, RoPE-less layers,
attention sinks, experts) is read from each layer's plan, cfg.layers[i] (llamacli/models/). Activations
float32; shapes in brackets with T tokens, D = n_embd, Hq/Hkv heads, Dh = head_dim, F = n_ff, V = vocab.

Prefill passes the whole prompt (T > 1, matrix-matrix products); decode passes one token (T = 1,
matrix-vector). Positions come as a backend array so the same code can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .backends.base import Backend
from .config import ModelConfig


def forward(be: Backend, cfg: ModelConfig, ids: Any, pos: Any, all_logits: bool = False) -> Any:
    """ids [T] token ids and pos [T] absolute positions (backend int32 arrays) -> logits [1, V] for the
    last position ([T, V] with all_logits), as a backend array. Writes K/V of the T tokens into the cache."""
    w = be.weights
    t = ids.shape[0]
    hq, hkv, dh = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    x = be.embed(ids)  # [T, D], times cfg.embd_scale (gemma: sqrt(D))
    for i, L in enumerate(w.layers):
        plan = cfg.layers[i]
        # Attention block: x += Wo . attention(rope(Wq h), rope(Wk h), Wv h), h = rmsnorm(x)
        h = be.rms_norm(x, L.attn_norm, cfg.rms_eps)
        if plan.fused_qkv:  # phi3: one matrix, rows [q; k; v]
            qkv = be.matmul(h, L.attn_qkv)  # [T, (Hq + 2 Hkv) Dh]
            q, k, v = qkv[:, : cfg.q_dim], qkv[:, cfg.q_dim : cfg.q_dim + cfg.kv_dim], qkv[:, cfg.q_dim + cfg.kv_dim :]
        else:
            q = be.matmul(h, L.attn_q, L.attn_q_bias)  # [T, Hq Dh]
            k = be.matmul(h, L.attn_k, L.attn_k_bias)  # [T, Hkv Dh]
            v = be.matmul(h, L.attn_v, L.attn_v_bias)  # [T, Hkv Dh]
        q, k = q.reshape(t, hq, dh), k.reshape(t, hkv, dh)
        if plan.qk_norm:  # qwen3: RMSNorm of each head's q and k, one weight [Dh] for all heads
            q, k = be.rms_norm(q, L.attn_q_norm, cfg.rms_eps), be.rms_norm(k, L.attn_k_norm, cfg.rms_eps)
        if plan.rope:  # smollm3's NoPE layers skip it; gemma's sliding-window layers use the local table
            q, k = be.rope(q, pos, plan.rope_local), be.rope(k, pos, plan.rope_local)
        a = be.attention(i, q, k, v.reshape(t, hkv, dh), pos)  # [T, Hq Dh] (window, soft-cap: the plan's)
        o = be.matmul(a, L.attn_output, L.attn_output_bias)  # [T, D] (+ bias: gpt-oss)
        if plan.post_norms:  # gemma: the block's output normalised before the residual add
            o = be.rms_norm(o, L.attn_post_norm, cfg.rms_eps)
        x = be.add(x, o)

        # Feed-forward block: x += W_down (act(W_gate h) * W_up h), h = rmsnorm(x); act as the plan names it
        h = be.rms_norm(x, L.ffn_norm, cfg.rms_eps)
        if plan.moe:  # qwen3moe, gpt-oss: the weighted sum of the FFNs of the experts the router picks
            f = be.moe(h, i)  # [T, D]
        else:
            if plan.fused_gate_up:  # phi3: ffn_up rows [gate; up]
                gu = be.matmul(h, L.ffn_up)  # [T, 2F]
                g, u = gu[:, : cfg.n_ff], gu[:, cfg.n_ff :]
            else:
                g, u = be.matmul(h, L.ffn_gate), be.matmul(h, L.ffn_up)  # [T, F] each
            f = be.matmul(be.gated(plan.activation, g, u), L.ffn_down)
        if plan.post_norms:
            f = be.rms_norm(f, L.ffn_post_norm, cfg.rms_eps)
        x = be.add(x, f)

    if not all_logits:
        x = x[t - 1 :]  # only the last position feeds the next token
    x = be.rms_norm(x, w.output_norm, cfg.rms_eps)
    logits = be.matmul(x, w.output)  # [1 or T, V]
    return be.softcap(logits, cfg.final_softcap) if cfg.final_softcap else logits


def prefill(be: Backend, cfg: ModelConfig, ids: Any, start: int) -> Any:
    """Run prompt ids [T] (host integers) at positions start.. through the model, filling the KV cache:
    one forward pass, or passes of be.prefill_chunk tokens where the backend sets one. -> logits [1, V] of
    the last token."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise ValueError("prefill needs at least one token")
    n = be.prefill_chunk or ids.size
    for s in range(0, ids.size, n):
        logits = be.forward_prompt(ids[s : s + n], start + s)
    return logits
