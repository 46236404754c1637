"""The one-kernel launchers the Backend operations and both fused executors share: embedding rows
(kernels/dequant.cu embed_<t>, times the config's embedding scale), RMSNorm (norm.cu), RoPE (rope.cu),
SwiGLU / GeGLU, the soft-cap, gemma4's Scale and the residual add (elementwise.cu). Each writes into the array it is given.
"""

from __future__ import annotations

from typing import Any

from ...models.config import ROPE_NEOX
from . import loader as K
from .linear import DeviceMatrix, qname


def embed_rows(cfg: Any, ids: Any, w: DeviceMatrix, out: Any, t: int, scale: float | None = None) -> None:
    """out [t, cols] = rows ids [t] of the embedding table w, dequantized, times `scale` (None: cfg.embd_scale;
    gemma4's per-layer table: sqrt(P))."""
    scale = cfg.embd_scale if scale is None else scale
    units = K.cdiv(w.cols, 32)
    K.launch("dequant", f"embed_{qname(w.qtype)}", (t, K.cdiv(units, 128)), (128,), ids=ids, w=w.ptr, K=w.cols,
             out=out)
    if scale != 1.0:  # gemma: rows times sqrt(D), as the reference's float32 product
        n = t * w.cols
        K.launch("elementwise", "scale_f32", (min(K.cdiv(n, 256), 4096),), (256,), x=out, y=out, s=scale, n=n)


def rms_norm_into(x: Any, weight: Any, eps: float, out: Any) -> None:
    """out = RMSNorm(x) * weight over x's last axis."""
    d = x.shape[-1]
    K.launch("norm", "rms_norm_f32", (x.size // d,), (256,), x=x, w=weight, y=out, D=d, eps=eps)


def rope_into(cfg: Any, x: Any, pos: Any, table: Any, attn: float, rope_dim: int | None = None) -> None:
    """x [t, H, Dh] rotated in place at positions pos [t] with the theta table and attention factor given, the
    first `rope_dim` dims of each head (None: cfg.rope_dim)."""
    t, h, dh = x.shape
    mode = "neox" if cfg.rope_type == ROPE_NEOX else "normal"
    K.launch("rope", f"rope_{mode}", (t, h), (max(32, K.cdiv(dh // 2, 32) * 32),), x=x, stride=h * dh, H=h,
             Dh=dh, rope_dim=cfg.rope_dim if rope_dim is None else rope_dim, pos=pos, inv_freq=table, attn=attn)


def glu_into(kernel: str, gate: Any, up: Any, out: Any) -> None:
    """out = act(gate) * up, `kernel` swiglu_f32 or geglu_f32."""
    n = gate.size
    K.launch("elementwise", kernel, (min(K.cdiv(n, 256), 4096),), (256,), g=gate, u=up, y=out, n=n)


def softcap_into(x: Any, out: Any, cap: float) -> None:
    """out = cap * tanh(x / cap)."""
    n = x.size
    K.launch("elementwise", "softcap_f32", (min(K.cdiv(n, 256), 4096),), (256,), x=x, y=out, c=cap, n=n)


def scale_into(x: Any, factor: float, weight: Any, out: Any) -> None:
    """out = x * factor (* weight [N], broadcast over x's last axis; None: none)."""
    n = x.size
    K.launch("elementwise", "scale_w_f32", (min(K.cdiv(n, 256), 4096),), (256,), x=x, y=out, s=factor, w=weight,
             n=n, N=1 if weight is None else int(weight.size))


def add_into(x: Any, y: Any, out: Any) -> None:
    """out = x + y."""
    n = x.size
    K.launch("elementwise", "add_f32", (min(K.cdiv(n, 256), 4096),), (256,), a=x, b=y, y=out, n=n)
