"""`llamacli bench -npl 1,4,16,64`: llama-batched-bench's table, B sequences decoded at once in this process.

For each prompt size PP (-npp), generation length TG (-ntg) and number of sequences B (-npl), as
llama.cpp's tools/batched-bench/batched-bench.cpp:

    B prompts of PP random ids, each in a cache slot of its own, their prompt steps together    T_PP
    TG decode steps, each one token of every sequence                                          T_TG
    N_KV = B (PP + TG)   S_PP = B PP / T_PP   S_TG = B TG / T_TG   T = T_PP + T_TG   S = N_KV / T

It runs through the step contract (backends/step.py): each step is one Backend.step of B SeqSteps in slots
0..B-1 (the prompts', then each decode step's), every sequence greedy, so it measures whatever the backend does
with a batch: the NumPy backend runs the sequences one after another; the CUDA backend's batched step reads the
weights once a step for all of them (backends/cuda/batch.py). A prompt step also picks the first id (llama-batched-bench computes the
last prompt token's logits): the TG decode steps then give TG more ids per sequence.

Each configuration runs untimed first, its prompts and two decode steps (compilation, cuBLAS's plans, the CUDA
graphs of the prefill chunks, captured at a length's second run, and of the batch's decode step; twice for
B = 1), then timed: synchronize and perf_counter
around each phase (every step returns its ids to the host, so each has finished when it returns).

Unlike llama-batched-bench, whose -c is the context all sequences share, each sequence has a cache slot of
its own of the model's context (-c, as `serve --parallel` gives each slot): a configuration runs where PP + TG
fits one slot (others are skipped with a notice, as llama-batched-bench skips those past its context), and
where the backend holds B slots (a B it cannot hold, or whose caches the memory cannot, is skipped likewise).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..backends.base import StepErrors
from ..backends.step import Sampler, SeqStep
from ..errors import BackendError, HostMemoryError, UsageError
from ..sampling.sampling import SamplingParams, make_rng
from ..textio import csv_text, printable
from .generate import Model

MAX_SEQUENCES = 256  # -npl's bound (serve --parallel's: each sequence holds a context's KV cache)
WARMUP_TG = 2  # decode steps of a configuration's untimed run


@dataclass
class BatchedRow:
    """One configuration's timings (seconds)."""

    pp: int
    tg: int
    b: int
    t_pp: float
    t_tg: float

    @property
    def n_kv(self) -> int:
        return self.b * (self.pp + self.tg)

    @property
    def t(self) -> float:
        return self.t_pp + self.t_tg

    @property
    def speed_pp(self) -> float:
        return self.b * self.pp / self.t_pp if self.t_pp > 0 else 0.0

    @property
    def speed_tg(self) -> float | None:
        return self.b * self.tg / self.t_tg if self.tg and self.t_tg > 0 else None

    @property
    def speed(self) -> float:
        return self.n_kv / self.t if self.t > 0 else 0.0

    def as_dict(self, info: dict[str, Any]) -> dict[str, Any]:
        tg = self.speed_tg
        return {**info, "n_prompt": self.pp, "n_gen": self.tg, "n_parallel": self.b, "n_kv": self.n_kv,
                "t_pp": round(self.t_pp, 6), "speed_pp": round(self.speed_pp, 3), "t_tg": round(self.t_tg, 6),
                "speed_tg": None if tg is None else round(tg, 3), "t": round(self.t, 6),
                "speed": round(self.speed, 3)}


def check_sizes(pps: list[int], tgs: list[int], npls: list[int]) -> None:
    """UsageError (one line) for sizes llama-batched-bench's table cannot have: no value, a prompt of no ids,
    a number of sequences outside 1..MAX_SEQUENCES."""
    for flag, values in (("-npp", pps), ("-ntg", tgs), ("-npl", npls)):
        if not values:
            raise UsageError(f"{flag} takes at least one number")
    if min(pps) < 1:
        raise UsageError(f"-npp values must be >= 1 (a prompt of at least one id), got {min(pps)}")
    if not 1 <= min(npls) <= max(npls) <= MAX_SEQUENCES:
        bad = min(npls) if min(npls) < 1 else max(npls)
        raise UsageError(f"-npl values must lie in 1..{MAX_SEQUENCES} (sequences decoded at once), got {bad}")


def context_for(pps: list[int], tgs: list[int]) -> int:
    """The context each sequence's slot needs for every configuration: the longest PP + TG."""
    return max(pps) + max(tgs)


def run_batched(model: Model, pps: list[int], tgs: list[int], npls: list[int],
                progress: Callable[[str], None] | None = None, seed: int = 0) -> list[BatchedRow]:
    """The table's rows, PP outermost and B innermost as llama-batched-bench orders them; a configuration whose
    PP + TG does not fit a slot's context is skipped, and so is a B the backend cannot hold (set_slots: a
    backend of fewer slots, or not enough memory for their caches), each said through `progress`; where
    nothing is left, the reason is raised. The model keeps the most slots it got, their caches left empty."""
    check_sizes(pps, tgs, npls)
    if min(pps) + min(tgs) > model.ctx:
        raise UsageError(f"no -npp/-ntg pair fits a context of {model.ctx} per sequence (PP + TG at most that): "
                         f"raise -c or lower -npp/-ntg")
    held, refused = _slots(model, npls)
    if not held:
        raise refused
    rng = np.random.default_rng(seed)
    rows = []
    try:
        for pp in pps:
            for tg in tgs:
                for b in npls:
                    if pp + tg > model.ctx:
                        if progress:
                            progress(f"skipping PP {pp}, TG {tg}: a sequence needs a context of {pp + tg}, "
                                     f"have {model.ctx} (-c)")
                        continue
                    if b > held:
                        if progress:
                            progress(f"skipping B {b}: {refused}")
                        continue
                    if progress:
                        progress(f"running PP {pp}, TG {tg}, B {b}")
                    for _ in range(2 if b == 1 else 1):  # (a prefill chunk's graph is captured at its second run)
                        _run(model, rng, pp, min(tg, WARMUP_TG), b)
                    t_pp, t_tg = _run(model, rng, pp, tg, b)
                    rows.append(BatchedRow(pp, tg, b, t_pp, t_tg))
    finally:
        for seq in model.seqs:  # random ids went into the caches: a later prompt starts afresh
            seq.clear()
    return rows


def _slots(model: Model, npls: list[int]) -> tuple[int, Exception | None]:
    """Give the model the most cache slots of -npl's values it can hold -> (those slots, or 0; why more were
    refused, or None)."""
    refused: Exception | None = None
    for b in sorted(set(npls), reverse=True):
        if len(model.seqs) >= b:
            return b, refused
        try:
            model.set_slots(b)
            return b, refused
        except (BackendError, HostMemoryError) as exc:
            refused = refused or type(exc)(f"-npl {b}: {exc}")
    return 0, refused


def _run(model: Model, rng: np.random.Generator, pp: int, tg: int, b: int) -> tuple[float, float]:
    """B sequences of PP random ids then TG decode steps, each phase's steps one Backend.step of B SeqSteps ->
    (prompt seconds, decode seconds)."""
    be, vocab = model.backend, model.cfg.vocab_size
    greedy = SamplingParams(temperature=0.0)
    samplers = [Sampler(greedy, make_rng(0), history=[]) for _ in range(b)]
    prompts = [rng.integers(0, vocab, size=pp).tolist() for _ in range(b)]
    be.synchronize()
    t0 = time.perf_counter()
    ids = _step(be, [SeqStep(prompts[i], 0, samplers[i], slot=i) for i in range(b)])
    be.synchronize()
    t1 = time.perf_counter()
    for k in range(tg):
        ids = _step(be, [SeqStep([ids[i]], pp + k, samplers[i], slot=i) for i in range(b)])
    be.synchronize()
    return t1 - t0, time.perf_counter() - t1


def _step(be: Any, batch: list[SeqStep]) -> list[int]:
    try:
        return [out.id for out in be.step(batch)]
    except StepErrors as exc:  # a sequence's own failure (NaN logits): the first one's error
        raise next(iter(exc.errors.values())) from None


# -- output -------------------------------------------------------------------------------------------------


COLUMNS = ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s")


def render_batched(rows: list[BatchedRow], fmt: str, info: dict[str, Any]) -> str:
    """md (llama-batched-bench's table under a line naming the model, backend, device and context), json (a list
    of rows) or csv (a header and the rows)."""
    dicts = [r.as_dict(info) for r in rows]
    if fmt == "json":
        return json.dumps(dicts, indent=2)
    if fmt == "csv":
        return csv_text([{k: printable(v) if isinstance(v, str) else v for k, v in d.items()} for d in dicts])
    lines = [f"model: {printable(info['model'])} ({info['backend']}); device: {printable(info['device'])}; "
             f"context {info['n_ctx']} per "
             "sequence, each in a cache slot of its own", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---:"] * len(COLUMNS)) + "|"]
    for r in rows:
        tg = r.speed_tg
        cells = [str(r.pp), str(r.tg), str(r.b), str(r.n_kv), f"{r.t_pp:.3f}", f"{r.speed_pp:.2f}", f"{r.t_tg:.3f}",
                 "-" if tg is None else f"{tg:.2f}", f"{r.t:.3f}", f"{r.speed:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
