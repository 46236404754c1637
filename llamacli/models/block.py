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
A Gated DeltaNet layer (hybrid models: qwen35, qwen35moe, qwen3next) has "qkv" [T, 2 Hk d_k + Hv d_v] (its q, k
and v side by side, before and after the convolution), "z" its output gate [T, Hv d_v], "b" and "a" its beta
and alpha [T, Hv]; a gated attention layer "gate" [T, Hq Dh]; a shared expert "s" [T, D] and its gate "sg" [T, 1].
Gemma 4 adds "r" the router's input [T, D], "e" the experts' output beside the dense FFN's "f", and "ple" the
layer's per-layer input [T, P] (block.per_layer_inputs), "pg" its gated projection [T, P] and "p" its output [T, D];
its layers' head sizes differ (cfg.layer_head_dim), and a shared-KV layer has no "k" or "v".
Weights are named by their LayerWeights field (ModelWeights for the model's own: output_norm, output), so a
program depends on the config alone and can be printed, compared and cached.

Adding a feature to a layer: a flag in its model module's plan, the operation it implies here, and that
operation in each executor (until the CUDA backend's fused paths have a form for it, fusion.py refuses such a
program at load with one line naming the operation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Union

import numpy as np


@dataclass(frozen=True)
class Norm:
    """dst = src / sqrt(mean(src^2) + eps) * weight over the last axis; `heads`: per head of Dh values (the
    q/k norm: one weight [Dh] for every head); weight None: no weight (gemma4's V norm)."""

    src: str
    weight: str | None
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
    """src's columns, in order, as the values dsts of widths `sizes` (phi3's fused QKV and gate/up rows). With
    `groups` > 0 the columns come in that many groups of sum(sizes), each split alike, and each dst joins its
    parts of every group: per head [q; gate] of a gated attention's attn_q (groups Hq), per key head [beta; alpha]
    of qwen3next's ssm_ba (groups Hk)."""

    src: str
    dsts: tuple[str, ...]
    sizes: tuple[int, ...]
    groups: int = 0


@dataclass(frozen=True)
class Rope:
    """src [T, H, Dh] rotated at the tokens' positions (the config's pairing, rope_dim and scaling; `local`: the
    local table, cfg.rope_local_base without scaling: gemma's sliding-window layers)."""

    src: str
    local: bool = False


@dataclass(frozen=True)
class Attention:
    """att = causal GQA of q over layer `layer`'s cache after k and v are written into it at the tokens'
    positions (with `store` False nothing is written: a shared-KV layer's queries read the cache an earlier layer
    wrote in the same pass): scores times cfg.query_scale, soft-capped c tanh(s / c) when softcap > 0, keys within
    `window` positions (0: all), a learned logit per head in the softmax's denominator when `sinks` (attn_sinks)."""

    layer: int
    window: int = 0
    softcap: float = 0.0
    sinks: bool = False
    store: bool = True  # False: a shared-KV layer's attention, which writes nothing and reads layer `layer`'s cache
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
    token of src (models/moe.py route: `gating`; each expert a Glu of `activation`; biases when `bias`). `router`:
    the value the router reads ("": src); `expert_scale`: each chosen expert's weight times ffn_down_exps.scale [E]
    (gemma4); `gate_up`: each expert's gate and up rows in one ffn_gate_up_exps [E, 2 F_exp, D]."""

    layer: int
    gating: str
    activation: str
    bias: bool = False
    src: str = "h"
    dst: str = "f"
    router: str = ""
    expert_scale: bool = False
    gate_up: bool = False


@dataclass(frozen=True)
class Gate:
    """dst = src * sigmoid(gate) (gate [T, N] elementwise, or [T, 1] for every column): the output gate of a gated
    attention, the shared expert's gate."""

    src: str
    gate: str
    dst: str


@dataclass(frozen=True)
class Conv:
    """dst [T, C] = silu(conv(src)): block `layer`'s causal depthwise convolution, channel c of token t being
    sum_j ssm_conv1d[c, j] * src[t - K + 1 + j, c] (K = cfg.ssm_conv_kernel) over the sequence's inputs, the K - 1
    before the first token read from the sequence's window (zeros at position 0), which then holds the last K - 1
    (the recurrent state's first part)."""

    layer: int
    src: str = "qkv"
    dst: str = "qkv"


@dataclass(frozen=True)
class DeltaRule:
    """The gated delta rule of block `layer` (Yang et al. 2024, "Gated Delta Networks") over the sequence's state
    S [Hv, d_k, d_v] (zeros at position 0): qkv [T, 2 Hk d_k + Hv d_v] splits into q, k [T, Hk, d_k] and
    v [T, Hv, d_v]; q and k are L2-normalised per head (x / sqrt(sum x^2 + eps)), q scaled by 1 / sqrt(d_k);
    value head h reads key head h % Hk (`heads` "tiled") or h // (Hv / Hk) ("grouped"). Per token t and head h:

        g = ssm_a[h] * softplus(a[t, h] + ssm_dt[h])      (ssm_a = -exp(A_log) < 0: a decay in (0, 1])
        beta = sigmoid(b[t, h])
        S = exp(g) S;   S = S + k (beta (v - S^T k))^T;   out[t, h] = S^T q

    -> dst [T, Hv d_v]."""

    layer: int
    heads: str = "tiled"
    qkv: str = "qkv"
    a: str = "a"
    b: str = "b"
    dst: str = "att"


@dataclass(frozen=True)
class GatedNorm:
    """dst = rms_norm(src) * weight * silu(gate), per value head of d_v = len(weight) values (the delta net's output
    norm, gated by z)."""

    src: str
    weight: str
    gate: str
    dst: str


@dataclass(frozen=True)
class Scale:
    """dst = src * factor (* weight, broadcast over the last axis: layer_output_scale [1], ffn_gate_inp.scale [D])."""

    src: str
    dst: str
    weight: str | None = None
    factor: float = 1.0


@dataclass(frozen=True)
class Add:
    """dst += src (x: the residual add)."""

    src: str
    dst: str = "x"


Op = Union[Norm, Linear, Split, Rope, Attention, Glu, Moe, Gate, Conv, DeltaRule, GatedNorm, Scale, Add]


@lru_cache(maxsize=8)
def programs(cfg: Any) -> tuple[tuple[Op, ...], ...]:
    """Every block's program, made once per config (a forward pass looks them up once: hashing a config costs
    tens of microseconds)."""
    return tuple(_program(cfg, i) for i in range(cfg.n_layer))


def layer_ops(cfg: Any, i: int) -> tuple[Op, ...]:
    """Block i's program."""
    return programs(cfg)[i]


def _program(cfg: Any, i: int) -> tuple[Op, ...]:
    """Block i's program, from its plan cfg.layers[i]: a pre-norm attention block (or a Gated DeltaNet block),
    then a pre-norm FFN block (dense or experts, a shared expert beside them; gemma4: a dense FFN and experts side by
    side), each added into the residual stream; then gemma4's per-layer input and output scale."""
    p = cfg.layers[i]
    ops: list[Op] = [Norm("x", "attn_norm", "h")]
    ops += _delta_net(cfg, i) if p.recurrent else _attention(cfg, i)
    ops += [Add("o"), Norm("x", "ffn_norm", "h")]
    if p.moe and not p.moe_dense:
        ops += _experts(cfg, i, "h", "f")
    else:
        if p.fused_gate_up:  # phi3: ffn_up rows [gate; up]
            n_ff = cfg.layer_n_ff(i)
            ops += [Linear("h", "ffn_up", "gu"), Split("gu", ("g", "u"), (n_ff, n_ff))]
        else:
            ops += [Linear("h", "ffn_gate", "g"), Linear("h", "ffn_up", "u")]
        ops += [Glu(p.activation), Linear("ff", "ffn_down", "f")]
    if p.moe_dense:  # gemma4 26B-A4B: the experts beside the dense FFN, each branch normalised, then added
        ops += [Norm("f", "ffn_post_norm_1", "f"), Norm("x", "ffn_pre_norm_2", "h")]
        ops += _experts(cfg, i, "h", "e") + [Norm("e", "ffn_post_norm_2", "e"), Add("e", "f")]
    if p.post_norms:
        ops.append(Norm("f", "ffn_post_norm", "f"))
    ops.append(Add("f"))
    if p.shared_expert:  # qwen35moe, qwen3next: a SwiGLU FFN every token runs, scaled by its own sigmoid gate
        ops += [Linear("h", "ffn_gate_shexp", "g"), Linear("h", "ffn_up_shexp", "u"), Glu("silu"),
                Linear("ff", "ffn_down_shexp", "s"), Linear("h", "ffn_gate_inp_shexp", "sg"), Gate("s", "sg", "s"),
                Add("s")]
    if p.per_layer_input:  # gemma4 E2B / E4B: the layer's per-layer input "ple" [T, P] gates a projection of x
        ops += [Linear("x", "per_layer_inp_gate", "pg"), Glu(p.activation, gate="pg", up="ple", dst="pg"),
                Linear("pg", "per_layer_proj", "p"), Norm("p", "per_layer_post_norm", "p"), Add("p")]
    if p.out_scale:  # gemma4: the whole residual stream scaled
        ops.append(Scale("x", "x", "layer_output_scale"))
    return tuple(ops)


def _experts(cfg: Any, i: int, src: str, dst: str) -> list[Op]:
    """Block i's mixture of experts from src to dst; with router_norm (gemma4) the router reads rms_norm(x) times
    ffn_gate_inp.scale / sqrt(D) ("r"), and the chosen experts' weights are scaled by ffn_down_exps.scale."""
    p = cfg.layers[i]
    ops: list[Op] = []
    if p.router_norm:
        ops += [Norm("x", "ffn_gate_inp_scale", "r"), Scale("r", "r", factor=1.0 / math.sqrt(cfg.n_embd))]
    return ops + [Moe(i, p.moe_gating, p.activation, p.moe_bias, src, dst, router="r" if p.router_norm else "",
                      expert_scale=p.router_norm, gate_up=p.gate_up_exps)]


def _attention(cfg: Any, i: int) -> list[Op]:
    """The attention branch of block i from its normalised input h to its output o (a shared-KV layer: its
    queries only, over the cache of layer kv_from)."""
    p = cfg.layers[i]
    dh, q_dim, kv_dim = cfg.layer_head_dim(i), cfg.n_head * cfg.layer_head_dim(i), cfg.layer_kv_heads(i) * cfg.layer_head_dim(i)
    own_kv = not p.shares_kv
    ops: list[Op] = []
    if p.attn_gate:  # qwen35, qwen3next: attn_q rows per head [q; gate]
        ops += [Linear("h", "attn_q", "qg"), Split("qg", ("q", "gate"), (dh, dh), cfg.n_head),
                Linear("h", "attn_k", "k"), Linear("h", "attn_v", "v")]
    elif p.fused_qkv:  # phi3: one matrix, rows [q; k; v]
        ops += [Linear("h", "attn_qkv", "qkv"), Split("qkv", ("q", "k", "v"), (q_dim, kv_dim, kv_dim))]
    else:  # (gemma4: a shared-KV layer projects q only; V = K where the file has no attn_v)
        names = "qkv" if own_kv and not p.v_from_k else "qk" if own_kv else "q"
        ops += [Linear("h", f"attn_{n}", n, f"attn_{n}_bias" if p.qkv_bias else None) for n in names]
    if p.qk_norm:  # qwen3, gemma3
        ops.append(Norm("q", "attn_q_norm", "q", heads=True))
    if own_kv and p.v_norm:  # gemma4: V normalised per head, no weight (from K's projection where V = K)
        ops.append(Norm("k" if p.v_from_k else "v", None, "v", heads=True))
    elif own_kv and p.v_from_k:
        ops.append(Scale("k", "v"))
    if p.qk_norm and own_kv:
        ops.append(Norm("k", "attn_k_norm", "k", heads=True))
    if p.rope:  # smollm3's NoPE layers have none
        ops += [Rope("q", p.rope_local)] + ([Rope("k", p.rope_local)] if own_kv else [])
    ops.append(Attention(p.kv_from if p.shares_kv else i, p.window, p.attn_softcap, p.sinks, store=own_kv))
    if p.attn_gate:
        ops.append(Gate("att", "gate", "att"))
    ops.append(Linear("att", "attn_output", "o", "attn_output_bias" if p.o_bias else None))
    if p.post_norms:  # gemma: the block's output normalised before the residual add
        ops.append(Norm("o", "attn_post_norm", "o"))
    return ops


def _delta_net(cfg: Any, i: int) -> list[Op]:
    """The Gated DeltaNet branch of block i from h to o: the projections (q/k/v, the output gate z, beta and
    alpha), the causal convolution, the delta rule over the sequence's state, the gated norm, ssm_out."""
    p = cfg.layers[i]
    ops: list[Op] = [Linear("h", "attn_qkv", "qkv"), Linear("h", "attn_gate", "z")]
    if p.ssm_ba:  # qwen3next: rows per key head [beta (Hv/Hk); alpha (Hv/Hk)]
        r = cfg.ssm_time_step_rank // cfg.ssm_group_count
        ops += [Linear("h", "ssm_ba", "ba"), Split("ba", ("b", "a"), (r, r), cfg.ssm_group_count)]
    else:
        ops += [Linear("h", "ssm_beta", "b"), Linear("h", "ssm_alpha", "a")]
    return ops + [Conv(i), DeltaRule(i, p.ssm_heads), GatedNorm("att", "ssm_norm", "z", "att"),
                  Linear("att", "ssm_out", "o")]


def run(be: Any, cfg: Any, ids: Any, pos: Any, all_logits: bool = False) -> Any:
    """The model through the Backend operations, one at a time: ids [T] token ids and pos [T] positions
    (backend int32 arrays) -> logits [1, V] of the last position ([T, V] with all_logits); writes the K/V of
    the T tokens into the cache. Past the last layer that writes a cache (gemma4's shared-KV layers write none)
    only the rows the logits need go on."""
    w = be.weights
    t = ids.shape[0]
    x = be.embed(ids)  # [T, D], times cfg.embd_scale (gemma: sqrt(D))
    ple = per_layer_inputs(be, cfg, ids, x) if cfg.n_embd_per_layer else None  # [T, L, P] (gemma4 E2B / E4B)
    last = t - 1
    cut = 1 + max((i for i, p in enumerate(cfg.layers) if not p.shares_kv), default=-1)  # later layers write nothing
    for i, (ops, L) in enumerate(zip(programs(cfg), w.layers)):
        if i == cut and not all_logits and t > 1:
            x, pos, ple = x[last:], pos[last:], None if ple is None else ple[last:]
        x = run_layer(be, cfg, i, ops, L, x, pos, None if ple is None else ple[:, i])
    if not all_logits:
        x = x[x.shape[0] - 1 :]  # only the last position feeds the next token
    logits = be.matmul(be.rms_norm(x, w.output_norm, cfg.rms_eps), w.output)  # [1 or T, V]
    return be.softcap(logits, cfg.final_softcap) if cfg.final_softcap else logits


def per_layer_inputs(be: Any, cfg: Any, ids: Any, x: Any) -> Any:
    """Gemma 4's per-layer inputs [T, L, P] (transformers' get_per_layer_inputs and project_per_layer_inputs;
    llama.cpp's build_inp_per_layer): each token's row of per_layer_token_embd [V, L P] times sqrt(P), and the
    embedded input x [T, D] projected by per_layer_model_proj [L P, D] times 1/sqrt(D) and RMS-normalised per layer
    by per_layer_proj_norm [P]; their sum times 1/sqrt(2). Layer i reads [:, i]."""
    w, t, n = be.weights, ids.shape[0], cfg.n_embd_per_layer
    proj = be.scale(be.matmul(x, w.per_layer_model_proj), 1.0 / math.sqrt(cfg.n_embd)).reshape(t, cfg.n_layer, n)
    proj = be.rms_norm(proj, w.per_layer_proj_norm, cfg.rms_eps)
    return be.scale(be.add(proj, be.embed_per_layer(ids)), 1.0 / math.sqrt(2.0))


def run_layer(be: Any, cfg: Any, i: int, ops: tuple[Op, ...], L: Any, x: Any, pos: Any, ple: Any = None,
              after: Callable[[Op, Any], Any] | None = None) -> Any:
    """Block i's program `ops` on the residual x [T, D] (eager; `ple` [T, P]: its per-layer input) -> the new
    residual. `after(op, out)`, where given, sees each operation's output and returns what takes its place: a
    tensor-split device sums the partial outputs of its shard there (backends/numpy_split.py)."""
    t, dh = x.shape[0], cfg.layer_head_dim(i)
    env: dict[str, Any] = {"x": x, "ple": ple}
    for op in ops:
        if isinstance(op, Norm):
            src = env[op.src].reshape(t, -1, dh) if op.heads else env[op.src]
            env[op.dst] = be.rms_norm(src, getattr(L, op.weight) if op.weight else None, cfg.rms_eps)
        elif isinstance(op, Linear):
            env[op.dst] = be.matmul(env[op.src], getattr(L, op.weight), getattr(L, op.bias) if op.bias else None)
        elif isinstance(op, Split):
            src, col = env[op.src], 0
            if op.groups:  # [T, groups, sum(sizes)]: each dst takes its columns of every group
                src = src.reshape(t, op.groups, -1)
            for name, n in zip(op.dsts, op.sizes):
                part, col = src[..., col : col + n], col + n
                env[name] = part.reshape(t, -1) if op.groups else part
        elif isinstance(op, Rope):
            env[op.src] = be.rope(env[op.src].reshape(t, -1, dh), pos, op.local)
        elif isinstance(op, Attention):
            q = env[op.q].reshape(t, -1, dh)
            k, v = (env[n].reshape(t, -1, dh) for n in (op.k, op.v)) if op.store else (None, None)
            env[op.dst] = be.attention(op, q, k, v, pos)  # [T, Hq Dh]
        elif isinstance(op, Glu):
            env[op.dst] = be.gated(op.activation, env[op.gate], env[op.up])
        elif isinstance(op, Moe):
            env[op.dst] = be.moe(op, env[op.src], env[op.router] if op.router else None)
        elif isinstance(op, Gate):
            env[op.dst] = be.sigmoid_gate(env[op.src], env[op.gate])
        elif isinstance(op, Conv):
            env[op.dst] = be.conv(op, env[op.src], pos)  # [T, C]; moves the sequence's window on
        elif isinstance(op, DeltaRule):
            env[op.dst] = be.delta_rule(op, env[op.qkv], env[op.a], env[op.b], pos)  # [T, Hv d_v]
        elif isinstance(op, GatedNorm):
            w = getattr(L, op.weight)  # [d_v]
            src, gate = (env[n].reshape(t, -1, w.shape[-1]) for n in (op.src, op.gate))
            env[op.dst] = be.gated_norm(src, w, gate, cfg.rms_eps).reshape(t, -1)
        elif isinstance(op, Scale):
            env[op.dst] = be.scale(env[op.src], op.factor, getattr(L, op.weight) if op.weight else None)
        elif isinstance(op, Add):
            env[op.dst] = be.add(env[op.dst], env[op.src])
        else:  # pragma: no cover - every Op is handled above
            raise TypeError(f"unknown operation {op!r}")
        if after is not None and not isinstance(op, (Add, Rope, Split)):
            env[op.dst] = after(op, env[op.dst])
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
