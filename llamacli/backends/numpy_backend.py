"""The NumPy backend: the readable reference every CUDA kernel is tested against.

Weights are dequantized to float32 once at load (layer by layer; experts as [E, rows, cols] arrays); the
embedding table stays quantized and only the rows asked for are dequantized. The KV cache is float32,
one [rows, Hkv, Dh] array per layer: ctx rows, or on a sliding-window layer a ring (kv_cache.py: position p at
row p mod rows), as the CUDA backend keeps it.
"""

from __future__ import annotations

import functools
import math
import os
import resource

import numpy as np

from ..errors import HostMemoryError, UsageError
from ..ggufio.file import GGUFFile
from ..ggufio.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from ..ggufio.quants import can_dequantize, gather_rows
from ..models import rope as rope_tables
from ..models.block import Attention, Moe
from ..models.config import ROPE_NEOX, ModelConfig
from ..models.kv_cache import DEFAULT as DEFAULT_CACHE, q8_0_roundtrip, ring_span
from ..models.moe import route
from ..models.weights import layer_tensor_names, model_specs
from ..units import human_bytes
from .base import Backend, LayerWeights, ModelWeights, Progress


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
    runnable_types = frozenset(t for t in QT if t in GGML_QUANT_SIZES and can_dequantize(t))
    cache_types = DEFAULT_CACHE  # (load sets the model's)

    @_ieee
    def load(self, gguf: GGUFFile, cfg: ModelConfig, ctx: int, progress: Progress | None = None,
             cache_types: tuple[str, str] = DEFAULT_CACHE) -> None:
        check_host_memory(cfg, ctx)  # before anything is allocated: the file's sizes or --ctx may be absurd
        self.cfg, self.ctx = cfg, ctx
        self.cache_types = cache_types
        f32 = gguf.dequantize
        total = cfg.n_layer + 2
        report = progress or (lambda done, total, what: None)

        emb = gguf.tensors["token_embd.weight"]
        token_embd = QuantTable(gguf.raw(emb.name), emb.type, (emb.shape[0], emb.shape[1]))
        report(1, total, "token_embd")
        layers = []
        for i in range(cfg.n_layer):  # every tensor the block's plan names, as float32 (experts [E, rows, cols])
            names = layer_tensor_names(cfg, i)
            layers.append(LayerWeights(**{field: f32(name) for field, name in names.items() if name in gguf.tensors}))
            report(2 + i, total, f"layer {i}")
        # The LM head needs the whole matrix every step: dequantize it once (a copy when tied).
        output = f32("output.weight") if "output.weight" in gguf.tensors else f32("token_embd.weight")
        self.weights = ModelWeights(token_embd, layers, f32("output_norm.weight"), output)
        report(total, total, "output")

        self.theta = rope_tables.inv_freq(cfg, gguf, ctx)  # [rope_dim/2]
        self.theta_local = rope_tables.inv_freq(cfg, gguf, ctx, local=True)
        self._caches = [self._new_cache()]
        self.slots = 1
        self.use_slot(0)

    def _new_cache(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """One slot's K and V caches: per layer [rows, Hkv, Dh] float32 (config.cache_rows)."""
        cfg = self.cfg
        k = [np.zeros((n, cfg.n_head_kv, cfg.head_dim), dtype=np.float32) for n in cfg.cache_rows(self.ctx)]
        return k, [np.zeros_like(x) for x in k]

    def set_slots(self, n: int) -> None:
        """Caches for n sequences: slot 0's stays, the others are allocated (checked against the host's memory
        first) or dropped."""
        if type(n) is not int or n < 1:
            raise UsageError(f"the number of sequences must be a positive integer, got {n!r}")
        if n > len(self._caches):
            check_host_memory(self.cfg, self.ctx, slots=n, held=len(self._caches))
        self._forget_slots(min(n, len(self._caches)))
        while len(self._caches) < n:
            self._caches.append(self._new_cache())
        del self._caches[n:]
        self.slots = n
        self.use_slot(0)

    def use_slot(self, slot: int) -> None:
        self.k_cache, self.v_cache = self._caches[slot]

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

    @_ieee
    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
        return (x / np.sqrt(ms + eps)).astype(np.float32) * weight

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
        r = cfg.rope_dim
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
        """q [T, q_dim], k and v [T, Hkv, Dh] at consecutive positions pos [T] -> [T, q_dim]. K and V go into
        layer op.layer's cache first (a ring takes at most kv_cache.ring_span positions per pass, so a long chunk
        goes in several)."""
        span = ring_span(op.window, self.k_cache[op.layer].shape[0], self.ctx)
        t = q.shape[0]
        if t <= span:
            return self._attend(op, q, k, v, pos)
        return np.concatenate([self._attend(op, q[s : s + span], k[s : s + span], v[s : s + span],
                                            pos[s : s + span]) for s in range(0, t, span)])

    def _attend(self, op: Attention, q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        kc, vc = self.k_cache[op.layer], self.v_cache[op.layer]
        # [T, Hkv, Dh] at their rows (position mod rows); an 8-bit cache keeps what its blocks hold (kv_cache.py)
        k_type, v_type = self.cache_types
        kc[pos % kc.shape[0]] = q8_0_roundtrip(k) if k_type == "q8_0" else k
        vc[pos % vc.shape[0]] = q8_0_roundtrip(v) if v_type == "q8_0" else v
        lo = max(0, int(pos.min()) - op.window + 1) if op.window else 0  # the first key any query sees
        key_pos = np.arange(lo, int(pos.max()) + 1)
        keys, values = _rows(kc, lo, key_pos.size), _rows(vc, lo, key_pos.size)  # [S, Hkv, Dh]
        t, n = q.shape[0], key_pos.size
        qg = q.reshape(t, cfg.n_head_kv, cfg.n_group, cfg.head_dim)  # query heads grouped by their KV head
        out = np.empty((t, cfg.n_head_kv, cfg.n_group, cfg.head_dim), dtype=np.float32)
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
                sink = self.weights.layers[op.layer].attn_sinks.reshape(cfg.n_head_kv, cfg.n_group, 1, 1)
                top = np.maximum(top, sink)
            p = np.exp(scores - top)
            denom = p.sum(axis=-1, keepdims=True)
            if op.sinks:
                denom += np.exp(sink - top)
            p /= denom
            out[r : r + rows] = np.einsum("hgts,shd->thgd", p, values)  # [rows, Hkv, G, Dh]
        return out.reshape(t, cfg.q_dim)

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
    def moe(self, op: Moe, h: np.ndarray) -> np.ndarray:
        """Route each token of h [T, D] to cfg.n_expert_used experts (moe.route), then run expert by expert
        over the tokens that chose it: gate/up [T_e, F_exp] (+ biases), the activation, down [T_e, D]
        (+ bias), times the token's weight, added into its row. A token picks distinct experts, so within
        one expert its rows are distinct and a plain indexed add suffices."""
        cfg, L = self.cfg, self.weights.layers[op.layer]
        logits = self.matmul(h, L.ffn_gate_inp, L.ffn_gate_inp_bias)  # [T, E]
        ids, weights = route(logits, cfg.n_expert_used, op.gating, cfg.expert_weights_norm)  # [T, k]
        k = ids.shape[1]
        flat, wflat = ids.reshape(-1), weights.reshape(-1)  # slot s = token s // k
        order = np.argsort(flat, kind="stable")  # slots grouped by expert
        experts, starts = np.unique(flat[order], return_index=True)
        ends = np.append(starts[1:], flat.size)
        out = np.zeros((h.shape[0], cfg.n_embd), dtype=np.float32)
        bias = lambda b, e: None if b is None else b[e]  # noqa: E731
        for e, s0, s1 in zip(experts.tolist(), starts.tolist(), ends.tolist()):
            slots = order[s0:s1]
            tok = slots // k
            x = h[tok]  # [T_e, D]
            g = self.matmul(x, L.ffn_gate_exps[e], bias(L.ffn_gate_exps_bias, e))  # [T_e, F_exp]
            u = self.matmul(x, L.ffn_up_exps[e], bias(L.ffn_up_exps_bias, e))
            y = self.matmul(self.gated(op.activation, g, u), L.ffn_down_exps[e], bias(L.ffn_down_exps_bias, e))
            out[tok] += y * wflat[slots, None]  # [T_e, D]
        return out

    @_ieee
    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        return (cap * np.tanh(x.astype(np.float64) / cap)).astype(np.float32)

    @_ieee
    def add(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return x + y


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
    acts = t * (8 * cfg.n_embd + 4 * cfg.q_dim + 4 * cfg.kv_dim + 6 * max(cfg.n_ff, cfg.n_ff_exp))
    if any(p.moe for p in cfg.layers):  # router logits and their float64 softmax [T, E], the gathered rows
        acts += t * (6 * cfg.n_expert + 2 * cfg.n_embd)
    scores = cfg.n_head * attention_rows(cfg, t, ctx) * ctx
    return 4 * (acts + 2 * cfg.vocab_size) + 8 * 4 * scores


def host_bytes(cfg: ModelConfig, ctx: int) -> tuple[int, int]:
    """(weights, KV cache) bytes this backend allocates: every tensor but the embedding table as float32 (the
    LM head too, a copy when tied; experts, all E of them, [E, rows, cols]), and K and V float32 [rows, Hkv,
    Dh] per layer (config.cache_rows)."""
    weights = sum(4 * math.prod(s.shape) for s in model_specs(cfg) if s.name != "token_embd.weight")
    if cfg.tied_embeddings:
        weights += 4 * cfg.vocab_size * cfg.n_embd
    return weights, 2 * 4 * sum(cfg.cache_rows(ctx)) * cfg.kv_dim


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
                      held: int = 0) -> None:
    """HostMemoryError, naming a context that would fit, when the weights and the KV caches of `slots`
    sequences at `ctx` exceed the available RAM (`held`: that many caches and the weights are allocated
    already)."""
    chunk = NumpyBackend.prefill_chunk  # None: a prompt of up to ctx tokens in one pass
    weights, kv = host_bytes(cfg, ctx)
    scratch = scratch_bytes(cfg, ctx, chunk)
    if held:  # what is allocated already is not asked for again
        weights, kv = 0, kv * (slots - held)
        if free_ok(available, kv + scratch):
            return
        raise HostMemoryError(f"not enough host memory for {slots} sequences on the NumPy backend: "
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
        f"not enough host memory for the NumPy backend: the model needs {human_bytes(weights + kv + scratch)} "
        f"(float32 weights {human_bytes(weights)}, KV cache {human_bytes(kv)}, prefill scratch "
        f"{human_bytes(scratch)}), {human_bytes(free)} is available; {hint}"
    )


def free_ok(available: int | None, need: int) -> bool:
    """Whether `need` more bytes fit in the host's available memory (unknown: taken as fitting)."""
    free = available_host_memory() if available is None else available
    return free is None or need <= free
