"""The CUDA backend: CuPy for memory and cuBLAS, our kernels (kernels/*.cu) for everything else.

Two ways to run the model:

- the Backend operations (embed, rms_norm, matmul, rope, attention, ...) that models/block.run calls, one
  kernel each (ops.py, linear.py, attention.py): the reference-shaped path;
- the fused paths: `forward_prompt`, the prefill pass of a prompt chunk (prefill.py), and `decode(token,
  pos)` / `decode_greedy`, the decode step captured into a CUDA graph with programmatic dependent launches
  and a look-ahead step (decode.py).

CudaBackend is the Backend over parts that each own their state and are handed the parts they launch
through (none reaches into another's attributes):

    gpu.Gpu, gpu.Options      the device's facts and helpers; the switches (CudaBackend's attributes)
    profile.Profiler          bench --profile's sections, bench's clock
    device.DeviceModel        the weights on the device, each layer's fused form, the RoPE tables
    kv.KVCache                the KV cache and its writers
    kv_pool.KVPool            the prefix cache's rows (engine/prefix_cache.py), apart from the KV cache
    linear.Linear             matvec / GEMM launchers, cuBLAS's workspace, prefill's dequantize scratch
    attention.AttentionKernels  the attention launchers, attention_split's counters
    moe.Experts               the expert FFN's launchers and buffers
    sampling.DeviceSampler    sampling on the device and its buffers
    decode.DecodeStep         the fused decode step: its inputs, buffers, graphs, the step queued ahead
    prefill.PrefillPass       the fused prefill pass: its buffers and graphs
    batch.BatchStep           the batched decode step of several sequences (cache slots): inputs, graphs, pool
    delta.DeltaNet            a hybrid model's delta-net layers: their launchers, each slot's recurrent states

load() uploads the model (DeviceModel) and attaches the rest to it (`attach`, which kernel tests call with a
model of no weights).

A model that runs op by op (fusion.op_by_op: the hybrid Qwen models, qwen35 / qwen35moe / qwen3next, with their
Gated DeltaNet layers, gated attention and shared experts; Gemma 4, with its layers of different shapes, shared KV,
per-layer embeddings and experts beside a dense FFN) has no fused form: its prompts, decode steps and
verifications all go through models/block.run (the Backend's own forms of forward_prompt, decode, step, ...: a
sampler on the host, the sequences of a step one after the other), and its recurrent states are DeltaNet's. Every
other model keeps the fused paths; `op_path` says which.

The current figures are in BENCHMARKS.md, their history in docs/perf-log.md; `llamacli bench --profile` breaks a step
down by kernel family.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import numpy as np

from ...errors import BackendError, DeviceMemoryError, UsageError
from ...ggufio.file import GGUFFile
from ...models import block
from ...models.block import Attention, Conv, DeltaRule, Moe
from ...models.config import ModelConfig
from ...units import human_bytes
from ..base import Backend, Progress, StepErrors
from ..step import SeqStep, StepOut
from . import loader as K
from .attention import AttentionKernels
from .batch import BatchStep
from .decode import DecodeStep
from .delta import DeltaNet, gated_norm_into, sigmoid_gate_into
from .device import (
    DeviceModel,
    cache_q8,
    check_attention_smem,
    compile_kernels,
    cuda_available,
    fused_layers,
    recurrent_bytes,
)
from .fusion import op_by_op
from .gpu import Gpu, Options
from .kv import KVCache
from .kv_pool import KVPool
from .linear import DEQUANT_CHUNK, RUNNABLE, DeviceMatrix, Linear
from .moe import Experts, moe_family_needed
from .ops import add_into, embed_rows, glu_into, rms_norm_into, rope_into, scale_into, softcap_into
from .prefill import PREFILL_CHUNK, PrefillPass
from .profile import Profiler, profiled
from .sampling import DeviceSampler


class _Option:
    """A CudaBackend attribute that reads and writes its Options field of the same name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.options, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.options, self.name, value)


class CudaBackend(Backend):
    name = "cuda"
    runnable_types = frozenset(RUNNABLE)
    prefill_chunk = PREFILL_CHUNK
    fill_steps = True  # prefill-only steps (step.py SeqStep.fill): Backend._fill over forward_prompt, in the slot

    use_graph = _Option()
    attention_tc = _Option()
    attention_wg = _Option()
    pdl = _Option()
    mv1_stream = _Option()
    batch_gemm = _Option()
    verify_batched = _Option()
    pdl_max_bytes = _Option()
    pdl_early_bytes = _Option()

    def __init__(self, use_graph: bool = True):
        ok, reason = cuda_available()
        if not ok:
            raise BackendError(f"the CUDA backend is unavailable: {reason}")
        self.gpu = Gpu()
        self.cp = self.gpu.cp
        self.options = Options(use_graph=use_graph,
                               attention_wg=K.built_arch("attention_wgmma") == "sm_90a" and K.tma_supported())
        self.profiler = Profiler(self.cp)
        self.model: DeviceModel | None = None
        self.kv: KVCache | None = None
        self.linear: Linear | None = None
        self.attn: AttentionKernels | None = None
        self.experts: Experts | None = None
        self.sampler: DeviceSampler | None = None
        self.decoder: DecodeStep | None = None
        self.prefill: PrefillPass | None = None
        self.batch: BatchStep | None = None
        self.verifier: BatchStep | None = None  # a verification's pass of drafts as a batched step (forward_verify)
        self.kv_pool: KVPool | None = None  # the prefix cache's rows (alloc_kv_pool)
        self.delta: DeltaNet | None = None  # a hybrid model's delta-net layers and recurrent states
        self.op_path = False  # the model runs op by op (fusion.op_by_op): no fused prefill, decode or batched step
        self._pos_hint: tuple[Any, int] | None = None  # the last positions() array and its first position
        self._ones_by_size: dict[int, Any] = {}  # rms_norm's weight of ones (a norm without one: gemma4's V norm)

    # -- lifetime ------------------------------------------------------------------------------------------
    def load(self, gguf: GGUFFile, cfg: ModelConfig, ctx: int, progress: Progress | None = None,
             cache_types: tuple[str, str] = ("f16", "f16")) -> None:
        q8 = cache_q8(cfg, cache_types)
        t0 = time.perf_counter()  # load_stages: kernels, weights, the rest
        report = progress or (lambda done, total, what: None)
        fused = fused_layers(cfg, gguf)
        check_attention_smem(self.gpu, cfg)
        compile_kernels(cfg)
        t_kernels = time.perf_counter()
        model = DeviceModel.upload(self.gpu, gguf, cfg, ctx, fused, tuple(cache_types), report)
        t_weights = time.perf_counter()
        self.attach(model, q8)
        if not self.op_path:
            self.decoder.plan()
        t_end = time.perf_counter()
        self.load_stages = (("kernels", (t_kernels - t0) * 1e3),
                            ("weights upload", (t_weights - t_kernels) * 1e3),
                            ("KV cache, buffers", (t_end - t_weights) * 1e3))

    def attach(self, model: DeviceModel, q8: bool = False) -> None:
        """Make the parts for `model`: its KV cache (`q8`: 8-bit), the launchers, the sampler and the decode
        step's inputs; load() then plans the decode step (kernel tests stop before: their model has no
        weights). The prefill pass is made with its first chunk."""
        self.model, self.cfg, self.ctx, self.weights = model, model.cfg, model.ctx, model.weights
        self.profiler.families = model.families
        gpu, opt = self.gpu, self.options
        self.kv = KVCache(self.cp, model.cfg, model.ctx, q8)
        self.linear = Linear(gpu, opt, model.cfg)
        self.attn = AttentionKernels(gpu, opt, model, self.kv)
        self.experts = Experts(gpu, model, self.linear)
        self.sampler = DeviceSampler(gpu, model.cfg, model.ctx, self.profiler)
        self.decoder = DecodeStep(gpu, opt, model, self.kv, self.linear, self.attn, self.experts, self.sampler,
                                  self.profiler)
        self.prefill = self.batch = self.verifier = None
        self.slots = 1
        self._slot_sampler, self._slot_kind = {}, {}
        self.kv_pool = None
        self.op_path = op_by_op(model.cfg)
        recurrent = any(plan.recurrent for plan in model.cfg.layers)
        self.delta = DeltaNet(gpu, model, self._start_of) if recurrent else None

    def close(self) -> None:
        self.batch = self.verifier = None
        self.decoder = self.prefill = self.sampler = self.experts = self.attn = self.linear = self.kv = None
        self.kv_pool = self.delta = None
        self._pos_hint = None
        self._ones_by_size = {}
        self.model = None
        self.weights = None  # type: ignore[assignment]
        self.cp.get_default_memory_pool().free_all_blocks()

    # -- cache slots and the batched step ---------------------------------------------------------------------
    def set_slots(self, n: int) -> None:
        """Caches for n sequences (kv.KVCache.set_slots: slot 0's stays; DeviceMemoryError where they do not fit).
        With more than one, step() runs the decode steps of several sequences together (batch.BatchStep)."""
        if type(n) is not int or n < 1:
            raise UsageError(f"the number of sequences must be a positive integer, got {n!r}")
        if self.op_path:
            self._set_slots_op(n)
            return
        self.batch = self.verifier = None  # (their graphs hold the old slots' addresses; their pools count as free below)
        if n > 1:  # what lives past any step made now, outside the batched step's memory pool
            self.prefill_pass().buffers()
            self.linear.workspace()
            if moe_family_needed(self.cfg):
                self.experts.buffers(max(PREFILL_CHUNK, n))
        cfg = self.cfg
        # room for the batched step's working set: a GEMM's fp16 weight chunk, its rows' activations and logits
        keep = DEQUANT_CHUNK * 2 + n * 4 * (8 * max(cfg.n_embd, cfg.q_dim + 2 * cfg.kv_dim, 2 * cfg.n_ff)
                                            + 3 * cfg.vocab_size) + (256 << 20)
        self.kv.set_slots(n, keep)
        self._forget_slots(min(n, self.slots))
        self.decoder.use_slot(0)
        self.decoder.forget_slots(n)
        self.prefill_pass().forget_slots(n)
        self.decoder.look_ahead = n == 1 or not self.kv.q8  # (an 8-bit cache's sequences take turns: see README)
        self.slots = n

    def _set_slots_op(self, n: int) -> None:
        """set_slots of a model that runs op by op: the KV caches (with room for each slot's recurrent states and the
        steps' working set) and the recurrent states of n slots; no batched step."""
        self.kv.set_slots(n, n * recurrent_bytes(self.cfg) + (256 << 20))
        if self.delta is not None:
            self.delta.set_slots(n)
        self._forget_slots(min(n, self.slots))
        self.decoder.use_slot(0)
        self.decoder.forget_slots(n)
        self.slots = n

    def use_slot(self, slot: int) -> None:
        self.kv.use(slot)
        self.decoder.use_slot(slot)
        if self.delta is not None:
            self.delta.use(slot)

    def step(self, batch: Sequence[SeqStep]) -> list[StepOut]:
        """Backend.step; with several cache slots the decode steps of two or more sequences run as one batched step
        (batch.py); a single one takes the fused decode step (its graph: the argmax or, for any other sampler, the
        logits chosen from as a single step's are)."""
        if self.slots == 1 or self.op_path:  # (op by op: the sequences one after the other)
            return super().step(batch)
        self._check_slots(batch)
        rows = [i for i, seq in enumerate(batch) if self._batchable(seq)]
        if len(rows) == 1:
            rows = []
        outs: list[StepOut | None] = [None] * len(batch)
        errors: dict[int, Exception] = {}
        for i, seq in enumerate(batch):  # prompts (and anything the batch does not take) one at a time
            if i not in rows:
                try:
                    outs[i] = self._step_one(seq)
                except Exception as exc:
                    errors[i] = exc
        if rows:
            for i, out in zip(rows, self._decode_batch([batch[i] for i in rows])):
                if isinstance(out, Exception):
                    errors[i] = out
                else:
                    outs[i] = out
        if errors:
            if len(batch) == 1:
                raise errors[0]
            raise StepErrors(errors, outs)
        return outs  # type: ignore[return-value]

    def _batchable(self, seq: SeqStep) -> bool:
        """A decode step the batched step takes: the sequence's next token in its own slot (after a verification of
        drafts, past those accepted: Backend.rollback has nothing to do for K/V rows), an fp16 cache."""
        s = seq.sampler
        low = s.verified + 1 if s.verified >= 0 else s.position
        return (not self.kv.q8 and s.position >= 0 and self._slot_sampler.get(seq.slot) is s
                and len(seq.tokens) == 1 and low <= seq.start <= s.position)

    def _decode_batch(self, seqs: list[SeqStep]) -> list[StepOut | Exception]:
        """One batched step of these sequences' decode steps -> per sequence its StepOut, or the exception that
        ended its step (the others go on)."""
        if self.batch is None:
            self.batch = BatchStep(self.gpu, self.options, self._forward_batch, self.slots, self.cfg.vocab_size)
        for seq in seqs:
            del self._slot_sampler[seq.slot]  # until its step has run whole
        self.decoder.drop_ahead()  # (its slot's cache changes under it)
        outs: list[StepOut | Exception] = []
        cap = self.prefill_pass().max_rows
        for first in range(0, len(seqs), cap):  # (more sequences than one pass takes: several passes)
            outs += self._decode_rows(seqs[first : first + cap])
        return outs

    def _decode_rows(self, seqs: list[SeqStep]) -> list[StepOut | Exception]:
        assert self.batch is not None
        try:
            choice, logits = self.batch.run([int(seq.tokens[0]) for seq in seqs], [seq.start for seq in seqs],
                                            [seq.slot for seq in seqs])
        except Exception as exc:
            return [exc] * len(seqs)
        outs: list[StepOut | Exception] = []
        for r, seq in enumerate(seqs):
            s = seq.sampler
            try:
                if self._slot_kind[seq.slot] == "greedy" and s.mask is None and not s.logits:
                    if choice[1, r]:
                        raise BackendError("the model's logits are not finite (NaN or infinity): no token can be "
                                           "chosen")
                    out = StepOut(int(choice[0, r]))
                else:
                    out = self._choose(logits[r : r + 1], s)
            except Exception as exc:
                outs.append(exc)
                continue
            out.snapshots = self.snapshots(seq.slot)
            s.position, s.verified, self._slot_sampler[seq.slot] = seq.start + 1, -1, s
            outs.append(out)
        return outs

    def _forward_batch(self, ids: Any, pos: Any, slots: Any, logits: Any) -> None:
        """The fused pass over rows that are sequences of their own (slots [B]) -> logits [B, V] in place
        (prefill.PrefillPass.launch_rows)."""
        self.prefill_pass().launch_rows(ids, pos, slots, logits)

    def _setup_decode(self, s: Any, pos: int) -> str:
        """Backend._setup_decode; with several slots a plain greedy sequence keeps the fused greedy step (its slot's
        graph) and any other decodes in the batched step ("batch"); with an 8-bit cache, which the batched step
        does not read, through the fused step's logits and the sampler (the device sampler's state is one
        sequence's)."""
        if self.slots == 1 or self.op_path:
            return super()._setup_decode(s, pos)
        if s.plain_greedy and not s.logits and s.mask is None:
            self.prepare_decode(("greedy",), pos=pos)
            return "greedy"
        if self.kv.q8:
            self.prepare_decode(("logits",), pos=pos)
            return "logits"
        return "batch"

    def _decode(self, token: int, pos: int, s: Any, kind: str) -> StepOut:
        if kind != "batch":
            return super()._decode(token, pos, s, kind)
        return self._choose(self.decode(token, pos), s)  # (alone in this step: the fused step's logits)

    # -- host <-> device -----------------------------------------------------------------------------------
    def positions(self, start: int, n: int) -> Any:
        pos = self.cp.asarray(np.arange(start, start + n, dtype=np.int32))
        self._pos_hint = (pos, start)  # (the delta-net layers need the first position on the host: _start_of)
        return pos

    def _start_of(self, pos: Any) -> int:
        """The first position of a positions array [T]: known on the host for the last one positions() made (the
        one block.run hands every layer), else read from the device."""
        hint = self._pos_hint
        if hint is not None and hint[0] is pos:
            return hint[1]
        return int(pos[0])

    def token_ids(self, ids: np.ndarray) -> Any:
        return self.cp.asarray(np.asarray(ids, dtype=np.int32).reshape(-1))

    def to_host(self, x: Any) -> np.ndarray:
        return self.gpu.to_host(x)

    # -- the Backend operations (models/block.run), one kernel each ------------------------------------------
    @profiled("embedding")
    def embed(self, ids: Any) -> Any:
        w: DeviceMatrix = self.weights.token_embd
        t = int(ids.shape[0])
        out = self.cp.empty((t, w.cols), dtype=self.cp.float32)
        embed_rows(self.cfg, ids, w, out, t)
        return out

    @profiled("embedding")
    def embed_per_layer(self, ids: Any) -> Any:
        """Gemma 4's per-layer embeddings: rows of per_layer_token_embd [V, L P] (kept in its GGUF layout, as
        token_embd) times sqrt(P) -> [T, L, P]."""
        cfg, w = self.cfg, self.weights.per_layer_token_embd
        t = int(ids.shape[0])
        out = self.cp.empty((t, w.cols), dtype=self.cp.float32)
        embed_rows(cfg, ids, w, out, t, scale=math.sqrt(cfg.n_embd_per_layer))
        return out.reshape(t, cfg.n_layer, cfg.n_embd_per_layer)

    @profiled("norm")
    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        x = self.gpu.f32(x)
        out = self.cp.empty_like(x)
        rms_norm_into(x, self._ones(x.shape[-1]) if weight is None else weight, eps, out)  # (None: gemma4's V norm)
        return out

    def _ones(self, n: int) -> Any:
        """float32 ones [n] on the device (a norm without a weight: times 1.0, exact), made once per size."""
        ones = self._ones_by_size.get(n)
        if ones is None:
            ones = self._ones_by_size[n] = self.cp.ones(n, dtype=self.cp.float32)
        return ones

    @profiled("other (scale)")
    def scale(self, x: Any, factor: float, weight: Any = None) -> Any:
        x = self.gpu.f32(x)
        out = self.cp.empty_like(x)
        scale_into(x, factor, weight, out)
        return out

    @profiled()
    def matmul(self, x: Any, w: DeviceMatrix, bias: Any = None) -> Any:
        return self.linear.matmul(x, w, bias)

    @profiled("RoPE")
    def rope(self, x: Any, pos: Any, local: bool = False) -> Any:
        out = self.gpu.f32(x).copy()
        m, cfg = self.model, self.cfg
        table, attn = (m.inv_freq_local, 1.0) if local else (m.inv_freq, cfg.rope_attn_factor)
        rope_into(cfg, out, pos, table, attn, cfg.local_rope_dim if local else cfg.rope_dim)
        return out

    @profiled("attention")
    def attention(self, op: Attention, q: Any, k: Any, v: Any, pos: Any) -> Any:
        return self.attn.attention(op, q, k, v, pos)

    @profiled("FFN")
    def swiglu(self, gate: Any, up: Any) -> Any:
        return self._glu("swiglu_f32", gate, up)

    @profiled("FFN")
    def geglu(self, gate: Any, up: Any) -> Any:
        return self._glu("geglu_f32", gate, up)

    def _glu(self, kernel: str, gate: Any, up: Any) -> Any:
        gate, up = self.gpu.f32(gate), self.gpu.f32(up)
        out = self.cp.empty_like(gate)
        glu_into(kernel, gate, up, out)
        return out

    @profiled("LM head")
    def softcap(self, x: Any, cap: float) -> Any:
        x = self.gpu.f32(x)
        out = self.cp.empty_like(x)
        softcap_into(x, out, cap)
        return out

    @profiled("other (residual add)")
    def add(self, x: Any, y: Any) -> Any:
        x, y = self.gpu.f32(x), self.gpu.f32(y)
        out = self.cp.empty_like(x)
        add_into(x, y, out)
        return out

    @profiled("FFN")
    def moe(self, op: Moe, h: Any, router_in: Any = None) -> Any:
        return self.experts.forward(op, h, router_in)

    # -- the hybrid models' operations (delta.py) -----------------------------------------------------------------
    @profiled("other (gates)")
    def sigmoid_gate(self, x: Any, gate: Any) -> Any:
        x, gate = self.gpu.f32(x), self.gpu.f32(gate)
        out = self.cp.empty_like(x)
        sigmoid_gate_into(x, gate, out)
        return out

    @profiled("delta net")
    def conv(self, op: Conv, x: Any, pos: Any) -> Any:
        return self._delta_net().conv(op, x, pos)

    @profiled("delta net")
    def delta_rule(self, op: DeltaRule, qkv: Any, a: Any, b: Any, pos: Any) -> Any:
        return self._delta_net().delta_rule(op, qkv, a, b, pos)

    @profiled("delta net")
    def gated_norm(self, x: Any, weight: Any, gate: Any, eps: float) -> Any:
        x, gate = self.gpu.f32(x), self.gpu.f32(gate)
        out = self.cp.empty_like(x)
        gated_norm_into(x, gate, weight, out, eps)
        return out

    def _delta_net(self) -> DeltaNet:
        if self.delta is None:
            raise BackendError("this model has no delta-net layers")
        return self.delta

    # -- recurrent states (delta.DeltaNet; Backend.resume, snapshots, rollback) ------------------------------------
    def resume(self, slot: int, pos: int) -> None:
        if self.delta is not None:
            self.delta.resume(slot, pos)

    def snapshots(self, slot: int, prompt_end: int | None = None) -> frozenset[int] | None:
        return None if self.delta is None else self.delta.snapshots(slot, prompt_end)

    def rollback(self, slot: int, pos: int) -> None:
        """Backend.rollback: with recurrent layers, the state stored at the verification's first position restored
        and the ids it kept run again (their K/V rows written again, to the same values)."""
        if self.delta is None:
            return
        again = self.delta.rollback(slot, pos)
        if again is not None:
            start, ids = again
            block.run(self, self.cfg, self.token_ids(ids), self.positions(start, int(ids.size)))

    # -- whole steps: the fused prefill pass and decode step ---------------------------------------------------
    def forward_prompt(self, ids: np.ndarray, start: int) -> Any:
        self.decoder.drop_ahead()  # a decode step queued ahead is stale once the cache changes
        if self.op_path or not PrefillPass.serves(int(np.asarray(ids).size), self.ctx):
            return super().forward_prompt(ids, start)
        return self.prefill_pass().forward(ids, start)

    def forward_verify(self, ids: np.ndarray, start: int) -> Any:
        """Backend.forward_verify: a verification of drafts (speculative decoding) -> logits [T, V] on the device.
        With an fp16 cache (and verify_batched on), the batched decode step's pass (batch.BatchStep, captured per
        T) with every row in the sequence's slot: its K/V stores come before any row's attention, which reads its
        slot up to its own position, so the rows see the drafts before them; each weight is read once for up to
        BG_NMAX rows (linear.Linear.bgemm). Otherwise up to MATVEC_TMAX tokens the operations one by one
        (block.run, as a short prompt chunk), longer ones the fused prefill pass with every row's LM head
        (prefill.PrefillPass.forward(all_rows=True)). A model that runs op by op: block.run, the recurrent states at
        `start` kept for rollback (delta.DeltaNet.begin_verify)."""
        self.decoder.drop_ahead()  # a decode step queued ahead is stale once the cache changes
        if self.op_path:
            if self.delta is not None:
                self.delta.begin_verify(ids, start)
            return super().forward_verify(ids, start)
        t = int(np.asarray(ids).size)
        if self._verify_in_batch(t):
            return self._verify_step(ids, start)[1]
        if not PrefillPass.serves(t, self.ctx):
            return super().forward_verify(ids, start)
        return self.prefill_pass().forward(ids, start, all_rows=True)

    def verify_greedy(self, ids: np.ndarray, start: int) -> list[int]:
        """Backend.verify_greedy with the argmax of each row on the device (the lowest id on ties, as the host's):
        only the ids and each row's maximum (or, in the batched step, a flag) cross; a row that is not finite goes
        to the host sampler's checks (NumericalError)."""
        if self.op_path:
            return super().verify_greedy(ids, start)
        if self._verify_in_batch(int(np.asarray(ids).size)):
            self.decoder.drop_ahead()
            choice, logits = self._verify_step(ids, start)
            bad, argmax = bool(choice[1].any()), [int(i) for i in choice[0]]
        else:
            logits = self.forward_verify(ids, start)
            both = self.to_host(self.cp.stack([logits.argmax(axis=1).astype(self.cp.float64),
                                               logits.max(axis=1).astype(self.cp.float64)]))
            bad, argmax = not np.isfinite(both[1]).all(), [int(i) for i in both[0]]
        if bad:
            from ...sampling.sampling import greedy

            return [greedy(row) for row in self.to_host(logits)]  # (raises, naming what is wrong)
        return argmax

    def _verify_in_batch(self, t: int) -> bool:
        """Whether a verification of t rows runs as a batched step (_verify_step): verify_batched on, an fp16
        cache, rows within one pass."""
        return self.verify_batched and not self.kv.q8 and t <= self.prefill_pass().max_rows

    def _verify_step(self, ids: np.ndarray, start: int) -> tuple[np.ndarray, Any]:
        """The verification's pass as a batched step of T rows in the current slot -> (choice [2, T] on the host:
        argmax ids, non-finite flags; logits [T, V], a buffer the next verification overwrites)."""
        t = int(np.asarray(ids).size)
        if self.verifier is None or self.verifier.logits.shape[0] < t:  # (rows for the longest verification yet)
            rows = max(t, 17 if self.verifier is None else 2 * self.verifier.logits.shape[0])
            # what outlives a step made first, outside the step's memory pool (as set_slots does for the batch)
            self.prefill_pass().buffers()
            self.linear.workspace()
            if moe_family_needed(self.cfg):
                self.experts.buffers(max(PREFILL_CHUNK, rows))
            self.kv.tables(0)
            self.verifier = BatchStep(self.gpu, self.options, self._forward_batch, rows, self.cfg.vocab_size)
        return self.verifier.run(np.asarray(ids, np.int64).reshape(-1), np.arange(start, start + t),
                                 np.full(t, self.kv.slot))

    def prefill_pass(self) -> PrefillPass:
        """The fused prefill pass (made with its first chunk: its buffers come with it) of a loaded model."""
        if self.prefill is None:
            if not hasattr(self.decoder, "qkv_plan"):
                raise BackendError("the fused prefill pass needs a loaded model (load(), not attach() alone)")
            self.prefill = PrefillPass(self.gpu, self.options, self.model, self.kv, self.linear, self.attn,
                                       self.experts, [bias for _, bias in self.decoder.qkv_plan], self.profiler)
        return self.prefill

    @property
    def prefill_graph_lengths(self) -> frozenset[int]:
        """The chunk lengths whose prefill pass is captured as a graph now."""
        return frozenset() if self.prefill is None else self.prefill.graph_lengths

    # The decode step: the fused one (decode.DecodeStep), or block.run for a model that runs op by op.
    def decode(self, token: int, pos: int) -> Any:
        if self.op_path:
            return super().decode(token, pos)
        return self.decoder.decode(token, pos)

    def decode_greedy(self, token: int, pos: int) -> int:
        if self.op_path:
            return super().decode_greedy(token, pos)
        return self.decoder.decode_greedy(token, pos)

    def decode_sampled(self, token: int, pos: int) -> int:
        if self.op_path:  # (start_sampling said no: step() never calls this then)
            return super().decode_sampled(token, pos)
        return self.decoder.decode_sampled(token, pos)

    def decode_allowed(self, token: int, pos: int, words: Any, params: Any, rng: Any, recent: list[int]) -> int:
        if self.op_path:
            return super().decode_allowed(token, pos, words, params, rng, recent)
        return self.decoder.decode_allowed(token, pos, words, params, rng, recent)

    def prepare_decode(self, kinds: tuple[str, ...] = ("greedy", "sampled"), pos: int = 0) -> None:
        if not self.op_path:  # (op by op: nothing is captured)
            self.decoder.prepare_decode(kinds, pos)

    def drop_graphs(self) -> None:
        """Forget the captured decode steps: the next step captures again (after changing pdl, say)."""
        self.decoder.drop_graphs()

    @property
    def queued_ahead(self) -> tuple[int, int] | None:
        """The (token, pos) of the step queued ahead and not handed out yet, or None (decode.DecodeStep)."""
        return self.decoder.queued_ahead

    # -- the prefix cache's pool (kv_pool.py) ------------------------------------------------------------------
    def _slot_kv(self, slot: int) -> tuple[list[Any], list[Any]]:
        """The K and V arrays of cache slot `slot` (kv.KVCache.slot_caches)."""
        if self.kv is None or type(slot) is not int or not 0 <= slot < len(self.kv.slot_caches):
            raise BackendError(f"the cuda backend holds no cache slot {slot!r}")
        return self.kv.slot_caches[slot]

    def kv_row_bytes(self) -> int:
        return KVPool.row_bytes(self.kv) if self.kv is not None else 0

    def alloc_kv_pool(self, rows: int) -> None:
        if type(rows) is not int or rows < 0:
            raise BackendError(f"a prefix-cache pool takes a number of rows >= 0, got {rows!r}")
        self.kv_pool = None
        if not rows:
            return
        need, free = rows * self.kv_row_bytes(), self.free_memory() or 0
        if need > free - (256 << 20):  # (room kept for the steps' buffers and graphs, as KVCache.set_slots keeps)
            raise DeviceMemoryError(f"a prefix cache of {human_bytes(need)} needs more GPU memory than is free "
                                    f"({human_bytes(free)}): give --cache-ram less")
        try:
            self.kv_pool = KVPool(self.cp, self.kv, rows)
        except self.cp.cuda.memory.OutOfMemoryError:
            self.kv_pool = None
            self.cp.get_default_memory_pool().free_all_blocks()
            raise DeviceMemoryError(f"not enough GPU memory for a prefix cache of {human_bytes(need)}: give "
                                    "--cache-ram less") from None

    def copy_kv_rows(self, slot: int, layers: Any, positions: np.ndarray, rows: np.ndarray, to_pool: bool) -> None:
        if self.kv_pool is None:
            raise BackendError("the cuda backend holds no prefix-cache pool (alloc_kv_pool)")
        caches = self._slot_kv(slot)
        if not to_pool:  # a decode step queued ahead is stale once a cache changes (it may be this slot's)
            self.decoder.drop_ahead()
        self.kv_pool.copy(caches, layers, positions, rows, to_pool)

    def free_memory(self) -> int | None:
        free, _ = self.cp.cuda.runtime.memGetInfo()
        return int(free) + int(self.cp.get_default_memory_pool().free_bytes())

    # -- sampling ------------------------------------------------------------------------------------------
    def start_sampling(self, params: Any, rng: np.random.Generator, recent: list[int]) -> bool:
        if self.op_path:  # (the sampler runs on the host: sample() on the step's logits)
            return False
        return self.decoder.start_sampling(params, rng, recent)

    def sample(self, logits: Any, params: Any, rng: np.random.Generator, recent: list[int]) -> int:
        return self.sampler.sample(logits, params, rng, recent)

    def sample_allowed(self, logits: Any, words: np.ndarray, params: Any, rng: np.random.Generator,
                       recent: list[int]) -> int:
        return self.sampler.sample_allowed(logits, words, params, rng, recent)

    # -- measuring (bench) ---------------------------------------------------------------------------------
    def synchronize(self) -> None:
        self.gpu.synchronize()

    def device_name(self) -> str:
        return self.gpu.device_name()

    def memory_bandwidth(self) -> float:
        return self.gpu.memory_bandwidth()

    def profile(self, fn: Callable[[], Any], spin_ms: float = 50.0) -> tuple[list[tuple[str, float, int]], float]:
        return self.profiler.profile(fn, spin_ms)

    def profile_decode(self, token: int, pos: int) -> tuple[list[tuple[str, float, int]], float]:
        """profile() of one fused greedy decode step, launched un-captured (the graph's kernels, one by one); of a
        model that runs op by op, its decode step through block.run."""
        if self.op_path:
            return self.profiler.profile(lambda: self.decode(token, pos), spin_ms=30.0)
        return self.decoder.profile_decode(token, pos)

    def elapsed(self, fn: Callable[[], Any]) -> float:
        return self.profiler.elapsed(fn)
