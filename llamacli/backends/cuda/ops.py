"""The small Backend operations models/block.run calls on the CUDA backend, one kernel each: embedding rows
(kernels/dequant.cu embed_<t>, times the config's embedding scale), RMSNorm (norm.cu), RoPE (rope.cu, the
global or the local table), SwiGLU / GeGLU, the soft-cap and the residual add (elementwise.cu). matmul is in linear.py, attention in attention.py."""

from __future__ import annotations

from typing import Any

from ...models.config import ROPE_NEOX
from . import loader as K
from .linear import DeviceMatrix, qname
from .profile import profiled


class OpsMixin:
    """Mixed into backend.CudaBackend."""

    cp: Any
    cfg: Any

    @profiled("embedding")
    def embed(self, ids: Any) -> Any:
        w: DeviceMatrix = self.weights.token_embd
        t = int(ids.shape[0])
        out = self.cp.empty((t, w.cols), dtype=self.cp.float32)
        self._embed(ids, w, out, t)
        return out

    def _embed(self, ids: Any, w: DeviceMatrix, out: Any, t: int) -> None:
        units = K.cdiv(w.cols, 32)
        K.launch("dequant", f"embed_{qname(w.qtype)}", (t, K.cdiv(units, 128)), (128,), ids=ids, w=w.ptr, K=w.cols,
                 out=out)
        if self.cfg.embd_scale != 1.0:  # gemma: rows times sqrt(D), as the reference's float32 product
            n = t * w.cols
            K.launch("elementwise", "scale_f32", (min(K.cdiv(n, 256), 4096),), (256,), x=out, y=out,
                     s=self.cfg.embd_scale, n=n)

    @profiled("norm")
    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        x = self._f32(x)
        out = self.cp.empty_like(x)
        self._rms_norm(x, weight, eps, out)
        return out

    def _rms_norm(self, x: Any, weight: Any, eps: float, out: Any) -> None:
        d = x.shape[-1]
        rows = x.size // d
        K.launch("norm", "rms_norm_f32", (rows,), (256,), x=x, w=weight, y=out, D=d, eps=eps)

    @profiled("RoPE")
    def rope(self, x: Any, pos: Any, local: bool = False) -> Any:
        cfg = self.cfg
        out = self._f32(x).copy()
        t, h, dh = out.shape
        mode = "neox" if cfg.rope_type == ROPE_NEOX else "normal"
        table, attn = (self.inv_freq_local, 1.0) if local else (self.inv_freq, cfg.rope_attn_factor)
        K.launch("rope", f"rope_{mode}", (t, h), (max(32, K.cdiv(dh // 2, 32) * 32),), x=out, stride=h * dh, H=h,
                 Dh=dh, rope_dim=cfg.rope_dim, pos=pos, inv_freq=table, attn=attn)
        return out

    @profiled("FFN")
    def swiglu(self, gate: Any, up: Any) -> Any:
        return self._glu("swiglu_f32", gate, up)

    @profiled("FFN")
    def geglu(self, gate: Any, up: Any) -> Any:
        return self._glu("geglu_f32", gate, up)

    def _glu(self, kernel: str, gate: Any, up: Any) -> Any:
        gate, up = self._f32(gate), self._f32(up)
        out = self.cp.empty_like(gate)
        n = gate.size
        K.launch("elementwise", kernel, (min(K.cdiv(n, 256), 4096),), (256,), g=gate, u=up, y=out, n=n)
        return out

    @profiled("LM head")
    def softcap(self, x: Any, cap: float) -> Any:
        x = self._f32(x)
        out = self.cp.empty_like(x)
        self._softcap(x, out, cap)
        return out

    def _softcap(self, x: Any, out: Any, cap: float) -> None:
        n = x.size
        K.launch("elementwise", "softcap_f32", (min(K.cdiv(n, 256), 4096),), (256,), x=x, y=out, c=cap, n=n)

    @profiled("other (residual add)")
    def add(self, x: Any, y: Any) -> Any:
        x, y = self._f32(x), self._f32(y)
        out = self.cp.empty_like(x)
        n = x.size
        K.launch("elementwise", "add_f32", (min(K.cdiv(n, 256), 4096),), (256,), a=x, b=y, y=out, n=n)
        return out
