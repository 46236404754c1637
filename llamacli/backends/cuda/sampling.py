"""Sampling on the device (kernels/sampling.cu): penalties, then argmax (greedy), or top-k (k <= TOPK_MAX) and
the rest of llamacli.sampling.sampling's chain over the candidates (top-p, min-p, temperature, the draw with the
uniform number the host's seeded generator supplies): only the chosen id crosses, and the tokens equal
llamacli.sampling.sampling's for the same seed (tests/backends/cuda/test_gpu_kernels.py, test_gpu_sampling.py; the host side of the
step's sampler without a GPU: test_cuda_sampling.py). top_k = 0 or > TOPK_MAX copies the logits and samples on
the host.

Two ways in:

- `sample(logits, params, rng, recent)`: one call of llamacli.sampling.sampling.sample, kernel by kernel (the first
  token after a prefill, and any step whose logits the caller holds);
- inside the captured decode step (`start`, then decode.DecodeStep.decode_sampled): the same kernels
  in their _step forms follow the LM head, so a sampled generation queues its next step ahead as the greedy
  one does and only the id crosses. The settings live in device memory (one graph serves them all). The
  step reads what the host would pass to sample() from the device:
    - the uniform number: the host draws them ahead from the same generator in the same order (draw d is the
      d-th rng.random() after start_sampling, the one sample() would have drawn for the d-th step) into a ring
      of UNIFORM_RING slots that the step indexes by its position (UniformFeed);
    - the recent tokens: a per-position history [ctx] that each step extends with its input token (the
      prompt's tail written by `start`), so the window of a step at pos is positions
      pos - repeat_last_n + 1 .. pos, as generate's history list.
  Greedy with penalties runs there too (top-k 1, temperature 0: no uniform number drawn). top_k = 0 or
  > TOPK_MAX stays with the host path (`start` says False).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ...errors import NumericalError
from ...sampling.sampling import SamplingParams
from . import loader as K
from .profile import profiled

TOPK_MAX = 1024  # device top-k candidates
TOPK_PART, TOPK_PART_K = 4096, 64  # kernels/sampling.cu: logits per block of topk_part_step_f32, its top_k limit
UNIFORM_RING = 1024  # uniform numbers the device holds ahead (a power of two); refilled by halves

# kernels/sampling.cu SampleParams, field for field (C layout: 56 bytes).
STEP_PARAMS = np.dtype([("top_p", "<f8"), ("log_min_p", "<f8"), ("temperature", "<f8"), ("repeat", "<f4"),
                        ("freq", "<f4"), ("present", "<f4"), ("top_k", "<i4"), ("window", "<i4"), ("base", "<i4"),
                        ("ring", "<i4")], align=True)


def on_device(params: Any) -> bool:
    """Whether the device can run this sampler in the decode step: greedy (with penalties), or top-k within
    1..TOPK_MAX (top_k = 0 or more candidates: the host path)."""
    return params.greedy or 0 < params.top_k <= TOPK_MAX


def step_params(params: Any, vocab: int, base: int) -> np.ndarray:
    """The SampleParams record for `params` (validated): greedy -> top-k 1 at temperature 0; the penalty window
    0 when no penalty changes a logit; `base`, the position whose step takes uniform number 0."""
    p = np.zeros((), STEP_PARAMS)
    p["top_p"] = params.top_p
    p["log_min_p"] = math.log(params.min_p) if params.min_p > 0 else -math.inf
    p["temperature"] = 0.0 if params.greedy else params.temperature
    p["repeat"], p["freq"], p["present"] = params.repeat_penalty, params.frequency_penalty, params.presence_penalty
    p["top_k"] = 1 if params.greedy else min(params.top_k, vocab)
    p["window"] = params.repeat_last_n if params.has_penalties else 0
    p["base"], p["ring"] = base, UNIFORM_RING
    return p


def record_bytes(rec: np.ndarray) -> np.ndarray:
    """A SampleParams record as the uint8 [56] its device buffer takes."""
    return np.frombuffer(rec.tobytes(), np.uint8).copy()


class UniformFeed:
    """The seeded uniform numbers ahead of the device, in draw order: draw d (the d-th rng.random() since
    `start`) sits in slot d % size of the device ring. `start` gives the whole first ring; `need(d)` the
    (first slot, numbers) writes that make draw d available, a half ring at a time, overwriting only draws
    at least half a ring older than d (the steps that read them are queued before the copy, and the host
    never goes back more than one step)."""

    def __init__(self, size: int = UNIFORM_RING):
        if size < 8 or size & (size - 1):
            raise ValueError(f"the ring size must be a power of two >= 8, got {size}")
        self.size, self.half = size, size // 2
        self.rng: np.random.Generator | None = None
        self.filled = 0  # draws made so far: draws [filled - size, filled) sit in the ring

    def start(self, rng: np.random.Generator) -> np.ndarray:
        self.rng, self.filled = rng, self.size
        return rng.random(self.size)  # the same numbers as `size` calls of rng.random()

    def need(self, d: int) -> list[tuple[int, np.ndarray]]:
        if self.rng is None or d < self.filled - self.size:
            raise ValueError(f"uniform number {d} is no longer in the ring (draws {self.filled - self.size}.."
                             f"{self.filled - 1})")
        writes = []
        while d >= self.filled:
            writes.append((self.filled % self.size, self.rng.random(self.half)))
            self.filled += self.half
        return writes


class DeviceSampler:
    """Sampling on the device for one model's vocabulary and context, with the buffers it owns: the top-k
    candidates, the penalty counts, the captured step's settings, token history and uniform ring, and a
    constraint's mask."""

    def __init__(self, gpu: Any, cfg: Any, ctx: int, profiler: Any):
        self.gpu, self.cfg, self.ctx, self.profiler = gpu, cfg, ctx, profiler
        cp = self.cp = gpu.cp
        self._topk_vals = cp.empty(TOPK_MAX, cp.float32)
        self._topk_ids = cp.empty(TOPK_MAX, cp.int32)
        # topk_part_step_f32's candidates: up to TOPK_PART_K from each slice of TOPK_PART logits
        n_part = K.cdiv(self.cfg.vocab_size, TOPK_PART)
        self._part_vals = cp.empty(n_part * TOPK_PART_K, cp.float32)
        self._part_ids = cp.empty(n_part * TOPK_PART_K, cp.int32)
        self._sample_out = cp.zeros(2, cp.int32)  # (token id, flag) from sample_topk_f32
        self._pen_counts = cp.zeros(self.cfg.vocab_size, cp.int32)  # the penalty kernels' counts: zero between them
        # The captured step's sampler: its settings, the token of every position, the uniform ring.
        self._step_params = cp.zeros(STEP_PARAMS.itemsize, cp.uint8)
        self._step_params.set(record_bytes(step_params(SamplingParams(temperature=0.0), self.cfg.vocab_size, 0)))
        self._hist = cp.full(self.ctx, -1, cp.int32)
        self._uniforms = cp.zeros(UNIFORM_RING, cp.float64)
        self._feed = UniformFeed(UNIFORM_RING)
        self._feed_greedy = True  # the settings draw no uniform numbers
        self._feed_base = 0  # the position whose step takes draw 0
        # Pinned staging for the ring's refills, one event per half (its last copy).
        mem = cp.cuda.alloc_pinned_memory(UNIFORM_RING * 8)
        self._uniform_stage = np.frombuffer(mem, np.float64, UNIFORM_RING)
        self._uniform_events = [cp.cuda.Event(disable_timing=True) for _ in range(2)]
        # A constraint's mask words (sample_allowed): pinned staging, the device copy, the masked logits.
        n_words = -(-self.cfg.vocab_size // 32)
        self._mask_stage = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * n_words), np.uint32, n_words)
        self._mask_words = cp.empty(n_words, cp.uint32)
        self._mask_event = cp.cuda.Event(disable_timing=True)
        self.masked = cp.empty((1, self.cfg.vocab_size), cp.float32)

    # -- one call ------------------------------------------------------------------------------------------
    @profiled("sampling")
    def sample(self, logits: Any, params: Any, rng: np.random.Generator, recent: list[int]) -> int:
        """Backend.sample on the device (the host path for top_k = 0 or > TOPK_MAX)."""
        from ...sampling import sampling as S

        cp, v = self.cp, self.cfg.vocab_size
        params.validate()
        if not params.greedy and not 0 < params.top_k <= TOPK_MAX:
            return S.sample(self.gpu.to_host(logits)[-1], params, rng, recent)  # host path (documented)
        x = self.gpu.f32(logits[-1]).copy()  # [V]; penalties write into it
        if params.has_penalties and recent:
            window = np.asarray(recent, dtype=np.int32)
            if params.repeat_last_n > 0:
                window = window[-params.repeat_last_n :]
            if window.size:
                hist = cp.asarray(window)
                K.launch("sampling", "penalties_f32", (1,), (1024,), x=x, hist=hist, n=window.size, V=v,
                         cnt=self._pen_counts, repeat=params.repeat_penalty, freq=params.frequency_penalty,
                         present=params.presence_penalty)
        if params.greedy:
            out = cp.empty(2, dtype=cp.int32)
            K.launch("sampling", "argmax_f32", (1,), (1024,), x=x, V=v, out=out, pos_inc=None)
            host = out.get()
            check_flag(int(host[1]), v)
            return int(host[0])
        k = min(params.top_k, v)
        K.launch("sampling", "topk_f32", (1,), (1024,), x=x, V=v, k=k, vals=self._topk_vals, ids=self._topk_ids)
        # top-p, min-p, temperature and the draw over the k candidates, on the device too (sampling.cu):
        # the host's seeded generator supplies the one uniform number, and only the id comes back.
        out = self._sample_out
        log_min_p = math.log(params.min_p) if params.min_p > 0 else -math.inf
        K.launch("sampling", "sample_topk_f32", (1,), (1024,), vals=self._topk_vals, ids=self._topk_ids, k=k,
                 top_p=params.top_p, log_min_p=log_min_p, temperature=params.temperature, u=rng.random(), out=out)
        token, flag = (int(a) for a in out.get())
        check_flag(flag, v)
        return token

    def sample_allowed(self, logits: Any, words: np.ndarray, params: Any, rng: np.random.Generator,
                       recent: list[int]) -> int:
        """Backend.sample_allowed on the device: the masked logits (mask) to sample()."""
        self.mask(logits, words)
        return self.sample(self.masked, params, rng, recent)

    def mask(self, logits: Any, words: np.ndarray) -> None:
        """masked = logits [1, V] with the ids outside `words` at -inf (mask_logits_f32). The words go through
        pinned memory, reused once the copy from it before has run."""
        from ...sampling.structured import check_words

        v = self.cfg.vocab_size
        words = check_words(words, v)
        self._mask_event.synchronize()
        np.copyto(self._mask_stage, words, casting="no")
        self._mask_words.data.copy_from_host_async(self._mask_stage.ctypes.data, self._mask_stage.nbytes)
        self._mask_event.record()
        K.launch("sampling", "mask_logits_f32", (K.cdiv(v, 256),), (256,), x=self.gpu.f32(logits[-1]),
                 words=self._mask_words, V=v, y=self.masked)

    # -- inside the decode step ----------------------------------------------------------------------------
    def start(self, params: Any, rng: np.random.Generator, recent: Sequence[int]) -> bool:
        """Set up the captured step's sampler for a generation whose first step runs at position len(recent)
        (`recent`: the ids at positions 0.. before it, as generate's history): the settings, the penalty
        window's tail of `recent`, and the first ring of uniform numbers from `rng` (its next draws, in order;
        none when greedy). False, and nothing changes, where the device cannot sample these settings
        (on_device). A step queued ahead under the old settings must not be taken after this
        (decode.DecodeStep.start_sampling)."""
        if not on_device(params.validate()):
            return False
        cp = self.cp
        base = len(recent)
        if base >= self.ctx:
            return False
        cp.cuda.get_current_stream().synchronize()  # a step queued ahead may still read the old settings
        rec = step_params(params, self.cfg.vocab_size, base)
        self._step_params.set(record_bytes(rec))
        window = int(rec["window"])
        lo = 0 if window < 0 else max(0, base - window + 1)  # the step at base writes position base itself
        if window and base > lo:
            self._hist[lo:base].set(np.asarray(recent[lo:base], dtype=np.int32))
        self._feed_greedy, self._feed_base = bool(params.greedy), base
        if not self._feed_greedy:
            for e in self._uniform_events:
                e.synchronize()
            self._uniform_stage[:] = self._feed.start(rng)
            self._copy_uniforms(0, UNIFORM_RING)
        return True

    def feed_uniforms(self, pos: int) -> None:
        """Before queuing the sampled step at `pos`: make its uniform number, draw pos - base, available."""
        if self._feed_greedy:
            return
        for slot, values in self._feed.need(pos - self._feed_base):
            self._uniform_events[slot // self._feed.half].synchronize()  # its last copy from the stage is done
            self._uniform_stage[slot : slot + values.size] = values
            self._copy_uniforms(slot, values.size)

    def _copy_uniforms(self, slot: int, n: int) -> None:
        """Queue the copy of stage slots [slot, slot + n) into the device ring (after the steps queued so far)."""
        cp = self.cp
        stream = cp.cuda.get_current_stream()
        src = self._uniform_stage.ctypes.data + 8 * slot
        cp.cuda.runtime.memcpyAsync(self._uniforms.data.ptr + 8 * slot, src, 8 * n, 1, stream.ptr)  # host -> device
        for half in range(slot // self._feed.half, (slot + n) // self._feed.half):
            self._uniform_events[half].record(stream)

    def step_tail(self, step: list, x: Any, step_ids: Any, step_pos: Any) -> None:
        """Append the captured step's sampling kernels (after the LM head wrote its logits x [1, V]) to the
        step's launch list (decode.DecodeStep.launch_step's (section, bytes, streams, launch(early)) entries):
        the id goes to step_ids, and step_pos advances."""
        V = self.cfg.vocab_size
        step.append(("sampling", 0, False, lambda early: K.launch(
            "sampling", "penalties_step_f32", (1,), (1024,), x=x, hist=self._hist, pos_p=step_pos,
            ids=step_ids, V=V, cnt=self._pen_counts, p=self._step_params)))
        n_part = K.cdiv(V, TOPK_PART)
        step.append(("sampling", 0, False, lambda early: K.launch(
            "sampling", "topk_part_step_f32", (n_part,), (1024,), x=x, V=V, p=self._step_params,
            cvals=self._part_vals, cids=self._part_ids)))
        step.append(("sampling", 0, False, lambda early: K.launch(
            "sampling", "topk_step_f32", (1,), (1024,), x=x, V=V, p=self._step_params, vals=self._topk_vals,
            ids=self._topk_ids, cvals=self._part_vals, cids=self._part_ids, n_part=n_part)))
        step.append(("sampling", 0, False, lambda early: K.launch(
            "sampling", "sample_step_f32", (1,), (1024,), vals=self._topk_vals, ids=self._topk_ids,
            p=self._step_params, uniforms=self._uniforms, pos_p=step_pos, out=step_ids)))


def check_flag(flag: int, vocab: int) -> None:
    """The NumericalError a sampler flag means (kernels/sampling.cu: 1 NaN/+inf, 2 no candidate)."""
    if flag == 1:
        raise NumericalError("the logits contain NaN or +inf: the model output is broken")
    if flag == 2:
        raise NumericalError(f"all {vocab} logits are -inf: no token can be sampled")
