"""The fused prefill pass of the CUDA backend (`forward_prompt`, block.prefill's chunks of PREFILL_CHUNK tokens).

forward_prompt runs a prompt chunk of T tokens (MATVEC_TMAX < T <= PREFILL_CHUNK) through preallocated
buffers, activations between GEMMs as fp16 with a power-of-two row scale (kernels/common.cuh f16_rowscale).
Per layer (PrefillPass.launch): rms_norm_f16 | dequantize Q,K,V into one fp16 scratch (one launch when they lie
back to back with one type; F16 weights are read in place) + one GEMM | scale, bias, RoPE, K/V store
(rope_store_pf) | attention on tensor cores, fp16 out | O GEMM accumulating into the residual (beta = 1) |
rms_norm_f16 | gate/up dequantize + one GEMM | swiglu_f16_rowscale | down dequantize + GEMM | rowscale_add into
the residual (a mixture-of-experts layer: rms_norm_f16, then moe.Experts.gemm's ~10 launches: router,
routing, grouping, the experts' GEMMs on tensor cores, their weighted sum into the residual). Then the LM head
on the last row only (mv1 with the final RMSNorm fused). 11-17 launches per dense layer where the op-by-op
path (block.run) takes ~45. A verification of drafts (speculative decoding, `forward(..., all_rows=True)`)
keeps every row: the layers as above (captured apart from the prompt's pass of the same length), then the
final RMSNorm and the LM head over all rows outside the graph (Linear.matmul: dequantized chunks and a GEMM).

A chunk of up to BG_NMAX tokens takes its products through bgemm (kernels/batch_gemm.cu: the weight decoded inside
the kernel; linear.Linear.gemm_weights), longer ones dequantize and call cuBLAS as above. `launch_rows` runs the same
pass over rows that are sequences of their own (the batched decode step, a verification of drafts: batch.py).

The token ids and positions live in device buffers, so a chunk length seen before is captured once into a
CUDA graph (per cache slot: it holds the slot's addresses) and replayed (the first sighting runs the kernels directly: compilation, cuBLAS plans); long
prompts repeat PREFILL_CHUNK, so every chunk after the second replays.

PrefillPass owns the pass's buffers and its captured graphs; it launches through the other parts (linear,
attention, experts) and the profiler's sections.
"""

from __future__ import annotations

import collections
import logging
from types import SimpleNamespace
from typing import Any

import numpy as np

from ...errors import BackendError
from ...models.config import ROPE_NEOX
from ...models.kv_cache import RING_CHUNK
from . import loader as K
from .attention import ATT_TC_DIMS, ATT_TC_MIN_T, tc_qscale
from .linear import MATVEC_TMAX, bgemm_ok, merge_rows
from .moe import dense_ff, moe_family_needed
from .ops import embed_rows, rms_norm_into, softcap_into

log = logging.getLogger("llamacli.cuda")

PREFILL_CHUNK = RING_CHUNK  # prompt tokens per prefill pass (forward_prompt's buffers; llama.cpp's micro-batch;
# the most a sliding-window ring takes in one pass, kv_cache.py): 512
PREFILL_GRAPHS = 8  # captured prefill passes kept, by length (least recently used dropped)


class PrefillPass:
    """The fused prefill pass of one model over its KV cache (see the module docstring)."""

    def __init__(self, gpu: Any, options: Any, model: Any, kv: Any, linear: Any, attention: Any, experts: Any,
                 qkv_bias: list[Any], profiler: Any):
        self.gpu, self.options, self.model, self.kv, self.linear = gpu, options, model, kv, linear
        self.attention, self.experts, self.profiler = attention, experts, profiler
        self.qkv_bias = qkv_bias  # each layer's QKV bias, concatenated (decode.DecodeStep.qkv_plan's)
        self.cp, self.cfg, self.ctx = gpu.cp, model.cfg, model.ctx
        self._buffers: SimpleNamespace | None = None
        # By (cache slot: a graph holds the slot's addresses; chunk length; whether the pass ends in the last row's
        # LM head: a verification's pass stops before it)
        self._graphs: collections.OrderedDict[tuple[int, int, bool], Any] = collections.OrderedDict()
        self._seen: set[tuple[int, bool]] = set()
        self._graph_ok = True

    @staticmethod
    def serves(t: int, ctx: int) -> bool:
        """Whether a chunk of t tokens takes the fused pass (shorter ones go through the matvecs, op by op)."""
        return MATVEC_TMAX < t <= min(ctx, PREFILL_CHUNK)

    def forward(self, ids: np.ndarray, start: int, all_rows: bool = False) -> Any:
        """The fused pass of host token ids [T] at positions start.. (serves(T)) -> logits [1, V] of the last
        one (a buffer the next pass overwrites), or with `all_rows` (a verification) logits [T, V] of every one
        (a new array); their K/V into the cache."""
        t = int(np.asarray(ids).size)
        cp = self.cp
        b = self.buffers()
        b.ids[:t].set(np.asarray(ids, dtype=np.int32).reshape(-1))
        b.pos[:t].set(np.arange(start, start + t, dtype=np.int32))
        head = not all_rows  # (a verification's pass stops before the LM head: head_all_rows follows)
        key = (self.kv.slot, t, head)  # (a graph holds its cache slot's addresses)
        profiling = self.profiler.active  # profiling times the kernels one by one
        graph = self._graphs.get(key) if not profiling else None
        if graph is None and self.options.use_graph and self._graph_ok and not profiling and (t, head) in self._seen:
            try:
                graph = self.gpu.capture(lambda: self.launch(t, head=head))
            except Exception as exc:  # a cuBLAS that cannot be captured: the kernels run directly from now on
                log.warning("prefill graph capture failed (%s: %s); prefill runs without graphs", type(exc).__name__, exc)
                self._graph_ok = False
            else:
                self._graphs[key] = graph
                while len(self._graphs) > PREFILL_GRAPHS:
                    self._graphs.popitem(last=False)
        if graph is not None:
            self._graphs.move_to_end(key)
            graph.launch(cp.cuda.get_current_stream())
        else:
            self.launch(t, head=head)
            self._seen.add((t, head))
        return self.head_all_rows(t) if all_rows else b.logits

    def head_all_rows(self, t: int) -> Any:
        """The final RMSNorm and the LM head (soft-capped where the model is) over the first t rows of the residual
        stream -> logits [t, V] (a new array): a verification's every position (not captured: it allocates)."""
        cp, cfg, w = self.cp, self.cfg, self.model.weights
        x = self._buffers.x[: t * cfg.n_embd].reshape(t, cfg.n_embd)
        h = cp.empty_like(x)
        rms_norm_into(x, w.output_norm, cfg.rms_eps, h)
        logits = self.linear.matmul(h, w.output)  # [t, V] float32
        if cfg.final_softcap:  # gemma2
            softcap_into(logits, logits, cfg.final_softcap)
        return logits

    def forget_slots(self, first: int) -> None:
        """Slots from `first` on are gone (KVCache.set_slots): their graphs too (they hold the old arrays)."""
        for key in [k for k in self._graphs if k[0] >= first]:
            del self._graphs[key]

    @property
    def graph_lengths(self) -> frozenset[int]:
        """The chunk lengths whose prefill pass (a prompt's, not a verification's) is captured as a graph now (for
        some cache slot)."""
        return frozenset(t for _, t, head in self._graphs if head)

    def buffers(self) -> SimpleNamespace:
        """forward's buffers (counted in device.scratch_bytes) and per-layer GEMM plans, made once: ids, pos,
        x (the residual stream), h16 + scale (GEMM input), att16, qkv, gu, y, logits, and per layer (QKV
        matrices, QKV bias, O, gate/up matrices, down); and the linear part's dequantize scratch."""
        if self._buffers is not None:
            return self._buffers
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
            logits=cp.empty((1, cfg.vocab_size), f32), layers=[],
        )
        self.linear.dequant_scratch()
        self.linear.bgemm_scratch()
        for i, (L, fl) in enumerate(zip(self.model.weights.layers, self.model.fused)):  # (fusion.py's branches)
            qkv = [getattr(L, m.weight) for m in fl.attention.qkv]
            o = [getattr(L, fl.attention.out.weight)]
            if fl.ffn.moe is not None:  # the experts: moe.Experts.gemm
                b.layers.append((merge_rows(qkv), self.qkv_bias[i], o, None, None))
                continue
            gu = [getattr(L, m.weight) for m in fl.ffn.gate_up]
            b.layers.append((merge_rows(qkv), self.qkv_bias[i], o, merge_rows(gu), [getattr(L, fl.ffn.down.weight)]))
        if moe_family_needed(cfg):
            self.experts.buffers(tm)  # before any capture: a captured pass allocates nothing
        self._buffers = b
        return b

    @property
    def max_rows(self) -> int:
        """The most rows one pass takes (its buffers' rows)."""
        return min(self.ctx, PREFILL_CHUNK)

    def launch_rows(self, ids: Any, pos: Any, slots: Any, logits: Any) -> None:
        """The pass over rows that are sequences of their own (the batched decode step, batch.BatchStep; a
        verification of drafts, its rows in one slot): device int32 ids, pos, slots [B] (B <= max_rows) ->
        logits [B, V] (float32, written in place). Each row's K/V goes into its own slot's cache (before any
        row's attention, so a verification's rows see the drafts before them), each row attends over its slot
        up to its position, the linear layers run through bgemm on every row (linear.Linear.gemm_weights with
        rows_apart: a row's sums do not depend on the others) and the LM head over every row. Not with an
        8-bit cache. (With options.batch_gemm off, or a matrix whose rows are not whole 32-value units, a
        float type's only, those products go through cuBLAS on the B rows, and there a row's bits may depend on
        B.)"""
        t = int(ids.shape[0])
        if not 1 <= t <= self.max_rows:
            raise BackendError(f"a pass over rows takes 1 to {self.max_rows} rows, got {t}")
        self.buffers()
        self.launch(t, rows=SimpleNamespace(ids=ids, pos=pos, slots=slots, logits=logits))

    def launch(self, t: int, head: bool = True, rows: SimpleNamespace | None = None) -> None:
        """Launch the fused prefill of b.ids[:t] at b.pos[:t] (see the module docstring) -> b.logits (`head`
        False: no LM head; the residual stream b.x holds the last layer's output of every row). `rows`
        (launch_rows): the rows are sequences of their own, ids, positions and slots from it, every row's
        logits into rows.logits."""
        cfg, w, b, fused = self.cfg, self.model.weights, self._buffers, self.model.fused
        kv, attn = self.kv, self.attention
        d, f, eps = cfg.n_embd, cfg.n_ff, cfg.rms_eps
        hq, hkv, dh = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        nqkv = cfg.q_dim + 2 * cfg.kv_dim
        mode = "neox" if cfg.rope_type == ROPE_NEOX else "normal"
        apart = rows is not None
        tc = not apart and t >= ATT_TC_MIN_T and dh in ATT_TC_DIMS and self.options.attention_tc
        ids, pos = (rows.ids, rows.pos) if apart else (b.ids, b.pos)
        x, h16, sc, qkv, gu, y = b.x, b.h16.data.ptr, b.scale, b.qkv, b.gu, b.y

        def gemm_weights(x16: int, t: int, mats: list[Any], y_ptr: int, ldy: int, accumulate: bool = False) -> None:
            self.linear.gemm_weights(x16, t, mats, y_ptr, ldy, accumulate, rows_apart=apart)

        def gemm_add(x16: int, mats: list[Any]) -> None:  # x += (X16 W^T) * sc (rows): fused into bgemm's output
            if self.linear.bgemm_serves(t, mats, apart):
                self.linear.gemm_weights(x16, t, mats, x.data.ptr, d, accumulate=True, rows_apart=apart, rs=sc)
            else:
                gemm_weights(x16, t, mats, y.data.ptr, d)
                add_scaled()

        xt = x[: t * d].reshape(t, d)  # the residual stream as [t, D]
        sec = self.profiler.section

        def norm16(weight: Any) -> None:  # h16, sc = fp16 RMSNorm(x) * weight with its row scales
            K.launch("norm", "rms_norm_f16", (t,), (256,), x=x, w=weight, y=h16, scale=sc, D=d, eps=eps)

        def add_scaled() -> None:  # x += y * sc (rows)
            K.launch("elementwise", "rowscale_add_f32", (min(K.cdiv(t * d, 256), 4096),), (256,), x=x, y=y, s=sc,
                     n=t * d, N=d)

        def post_add(weight: Any, scale: Any) -> None:  # x += RMSNorm(y * scale (rows; None: 1)) * weight
            K.launch("norm", "rms_norm_add", (t,), (256,), x=x, y=y, s=scale, w=weight, D=d, eps=eps)

        with sec("embedding"):
            embed_rows(cfg, ids, w.token_embd, x, t)
        for i, L in enumerate(w.layers):  # each layer's two branches, as fusion.match_layer read its program
            a, fb = fused[i].attention, fused[i].ffn
            qkv_w, bias, o_w, gu_w, down_w = b.layers[i]
            with sec("norm"):
                norm16(getattr(L, a.norm.weight))
            with sec("QKV"):
                gemm_weights(h16, t, qkv_w, qkv.data.ptr, nqkv)
            with sec("RoPE"):  # + the bias, and q/k norms where the plan has them; no rotation on NoPE layers
                dims, table, factor = self.model.rope_args(a.rope)
                qn, kn = (getattr(L, n.weight) for n in a.head_norms) if a.head_norms is not None else (None, None)
                grid, block = (t, hq + 2 * hkv), (max(32, K.cdiv(dh // 2, 32) * 32),)
                if apart:  # each row's K/V into its own slot's cache
                    kt, vt = kv.tables(i)
                    K.launch("rope", f"rope_store_pfb_{mode}", grid, block, qkv=qkv, stride=nqkv, Hq=hq, Hkv=hkv,
                             Dh=dh, rope_dim=dims, pos=pos, inv_freq=table, attn=factor, kt=kt, vt=vt, slot=rows.slots,
                             ring=kv.k_cache[i].shape[0], scale=sc, bias=bias, qn=qn, kn=kn, eps=eps)
                else:
                    kc, vc = kv.rope_store_caches(i)  # (an 8-bit cache: its fp16 pair, then store_q8)
                    args = dict(qkv=qkv, stride=nqkv, Hq=hq, Hkv=hkv, Dh=dh, rope_dim=dims, pos=pos, inv_freq=table,
                                attn=factor, kc=kc, vc=vc, ring=kc.shape[0], scale=sc, bias=bias,
                                q16=h16 if tc else None, q16_stride=cfg.q_dim, qscale=tc_qscale(dh, cfg.attn_scale))
                    if qn is not None:
                        kernel, args = f"rope_store_pf_qkn_{mode}", {**args, "qn": qn, "kn": kn, "eps": eps}
                    else:
                        kernel = f"rope_store_pf_{mode}"
                    K.launch("rope", kernel, grid, block, **args)
                    kv.store_q8(i, qkv, nqkv, pos, t)
            with sec("attention"):
                if apart:  # each row over its own slot, fp32 q from the qkv rows; fp16 with a row scale
                    att = y[: t * cfg.q_dim].reshape(t, cfg.q_dim)
                    attn.attend_batch(a.attention, qkv, nqkv, pos, rows.slots, t, out=att)
                    K.launch("elementwise", "to_f16_rowscale_f32", (t,), (256,), x=att, x16=b.att16, scale=sc,
                             k=cfg.q_dim)
                elif tc:  # q16 in h16 (the QKV GEMM is done with it), written by rope_store_pf
                    attn.attend_tc(b.h16, cfg.q_dim, kv.k_cache[i], kv.v_cache[i], pos, t, b.att16, a.attention)
                else:  # fp32 CUDA-core attention, then fp16 with a row scale
                    att = y[: t * cfg.q_dim].reshape(t, cfg.q_dim)
                    attn.attend(qkv, nqkv, kv.k_cache[i], kv.v_cache[i], pos, t, att, 1, self.ctx, None, None,
                                op=a.attention)
                    K.launch("elementwise", "to_f16_rowscale_f32", (t,), (256,), x=att, x16=b.att16, scale=sc,
                             k=cfg.q_dim)
            with sec("O-proj"):
                if a.post is not None:  # gemma: x += RMSNorm(Wo att (x the row scale unless tc)) * w_post
                    gemm_weights(b.att16.data.ptr, t, o_w, y.data.ptr, d)
                    post_add(getattr(L, a.post.weight), None if tc else sc)
                elif tc:  # unscaled fp16 input: accumulate straight into the residual stream
                    gemm_weights(b.att16.data.ptr, t, o_w, x.data.ptr, d, accumulate=True)
                else:
                    gemm_add(b.att16.data.ptr, o_w)
                if a.out.bias is not None:  # gpt-oss
                    xt += getattr(L, a.out.bias)
            with sec("norm"):
                norm16(getattr(L, fb.norm.weight))
            if fb.moe is not None:  # x += the experts' weighted sum (moe.Experts.gemm)
                with sec("FFN"):
                    self.experts.gemm(h16, sc, t, fb.moe, xt)
                continue
            with sec("FFN"):
                gemm_weights(h16, t, gu_w, gu.data.ptr, 2 * f)
                glu = "geglu_f16_rowscale" if fb.glu.activation == "gelu_tanh" else "swiglu_f16_rowscale"
                K.launch("elementwise", glu, (t,), (256,), gu=gu, s_in=sc, F=f, y16=h16, s_out=sc)
                if fb.post is not None:
                    gemm_weights(h16, t, down_w, y.data.ptr, d)
                    post_add(getattr(L, fb.post.weight), sc)
                else:
                    gemm_add(h16, down_w)
        if apart:  # every row's logits: the final RMSNorm, then the LM head on every row with the row scales
            with sec("LM head"):
                if self.options.batch_gemm and bgemm_ok([w.output]):
                    norm16(w.output_norm)
                    self.linear.bgemm(h16, t, w.output, rows.logits.data.ptr, cfg.vocab_size, rs=sc)
                    if cfg.final_softcap:  # gemma2
                        softcap_into(rows.logits, rows.logits, cfg.final_softcap)
                else:
                    rows.logits[...] = self.head_all_rows(t)
            return
        if not head:
            return
        with sec("LM head"):
            last = x[(t - 1) * d : t * d].reshape(1, d)
            self.linear.matvec((w.output,), last, 1, b.logits, norm=w.output_norm)
            if cfg.final_softcap:  # gemma2
                softcap_into(b.logits, b.logits, cfg.final_softcap)
