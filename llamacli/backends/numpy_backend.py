"""The NumPy backend: the readable reference every CUDA kernel is tested against.

Weights are dequantized to float32 once at load (layer by layer); the embedding table stays quantized and
only the rows asked for are dequantized. The KV cache is float32 [layer, ctx, Hkv, Dh].
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from .. import rope as rope_tables
from ..config import ROPE_NEOX, ModelConfig
from ..gguf_file import GGUFFile
from ..quants import can_dequantize, gather_rows
from .base import Backend, LayerWeights, ModelWeights, Progress


class QuantTable:
    """A 2-D tensor kept in its GGUF layout; rows are dequantized on demand."""

    def __init__(self, raw: np.ndarray, qtype: QT, shape: tuple[int, int]):
        self.raw, self.qtype, self.shape = raw, qtype, shape

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return gather_rows(self.raw, self.qtype, ids, self.shape[1])


class NumpyBackend(Backend):
    name = "numpy"
    runnable_types = frozenset(t for t in QT if t in GGML_QUANT_SIZES and can_dequantize(t))

    def load(self, gguf: GGUFFile, cfg: ModelConfig, ctx: int, progress: Progress | None = None) -> None:
        self.cfg, self.ctx = cfg, ctx
        f32 = gguf.dequantize
        total = cfg.n_layer + 2
        report = progress or (lambda done, total, what: None)

        emb = gguf.tensors["token_embd.weight"]
        token_embd = QuantTable(gguf.raw(emb.name), emb.type, (emb.shape[0], emb.shape[1]))
        report(1, total, "token_embd")
        layers = []
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            get = lambda name: f32(p + name) if p + name in gguf.tensors else None  # noqa: E731
            layers.append(
                LayerWeights(
                    attn_norm=get("attn_norm.weight"),
                    attn_q=get("attn_q.weight"),
                    attn_k=get("attn_k.weight"),
                    attn_v=get("attn_v.weight"),
                    attn_qkv=get("attn_qkv.weight"),
                    attn_q_bias=get("attn_q.bias"),
                    attn_k_bias=get("attn_k.bias"),
                    attn_v_bias=get("attn_v.bias"),
                    attn_output=get("attn_output.weight"),
                    ffn_norm=get("ffn_norm.weight"),
                    ffn_gate=get("ffn_gate.weight"),
                    ffn_up=get("ffn_up.weight"),
                    ffn_down=get("ffn_down.weight"),
                )
            )
            report(2 + i, total, f"layer {i}")
        # The LM head needs the whole matrix every step: dequantize it once (a copy when tied).
        output = f32("output.weight") if "output.weight" in gguf.tensors else f32("token_embd.weight")
        self.weights = ModelWeights(token_embd, layers, f32("output_norm.weight"), output)
        report(total, total, "output")

        self.theta = rope_tables.inv_freq(cfg, gguf, ctx)  # [rope_dim/2]
        self.k_cache = np.zeros((cfg.n_layer, ctx, cfg.n_head_kv, cfg.head_dim), dtype=np.float32)
        self.v_cache = np.zeros_like(self.k_cache)

    # -- host <-> backend --------------------------------------------------------------------------------
    def positions(self, start: int, n: int) -> np.ndarray:
        return np.arange(start, start + n, dtype=np.int32)

    def token_ids(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(ids, dtype=np.int32).reshape(-1)

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    # -- operations --------------------------------------------------------------------------------------
    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self.weights.token_embd.rows(ids)  # [T, D]

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
        return (x / np.sqrt(ms + eps)).astype(np.float32) * weight

    def matmul(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        y = x @ w.T  # [T, K] x [N, K]^T -> [T, N]
        return y + bias if bias is not None else y

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        cos, sin = rope_tables.cos_sin(self.theta, pos, cfg.rope_attn_factor)  # [T, R/2]
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

    def attention(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        self.k_cache[layer, pos] = k  # [T, Hkv, Dh] at their positions
        self.v_cache[layer, pos] = v
        n = int(pos.max()) + 1
        keys, values = self.k_cache[layer, :n], self.v_cache[layer, :n]  # [S, Hkv, Dh]
        t = q.shape[0]
        qg = q.reshape(t, cfg.n_head_kv, cfg.n_group, cfg.head_dim)  # query heads grouped by their KV head
        scores = np.einsum("thgd,shd->hgts", qg, keys) / np.sqrt(cfg.head_dim)  # [Hkv, G, T, S]
        causal = np.arange(n)[None, :] > pos[:, None]  # [T, S]: key after the query's position
        scores = np.where(causal, -np.inf, scores)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out = np.einsum("hgts,shd->thgd", p, values)  # [T, Hkv, G, Dh]
        return out.reshape(t, cfg.q_dim).astype(np.float32)

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        sigmoid = 0.5 * (1.0 + np.tanh(0.5 * gate))  # = 1 / (1 + e^-gate), without overflow
        return (gate * sigmoid * up).astype(np.float32)

    def add(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return x + y
