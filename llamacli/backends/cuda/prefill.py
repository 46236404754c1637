"""The fused prefill pass of the CUDA backend (`forward_prompt`, block.prefill's chunks of PREFILL_CHUNK tokens).

forward_prompt runs a prompt chunk of T tokens (MATVEC_TMAX < T <= PREFILL_CHUNK) through preallocated
buffers, activations between GEMMs as fp16 with a power-of-two row scale (kernels/common.cuh f16_rowscale).
Per layer (_prefill_kernels): rms_norm_f16 | dequantize Q,K,V into one fp16 scratch (one launch when they lie
back to back with one type; F16 weights are read in place) + one GEMM | scale, bias, RoPE, K/V store
(rope_store_pf) | attention on tensor cores, fp16 out | O GEMM accumulating into the residual (beta = 1) |
rms_norm_f16 | gate/up dequantize + one GEMM | swiglu_f16_rowscale | down dequantize + GEMM | rowscale_add into
the residual (a mixture-of-experts layer: rms_norm_f16, then moe.MoEMixin._moe_gemm's ~10 launches: router,
routing, grouping, the experts' GEMMs on tensor cores, their weighted sum into the residual). Then the LM head
on the last row only (mv1 with the final RMSNorm fused). 11-17 launches per dense layer where the op-by-op
path (block.run) takes ~45.

The token ids and positions live in device buffers, so a chunk length seen before is captured once into a
CUDA graph and replayed (the first sighting runs the kernels directly: compilation, cuBLAS plans); long
prompts repeat PREFILL_CHUNK, so every chunk after the second replays.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import numpy as np

from ...ggufio.ggml_types import GGMLQuantizationType as QT
from ...models.config import ROPE_NEOX
from ...models.kv_cache import RING_CHUNK
from . import loader as K
from .attention import ATT_TC_DIMS, ATT_TC_MIN_T, tc_qscale
from .linear import DEQUANT_CHUNK, MATVEC_TMAX, DeviceMatrix, merge_rows, qname
from .moe import dense_ff, moe_family_needed

log = logging.getLogger("llamacli.cuda")

PREFILL_CHUNK = RING_CHUNK  # prompt tokens per prefill pass (forward_prompt's buffers; llama.cpp's micro-batch;
# the most a sliding-window ring takes in one pass, kv_cache.py): 512
PREFILL_GRAPHS = 8  # captured prefill passes kept, by length (least recently used dropped)


class PrefillMixin:
    """Mixed into backend.CudaBackend."""

    cp: Any
    cfg: Any
    ctx: int

    def forward_prompt(self, ids: np.ndarray, start: int) -> Any:
        self._ahead = None  # a decode step queued ahead is stale once the cache changes
        t = int(np.asarray(ids).size)
        if t <= MATVEC_TMAX or t > min(self.ctx, PREFILL_CHUNK):
            return super().forward_prompt(ids, start)  # type: ignore[misc]
        cp = self.cp
        b = self.prefill_buffers()
        b.ids[:t].set(np.asarray(ids, dtype=np.int32).reshape(-1))
        b.pos[:t].set(np.arange(start, start + t, dtype=np.int32))
        graph = self._pf_graphs.get(t) if self._prof is None else None  # profiling times the kernels one by one
        if graph is None and self.use_graph and self._pf_graph_ok and self._prof is None and t in self._pf_seen:
            try:
                graph = self._capture(lambda: self._prefill_kernels(t))
            except Exception as exc:  # a cuBLAS that cannot be captured: the kernels run directly from now on
                log.warning("prefill graph capture failed (%s: %s); prefill runs without graphs", type(exc).__name__, exc)
                self._pf_graph_ok = False
            else:
                self._pf_graphs[t] = graph
                while len(self._pf_graphs) > PREFILL_GRAPHS:
                    self._pf_graphs.popitem(last=False)
        if graph is not None:
            self._pf_graphs.move_to_end(t)
            graph.launch(cp.cuda.get_current_stream())
        else:
            self._prefill_kernels(t)
            self._pf_seen.add(t)
        return b.logits

    @property
    def prefill_graph_lengths(self) -> frozenset[int]:
        """The chunk lengths whose prefill pass is captured as a graph now."""
        return frozenset(self._pf_graphs)

    def prefill_buffers(self) -> SimpleNamespace:
        """forward_prompt's buffers (counted in _scratch_bytes) and per-layer GEMM plans, made once: ids, pos,
        x (the residual stream), h16 + scale (GEMM input), att16, qkv, gu, y, dq (the dequantized weight
        scratch), logits, and per layer (QKV matrices, QKV bias, O, gate/up matrices, down)."""
        if self._pf is not None:
            return self._pf
        cp, cfg = self.cp, self.cfg
        tm = min(self.ctx, PREFILL_CHUNK)
        d, f, nqkv = cfg.n_embd, dense_ff(cfg), cfg.q_dim + 2 * cfg.kv_dim
        f32 = cp.float32
        b = SimpleNamespace(
            ids=cp.zeros(tm, cp.int32), pos=cp.zeros(tm, cp.int32),
            x=cp.empty(tm * d, f32),  # the residual stream
            h16=cp.empty(tm * max(d, cfg.q_dim, f), cp.float16), scale=cp.empty(tm, f32),  # GEMM input
            att16=cp.empty(tm * cfg.q_dim, cp.float16),  # attention output (O-projection input)
            qkv=cp.empty(tm * nqkv, f32), gu=cp.empty(tm * 2 * f, f32), y=cp.empty(tm * max(d, cfg.q_dim), f32),
            dq=cp.empty(DEQUANT_CHUNK, cp.float16), logits=cp.empty((1, cfg.vocab_size), f32), layers=[],
        )
        for i, (L, fl) in enumerate(zip(self.weights.layers, self.fused)):  # (fusion.py's branches)
            qkv = [getattr(L, m.weight) for m in fl.attention.qkv]
            o = [getattr(L, fl.attention.out.weight)]
            if fl.ffn.moe is not None:  # the experts: moe.MoEMixin.moe
                b.layers.append((merge_rows(qkv), self._qkv_plan[i][1], o, None, None))
                continue
            gu = [getattr(L, m.weight) for m in fl.ffn.gate_up]
            b.layers.append((merge_rows(qkv), self._qkv_plan[i][1], o, merge_rows(gu), [getattr(L, fl.ffn.down.weight)]))
        if moe_family_needed(cfg):
            self._moe_buffers(tm)  # before any capture: a captured pass allocates nothing
        self._pf = b
        return b

    def _gemm_weights(self, x16_ptr: int, t: int, mats: list[DeviceMatrix], y_ptr: int, ldy: int,
                      accumulate: bool = False) -> None:
        """Y[t, :] (=, or +=) X16 [t, K] . [W0; W1; ...]^T, the rows of the matrices side by side in Y's
        columns: F16 weights multiplied where they lie, others dequantized into the fp16 scratch (up to
        DEQUANT_CHUNK values per GEMM)."""
        dq = self._pf.dq.data.ptr
        k = mats[0].cols
        cap = max(1, DEQUANT_CHUNK // k)
        col0, filled = 0, 0  # Y column of the scratch's first row; rows in the scratch

        def flush() -> None:
            nonlocal col0, filled
            if filled:
                self._gemm(x16_ptr, t, k, dq, filled, y_ptr, ldy, col0, accumulate)
                col0, filled = col0 + filled, 0

        for m in mats:
            if m.qtype == QT.F16 and m.row_bytes == 2 * k:
                flush()
                self._gemm(x16_ptr, t, k, m.ptr, m.rows, y_ptr, ldy, col0, accumulate)
                col0 += m.rows
                continue
            r = 0
            while r < m.rows:
                n = min(cap - filled, m.rows - r)
                units = n * K.cdiv(k, 32)
                K.launch("dequant", f"dequant_{qname(m.qtype)}", (min(K.cdiv(units, 256), 65535),), (256,),
                         w=m.ptr + r * m.row_bytes, N=n, K=k, out=dq + 2 * filled * k)
                filled, r = filled + n, r + n
                if filled == cap:
                    flush()
        flush()

    def _prefill_kernels(self, t: int) -> None:
        """Launch the fused prefill of b.ids[:t] at b.pos[:t] (see the module docstring) -> b.logits."""
        cfg, w, b = self.cfg, self.weights, self._pf
        d, f, eps = cfg.n_embd, cfg.n_ff, cfg.rms_eps
        hq, hkv, dh = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        nqkv = cfg.q_dim + 2 * cfg.kv_dim
        mode = "neox" if cfg.rope_type == ROPE_NEOX else "normal"
        tc = t >= ATT_TC_MIN_T and dh in ATT_TC_DIMS and self.attention_tc
        x, h16, sc, qkv, gu, y = b.x, b.h16.data.ptr, b.scale, b.qkv, b.gu, b.y
        xt = x[: t * d].reshape(t, d)  # the residual stream as [t, D]
        sec = self._section

        def norm16(weight: Any) -> None:  # h16, sc = fp16 RMSNorm(x) * weight with its row scales
            K.launch("norm", "rms_norm_f16", (t,), (256,), x=x, w=weight, y=h16, scale=sc, D=d, eps=eps)

        def add_scaled() -> None:  # x += y * sc (rows)
            K.launch("elementwise", "rowscale_add_f32", (min(K.cdiv(t * d, 256), 4096),), (256,), x=x, y=y, s=sc,
                     n=t * d, N=d)

        def post_add(weight: Any, scale: Any) -> None:  # x += RMSNorm(y * scale (rows; None: 1)) * weight
            K.launch("norm", "rms_norm_add", (t,), (256,), x=x, y=y, s=scale, w=weight, D=d, eps=eps)

        with sec("embedding"):
            self._embed(b.ids, w.token_embd, x, t)
        for i, L in enumerate(w.layers):  # each layer's two branches, as fusion.match_layer read its program
            a, fb = self.fused[i].attention, self.fused[i].ffn
            qkv_w, bias, o_w, gu_w, down_w = b.layers[i]
            with sec("norm"):
                norm16(getattr(L, a.norm.weight))
            with sec("QKV"):
                self._gemm_weights(h16, t, qkv_w, qkv.data.ptr, nqkv)
            with sec("RoPE"):  # + the bias, and q/k norms where the plan has them; no rotation on NoPE layers
                dims, table, attn = self.rope_args(a.rope)
                kc, vc = self.rope_store_caches(i)  # (an 8-bit cache: its fp16 pair, then store_q8)
                args = dict(qkv=qkv, stride=nqkv, Hq=hq, Hkv=hkv, Dh=dh, rope_dim=dims, pos=b.pos, inv_freq=table,
                            attn=attn, kc=kc, vc=vc, ring=kc.shape[0], scale=sc, bias=bias, q16=h16 if tc else None,
                            q16_stride=cfg.q_dim, qscale=tc_qscale(dh, cfg.attn_scale))
                if a.head_norms is not None:
                    qn, kn = (getattr(L, n.weight) for n in a.head_norms)
                    kernel, args = f"rope_store_pf_qkn_{mode}", {**args, "qn": qn, "kn": kn, "eps": eps}
                else:
                    kernel = f"rope_store_pf_{mode}"
                K.launch("rope", kernel, (t, hq + 2 * hkv), (max(32, K.cdiv(dh // 2, 32) * 32),), **args)
                self.store_q8(i, qkv, nqkv, b.pos, t)
            with sec("attention"):
                if tc:  # q16 in h16 (the QKV GEMM is done with it), written by rope_store_pf
                    self.attend_tc(b.h16, cfg.q_dim, self.k_cache[i], self.v_cache[i], b.pos, t, b.att16, a.attention)
                else:  # fp32 CUDA-core attention, then fp16 with a row scale
                    att = y[: t * cfg.q_dim].reshape(t, cfg.q_dim)
                    self.attend(qkv, nqkv, self.k_cache[i], self.v_cache[i], b.pos, t, att, 1, self.ctx, None, None,
                                op=a.attention)
                    K.launch("elementwise", "to_f16_rowscale_f32", (t,), (256,), x=att, x16=b.att16, scale=sc,
                             k=cfg.q_dim)
            with sec("O-proj"):
                if a.post is not None:  # gemma: x += RMSNorm(Wo att (x the row scale unless tc)) * w_post
                    self._gemm_weights(b.att16.data.ptr, t, o_w, y.data.ptr, d)
                    post_add(getattr(L, a.post.weight), None if tc else sc)
                elif tc:  # unscaled fp16 input: accumulate straight into the residual stream
                    self._gemm_weights(b.att16.data.ptr, t, o_w, x.data.ptr, d, accumulate=True)
                else:
                    self._gemm_weights(b.att16.data.ptr, t, o_w, y.data.ptr, d)
                    add_scaled()
                if a.out.bias is not None:  # gpt-oss
                    xt += getattr(L, a.out.bias)
            with sec("norm"):
                norm16(getattr(L, fb.norm.weight))
            if fb.moe is not None:  # x += the experts' weighted sum (moe.MoEMixin._moe_gemm)
                with sec("FFN"):
                    self._moe_gemm(h16, sc, t, fb.moe, xt)
                continue
            with sec("FFN"):
                self._gemm_weights(h16, t, gu_w, gu.data.ptr, 2 * f)
                glu = "geglu_f16_rowscale" if fb.glu.activation == "gelu_tanh" else "swiglu_f16_rowscale"
                K.launch("elementwise", glu, (t,), (256,), gu=gu, s_in=sc, F=f, y16=h16, s_out=sc)
                self._gemm_weights(h16, t, down_w, y.data.ptr, d)
                if fb.post is not None:
                    post_add(getattr(L, fb.post.weight), sc)
                else:
                    add_scaled()
        with sec("LM head"):
            last = x[(t - 1) * d : t * d].reshape(1, d)
            self.matvec((w.output,), last, 1, b.logits, norm=w.output_norm)
            if cfg.final_softcap:  # gemma2
                self._softcap(b.logits, b.logits, cfg.final_softcap)
