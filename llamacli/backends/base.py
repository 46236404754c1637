"""The backend interface: the few operations a layer's program (models/block.py) is written against.

Arrays are the backend's own (numpy.ndarray for the NumPy reference, cupy.ndarray for CUDA). Activations
are float32, shapes in brackets: T tokens, D = n_embd, Hq/Hkv heads, Dh = head_dim.

Shaped for CUDA-graph capture: positions arrive as a backend int32 array (`pos`, one absolute position per
token), so kernels read them from device memory; no operation may sync with the host or branch on device
values. Fused CUDA paths are welcome inside a backend; the NumPy backend keeps the plain math beside them.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..errors import BackendError
from ..ggufio.ggml_types import GGMLQuantizationType
from ..models.config import ModelConfig

if TYPE_CHECKING:
    from ..sampling.sampling import SamplingParams
from ..ggufio.file import GGUFFile
from ..models import block
from ..models.block import Attention, Conv, DeltaRule, Moe
from .step import Sampler, SeqStep, StepOut

Progress = Callable[[int, int, str], None]  # (done, total, what) -> None; called while loading


class StepErrors(BackendError):
    """Some sequences of a step of several failed on their own (a constraint's mask that raised, logits with NaN):
    `errors` maps their index in the batch to what they raised, `outs` holds the others' results (None for the
    failed). Each failed sequence must start again with a new Sampler; the others go on."""

    def __init__(self, errors: dict[int, Exception], outs: list[StepOut | None]):
        first = next(iter(errors.values()), None)
        super().__init__(f"{len(errors)} of {len(outs)} sequences failed their step"
                         + (f" (the first: {type(first).__name__}: {first})" if first is not None else ""))
        self.errors, self.outs = errors, outs


@dataclass
class LayerWeights:
    """One transformer block. Matrices are backend weight handles of shape [out, in]; vectors float32."""

    attn_norm: Any  # [D]
    attn_q: Any = None  # [Hq*Dh, D]
    attn_k: Any = None  # [Hkv*Dh, D]
    attn_v: Any = None  # [Hkv*Dh, D]
    attn_qkv: Any = None  # [(Hq+2*Hkv)*Dh, D] (phi3)
    attn_q_bias: Any = None  # [Hq*Dh] (qwen2)
    attn_k_bias: Any = None  # [Hkv*Dh]
    attn_v_bias: Any = None  # [Hkv*Dh]
    attn_q_norm: Any = None  # [Dh] per-head RMSNorm of q (qwen3)
    attn_k_norm: Any = None  # [Dh] per-head RMSNorm of k
    attn_post_norm: Any = None  # [D] post_attention_norm (gemma)
    ffn_post_norm: Any = None  # [D] post_ffw_norm (gemma)
    attn_output: Any = None  # [D, Hq*Dh]
    ffn_norm: Any = None  # [D]
    ffn_gate: Any = None  # [F, D]
    ffn_up: Any = None  # [F, D], or [2F, D] holding [gate; up] (phi3)
    ffn_down: Any = None  # [D, F]
    attn_output_bias: Any = None  # [D] (gpt-oss)
    attn_sinks: Any = None  # [Hq] float32 (gpt-oss)
    # Mixture of experts (plan.moe): the router and the experts. Expert tensors are [E, rows, cols]: NumPy
    # float32 arrays of that shape; on CUDA one DeviceMatrix of E * rows rows (expert e: rows e*rows ..).
    ffn_gate_inp: Any = None  # [E, D] router
    ffn_gate_inp_bias: Any = None  # [E]
    ffn_gate_exps: Any = None  # [E, F_exp, D]
    ffn_up_exps: Any = None  # [E, F_exp, D]
    ffn_down_exps: Any = None  # [E, D, F_exp]
    ffn_gate_exps_bias: Any = None  # [E, F_exp] float32
    ffn_up_exps_bias: Any = None  # [E, F_exp]
    ffn_down_exps_bias: Any = None  # [E, D]
    # A shared expert (qwen35moe, qwen3next): a SwiGLU FFN of width F_sh and its sigmoid gate
    ffn_gate_inp_shexp: Any = None  # [1, D]
    ffn_gate_shexp: Any = None  # [F_sh, D]
    ffn_up_shexp: Any = None  # [F_sh, D]
    ffn_down_shexp: Any = None  # [D, F_sh]
    # A Gated DeltaNet layer (plan.mixer "delta_net"): C = 2 Hk d_k + Hv d_v channels; attn_qkv above is [C, D]
    attn_gate: Any = None  # [Hv d_v, D] z, the output norm's gate
    ssm_beta: Any = None  # [Hv, D]
    ssm_alpha: Any = None  # [Hv, D]
    ssm_ba: Any = None  # [2 Hv, D] rows per key head [beta; alpha] (qwen3next)
    ssm_conv1d: Any = None  # [C, K] float32 (every backend reads it on the host first)
    ssm_dt: Any = None  # [Hv] float32
    ssm_a: Any = None  # [Hv] float32, -exp(A_log)
    ssm_norm: Any = None  # [d_v] float32
    ssm_out: Any = None  # [D, Hv d_v]
    # Gemma 4 (models/arch/gemma4.py); its attention tensors are of the layer's own head size
    ffn_gate_up_exps: Any = None  # [E, 2 F_exp, D] rows [gate; up] of each expert
    ffn_gate_inp_scale: Any = None  # [D] float32: the router input's scale
    ffn_down_exps_scale: Any = None  # [E] float32: each expert's output scale
    ffn_post_norm_1: Any = None  # [D] after the dense FFN beside the experts
    ffn_pre_norm_2: Any = None  # [D] the experts' input norm
    ffn_post_norm_2: Any = None  # [D] after the experts
    per_layer_inp_gate: Any = None  # [P, D]
    per_layer_proj: Any = None  # [D, P]
    per_layer_post_norm: Any = None  # [D]
    layer_output_scale: Any = None  # [1] float32


@dataclass
class ModelWeights:
    token_embd: Any  # [V, D], kept quantized: rows are gathered
    layers: list[LayerWeights]
    output_norm: Any  # [D]
    output: Any  # [V, D]; token_embd's handle when tied
    extra: dict[str, Any] = field(default_factory=dict)
    # Gemma 4's per-layer embeddings (cfg.n_embd_per_layer = P > 0; block.per_layer_inputs)
    per_layer_token_embd: Any = None  # [V, L P], kept quantized: rows are gathered
    per_layer_model_proj: Any = None  # [L P, D]
    per_layer_proj_norm: Any = None  # [P]


class Backend(ABC):
    name: str = "base"
    # 2-D weight types this backend can run (1-D vectors are always F32/F16/BF16, read on the host).
    runnable_types: frozenset[GGMLQuantizationType] = frozenset()
    # Prompt tokens per forward pass in block.prefill; None runs the whole prompt in one pass (the default,
    # as the reference does). A backend may set a micro-batch (llama.cpp's is 512) to bound its scratch.
    prefill_chunk: int | None = None
    # (stage, ms) of the last load() where the backend times its parts (--verbose lists them).
    load_stages: tuple[tuple[str, float], ...] = ()
    # The --split-mode values the backend runs (split_plan.py), and whether it runs on a GPU other than the first
    # visible one (--main-gpu, -dev); `split` holds the options it loads with (select_backend sets them).
    split_modes: tuple[str, ...] = ("none",)
    any_gpu: bool = False
    split: Any = None
    # Cache slots: sequences whose caches the backend holds at once (set_slots); step() takes one sequence per
    # slot. Per slot, step() keeps the sequence whose cache it is (its Sampler) and the decode form chosen for it.
    slots: int = 1
    # Whether step() takes prefill-only steps (SeqStep.fill: a prompt in parts, step.py); the scheduler chunks long
    # prompts only where it does. Off here: a backend that overrides step() or its prompt's setup says it runs them.
    fill_steps: bool = False
    _slot_sampler: dict[int, Sampler]
    _slot_kind: dict[int, str]

    cfg: ModelConfig
    ctx: int
    weights: ModelWeights

    # -- lifetime --------------------------------------------------------------------------------------
    @abstractmethod
    def load(self, gguf: GGUFFile, cfg: ModelConfig, ctx: int, progress: Progress | None = None,
             cache_types: tuple[str, str] = ("f16", "f16")) -> None:
        """Upload the weights (self.weights), allocate the KV cache (a [rows, Hkv, Dh] array per layer, rows
        as cfg.cache_rows(ctx) says: ctx, or a sliding-window layer's ring) of the K and V `cache_types`
        (kv_cache.CACHE_TYPES, already checked against the head dim) and scratch.
        The tensors were already checked by weights.check_tensors."""

    def close(self) -> None:
        """Free device memory (a no-op for NumPy)."""

    def set_slots(self, n: int) -> None:
        """Hold the caches of `n` sequences at once (slots 0..n-1; slot 0's cache is the one load() made). A
        backend that holds one says so (BackendError) for n > 1."""
        if n != 1:
            raise BackendError(f"the {self.name} backend holds one sequence's cache at a time (asked for {n})")

    def use_slot(self, slot: int) -> None:
        """Make slot `slot`'s cache the one the operations read and write (a backend of one slot: nothing)."""

    def _forget_slots(self, first: int) -> None:
        """Slots from `first` on hold no sequence any more (their caches were dropped or replaced)."""
        for table in (getattr(self, "_slot_sampler", {}), getattr(self, "_slot_kind", {})):
            for slot in [k for k in table if k >= first]:
                del table[slot]

    # -- host <-> backend --------------------------------------------------------------------------------
    @abstractmethod
    def positions(self, start: int, n: int) -> Any:
        """int32 [n] = start .. start+n-1, as a backend array (CUDA: a preallocated device buffer)."""

    @abstractmethod
    def token_ids(self, ids: np.ndarray) -> Any:
        """int32 [T] token ids as a backend array."""

    @abstractmethod
    def to_host(self, x: Any) -> np.ndarray: ...

    # -- operations --------------------------------------------------------------------------------------
    @abstractmethod
    def embed(self, ids: Any) -> Any:
        """[T] ids -> [T, D] rows of token_embd, dequantized, times cfg.embd_scale."""

    @abstractmethod
    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """[..., D] -> x / sqrt(mean(x^2) + eps) * weight, over the last axis ([T, H, Dh]: per head); weight None:
        no weight."""

    @abstractmethod
    def matmul(self, x: Any, w: Any, bias: Any = None) -> Any:
        """[T, K] @ W[N, K]^T (+ bias[N]) -> [T, N]."""

    @abstractmethod
    def rope(self, x: Any, pos: Any, local: bool = False) -> Any:
        """[T, H, Dh] rotated at positions pos [T] (the config's pairing and scaling; the first rope_dim
        dims of each head rotate, the rest pass through); `local`: the local table (rope.inv_freq)."""

    @abstractmethod
    def attention(self, op: Attention, q: Any, k: Any, v: Any, pos: Any) -> Any:
        """Write k, v [T, Hkv, Dh] into layer op.layer's cache at pos (not with op.store False: a shared-KV layer,
        k and v None), then causal GQA of q [T, Hq, Dh] over cache positions 0..pos[t] for each t (only
        pos[t] - window < k with op.window), scores scaled by cfg.query_scale and soft-capped by op.softcap,
        op.sinks: attn_sinks in the denominator -> [T, Hq*Dh]. Dh and Hkv are the layer's own (its cache's)."""

    @abstractmethod
    def swiglu(self, gate: Any, up: Any) -> Any:
        """silu(gate) * up, [T, F]."""

    def geglu(self, gate: Any, up: Any) -> Any:
        """gelu_tanh(gate) * up, [T, F] (gemma's FFN)."""
        raise BackendError(f"the {self.name} backend has no GeGLU (gemma models)")

    def swiglu_oai(self, gate: Any, up: Any) -> Any:
        """gpt-oss's clamped SwiGLU, [T, F]: min(gate, 7) sigmoid(1.702 min(gate, 7)) (clip(up, -7, 7) + 1)."""
        raise BackendError(f"the {self.name} backend has no clamped SwiGLU as a separate operation")

    def gated(self, activation: str, gate: Any, up: Any) -> Any:
        """A gated FFN's activation as a layer plan names it: "silu" (SwiGLU), "gelu_tanh" (GeGLU),
        "swiglu_oai" (gpt-oss)."""
        if activation == "gelu_tanh":
            return self.geglu(gate, up)
        if activation == "swiglu_oai":
            return self.swiglu_oai(gate, up)
        return self.swiglu(gate, up)

    def softcap(self, x: Any, cap: float) -> Any:
        """cap * tanh(x / cap) (gemma2's final logits)."""
        raise BackendError(f"the {self.name} backend has no logit soft-capping (gemma2 models)")

    def moe(self, op: Moe, h: Any, router_in: Any = None) -> Any:
        """The mixture-of-experts FFN of block op.layer on the normalised input h [T, D]: route each token
        (llamacli/moe.py route with op.gating over ffn_gate_inp of `router_in` [T, D], else of h: ids and weights of
        cfg.n_expert_used experts; op.expert_scale: each weight times ffn_down_exps_scale of its expert), run the
        chosen experts' gated FFNs (op.activation, biases when op.bias) -> sum_j w_j FFN_j(h) [T, D]."""
        raise BackendError(f"the {self.name} backend has no mixture-of-experts FFN")

    def scale(self, x: Any, factor: float, weight: Any = None) -> Any:
        """x * factor (* weight, broadcast over the last axis)."""
        raise BackendError(f"the {self.name} backend has no separate scale operation (gemma4 models)")

    def embed_per_layer(self, ids: Any) -> Any:
        """[T] ids -> [T, L, P] rows of per_layer_token_embd, dequantized, times sqrt(P) (gemma4's per-layer
        embeddings)."""
        raise BackendError(f"the {self.name} backend has no per-layer embeddings (gemma4 models)")

    def sigmoid_gate(self, x: Any, gate: Any) -> Any:
        """x * sigmoid(gate), gate [T, N] or [T, 1] (a gated attention's output; the shared expert's)."""
        raise BackendError(f"the {self.name} backend has no sigmoid gate (qwen35 / qwen3next models)")

    def conv(self, op: Conv, x: Any, pos: Any) -> Any:
        """Block op.layer's causal convolution of x [T, C] at positions pos [T] over the sequence's window (block.py
        Conv), SiLU applied -> [T, C]; the window moves on to the last K - 1 inputs."""
        raise BackendError(f"the {self.name} backend has no gated delta-net layers (qwen35 / qwen3next models)")

    def delta_rule(self, op: DeltaRule, qkv: Any, a: Any, b: Any, pos: Any) -> Any:
        """Block op.layer's gated delta rule (block.py DeltaRule) over the sequence's state from qkv [T, C], alpha and
        beta [T, Hv] at positions pos [T] -> [T, Hv d_v]; the state moves on past the last position."""
        raise BackendError(f"the {self.name} backend has no gated delta-net layers (qwen35 / qwen3next models)")

    def gated_norm(self, x: Any, weight: Any, gate: Any, eps: float) -> Any:
        """rms_norm(x) * weight * silu(gate) over the last axis, x and gate [T, H, d]."""
        raise BackendError(f"the {self.name} backend has no gated delta-net layers (qwen35 / qwen3next models)")

    @abstractmethod
    def add(self, x: Any, y: Any) -> Any:
        """x + y (may write into x)."""

    # -- recurrent states (models with delta-net layers; models/seq_cache.py) -------------------------------------
    def resume(self, slot: int, pos: int) -> None:
        """Before a prompt's prefill from position `pos` in cache `slot`: the slot's recurrent states set to those
        stored after position pos - 1 (zeros at 0), and those stored past pos forgotten (they hold ids the prompt
        replaces). Nothing to do for a model without recurrent layers."""

    def snapshots(self, slot: int, prompt_end: int | None = None) -> frozenset[int] | None:
        """After a step: the positions whose recurrent states the backend holds for `slot` (the step stored some,
        seq_cache.snapshot_positions; `prompt_end`: the step was a prompt's, ending there, a position to keep);
        None for a model without recurrent layers."""
        return None

    # -- the prefix cache's pool (engine/prefix_cache.py) ------------------------------------------------------
    # K and V rows kept apart from the slots, so that a prompt's prefix computed for one sequence is copied into
    # any slot for another: one pool array per layer with a KV cache, in the layout of that layer's cache.
    def kv_row_bytes(self) -> int:
        """Bytes of one position's K and V over every layer with a KV cache, as the pool holds them; 0 where this
        backend keeps no pool (the prefix cache is off then)."""
        return 0

    def alloc_kv_pool(self, rows: int) -> None:
        """Hold a pool of `rows` positions (replacing any; 0 frees it). BackendError where the memory is not there
        (or this backend keeps no pool)."""
        raise BackendError(f"the {self.name} backend keeps no prefix cache")

    def copy_kv_rows(self, slot: int, layers: Sequence[int], positions: np.ndarray, rows: np.ndarray,
                     to_pool: bool) -> None:
        """Copy the K and V of `positions` (int64 [n]) in slot `slot`'s cache, each at its row there (p mod the
        layer's rows: a ring's), to pool rows `rows` (int64 [n]) with `to_pool`, or from those pool rows back to
        those positions, on each layer of `layers` (layers with a KV cache). Queued in order with the steps (a
        GPU's copies run on the stream the steps run on); positions on a ring must fall on distinct rows."""
        raise BackendError(f"the {self.name} backend keeps no prefix cache")

    def free_memory(self) -> int | None:
        """Bytes the backend could still allocate (host RAM; a GPU's free memory), None where unknown: the prefix
        cache's default bound."""
        return None

    # -- the step contract (backends/step.py) ----------------------------------------------------------------
    def step(self, batch: Sequence[SeqStep]) -> list[StepOut]:
        """Run one step of each sequence in `batch` (one per cache slot) -> its chosen id (and logits where asked),
        per sequence, in batch order. A sequence's first step (its Sampler not started) prefills its tokens and
        sets up the decode for its sampler; each later step decodes one token at the sequence's next position,
        through the fastest form the sampler allows: the argmax or the whole sampler inside the step, a
        constraint's mask applied where the logits are, or the logits to the host (logprobs); or, for a
        speculative sampler, verifies drafts (step.py); a prefill-only step (SeqStep.fill, where the backend takes
        them: fill_steps) writes a part of the prompt and chooses nothing. The sequences run one after the other
        here; a backend with batched kernels runs the decode steps together."""
        self._check_slots(batch)
        if len(batch) == 1:
            return [self._step_one(batch[0])]
        outs: list[StepOut | None] = []
        errors: dict[int, Exception] = {}
        for i, seq in enumerate(batch):  # one sequence's failure (its constraint's mask, its logits) is its own
            try:
                outs.append(self._step_one(seq))
            except Exception as exc:
                errors[i] = exc
                outs.append(None)
        if errors:
            raise StepErrors(errors, outs)
        return outs  # type: ignore[return-value]

    def _check_slots(self, batch: Sequence[SeqStep]) -> None:
        slots = [seq.slot for seq in batch]
        if len(set(slots)) != len(slots) or not all(type(x) is int and 0 <= x < self.slots for x in slots):
            raise BackendError(f"a step takes at most one sequence per cache slot, slots 0..{self.slots - 1} "
                               f"(got slots {slots})")

    def _step_one(self, seq: SeqStep) -> StepOut:
        if not hasattr(self, "_slot_sampler"):
            self._slot_sampler, self._slot_kind = {}, {}
        s, pos, slot = seq.sampler, seq.start, seq.slot
        self.use_slot(slot)
        if seq.fill:
            return self._fill(seq)
        if s.position < 0:  # a new sequence: its prompt, then the decode set up for its sampler
            self._slot_sampler.pop(slot, None)  # (the slot is this sequence's once the prompt's step has run whole)
            self.resume(slot, pos)  # recurrent states: those stored at pos (zeros at 0)
            out = self._choose(block.prefill(self, self.cfg, seq.tokens, pos), s)
            out.snapshots = self.snapshots(slot, pos + len(seq.tokens))
            t0 = time.perf_counter()
            self._slot_kind[slot] = self._setup_decode(s, pos + len(seq.tokens))
            out.setup_ms = (time.perf_counter() - t0) * 1e3
            s.position, self._slot_sampler[slot] = pos + len(seq.tokens), s
            return out
        if self._slot_sampler.get(slot) is not s:
            raise BackendError("the cache no longer holds this sequence (another ran since, or its last step "
                               "failed): start it again with a new Sampler")
        n = len(seq.tokens)
        low = s.verified + 1 if s.verified >= 0 else s.position  # after a verification: where its drafts began
        if not low <= pos <= s.position or n < 1 or (n > 1 and not s.speculative) or pos + n > self.ctx:
            where = f"{s.position}" if low == s.position else f"{low}..{s.position} (past the drafts accepted)"
            what = "the token" + (" (and drafts after it, within the context)" if s.speculative else "")
            raise BackendError(f"a decode step takes {what if s.speculative else 'the one token'} at the "
                               f"sequence's next position {where}, got {n} at {pos}")
        del self._slot_sampler[slot]  # until this step has run whole
        if s.verified >= 0:  # the last step verified drafts: those rejected go (pos: past the ones accepted)
            s.verified = -1
            self.rollback(slot, pos)
        if n > 1:  # a verification: the token at pos and its drafts, in one pass
            out = self._verify(seq.tokens, pos, s)
            s.verified = pos
        else:
            out = self._decode(seq.tokens[0], pos, s, self._slot_kind[slot])
        out.snapshots = self.snapshots(slot)
        s.position, self._slot_sampler[slot] = pos + n, s
        return out

    def _fill(self, seq: SeqStep) -> StepOut:
        """A prefill-only step (step.py): the ids' K/V (and recurrent states) written at positions start.. of the
        slot, nothing chosen, the sampler left not started; the slot is no other sequence's any more."""
        s, pos, slot, n = seq.sampler, seq.start, seq.slot, len(seq.tokens)
        if not self.fill_steps:
            raise BackendError(f"the {self.name} backend takes no prefill-only steps: a prompt runs whole")
        if s.position >= 0:
            raise BackendError("a prefill-only step is a part of a prompt: it comes before the sequence's prompt "
                               "step (its Sampler already started)")
        if n < 1 or type(pos) is not int or pos < 0 or pos + n >= self.ctx:
            raise BackendError(f"a prefill-only step takes one id or more at positions within the context, leaving "
                               f"room for the prompt's last part (got {n} at {pos}, context {self.ctx})")
        self._slot_sampler.pop(slot, None)
        self._slot_kind.pop(slot, None)
        self.resume(slot, pos)  # recurrent states: those stored at pos (the part before stored its end)
        self.forward_fill(np.asarray(seq.tokens, dtype=np.int64), pos)
        return StepOut(-1, snapshots=self.snapshots(slot))

    def _verify(self, tokens: Sequence[int], pos: int, s: Sampler) -> StepOut:
        """A verification step (backends/step.py): each position's argmax for a plain greedy sampler (no mask, no
        logprobs: only the ids cross), else the raw logits of every position, on the host."""
        ids = np.asarray(tokens, dtype=np.int64)
        if s.plain_greedy and s.mask is None and not s.logits:
            return StepOut(-1, choices=self.verify_greedy(ids, pos))
        return StepOut(-1, logits=self.to_host(self.forward_verify(ids, pos)))

    def _decode(self, token: int, pos: int, s: Sampler, kind: str) -> StepOut:
        p, rng, hist = s.params, s.rng, s.history
        if s.mask is not None and not s.logits:  # the mask computed while the step runs
            return StepOut(self.decode_allowed(token, pos, s.mask, p, rng, hist))
        if s.logits:  # (with or without a mask: _choose applies it on the host)
            return self._choose(self.decode(token, pos), s)
        if kind == "greedy":  # the argmax runs inside the step: only the id crosses
            return StepOut(self.decode_greedy(token, pos))
        if kind == "sampled":  # so does the sampler (the same ids as sample(), draw for draw)
            return StepOut(self.decode_sampled(token, pos))
        return StepOut(self.sample(self.decode(token, pos), p, rng, hist))

    def _choose(self, logits: Any, s: Sampler) -> StepOut:
        """The id from a step's logits [1, V] as `s` says; the raw logits (host) too with s.logits. A mask is
        computed before the logits are read (on a GPU the step is still running then)."""
        words = s.mask() if s.mask is not None else None
        if s.logits:  # the raw logits come back (logprobs); the id from them, masked by the constraint
            from ..sampling.sampling import sample
            from ..sampling.structured import unpack_words

            raw = self.to_host(logits)[-1]
            x = raw if words is None else np.where(unpack_words(words, raw.shape[-1]), raw, np.float32(-np.inf))
            return StepOut(sample(x, s.params, s.rng, s.history), raw)
        if words is not None:
            return StepOut(self.sample_allowed(logits, words, s.params, s.rng, s.history))
        return StepOut(self.sample(logits, s.params, s.rng, s.history))

    def _setup_decode(self, s: Sampler, pos: int) -> str:
        """The decode form for sampler `s` whose first decode step runs at `pos` ("greedy", "sampled",
        "logits"), made ready (start_sampling: the sampler inside the step; prepare_decode: its graph)."""
        logits_path = s.logits or s.mask is not None
        # (a speculative sequence's sampled ids are drawn on the host, a verification's rows too: no sampler
        # inside the step, whose state would not follow the drafts)
        sampled = (not logits_path and not s.plain_greedy and not s.speculative
                   and self.start_sampling(s.params, s.rng, s.history))
        kind = "sampled" if sampled else "greedy" if s.plain_greedy and not logits_path else "logits"
        self.prepare_decode((kind,), pos=pos)
        return kind

    # -- whole steps ---------------------------------------------------------------------------------------
    # step() calls these; a GPU backend overrides them with fused kernels and captured graphs.
    def forward_prompt(self, ids: np.ndarray, start: int) -> Any:
        """One prefill pass: host token ids [T] at positions start.. -> logits [1, V] of the last one;
        writes their K/V into the cache (block.prefill calls it per chunk)."""
        return block.run(self, self.cfg, self.token_ids(ids), self.positions(start, int(ids.size)))

    def forward_fill(self, ids: np.ndarray, start: int) -> None:
        """A prefill-only step's passes: host token ids [T] at positions start.. into the cache, as a prompt's
        (block.prefill: the backend's prefill_chunk passes); the last row's logits are computed and dropped (one
        row of the LM head, the price of one code path for both)."""
        block.prefill(self, self.cfg, ids, start)

    def forward_verify(self, ids: np.ndarray, start: int) -> Any:
        """A verification pass: host token ids [T] (the last id taken and T - 1 drafts) at positions start.. ->
        the logits [T, V] of every position; writes their K/V (a prefill pass whose every row is kept)."""
        return block.run(self, self.cfg, self.token_ids(ids), self.positions(start, int(ids.size)), all_logits=True)

    def verify_greedy(self, ids: np.ndarray, start: int) -> list[int]:
        """forward_verify followed by each row's argmax (lowest id on ties): only the ids need come back."""
        from ..sampling.sampling import greedy

        return [greedy(row) for row in self.to_host(self.forward_verify(ids, start))]

    def rollback(self, slot: int, pos: int) -> None:
        """The step after a verification starts at `pos` (past the drafts accepted): slot `slot`'s cache goes back
        there. K/V rows past pos need nothing (a later step overwrites them before any query reads them); a
        backend that keeps recurrent states restores the state after pos - 1."""

    def decode(self, token: int, pos: int) -> Any:
        """One decode step: `token` at position `pos` -> logits [1, V]; writes that position's K/V."""
        return block.run(self, self.cfg, self.token_ids(np.asarray([token])), self.positions(pos, 1))

    def decode_greedy(self, token: int, pos: int) -> int:
        """A decode step followed by the argmax (lowest id on ties): only the id comes back."""
        from ..sampling.sampling import greedy

        return greedy(self.to_host(self.decode(token, pos))[-1])

    def decode_allowed(self, token: int, pos: int, words: Callable[[], np.ndarray], params: "SamplingParams",
                       rng: np.random.Generator, recent: list[int]) -> int:
        """A decode step whose logits are masked to a constraint's ids, then sampled: sample_allowed(decode(
        token, pos), words(), ...). `words` (Constraint.allowed_words) is called after the step is launched, so
        the mask is computed while the device runs it; a GPU backend may also queue the following step."""
        logits = self.decode(token, pos)
        return self.sample_allowed(logits, words(), params, rng, recent)

    def prepare_decode(self, kinds: tuple[str, ...] = ("greedy", "sampled"), pos: int = 0) -> None:
        """Get the decode steps of `kinds` ready ("greedy", "sampled", "logits": a GPU backend captures its
        graphs) so that no timed step pays for it; a warm-up may write position `pos`'s K/V."""

    def start_sampling(self, params: "SamplingParams", rng: np.random.Generator, recent: list[int]) -> bool:
        """Set up decode_sampled for a generation whose first step runs at position len(recent) (`recent`: the
        ids before it), drawing from `rng` as sample() would; False where this backend cannot (step() then
        calls sample(decode(...)))."""
        return False

    def decode_sampled(self, token: int, pos: int) -> int:
        """A decode step with the sampler start_sampling set up inside it: only the id comes back, the same
        as sample(decode(token, pos), params, rng, recent) with the same generator."""
        raise BackendError(f"the {self.name} backend samples on the host (start_sampling returned False)")

    # -- measuring (bench) ---------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on the host)."""

    def device_name(self) -> str:
        import platform

        return f"CPU ({platform.processor() or platform.machine()}, NumPy)"

    def memory_bandwidth(self) -> float:
        """Measured copy bandwidth in bytes/s, counting bytes read + written (bench's % BW)."""
        import time

        src = np.ones(64 << 20, dtype=np.uint8)
        dst = np.empty_like(src)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - t0)
        return 2 * src.nbytes / best

    # -- sampling ----------------------------------------------------------------------------------------
    def sample(self, logits: Any, params: "SamplingParams", rng: np.random.Generator, recent: list[int]) -> int:
        """The next token from logits [1, V]. The reference samples on the host (sampling.py); a GPU backend
        may sample on the device so that only the id crosses, with the same semantics."""
        from ..sampling.sampling import sample

        return sample(self.to_host(logits)[-1], params, rng, recent)

    def sample_allowed(self, logits: Any, words: np.ndarray, params: "SamplingParams", rng: np.random.Generator,
                       recent: list[int]) -> int:
        """sample() over logits [1, V] with every id whose bit is clear in `words` (uint32 [ceil(V / 32)], bit
        i % 32 of word i // 32 for id i: structured.Constraint.allowed_words) set to -inf first."""
        from ..sampling.sampling import sample
        from ..sampling.structured import unpack_words

        x = self.to_host(logits)[-1]
        return sample(np.where(unpack_words(words, x.shape[-1]), x, np.float32(-np.inf)), params, rng, recent)
