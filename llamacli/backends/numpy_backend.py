"""The NumPy backend: the readable reference every CUDA kernel is tested against.

Weights are dequantized to float32 once at load (layer by layer; experts as [E, rows, cols] arrays); the
embedding tables (token_embd, Gemma 4's per_layer_token_embd) stay quantized and only the rows asked for are
dequantized. The KV cache is float32, one [rows, Hkv, Dh] array per layer (the layer's own Hkv and Dh): ctx rows, or
on a sliding-window layer a ring (kv_cache.py: position p at row p mod rows), as the CUDA backend keeps it; none on a
shared-KV layer (Gemma 4), whose queries read the cache of the layer it names.

A Gated DeltaNet layer (hybrid models, models/arch/qwen35.py) keeps a recurrent state instead: the convolution's
window [K - 1, C] and the delta rule's state [Hv, d_k, d_v], float32, each with the position it stands at. Both
are replaced, never written in place, so a stored state (models/seq_cache.py: the snapshots a prompt resumes from)
is the arrays themselves, kept by reference. The delta rule itself is numpy_delta.py: token by token in a decode
step, in chunks of 64 positions (aligned to multiples of 64, so that the states stored at multiples of 256 fall on
chunk ends) in a prompt.
"""

from __future__ import annotations

import functools
import math
import os
import resource

import numpy as np

from ..errors import BackendError, HostMemoryError, UsageError
from ..ggufio.file import GGUFFile
from ..ggufio.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from ..ggufio.quants import can_dequantize, gather_rows
from ..models import block, rope as rope_tables
from ..models.block import Attention, Conv, DeltaRule, Moe
from ..models.config import ROPE_NEOX, ModelConfig
from ..models.kv_cache import DEFAULT as DEFAULT_CACHE, q8_0_roundtrip, ring_span
from ..models.moe import route
from ..models.seq_cache import MAX_SNAPSHOTS, LayerState, RecurrentSlot, snapshot_positions
from ..models.weights import layer_tensor_names, model_specs
from ..units import human_bytes
from . import numpy_delta
from .base import Backend, LayerWeights, ModelWeights, Progress
from .numpy_delta import CHUNK


def _ieee(op):
    """NaN and inf flow through as IEEE values and are reported once, as NumericalError on the logits
    (sampling.py); numpy's RuntimeWarnings on the way would only add lines to stderr."""

    @functools.wraps(op)
    def quiet(*args, **kwargs):
        with np.errstate(all="ignore"):
            return op(*args, **kwargs)

    return quiet


class QuantTable:
    """A 2-D tensor kept in its GGUF layout; rows are dequantized on demand."""

    def __init__(self, raw: np.ndarray, qtype: QT, shape: tuple[int, int]):
        self.raw, self.qtype, self.shape = raw, qtype, shape

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return gather_rows(self.raw, self.qtype, ids, self.shape[1])


class NumpyBackend(Backend):
    name = "numpy"
    label = "NumPy"  # in messages
    fill_steps = True  # (Backend.step's own: a prompt's part is a prompt's passes without the setup)
    runnable_types = frozenset(t for t in QT if t in GGML_QUANT_SIZES and can_dequantize(t))
    cache_types = DEFAULT_CACHE  # (load sets the model's)

    @_ieee
    def load(self, gguf: GGUFFile, cfg: ModelConfig, ctx: int, progress: Progress | None = None,
             cache_types: tuple[str, str] = DEFAULT_CACHE) -> None:
        self._check_memory(gguf, cfg, ctx)  # before anything is allocated: the file's sizes or --ctx may be absurd
        f32 = gguf.dequantize
        total = cfg.n_layer + 2
        report = progress or (lambda done, total, what: None)

        def table(name: str) -> QuantTable:  # an embedding table, kept in its GGUF layout
            t = gguf.tensors[name]
            return QuantTable(gguf.raw(name), t.type, (t.shape[0], t.shape[1]))

        token_embd = self._embedding(gguf)
        report(1, total, "token_embd")
        layers = []
        for i in range(cfg.n_layer):  # every tensor the block's plan names (experts [E, rows, cols])
            names = layer_tensor_names(cfg, i)
            layers.append(LayerWeights(**{field: self._layer_tensor(gguf, cfg, field, name)
                                          for field, name in names.items() if name in gguf.tensors}))
            report(2 + i, total, f"layer {i}")
        weights = ModelWeights(token_embd, layers, f32("output_norm.weight"), self._lm_head(gguf, token_embd))
        if cfg.n_embd_per_layer:  # gemma4: the per-layer token embeddings stay quantized, as token_embd does
            weights.per_layer_token_embd = table("per_layer_token_embd.weight")
            weights.per_layer_model_proj = f32("per_layer_model_proj.weight")
            weights.per_layer_proj_norm = f32("per_layer_proj_norm.weight")
        report(total, total, "output")
        self.adopt(cfg, ctx, weights, rope_tables.inv_freq(cfg, gguf, ctx),  # [rope_dim/2]
                   rope_tables.inv_freq(cfg, gguf, ctx, local=True), cache_types)

    def adopt(self, cfg: ModelConfig, ctx: int, weights: ModelWeights, theta: np.ndarray, theta_local: np.ndarray,
              cache_types: tuple[str, str] = DEFAULT_CACHE, layers: range | None = None,
              experts: tuple[int, int] | None = None) -> None:
        """Run with `weights` at `ctx` (load() reads them from the file; numpy_split.py gives an emulated device
        its shard): the RoPE tables `theta` [rope_dim/2], `theta_local` [local_rope_dim/2], a KV cache of
        `cache_types` for the `layers` it runs (None: every one) and, where its experts are a slice, the experts
        [first, end) of each MoE layer."""
        self.cfg, self.ctx, self.cache_types, self.weights = cfg, ctx, cache_types, weights
        self.theta, self.theta_local = theta, theta_local
        self.held = range(cfg.n_layer) if layers is None else layers
        self.experts = experts
        self.recurrent_layers = [i for i, plan in enumerate(cfg.layers) if plan.recurrent and i in self.held]
        self.prefill_chunk = shared_ring_chunk(cfg, ctx)
        self._caches = [self._new_cache()]
        self._pool: list[tuple[np.ndarray, np.ndarray] | None] = []  # the prefix cache's rows per layer
        self.slots = 1
        self.use_slot(0)

    # How load() holds the weights (a subclass that keeps them otherwise overrides these: backends/cpu/).
    def _check_memory(self, gguf: GGUFFile, cfg: ModelConfig, ctx: int) -> None:
        check_host_memory(cfg, ctx)

    def _embedding(self, gguf: GGUFFile) -> QuantTable:
        """token_embd kept in its GGUF layout: only the rows asked for are dequantized."""
        emb = gguf.tensors["token_embd.weight"]
        return QuantTable(gguf.raw(emb.name), emb.type, (emb.shape[0], emb.shape[1]))

    def _layer_tensor(self, gguf: GGUFFile, cfg: ModelConfig, field: str, name: str) -> np.ndarray:
        """A layer's tensor (LayerWeights field `field`) as float32."""
        return gguf.dequantize(name)

    def _lm_head(self, gguf: GGUFFile, token_embd: QuantTable) -> np.ndarray:
        """The LM head needs the whole matrix every step: dequantized once (a copy of token_embd when tied)."""
        return gguf.dequantize("output.weight" if "output.weight" in gguf.tensors else "token_embd.weight")

    def _new_cache(self) -> tuple[list[np.ndarray], list[np.ndarray], RecurrentSlot]:
        """One slot's K and V caches: per layer [rows, Hkv, Dh] float32 (config.cache_rows; the layer's own Hkv and
        Dh; no rows for a layer it does not run); and its recurrent states (delta-net layers)."""
        cfg = self.cfg
        k = [np.zeros((n if i in self.held else 0, cfg.layer_kv_heads(i), cfg.layer_head_dim(i)), dtype=np.float32)
             for i, n in enumerate(cfg.cache_rows(self.ctx))]  # (none on a shared-KV layer: [0, Hkv, Dh])
        return k, [np.zeros_like(x) for x in k], RecurrentSlot()

    def set_slots(self, n: int) -> None:
        """Caches for n sequences: slot 0's stays, the others are allocated (checked against the host's memory
        first) or dropped."""
        if type(n) is not int or n < 1:
            raise UsageError(f"the number of sequences must be a positive integer, got {n!r}")
        if n > len(self._caches):
            check_host_memory(self.cfg, self.ctx, slots=n, held=len(self._caches), backend=self.label)
        self.resize_slots(n)

    def resize_slots(self, n: int) -> None:
        """set_slots without the memory check (numpy_split.py checks the whole model's once, for its devices)."""
        self._forget_slots(min(n, len(self._caches)))
        while len(self._caches) < n:
            self._caches.append(self._new_cache())
        del self._caches[n:]
        self.slots = n
        self.use_slot(0)

    def use_slot(self, slot: int) -> None:
        self.k_cache, self.v_cache, self.recurrent_slot = self._caches[slot]

    # -- the prefix cache's pool: float32 rows as the caches hold them (np.zeros: pages are taken as rows are
    # written, so a pool no prefix has filled yet costs no memory) -----------------------------------------------
    def kv_row_bytes(self) -> int:
        cfg = self.cfg
        return sum(2 * 4 * cfg.layer_kv_heads(i) * cfg.layer_head_dim(i) for i, n in enumerate(cfg.cache_rows(self.ctx))
                   if n and i in self.held)

    def alloc_kv_pool(self, rows: int) -> None:
        if type(rows) is not int or rows < 0:
            raise UsageError(f"a prefix-cache pool takes a number of rows >= 0, got {rows!r}")
        cfg = self.cfg
        self._pool = []
        if rows and not free_ok(None, rows * self.kv_row_bytes()):
            raise HostMemoryError(f"not enough host memory for a prefix cache of {human_bytes(rows * self.kv_row_bytes())}")
        shapes = [(rows, cfg.layer_kv_heads(i), cfg.layer_head_dim(i)) for i in range(cfg.n_layer)]  # (each layer's)
        self._pool = [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) if n and rows and i in self.held
                      else None for i, (shape, n) in enumerate(zip(shapes, cfg.cache_rows(self.ctx)))]

    def copy_kv_rows(self, slot: int, layers, positions: np.ndarray, rows: np.ndarray, to_pool: bool) -> None:
        k, v, _ = self._caches[slot]
        for layer in layers:
            pool = self._pool[layer] if layer < len(self._pool) else None
            if pool is None:
                raise BackendError(f"layer {layer} has no prefix-cache pool")
            at = positions % k[layer].shape[0]  # the cache rows (a ring's: position mod rows)
            for cache, part in zip((k[layer], v[layer]), pool):
                if to_pool:
                    part[rows] = cache[at]
                else:
                    cache[at] = part[rows]

    def free_memory(self) -> int | None:
        return available_host_memory()

    # -- host <-> backend --------------------------------------------------------------------------------
    def positions(self, start: int, n: int) -> np.ndarray:
        return np.arange(start, start + n, dtype=np.int32)

    def token_ids(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(ids, dtype=np.int32).reshape(-1)

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    # -- operations --------------------------------------------------------------------------------------
    def embed(self, ids: np.ndarray) -> np.ndarray:
        rows = self.weights.token_embd.rows(ids)  # [T, D]
        return rows * np.float32(self.cfg.embd_scale) if self.cfg.embd_scale != 1.0 else rows

    def embed_per_layer(self, ids: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        rows = self.weights.per_layer_token_embd.rows(ids)  # [T, L P]
        return (rows * np.float32(math.sqrt(cfg.n_embd_per_layer))).reshape(len(ids), cfg.n_layer, cfg.n_embd_per_layer)

    @_ieee
    def rms_norm(self, x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
        ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
        y = (x / np.sqrt(ms + eps)).astype(np.float32)
        return y if weight is None else y * weight

    @_ieee
    def scale(self, x: np.ndarray, factor: float, weight: np.ndarray | None = None) -> np.ndarray:
        y = x * np.float32(factor) if factor != 1.0 else x
        return y if weight is None else y * weight

    @_ieee
    def matmul(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        y = x @ w.T  # [T, K] x [N, K]^T -> [T, N]
        return y + bias if bias is not None else y

    @_ieee
    def rope(self, x: np.ndarray, pos: np.ndarray, local: bool = False) -> np.ndarray:
        cfg = self.cfg
        theta, attn = (self.theta_local, 1.0) if local else (self.theta, cfg.rope_attn_factor)
        cos, sin = rope_tables.cos_sin(theta, pos, attn)  # [T, R/2]
        cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
        out = x.copy()
        r = cfg.local_rope_dim if local else cfg.rope_dim
        if cfg.rope_type == ROPE_NEOX:  # pairs (i, i + R/2)
            a, b = x[..., : r // 2], x[..., r // 2 : r]
            out[..., : r // 2] = a * cos - b * sin
            out[..., r // 2 : r] = a * sin + b * cos
        else:  # pairs (2i, 2i + 1)
            a, b = x[..., 0:r:2], x[..., 1:r:2]
            out[..., 0:r:2] = a * cos - b * sin
            out[..., 1:r:2] = a * sin + b * cos
        return out

    @_ieee
    def attention(self, op: Attention, q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """q [T, Hq, Dh], k and v [T, Hkv, Dh] at consecutive positions pos [T] -> [T, Hq Dh]. K and V go into
        layer op.layer's cache first (a ring takes at most kv_cache.ring_span positions per pass, so a long chunk
        goes in several); a shared-KV layer's queries (op.store False, k and v None) read the cache as the layer
        that wrote it left it in this pass (a pass is at most a ring's span long then: shared_ring_chunk)."""
        span = ring_span(op.window, self.k_cache[op.layer].shape[0], self.ctx) if op.store else self.ctx
        t = q.shape[0]
        if t <= span:
            return self._attend(op, q, k, v, pos)
        return np.concatenate([self._attend(op, q[s : s + span], k[s : s + span], v[s : s + span],
                                            pos[s : s + span]) for s in range(0, t, span)])

    def _attend(self, op: Attention, q: np.ndarray, k: np.ndarray | None, v: np.ndarray | None,
                pos: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        kc, vc = self.k_cache[op.layer], self.v_cache[op.layer]  # [rows, Hkv, Dh]
        if op.store:  # [T, Hkv, Dh] at their rows (position mod rows); an 8-bit cache keeps what its blocks hold
            k_type, v_type = self.cache_types
            kc[pos % kc.shape[0]] = q8_0_roundtrip(k) if k_type == "q8_0" else k
            vc[pos % vc.shape[0]] = q8_0_roundtrip(v) if v_type == "q8_0" else v
        lo = max(0, int(pos.min()) - op.window + 1) if op.window else 0  # the first key any query sees
        key_pos = np.arange(lo, int(pos.max()) + 1)
        keys, values = _rows(kc, lo, key_pos.size), _rows(vc, lo, key_pos.size)  # [S, Hkv, Dh]
        t, n = q.shape[0], key_pos.size
        hkv, dh = kc.shape[1], kc.shape[2]  # the layer's own (gemma4's sliding and global layers differ)
        qg = q.reshape(t, hkv, q.shape[1] // hkv, dh)  # query heads grouped by their KV head
        out = np.empty(qg.shape, dtype=np.float32)
        rows = attention_rows(cfg, t, n)  # query rows per pass: the score arrays stay within ATT_SCRATCH
        for r in range(0, t, rows):
            qr, pr = qg[r : r + rows], pos[r : r + rows]
            scores = np.einsum("thgd,shd->hgts", qr, keys) * cfg.query_scale  # [Hkv, G, rows, S]
            if op.softcap:  # gemma2: c tanh(s / c)
                scores = op.softcap * np.tanh(scores / op.softcap)
            hidden = key_pos[None, :] > pr[:, None]  # [rows, S]: key after the query's position
            if op.window:  # sliding window: keys at or before p - window are out of reach
                hidden |= key_pos[None, :] <= pr[:, None] - op.window
            scores = np.where(hidden, -np.inf, scores)
            top = scores.max(axis=-1, keepdims=True)  # [Hkv, G, rows, 1]
            if op.sinks:  # gpt-oss: the head's sink logit joins the denominator (and the max), no value row
                sink = self.weights.layers[op.layer].attn_sinks.reshape(hkv, -1, 1, 1)
                top = np.maximum(top, sink)
            p = np.exp(scores - top)
            denom = p.sum(axis=-1, keepdims=True)
            if op.sinks:
                denom += np.exp(sink - top)
            p /= denom
            out[r : r + rows] = np.einsum("hgts,shd->thgd", p, values)  # [rows, Hkv, G, Dh]
        return out.reshape(t, -1)

    @_ieee
    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        sigmoid = 0.5 * (1.0 + np.tanh(0.5 * gate))  # = 1 / (1 + e^-gate), without overflow
        return (gate * sigmoid * up).astype(np.float32)

    @_ieee
    def geglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """gelu with the tanh approximation (gemma's gelu_pytorch_tanh) times up."""
        g = gate.astype(np.float64)
        gelu = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
        return (gelu * up).astype(np.float32)

    @_ieee
    def swiglu_oai(self, gate: np.ndarray, up: np.ndarray, alpha: float = 1.702, limit: float = 7.0) -> np.ndarray:
        """gpt-oss's clamped SwiGLU (ggml_swiglu_oai; transformers' GptOssExperts): g = min(gate, limit),
        u = clip(up, -limit, limit) -> g sigmoid(alpha g) (u + 1)."""
        g = np.minimum(gate, limit).astype(np.float64)  # no lower clamp: float64 keeps sigmoid's tail exact
        u = np.clip(up, -limit, limit)
        return (g / (1.0 + np.exp(-alpha * g)) * (u + 1.0)).astype(np.float32)

    @_ieee
    def moe(self, op: Moe, h: np.ndarray, router_in: np.ndarray | None = None) -> np.ndarray:
        """Route each token of h [T, D] to cfg.n_expert_used experts (moe.route over the router's logits of
        router_in, else of h; op.expert_scale: each weight times its expert's ffn_down_exps_scale), then run expert
        by expert over the tokens that chose it: gate/up [T_e, F_exp] (+ biases; op.gate_up: the two halves of one
        ffn_gate_up_exps matrix), the activation, down [T_e, D] (+ bias), times the token's weight, added into its
        row. A token picks distinct experts, so within one expert its rows are distinct and a plain indexed add
        suffices."""
        cfg, L = self.cfg, self.weights.layers[op.layer]
        first, end = self.experts or (0, cfg.n_expert)  # (an emulated device of an expert split holds a slice)
        logits = self.matmul(h if router_in is None else router_in, L.ffn_gate_inp, L.ffn_gate_inp_bias)  # [T, E]
        ids, weights = route(logits, cfg.n_expert_used, op.gating, cfg.expert_weights_norm)  # [T, k]
        if op.expert_scale:
            weights = weights * L.ffn_down_exps_scale[ids]
        k = ids.shape[1]
        flat, wflat = ids.reshape(-1), weights.reshape(-1)  # slot s = token s // k
        order = np.argsort(flat, kind="stable")  # slots grouped by expert
        experts, starts = np.unique(flat[order], return_index=True)
        ends = np.append(starts[1:], flat.size)
        out = np.zeros((h.shape[0], cfg.n_embd), dtype=np.float32)
        bias = lambda b, e: None if b is None else b[e]  # noqa: E731
        f = cfg.n_ff_exp
        for e, s0, s1 in zip(experts.tolist(), starts.tolist(), ends.tolist()):
            if not first <= e < end:
                continue
            slots = order[s0:s1]
            tok = slots // k
            x, j = h[tok], e - first  # [T_e, D]; the expert's place in the tensors held
            gate = L.ffn_gate_up_exps[j, :f] if op.gate_up else L.ffn_gate_exps[j]  # [F_exp, D]
            up = L.ffn_gate_up_exps[j, f:] if op.gate_up else L.ffn_up_exps[j]
            g = self.matmul(x, gate, bias(L.ffn_gate_exps_bias, j))  # [T_e, F_exp]
            u = self.matmul(x, up, bias(L.ffn_up_exps_bias, j))
            y = self.matmul(self.gated(op.activation, g, u), L.ffn_down_exps[j], bias(L.ffn_down_exps_bias, j))
            out[tok] += y * wflat[slots, None]  # [T_e, D]
        return out

    @_ieee
    def sigmoid_gate(self, x: np.ndarray, gate: np.ndarray) -> np.ndarray:
        return (x * _sigmoid(gate)).astype(np.float32)

    @_ieee
    def gated_norm(self, x: np.ndarray, weight: np.ndarray, gate: np.ndarray, eps: float) -> np.ndarray:
        """rms_norm(x) * weight * silu(gate) per head: x, gate [T, H, d_v], weight [d_v]."""
        return (self.rms_norm(x, weight, eps) * gate * _sigmoid(gate)).astype(np.float32)

    # -- Gated DeltaNet layers: the convolution and the delta rule over the sequence's recurrent state ----------------
    @_ieee
    def conv(self, op: Conv, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x [T, C] at positions start.. -> silu of the causal depthwise convolution [T, C]: out[t, c] = sum_j
        w[c, j] * inputs[t - K + 1 + j, c] over the window's K - 1 inputs before the first token, then x."""
        w = self.weights.layers[op.layer].ssm_conv1d  # [C, K], the oldest input's tap first
        k, t, start = w.shape[1], x.shape[0], int(pos[0])
        window = self._part(op.layer, start, "conv")  # [K - 1, C]
        full = np.concatenate([window, x])  # [K - 1 + T, C]: the inputs at positions start - K + 1 .. start + T - 1
        out = np.zeros_like(x)
        for j in range(k):
            out += full[j : j + t] * w[:, j]
        for p in snapshot_positions(start, t):  # the window after position p - 1: inputs p - K + 1 .. p - 1
            self._store(p, op.layer, 0, full[p - start : p - start + k - 1].copy())
        state = self.recurrent_slot.states[op.layer]
        state.conv, state.conv_pos = full[t:].copy(), start + t
        return (out * _sigmoid(out)).astype(np.float32)

    @_ieee
    def delta_rule(self, op: DeltaRule, qkv: np.ndarray, a: np.ndarray, b: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """The gated delta rule (block.py DeltaRule; numpy_delta.py its two forms: a decode step token by token, a
        prompt in chunks): qkv [T, C], alpha and beta [T, Hv] -> [T, Hv d_v], the layer's state moved on past the
        last token (and stored where snapshot_positions says)."""
        cfg, L = self.cfg, self.weights.layers[op.layer]
        hk, hv, dk = cfg.ssm_group_count, cfg.ssm_time_step_rank, cfg.ssm_state_size
        t, start = qkv.shape[0], int(pos[0])
        q = _l2_norm(qkv[:, : hk * dk].reshape(t, hk, dk), cfg.rms_eps) / np.float32(math.sqrt(dk))
        k = _l2_norm(qkv[:, hk * dk : 2 * hk * dk].reshape(t, hk, dk), cfg.rms_eps)
        v = qkv[:, 2 * hk * dk :].reshape(t, hv, -1)  # [T, Hv, d_v]
        src = key_heads(op.heads, hk, hv)  # the key head each value head reads
        q, k = q[:, src], k[:, src]  # [T, Hv, d_k]
        g = (L.ssm_a * _softplus(a + L.ssm_dt)).astype(np.float32)  # [T, Hv] log decay (<= 0: ssm_a < 0)
        beta = _sigmoid(b).astype(np.float32)  # [T, Hv]
        s = self._part(op.layer, start, "ssm")  # [Hv, d_k, d_v]
        heads = [x.transpose(1, 0, *range(2, x.ndim)) for x in (q, k, v, g, beta)]  # value heads first
        if t == 1:  # a decode step: the rule itself
            out, s = numpy_delta.recurrent(*heads, s)
        else:  # a prompt: chunks of CHUNK positions (aligned to multiples of CHUNK, where states are stored)
            marks = set(snapshot_positions(start, t))
            bounds = sorted({0, t} | {p - start for p in range(-(-start // CHUNK) * CHUNK, start + t, CHUNK)})
            parts = []
            for c0, c1 in zip(bounds, bounds[1:]):
                o, s = numpy_delta.chunked(*(x[:, c0:c1] for x in heads), s)
                parts.append(o)
                if start + c1 in marks:
                    self._store(start + c1, op.layer, 1, s)
            out = np.concatenate(parts, axis=1)
        if t == 1:
            self._store(start + 1, op.layer, 1, s)
        state = self.recurrent_slot.states[op.layer]
        state.ssm, state.ssm_pos = s, start + t
        if op.layer == self.recurrent_layers[-1]:  # the pass has stored every layer's part
            self.recurrent_slot.trim(len(self.recurrent_layers))
        return out.transpose(1, 0, 2).reshape(t, -1)

    def _part(self, layer: int, start: int, part: str) -> np.ndarray:
        """The state `part` ("conv", "ssm") of `layer` before position `start`: zeros at 0 (a new sequence), else
        the live one, which must stand there."""
        cfg = self.cfg
        if start == 0:
            zeros = LayerState(np.zeros((cfg.ssm_conv_kernel - 1, cfg.ssm_conv_dim), np.float32), 0,
                               np.zeros((cfg.ssm_time_step_rank, cfg.ssm_state_size, cfg.ssm_state_size), np.float32), 0)
            state = self.recurrent_slot.states.setdefault(layer, zeros)
            setattr(state, part, getattr(zeros, part))
            setattr(state, f"{part}_pos", 0)
        state = self.recurrent_slot.states.get(layer)
        at = -1 if state is None else getattr(state, f"{part}_pos")
        if at != start:
            raise BackendError(f"layer {layer}'s recurrent state stands at position {at}, not {start}: a sequence "
                               "continues where its last step ended, or resumes from a stored state (Backend.resume)")
        return getattr(state, part)

    def _store(self, pos: int, layer: int, part: int, value: np.ndarray) -> None:
        self.recurrent_slot.stored.setdefault(pos, {}).setdefault(layer, [None, None])[part] = value

    # -- verification (speculative decoding): the recurrent states rolled back past rejected drafts --------------
    def forward_verify(self, ids: np.ndarray, start: int) -> np.ndarray:
        """Backend.forward_verify; with recurrent layers, the state at `start` (stored by the step before, the
        latest) is kept through the pass for rollback."""
        if self.recurrent_layers:
            self.recurrent_slot.begin_verify(ids, start)
        return super().forward_verify(ids, start)

    def rollback(self, slot: int, pos: int) -> None:
        """Backend.rollback: the recurrent states after pos - 1, where the verification's drafts were rejected
        from pos on: the state stored at its first position restored and the ids it kept run again (their K/V
        rows are written again, to the same values)."""
        if not self.recurrent_layers:
            return
        kept = self._caches[slot][2].take_verified(pos)
        if kept is not None:
            start, ids = kept
            self.resume(slot, start)
            block.run(self, self.cfg, self.token_ids(ids), self.positions(start, ids.size))

    def resume(self, slot: int, pos: int) -> None:
        if not self.recurrent_layers:
            return
        rec = self._caches[slot][2]
        stored = rec.resume_at(pos, len(self.recurrent_layers))
        for layer, (conv, ssm) in (stored or {}).items():  # (none at 0: each layer's first pass starts from zeros)
            rec.states[layer] = LayerState(conv, pos, ssm, pos)

    def snapshots(self, slot: int, prompt_end: int | None = None) -> frozenset[int] | None:
        if not self.recurrent_layers:
            return None
        return self._caches[slot][2].snapshots(len(self.recurrent_layers), prompt_end)

    @_ieee
    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        return (cap * np.tanh(x.astype(np.float64) / cap)).astype(np.float32)

    @_ieee
    def add(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return x + y


def key_heads(order: str, hk: int, hv: int) -> np.ndarray:
    """int [Hv]: the key head each value head of a delta-net layer reads ("tiled": j % Hk; "grouped": j // (Hv / Hk))."""
    j = np.arange(hv)
    return j % hk if order == "tiled" else j // (hv // hk)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # = 1 / (1 + e^-x), without overflow


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)  # log(1 + e^x), without overflow


def _l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis (llama.cpp's build_gdn_l2_norm, FLA's l2norm)."""
    ss = np.sum(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    return (x / np.sqrt(ss + eps)).astype(np.float32)


# -- host memory ---------------------------------------------------------------------------------------------


ATT_SCRATCH = 1 << 22  # attention scores per pass (float64 under NumPy 2: 32 MiB); longer spans take fewer rows


def _rows(cache: np.ndarray, start: int, n: int) -> np.ndarray:
    """Positions start .. start + n - 1 of a layer's cache (row = position mod rows): a view, or two pieces
    joined where a ring wraps."""
    rows = cache.shape[0]
    a = start % rows
    if a + n <= rows:
        return cache[a : a + n]
    return np.concatenate([cache[a:], cache[: a + n - rows]])


def shared_ring_chunk(cfg: ModelConfig, ctx: int) -> int | None:
    """The longest prefill pass when a shared-KV layer reads a ring (gemma4's sliding layers): the ring's span
    (kv_cache.ring_span, at least RING_CHUNK), so that when the shared layer runs, the layer it reads still holds the
    window before the pass's first position; None (the whole prompt at once) otherwise."""
    rows = cfg.cache_rows(ctx)
    spans = [ring_span(cfg.layers[p.kv_from].window, rows[p.kv_from], ctx) for p in cfg.layers
             if p.shares_kv and rows[p.kv_from] < ctx]
    return min(spans) if spans else None


def attention_rows(cfg: ModelConfig, t: int, span: int) -> int:
    """Query rows per attention pass so that one [Hq, rows, span] score array holds at most ATT_SCRATCH
    floats (at least one row)."""
    return max(1, min(t, ATT_SCRATCH // max(1, cfg.n_head * span)))


def scratch_bytes(cfg: ModelConfig, ctx: int, chunk: int | None = None) -> int:
    """Peak working set of one prefill pass of min(ctx, chunk) tokens (the whole prompt, up to the context,
    when chunk is None) beside the weights and the cache: the activations alive at once (float64 norm
    temporaries, q/k/v and their rotations, gate/up and SwiGLU's temporaries) and four score arrays of one
    attention pass of query rows over the whole context (einsum, scaled, where(), exp())."""
    t = min(ctx, chunk or ctx)
    layers = range(cfg.n_layer)
    q_dim = max(cfg.n_head * cfg.layer_head_dim(i) for i in layers)  # (gemma4: the widest layer's)
    kv_dim = max(cfg.layer_kv_heads(i) * cfg.layer_head_dim(i) for i in layers)
    ff = max(max(cfg.layer_n_ff(i) for i in layers), cfg.n_ff_exp)
    acts = t * (8 * cfg.n_embd + 4 * q_dim + 4 * kv_dim + 6 * ff + 4 * cfg.n_layer * cfg.n_embd_per_layer)
    if any(p.moe for p in cfg.layers):  # router logits and their float64 softmax [T, E], the gathered rows
        acts += t * (6 * cfg.n_expert + 2 * cfg.n_embd)
    if any(p.recurrent for p in cfg.layers):  # q/k/v before and after the convolution, its window joined, z, the
        # rule's q and k per value head, its output; a few states [Hv, d_k, d_v] in the token loop
        acts += t * (4 * cfg.ssm_conv_dim + 4 * cfg.ssm_time_step_rank * cfg.ssm_state_size + 3 * cfg.ssm_inner_size)
        acts += 4 * cfg.ssm_time_step_rank * cfg.ssm_state_size ** 2
    scores = cfg.n_head * attention_rows(cfg, t, ctx) * ctx
    return 4 * (acts + 2 * cfg.vocab_size) + 8 * 4 * scores


def host_bytes(cfg: ModelConfig, ctx: int) -> tuple[int, int]:
    """(weights, cache) bytes this backend allocates: every tensor but the embedding tables as float32 (the
    LM head too, a copy when tied; experts, all E of them, [E, rows, cols]), and K and V float32 [rows, Hkv,
    Dh] per layer (config.cache_rows; none on a shared-KV layer) plus, with delta-net layers, the live recurrent state, the stored ones
    (MAX_SNAPSHOTS) and one a pass is storing."""
    tables = ("token_embd.weight", "per_layer_token_embd.weight")  # kept quantized
    weights = sum(4 * math.prod(s.shape) for s in model_specs(cfg) if s.name not in tables)
    if cfg.tied_embeddings:
        weights += 4 * cfg.vocab_size * cfg.n_embd
    states = (MAX_SNAPSHOTS + 2) * cfg.recurrent_state_bytes()
    return weights, 2 * 4 * cfg.kv_values(ctx) + states


def available_host_memory() -> int | None:
    """Bytes this process can still allocate: /proc/meminfo MemAvailable (else free pages), within a cgroup v2
    limit and RLIMIT_AS when set; None when the system does not say."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            avail = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except (OSError, ValueError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    room = []
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                room.append(int(limit) - int(g.read()))
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/status") as f:
                vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
            room.append(soft - vm)
        except (OSError, ValueError, StopIteration):
            pass
    if avail is not None:
        room.append(avail)
    return max(min(room), 0) if room else None


def check_host_memory(cfg: ModelConfig, ctx: int, available: int | None = None, slots: int = 1,
                      held: int = 0, weights: int | None = None, backend: str = "NumPy") -> None:
    """HostMemoryError, naming a context that would fit, when the weights and the KV caches of `slots`
    sequences at `ctx` exceed the available RAM (`held`: that many caches and the weights are allocated
    already). `weights`: the bytes the `backend` holds its weights in, where not host_bytes' float32."""
    chunk = NumpyBackend.prefill_chunk  # None: a prompt of up to ctx tokens in one pass
    float32, kv = host_bytes(cfg, ctx)
    weights = float32 if weights is None else weights
    scratch = scratch_bytes(cfg, ctx, chunk)
    if held:  # what is allocated already is not asked for again
        weights, kv = 0, kv * (slots - held)
        if free_ok(available, kv + scratch):
            return
        raise HostMemoryError(f"not enough host memory for {slots} sequences on the {backend} backend: "
                              f"{slots - held} more KV caches need {human_bytes(kv)} (at --ctx {ctx}); "
                              f"ask for fewer, or a smaller context")
    kv *= slots

    def need(c: int) -> int:  # the weights do not depend on the context
        return weights + slots * host_bytes(cfg, c)[1] + scratch_bytes(cfg, c, chunk)

    free = available_host_memory() if available is None else available
    if free is None or weights + kv + scratch <= free:
        return
    lo, hi = 0, ctx  # the largest context that fits: need() grows with the context
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= free else (lo, mid - 1)
    fit = lo // 256 * 256 if lo >= 512 else lo
    hint = (
        f"try --ctx {fit} (the KV cache needs {human_bytes(kv)} at --ctx {ctx})"
        if fit >= 16
        else "the weights alone do not fit: use a smaller model, or the CUDA backend"
    )
    raise HostMemoryError(
        f"not enough host memory for the {backend} backend: the model needs {human_bytes(weights + kv + scratch)} "
        f"({'float32 ' if weights == float32 else ''}weights {human_bytes(weights)}, KV cache {human_bytes(kv)}, prefill scratch "
        f"{human_bytes(scratch)}), {human_bytes(free)} is available; {hint}"
    )


def free_ok(available: int | None, need: int) -> bool:
    """Whether `need` more bytes fit in the host's available memory (unknown: taken as fitting)."""
    free = available_host_memory() if available is None else available
    return free is None or need <= free
