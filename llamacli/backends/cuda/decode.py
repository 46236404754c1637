"""The fused decode step of the CUDA backend: `decode(token, pos)`, `decode_greedy` and `decode_sampled`.

Every buffer is allocated at load and the token and position are read by the kernels from device memory
(step_ids, step_pos), so the step is captured once into a CUDA graph and replayed on the current stream
(`use_graph`); the host uploads token/pos only when the device does not already hold them and reads back
one id. Per layer (DecodeStep.launch_step), 5 kernels: QKV matvec (RMSNorm fused into its input, + bias) | attention
(the q/k norm where the layer's plan has it, RoPE, K/V store, splits and their merge in one kernel) | output
matvec + residual | gate/up matvec (RMSNorm fused, + SwiGLU) | down matvec + residual (a mixture-of-experts
layer: router + routing | the chosen experts' gate/up | down | their weighted sum, moe.Experts.step);
then the LM head with the final RMSNorm and, when greedy, the
argmax fused in (kernels/matvec.cu mv1_*), or, when sampled, the device sampler after it (penalties, top-k,
the draw: sampling.DeviceSampler.step_tail). Inside the graph the small matvecs and the attention are programmatic dependents
(sm_90: each starts while the previous kernel finishes), and decode_greedy / decode_sampled queue the next
step before they read this step's id (look-ahead). The graphs of "greedy" and "sampled" are captured at load
(`prepare_decode`, engine/generate.Model); a sequence's first step (Backend.step) makes its form ready, timed
apart from its prompt and its generation.

DecodeStep owns the step's state: its inputs on the device (step_ids, step_pos) and its logits, the
activations, the per-layer plans, the captured graphs and the step queued ahead; it launches through the
other parts (linear, attention, experts, the sampler) and the profiler's sections.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from ...models.config import ROPE_NEOX
from . import loader as K
from .linear import DeviceMatrix, mv1_kernel, mv1_stream_ok
from .ops import embed_rows, softcap_into
from .profile import _NULL
from .sampling import check_flag

log = logging.getLogger("llamacli.cuda")
# The captured steps by what follows the LM head: (the argmax fused into it, the device sampler after it).
STEP_KINDS = {"logits": (False, False), "greedy": (True, False), "sampled": (False, True)}


class DecodeStep:
    """The fused decode step of one model over its KV cache (see the module docstring)."""

    def __init__(self, gpu: Any, options: Any, model: Any, kv: Any, linear: Any, attention: Any, experts: Any,
                 sampler: Any, profiler: Any):
        self.gpu, self.options, self.model, self.kv, self.linear = gpu, options, model, kv, linear
        self.attention, self.experts, self.sampler, self.profiler = attention, experts, sampler, profiler
        self.cp, self.cfg, self.ctx = gpu.cp, model.cfg, model.ctx
        cp = self.cp
        # The step's device-side token and position, and the fused argmax's cells: all that needs no weights
        # (kernel tests use them without a model; plan() makes the rest).
        self.step_ids = cp.zeros(2, dtype=cp.int32)  # [token, flag]: argmax writes both
        self.step_pos = cp.zeros(1, dtype=cp.int32)
        # Fused argmax cells (kernels/matvec.cu mv1): key, block counter, flag, &step_ids, &step_pos.
        self.am = cp.asarray(np.asarray([0, 0, 0, self.step_ids.data.ptr, self.step_pos.data.ptr], np.uint64))
        self._graphs: dict[str, Any] = {}  # the current cache slot's (a graph holds its cache's addresses)
        self._slot = 0
        self._slot_graphs: dict[int, dict[str, Any]] = {0: self._graphs}
        self._dev_state: tuple[int, int] | None = None
        # The step decode_greedy / decode_sampled queued ahead: ((token, pos) it computes, its pinned slot, launch
        # count then, its graph's key)
        self._ahead: tuple[tuple[int, int], int, int, str] | None = None
        self.look_ahead = True  # queue the next step ahead (off where sequences take turns on this step)
        self._cur_token = self._cur_pos = 0

    def plan(self) -> None:
        """The step's buffers and each layer's launch plan, from the model's weights and fused forms."""
        cp, cfg = self.cp, self.cfg
        f = cp.float32
        self._x = cp.empty((1, cfg.n_embd), f)
        self._qkv = cp.empty((1, cfg.q_dim + 2 * cfg.kv_dim), f)
        self._att = cp.empty((1, cfg.q_dim), f)
        self._ff = cp.empty((1, cfg.n_ff), f)
        self._blk = cp.empty((1, cfg.n_embd), f)  # a block's output before its post-norm (gemma)
        self._x2 = cp.empty((1, cfg.n_embd), f)  # the residual's second buffer (a pending post-norm: launch_step)
        self._post_descs: dict[tuple[int, int, int], Any] = {}
        self.step_logits = cp.empty((1, cfg.vocab_size), f)
        n_split = self.attention.decode_splits(self.ctx)
        self.part_o = cp.empty((n_split, cfg.n_head, cfg.head_dim), f)  # attention_split's partials
        self.part_ml = cp.empty((n_split, cfg.n_head, 2), f)
        self._ids_slot = 0
        self._ids_out = []
        for _ in range(2):  # pinned host slots for the (id, flag) of a step, each with its copy's event
            mem = cp.cuda.alloc_pinned_memory(8)
            self._ids_out.append((np.frombuffer(mem, np.int32, 2), cp.cuda.Event(disable_timing=True)))
        # Per layer (its branches as fusion.py matched them): the QKV matvec segments (one launch when the three
        # share a type, or one fused matrix) and their bias.
        self.qkv_plan = []
        for L, fl in zip(self.model.weights.layers, self.model.fused):
            mats = tuple(getattr(L, m.weight) for m in fl.attention.qkv)
            segs = [mats] if len(mats) == 1 or mv1_kernel(mats) is not None else [(m,) for m in mats]
            bias = None
            if fl.attention.qkv[0].bias is not None:
                bias = cp.concatenate([getattr(L, m.bias) for m in fl.attention.qkv])
            self.qkv_plan.append((segs, bias))
        # Gate/up: separate tensors of one type, or one matrix's rows [gate; up] (phi3).
        self._ffn_plan = []
        for L, fl in zip(self.model.weights.layers, self.model.fused):
            f = fl.ffn
            mats = tuple(getattr(L, m.weight) for m in f.gate_up)
            if f.moe is not None:  # the experts: moe.Experts.step
                self._ffn_plan.append(None)
            elif f.split is not None:
                n = f.split.sizes[0]
                self._ffn_plan.append((mats[0].slice_rows(0, n), mats[0].slice_rows(n, n)))
            elif mats[0].qtype == mats[1].qtype:
                self._ffn_plan.append(mats)
            else:
                self._ffn_plan.append(None)  # mixed types: two matvecs and a swiglu kernel
        self._ff2 = cp.empty((2, 1, cfg.n_ff), dtype=cp.float32)  # gate and up of mixed types

    def launch_step(self, greedy: bool, sample: bool = False) -> None:
        """Launch one decode step reading step_ids[0] and step_pos[0]; logits -> step_logits (`sample`: then the
        device sampler, sampling.DeviceSampler.step_tail, writes the id and advances pos). Per layer:
        QKV matvec (+ RMSNorm, bias) | attention step (q/k norm + RoPE + K/V store + splits + their merge; where
        the head shape has no such kernel: head_rms_norm, rope_store, attention splits, combine) | O matvec +
        residual | gate/up matvec (+ RMSNorm, SwiGLU) | down matvec + residual; then the LM head (+ RMSNorm,
        argmax). A gemma block's post-norm rides on the next matvec's input (see below)."""
        cfg, w, fused = self.cfg, self.model.weights, self.model.fused
        x, qkv, att, ff = self._x, self._qkv, self._att, self._ff
        mode = "neox" if cfg.rope_type == ROPE_NEOX else "normal"
        hq, hkv, dh = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        attn, kv, opt = self.attention, self.kv, self.options
        n_split, chunk = attn.decode_splits(self.ctx), attn.decode_chunk(self.ctx)
        sec = self.profiler.section
        with sec("embedding"):
            embed_rows(cfg, self.step_ids, w.token_embd, x, 1)
        # The step as (section, weight bytes, streams, launch(early)). Inside the capture (_capture_step) the
        # kernels of matrices under pdl_max_bytes, the streaming matvecs (mv1_stream) and the attention
        # launch as programmatic dependents: each starts while the one before finishes (hiding the launch gap
        # and its prologue; mv1_stream also loads its first weights then); other large matvecs launch
        # plainly (there it measured slower). `early` tells a kernel to let the next one start right after
        # its own pdl_wait() rather than after its main loop: right for a next kernel that is latency-bound
        # (a matrix under pdl_early_bytes) and for a streaming one, whose blocks then take each SM a block of
        # this kernel leaves and load their first weights during this kernel's tail (faster on the 8B F16
        # than when it waited); an mv1 matvec whose blocks wait on SMs busy with this one streamed slower.
        # Against plain launches this measured faster at tg128 on every model tried, the most on the smallest
        # (SmolLM2); the figures are in docs/perf-log.md.
        step: list[tuple[str, int, bool, Callable[[bool], None]]] = []

        def mv(name: str, ws: tuple[DeviceMatrix, ...], src: Any, dst: Any, **kw: Any) -> None:
            step.append((name, sum(m.nbytes for m in ws), opt.mv1_stream and mv1_stream_ok(ws),
                         lambda early: self.linear.matvec(ws, src, 1, dst, early=early, **kw)))

        # A gemma block's output goes through its post-norm before the residual add: x + RMSNorm(blk) * w. That
        # sum is not computed by a kernel of its own: it stays pending and the next matvec that normalises
        # the residual (the next block's QKV or gate/up, or the LM head) takes it as its input (`post`,
        # kernels/matvec.cu PostIn) and writes the new residual into the other of two buffers (its other
        # blocks still read the old one). (No architecture has post-norms and experts: check_moe refuses one.)
        res = {"cur": x, "pending": None}

        def take() -> tuple[Any, Any]:
            """(the residual buffer to read, the post descriptor or None); the residual moves to the other
            buffer when a post-norm is pending."""
            cur, pend = res["cur"], res["pending"]
            if pend is None:
                return cur, None
            out = self._x2 if cur is self._x else self._x
            res["cur"], res["pending"] = out, None
            return cur, self._post_desc(pend[0], pend[1], out)

        for i, L in enumerate(w.layers):  # each layer's two branches, as fusion.match_layer read its program
            a, fb = fused[i].attention, fused[i].ffn
            segs, bias = self.qkv_plan[i]
            norm = getattr(L, a.norm.weight)
            src, pd = take()
            if len(segs) == 1:
                mv("norm+QKV", segs[0], src, qkv, bias=bias, norm=norm, post=pd)
            else:  # mixed types: three launches into the row ranges of qkv, each normalising x itself (each
                # writes the same new residual when a post-norm is pending)
                off = 0
                for (m,) in segs:
                    b = None if bias is None else bias[off : off + m.rows]
                    mv("norm+QKV", (m,), src, qkv[:, off : off + m.rows], bias=b, norm=norm, post=pd)
                    off += m.rows
            if attn.split_fits():  # one kernel: q/k norm, RoPE, K/V store, the attention splits and their merge
                step.append(("RoPE+KV+attention", 0, False, lambda early, a=a: attn.attend_step(
                    a, qkv, att, self.step_pos, self.part_o, self.part_ml, early)))
            else:
                if a.head_norms is not None:  # qwen3: per-head RMSNorm of q and k, in place, before the RoPE
                    qn, kn = (getattr(L, n.weight) for n in a.head_norms)
                    step.append(("q/k norm", 0, False, lambda early, qn=qn, kn=kn: K.launch(
                        "norm", "head_rms_norm", (1, hq + hkv), (min(1024, K.cdiv(dh, 32) * 32),), x=qkv,
                        stride=qkv.shape[1], Hq=hq, Hkv=hkv, Dh=dh, wq=qn, wk=kn, eps=cfg.rms_eps)))
                dims, table, factor = self.model.rope_args(a.rope)
                kc, vc = kv.rope_store_caches(i)  # (an 8-bit cache: its fp16 pair, then store_q8)
                step.append(("RoPE+KV", 0, False, lambda early, dims=dims, table=table, factor=factor, kc=kc, vc=vc:
                             K.launch("rope", f"rope_store_{mode}", (1, hq + 2 * hkv),
                                      (max(32, K.cdiv(dh // 2, 32) * 32),), qkv=qkv, stride=qkv.shape[1], Hq=hq,
                                      Hkv=hkv, Dh=dh, rope_dim=dims, pos=self.step_pos, inv_freq=table, attn=factor,
                                      kc=kc, vc=vc, ring=kc.shape[0])))
                step.append(("RoPE+KV", 0, False, lambda early, i=i: kv.store_q8(i, qkv, qkv.shape[1],
                                                                                self.step_pos, 1)))
                step.append(("attention", 0, False, lambda early, i=i, op=a.attention: attn.attend(
                    qkv, qkv.shape[1], kv.k_cache[i], kv.v_cache[i], self.step_pos, 1, att, n_split, chunk,
                    self.part_o, self.part_ml, op=op)))
            o_w = getattr(L, a.out.weight)
            if a.post is not None:  # gemma: x += RMSNorm(Wo att) * w_post, pending until the FFN's input
                mv("O-proj", (o_w,), att, self._blk)
                res["pending"] = (self._blk, getattr(L, a.post.weight))
            else:
                o_b = getattr(L, a.out.bias) if a.out.bias else None
                mv("O-proj", (o_w,), att, res["cur"], resid=res["cur"], bias=o_b)
            if fb.moe is not None:  # x += the chosen experts' weighted sum
                self.experts.step(fb, res["cur"], lambda name, nbytes, launch: step.append((name, nbytes, False, launch)))
                continue
            act, plan = fb.glu.activation, self._ffn_plan[i]
            norm = getattr(L, fb.norm.weight)
            src, pd = take()
            if plan is not None:
                step.append(("norm+FFN", plan[0].nbytes + plan[1].nbytes, opt.mv1_stream and mv1_stream_ok(plan),
                             lambda early, plan=plan, norm=norm, act=act, src=src, pd=pd:
                             self.linear.matvec_swiglu(plan[0], plan[1], src, 1, ff, norm=norm, early=early,
                                                       act=act, post=pd)))
            else:
                g = self._ff2
                gw, uw = (getattr(L, m.weight) for m in fb.gate_up)
                mv("norm+FFN", (gw,), src, g[0], norm=norm, post=pd)
                mv("norm+FFN", (uw,), src, g[1], norm=norm, post=pd)
                glu = "geglu_f32" if act == "gelu_tanh" else "swiglu_f32"
                step.append(("norm+FFN", 0, False, lambda early, g=g, glu=glu: K.launch(
                    "elementwise", glu, (K.cdiv(cfg.n_ff, 256),), (256,), g=g[0], u=g[1], y=ff, n=cfg.n_ff)))
            down = getattr(L, fb.down.weight)
            if fb.post is not None:
                mv("norm+FFN", (down,), ff, self._blk)
                res["pending"] = (self._blk, getattr(L, fb.post.weight))
            else:
                mv("norm+FFN", (down,), ff, res["cur"], resid=res["cur"])
        src, pd = take()
        if cfg.final_softcap:  # gemma2: logits -> c tanh(logits / c), then (greedy) argmax_f32 over them
            mv("norm+LM head", (w.output,), src, self.step_logits, norm=w.output_norm, post=pd)
            step.append(("LM head", 0, False, lambda early: softcap_into(self.step_logits, self.step_logits,
                                                                         cfg.final_softcap)))
            if greedy:  # argmax_f32 writes step_ids [id, NaN/+inf seen] and advances step_pos, as mv1's argmax
                step.append(("argmax", 0, False, lambda early: K.launch(
                    "sampling", "argmax_f32", (1,), (1024,), x=self.step_logits, V=cfg.vocab_size, out=self.step_ids,
                    pos_inc=self.step_pos)))
        else:
            mv("norm+LM head+argmax" if greedy else "norm+LM head", (w.output,), src, self.step_logits,
               norm=w.output_norm, argmax=self.am if greedy else None, post=pd)
        if sample:  # penalties (the history by position) | top-k | top-p, min-p, temperature, the draw
            self.sampler.step_tail(step, self.step_logits, self.step_ids, self.step_pos)
        for j, (name, nbytes, streams, launch) in enumerate(step):
            nxt_bytes, nxt_streams = step[j + 1][1:3] if j + 1 < len(step) else (0, False)
            plain = nbytes >= opt.pdl_max_bytes and not streams
            with sec(name), (K.dependent_launches(False) if plain else _NULL):
                launch(nxt_bytes < opt.pdl_early_bytes or nxt_streams)

    def _post_desc(self, blk: Any, weight: Any, out: Any) -> Any:
        """The device array {blk, weight, out} of pointers a matvec's `post` input reads (made once per triple,
        in the un-captured warm-up that precedes every capture of the step)."""
        key = (blk.data.ptr, weight.data.ptr, out.data.ptr)
        desc = self._post_descs.get(key)
        if desc is None:
            desc = self._post_descs[key] = self.cp.asarray(np.asarray(key, np.uint64))
        return desc

    def _run_step(self, kind: str) -> None:
        """Queue one decode step of `kind` (STEP_KINDS): its graph replayed (captured first if need be), or
        its kernels launched one by one without graphs."""
        if not self.options.use_graph:
            self.launch_step(*STEP_KINDS[kind])
            return
        # Replay on the current stream: ordered after the prefill and the input copies, and the host waits
        # only where it reads a result (step_ids.get(), or the caller's use of the logits).
        self._graph(kind).launch(self.cp.cuda.get_current_stream())

    def _graph(self, kind: str) -> Any:
        """The captured step of `kind`; capturing it runs the step once first, for the inputs set now."""
        graph = self._graphs.get(kind)
        if graph is None:
            self.launch_step(*STEP_KINDS[kind])  # warm up: compile, first-launch setup, outside the capture
            graph = self._graphs[kind] = self._capture_step(kind)
            # The warm-up ran the step once (it wrote this position's K/V and, when greedy or sampled, the id
            # and pos + 1): restore the inputs so the first replay computes the same step.
            self.step_ids[:1].set(np.asarray([self._cur_token], np.int32))
            self.step_pos.set(np.asarray([self._cur_pos], np.int32))
        return graph

    def prepare_decode(self, kinds: tuple[str, ...] = ("greedy", "sampled"), pos: int = 0) -> None:
        """Capture the decode steps of `kinds` now (at load, or before a generation's timed loop) so that no
        decode pays for it. The warm-up runs a step at position `pos`, whose K/V only a later decode there
        may read (that decode overwrites them first): pos 0 on an empty cache, or the next decode position."""
        todo = [k for k in kinds if k not in self._graphs] if self.options.use_graph else []
        if not todo:
            return
        for kind in todo:
            self._set_inputs(0, pos)
            self._graph(kind)
        self._dev_state = None

    def _capture_step(self, kind: str) -> Any:
        """The decode step's graph, its matvecs and attention launched as programmatic dependents (each starts
        while the one before finishes; loader.dependent_launches) unless `pdl` is off or that capture
        fails (then a plain one, with a warning)."""
        if self.options.pdl:
            try:
                with K.dependent_launches():
                    return self.gpu.capture(lambda: self.launch_step(*STEP_KINDS[kind]))
            except Exception as exc:  # a driver that refuses the attribute in capture: the plain graph
                log.warning("decode step capture with programmatic launches failed (%s); capturing without", exc)
                self.options.pdl = False
        return self.gpu.capture(lambda: self.launch_step(*STEP_KINDS[kind]))

    @property
    def captured(self) -> frozenset[str]:
        """The step kinds (STEP_KINDS) captured as graphs now."""
        return frozenset(self._graphs)

    def drop_graphs(self) -> None:
        """Forget the captured decode steps (of every cache slot): the next step captures again (after changing
        pdl, say)."""
        for graphs in self._slot_graphs.values():
            graphs.clear()

    def use_slot(self, slot: int) -> None:
        """Run on cache slot `slot` (kv.KVCache.use) from now: its own captured steps; what the device holds of the
        last step and the step queued ahead were another slot's."""
        if slot != self._slot:
            self._slot = slot
            self._graphs = self._slot_graphs.setdefault(slot, {})
            self._dev_state = None
            self._ahead = None

    def forget_slots(self, first: int) -> None:
        """Slots from `first` on are gone (KVCache.set_slots): their graphs too."""
        for slot in [s for s in self._slot_graphs if s >= first and s != self._slot]:
            del self._slot_graphs[slot]

    def _set_inputs(self, token: int, pos: int) -> None:
        """Upload token and position unless the device already holds them (a greedy step leaves its output
        id in step_ids[0] and pos + 1 in step_pos): one host-to-device copy fewer per generated token."""
        self._cur_token, self._cur_pos = int(token), int(pos)
        if self._dev_state != (self._cur_token, self._cur_pos):
            self.step_ids[:1].set(np.asarray([token], np.int32))
            self.step_pos.set(np.asarray([pos], np.int32))
        self._dev_state = None
        self._ahead = None

    def decode(self, token: int, pos: int) -> Any:
        """The fused decode step for `token` at position `pos` -> logits [1, V] (a device buffer that the
        next step overwrites). Writes that position's K/V into the cache."""
        self._set_inputs(token, pos)
        self._run_step("logits")
        return self.step_logits

    def decode_greedy(self, token: int, pos: int) -> int:
        """The fused decode step with the argmax fused into the LM head: only the chosen id comes back.

        With graphs on, the following step is queued before this one's id is read: the device already holds
        its inputs (this step's id and pos + 1), so the GPU does not wait for the host between tokens (the
        round trip this hides: docs/perf-log.md). That step writes position pos + 1's K/V for the predicted token;
        the next call, (that id, pos + 1), takes its result, and any other call or launch recomputes (positions
        past pos must hold nothing the caller needs: true of generation, which extends the cache one token a
        time). Each result leaves the device through its own pinned slot, copied between the two steps."""
        return self._decode_id(token, pos, "greedy")

    def decode_sampled(self, token: int, pos: int) -> int:
        """The fused decode step with the device sampler after the LM head (sampling.DeviceSampler, set up by
        start_sampling): only the chosen id comes back, and the next step is queued ahead as in
        decode_greedy. The ids equal sample(decode(token, pos), params, rng, history) call for call: the
        step takes the uniform number and the penalty window of its position (sampling.py's docstring)."""
        self.sampler.feed_uniforms(pos)
        return self._decode_id(token, pos, "sampled")

    def _decode_id(self, token: int, pos: int, kind: str) -> int:
        """decode_greedy / decode_sampled: a step of `kind` that writes its id into step_ids, the next one
        queued ahead."""
        ahead = self._take_ahead(token, pos, kind)
        if ahead is not None:
            slot = ahead[1]
        else:
            self._set_inputs(token, pos)
            self._run_step(kind)
            slot = self._copy_ids()
        nxt = None
        if self._can_queue(pos, kind):
            if kind == "sampled":
                self.sampler.feed_uniforms(pos + 1)
            self._run_step(kind)  # reads (id, pos + 1) from the device
            nxt = self._copy_ids()
        tok = self._read_id(slot)
        if nxt is None:
            self._dev_state = (tok, self._cur_pos + 1)
        else:
            self._dev_state = None  # the queued step moved the device on to (its id, pos + 2)
            self._ahead = ((tok, self._cur_pos + 1), nxt, K.launch_count(), kind)
        return tok

    def decode_allowed(self, token: int, pos: int, words: Any, params: Any, rng: Any, recent: list[int]) -> int:
        """Backend.decode_allowed: the "logits" step, words() while it runs, then sample_allowed. Greedy without
        penalties takes the masked argmax into step_ids (advancing step_pos, as the fused argmax) and, with
        graphs, queues the following step before the id is read, so the GPU runs it while the host records
        the id with the constraint and computes the next mask; the next call for (that id, pos + 1) takes it,
        anything else recomputes (the queued step wrote pos + 1's K/V only)."""
        if self._take_ahead(token, pos, "allowed") is None:
            self._set_inputs(token, pos)
            self._run_step("logits")
        mask = words()
        if not params.greedy or params.has_penalties:
            self._dev_state = None
            return self.sampler.sample_allowed(self.step_logits, mask, params, rng, recent)
        self.sampler.mask(self.step_logits, mask)
        K.launch("sampling", "argmax_f32", (1,), (1024,), x=self.sampler.masked, V=self.cfg.vocab_size,
                 out=self.step_ids, pos_inc=self.step_pos)
        slot = self._copy_ids()
        queued = self._can_queue(pos, "logits")
        if queued:
            self._run_step("logits")  # reads (id, pos + 1) from the device
        tok = self._read_id(slot)
        self._dev_state = (tok, int(pos) + 1)  # a logits step leaves step_ids and step_pos as they are
        if queued:
            self._ahead = ((tok, int(pos) + 1), -1, K.launch_count(), "allowed")  # (no ids slot: logits)
        return tok

    def _take_ahead(self, token: int, pos: int, kind: str) -> tuple[tuple[int, int], int, int, str] | None:
        """The step of `kind` queued ahead for (token, pos), if it is that one and nothing launched since (then
        (token, pos) is the current step); None else. Either way nothing stays queued."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead[0] != (int(token), int(pos)) or ahead[2] != K.launch_count() or ahead[3] != kind:
            return None
        self._cur_token, self._cur_pos = int(token), int(pos)
        return ahead

    def _can_queue(self, pos: int, kind: str) -> bool:
        """Whether the step after position pos can be queued ahead: graphs on, room in the cache, `kind` captured."""
        return self.look_ahead and self.options.use_graph and pos + 1 < self.ctx and kind in self._graphs

    def _read_id(self, slot: int) -> int:
        """The id in pinned slot `slot` once its copy has landed; a flag (NaN/+inf, no candidate) raises."""
        ids, event = self._ids_out[slot]
        event.synchronize()
        tok, flag = int(ids[0]), int(ids[1])
        if flag:
            self._dev_state = None
            check_flag(flag, self.cfg.vocab_size)
        return tok

    @property
    def queued_ahead(self) -> tuple[int, int] | None:
        """The (token, pos) of the step decode_greedy / decode_sampled / decode_allowed queued ahead and has not
        handed out yet, or None."""
        return None if self._ahead is None else self._ahead[0]

    def _copy_ids(self) -> int:
        """Queue the copy of step_ids into the next pinned slot (after the step just queued) -> the slot."""
        cp = self.cp
        slot = self._ids_slot = 1 - self._ids_slot
        ids, event = self._ids_out[slot]
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(ids.ctypes.data, self.step_ids.data.ptr, 8, 2, stream.ptr)  # device -> host
        event.record(stream)
        return slot

    def profile_decode(self, token: int, pos: int) -> tuple[list[tuple[str, float, int]], float]:
        """profile() of one fused greedy decode step, launched un-captured (the graph's kernels, one by one)."""
        self._set_inputs(token, pos)
        try:
            return self.profiler.profile(lambda: self.launch_step(True), spin_ms=30.0)
        finally:
            self._dev_state = None

    def drop_ahead(self) -> None:
        """Forget the step queued ahead (the cache or the sampler's settings changed since it was queued)."""
        self._ahead = None

    def start_sampling(self, params: Any, rng: np.random.Generator, recent: Any) -> bool:
        """Backend.start_sampling: the sampler set up for the captured step (sampling.DeviceSampler.start); a
        step queued ahead under the old settings is not taken."""
        if not self.sampler.start(params, rng, recent):
            return False
        self._ahead = None
        return True
