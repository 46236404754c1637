"""What a transformer layer computes, written once: each layer's plan (base.LayerPlan) turned into a short
program of operations that every executor runs.

`layer_ops(cfg, i)` is the only reader of a plan's flags for the computation (weights.py reads them for the
tensors a layer needs). Each executor runs the same program and chooses its own fusions, as llama.cpp builds
one graph per model and lets each backend fuse it:

- `run` below, eagerly, through the Backend operations (backends/base.py): the NumPy reference, and the CUDA
  backend's op-by-op path (every operation a kernel of its own);
- the CUDA backend's prefill pass and captured decode step (backends/cuda/fusion.py matches the program
  against the fused forms its kernels offer; prefill.py and decode.py launch them).

A program is a tuple of operations on named values: "x" the residual stream [T, D]; "h" a normalised input;
"q", "k", "v" the projections [T, H Dh] (heads of Dh values side by side); "att" the attention's output
[T, Hq Dh]; "o" and "f" a block's output [T, D]; "g", "u" the gated FFN's halves [T, F], "ff" its activation.
Weights are named by their LayerWeights field (ModelWeights for the model's own: output_norm, output), so a
program depends on the config alone and can be printed, compared and cached.

Adding a feature to a layer: a flag in its model module's plan, the operation it implies here, and that
operation in each executor (until the CUDA backend's fused paths have a form for it, fusion.py refuses such a
program at load with one line naming the operation).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Union

import numpy as np


@dataclass(frozen=True)
class Norm:
    """dst = src / sqrt(mean(src^2) + eps) * weight over the last axis; `heads`: per head of Dh values (the
    q/k norm: one weight [Dh] for every head)."""

    src: str
    weight: str
    dst: str
    heads: bool = False


@dataclass(frozen=True)
class Linear:
    """dst [T, N] = src [T, K] @ weight[N, K]^T (+ bias [N])."""

    src: str
    weight: str
    dst: str
    bias: str | None = None


@dataclass(frozen=True)
class Split:
    """src's columns, in order, as the values dsts of widths `sizes` (phi3's fused QKV and gate/up rows)."""

    src: str
    dsts: tuple[str, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Rope:
    """src [T, H, Dh] rotated at the tokens' positions (the config's pairing, rope_dim and scaling; `local`: the
    local table, cfg.rope_local_base without scaling: gemma's sliding-window layers)."""

    src: str
    local: bool = False


@dataclass(frozen=True)
class Attention:
    """att = causal GQA of q over layer `layer`'s cache after k and v are written into it at the tokens'
    positions: scores times cfg.query_scale, soft-capped c tanh(s / c) when softcap > 0, keys within `window`
    positions (0: all), a learned logit per head in the softmax's denominator when `sinks` (attn_sinks)."""

    layer: int
    window: int = 0
    softcap: float = 0.0
    sinks: bool = False
    q: str = "q"
    k: str = "k"
    v: str = "v"
    dst: str = "att"


@dataclass(frozen=True)
class Glu:
    """dst = act(gate) * up: "silu" (SwiGLU), "gelu_tanh" (GeGLU) or "swiglu_oai" (gpt-oss's clamped form)."""

    activation: str
    gate: str = "g"
    up: str = "u"
    dst: str = "ff"


@dataclass(frozen=True)
class Moe:
    """dst = the weighted sum of the FFNs of the cfg.n_expert_used experts the router (ffn_gate_inp) picks per
    token of src (models/moe.py route: `gating`; each expert a Glu of `activation`; biases when `bias`)."""

    layer: int
    gating: str
    activation: str
    bias: bool = False
    src: str = "h"
    dst: str = "f"


@dataclass(frozen=True)
class Add:
    """x += src (the residual add)."""

    src: str


Op = Union[Norm, Linear, Split, Rope, Attention, Glu, Moe, Add]


@lru_cache(maxsize=8)
def programs(cfg: Any) -> tuple[tuple[Op, ...], ...]:
    """Every block's program, made once per config (a forward pass looks them up once: hashing a config costs
    tens of microseconds)."""
    return tuple(_program(cfg, i) for i in range(cfg.n_layer))


def layer_ops(cfg: Any, i: int) -> tuple[Op, ...]:
    """Block i's program."""
    return programs(cfg)[i]


def _program(cfg: Any, i: int) -> tuple[Op, ...]:
    """Block i's program, from its plan cfg.layers[i]: a pre-norm attention block, then a pre-norm FFN block
    (dense or experts), each added into the residual stream."""
    p = cfg.layers[i]
    ops: list[Op] = [Norm("x", "attn_norm", "h")]
    if p.fused_qkv:  # phi3: one matrix, rows [q; k; v]
        ops += [Linear("h", "attn_qkv", "qkv"), Split("qkv", ("q", "k", "v"), (cfg.q_dim, cfg.kv_dim, cfg.kv_dim))]
    else:
        ops += [Linear("h", f"attn_{n}", n, f"attn_{n}_bias" if p.qkv_bias else None) for n in "qkv"]
    if p.qk_norm:  # qwen3, gemma3
        ops += [Norm("q", "attn_q_norm", "q", heads=True), Norm("k", "attn_k_norm", "k", heads=True)]
    if p.rope:  # smollm3's NoPE layers have none
        ops += [Rope("q", p.rope_local), Rope("k", p.rope_local)]
    ops += [Attention(i, p.window, p.attn_softcap, p.sinks),
            Linear("att", "attn_output", "o", "attn_output_bias" if p.o_bias else None)]
    if p.post_norms:  # gemma: the block's output normalised before the residual add
        ops.append(Norm("o", "attn_post_norm", "o"))
    ops += [Add("o"), Norm("x", "ffn_norm", "h")]
    if p.moe:
        ops.append(Moe(i, p.moe_gating, p.activation, p.moe_bias))
    else:
        if p.fused_gate_up:  # phi3: ffn_up rows [gate; up]
            ops += [Linear("h", "ffn_up", "gu"), Split("gu", ("g", "u"), (cfg.n_ff, cfg.n_ff))]
        else:
            ops += [Linear("h", "ffn_gate", "g"), Linear("h", "ffn_up", "u")]
        ops += [Glu(p.activation), Linear("ff", "ffn_down", "f")]
    if p.post_norms:
        ops.append(Norm("f", "ffn_post_norm", "f"))
    ops.append(Add("f"))
    return tuple(ops)


def run(be: Any, cfg: Any, ids: Any, pos: Any, all_logits: bool = False) -> Any:
    """The model through the Backend operations, one at a time: ids [T] token ids and pos [T] positions
    (backend int32 arrays) -> logits [1, V] of the last position ([T, V] with all_logits); writes the K/V of
    the T tokens into the cache."""
    w = be.weights
    t = ids.shape[0]
    x = be.embed(ids)  # [T, D], times cfg.embd_scale (gemma: sqrt(D))
    for ops, L in zip(programs(cfg), w.layers):
        x = run_layer(be, cfg, ops, L, x, pos)
    if not all_logits:
        x = x[t - 1 :]  # only the last position feeds the next token
    logits = be.matmul(be.rms_norm(x, w.output_norm, cfg.rms_eps), w.output)  # [1 or T, V]
    return be.softcap(logits, cfg.final_softcap) if cfg.final_softcap else logits


def run_layer(be: Any, cfg: Any, ops: tuple[Op, ...], L: Any, x: Any, pos: Any) -> Any:
    """One block's program on the residual x [T, D] (eager) -> the new residual."""
    t, dh = x.shape[0], cfg.head_dim
    env: dict[str, Any] = {"x": x}
    for op in ops:
        if isinstance(op, Norm):
            src = env[op.src].reshape(t, -1, dh) if op.heads else env[op.src]
            env[op.dst] = be.rms_norm(src, getattr(L, op.weight), cfg.rms_eps)
        elif isinstance(op, Linear):
            env[op.dst] = be.matmul(env[op.src], getattr(L, op.weight), getattr(L, op.bias) if op.bias else None)
        elif isinstance(op, Split):
            src, col = env[op.src], 0
            for name, n in zip(op.dsts, op.sizes):
                env[name], col = src[:, col : col + n], col + n
        elif isinstance(op, Rope):
            env[op.src] = be.rope(env[op.src].reshape(t, -1, dh), pos, op.local)
        elif isinstance(op, Attention):
            q, k, v = (env[n].reshape(t, -1, dh) for n in (op.q, op.k, op.v))
            env[op.dst] = be.attention(op, q, k, v, pos)  # [T, Hq Dh]
        elif isinstance(op, Glu):
            env[op.dst] = be.gated(op.activation, env[op.gate], env[op.up])
        elif isinstance(op, Moe):
            env[op.dst] = be.moe(op, env[op.src])
        elif isinstance(op, Add):
            env["x"] = be.add(env["x"], env[op.src])
        else:  # pragma: no cover - every Op is handled above
            raise TypeError(f"unknown operation {op!r}")
    return env["x"]


def prefill(be: Any, cfg: Any, ids: Any, start: int) -> Any:
    """Run prompt ids [T] (host integers) at positions start.. through the model, filling the KV cache: one
    pass, or passes of be.prefill_chunk tokens where the backend sets one. -> logits [1, V] of the last token."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise ValueError("prefill needs at least one token")
    n = be.prefill_chunk or ids.size
    for s in range(0, ids.size, n):
        logits = be.forward_prompt(ids[s : s + n], start + s)
    return logits


def layer_op(cfg: Any, i: int, kind: type) -> Any:
    """The first operation of type `kind` in block i's program (how a kernel test names a layer's attention)."""
    return next(op for op in layer_ops(cfg, i) if isinstance(op, kind))
