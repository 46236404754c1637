"""The step contract between the engine and a backend (Backend.step).

The engine hands the backend a batch: for each sequence its new token ids, the position of the first, its cache
slot, and how its next id is chosen (a Sampler: the sampling settings, the sequence's own seeded generator, the
ids before the step for the penalties, a constraint's mask); it gets back, per sequence, the chosen id and,
where the sampler asks, the step's logits. Everything about how a step runs stays inside the backend: prefill
passes, the captured decode graphs and the step queued ahead of time, sampling on the device.

A sequence's first step (its Sampler not started) is its prompt: a prefill of the new ids (whatever their
number), the first id from the last one's logits, and the backend's decode set up for that sampler. Every
later step is one token at the sequence's next position (Sampler.position, which the backend keeps), or, for a
speculative sampler (Sampler.speculative), a verification: that token and k drafted ids after it, run in one
pass over the sequence's cache (prefill-like), which gives back each of the k + 1 positions' argmax (a plain
greedy sampler: StepOut.choices) or logits (StepOut.logits [k + 1, V]) for the engine to accept the drafts
from (engine/speculative.py). The step after a verification at position p starts at p + 1 + a, the a drafts
the engine accepted (0..k): the backend rolls the cache back there first (K/V rows past it are overwritten
before any step reads them; a recurrent state is restored, Backend.rollback). In a model
with recurrent layers (models/seq_cache.py) a prompt that starts past position 0 resumes from the state the
backend stored there, and every step says which positions it holds stored states for (StepOut.snapshots). A step
that raised, or a cache another sequence has taken since, leaves the sequence to be started again with a new
Sampler (the backend refuses it with one line).

A prompt may also arrive in parts (the scheduler's chunked prefill: a long prompt in pieces of a turn's token
budget, the running sequences' decode steps taken between them): each part but the last is a prefill-only step
(SeqStep.fill), which writes its ids' K/V (and moves a recurrent state on) at positions start.. of its slot and
chooses nothing (StepOut id -1, no logits); the Sampler stays not started, so the last part is the ordinary prompt
step, starting past 0 where the parts before it ended, exactly as a prompt resumed from a cached prefix starts
(the engine vouches for rows 0..start-1 of the slot, SequenceCache, as it does there; a recurrent state resumes
from the one the part before stored at its end, which is the slot's latest and so kept, Backend.snapshots).
Backends that take these say so (Backend.fill_steps); one that does not refuses them, and the scheduler runs
every prompt whole there.

A batch holds at most one sequence per cache slot (Backend.set_slots); the NumPy backend runs them one after the
other, the CUDA backend runs their decode steps as one batched step (backends/cuda/batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..sampling.sampling import SamplingParams


@dataclass(eq=False)
class Sampler:
    """How one sequence's next ids are chosen. The object is the sequence's identity for the backend: a new
    Sampler starts a new generation (the first step is then the prompt)."""

    params: SamplingParams
    rng: np.random.Generator  # the sequence's own draws (seeded: reproducible whatever else runs)
    history: list[int]  # the ids before the step (prompt and generated): the penalties' window; the engine
    #                     appends each id it takes
    mask: Callable[[], np.ndarray] | None = None  # a constraint's allowed ids as uint32 bit words
    #                                              (structured.mask_words): called while the step runs
    logits: bool = False  # bring each step's raw logits back (logprobs)
    speculative: bool = False  # later steps may carry drafts to verify: the backend then keeps no sampler state
    #                            across steps (a sampled id is drawn on the host, from `rng`, row by row)
    position: int = field(default=-1, init=False)  # the next position this sequence decodes at (the backend
    #                                                keeps it); -1: not started
    verified: int = field(default=-1, init=False)  # the first position of the last step when that step verified
    #                                                drafts (the next step may start past it, up to `position`); -1

    @property
    def plain_greedy(self) -> bool:
        return self.params.greedy and not self.params.has_penalties


@dataclass
class SeqStep:
    """One sequence's part of a step: `tokens` at positions start, start + 1, ... in cache `slot`. With `fill`, a
    prefill-only part of the prompt (its Sampler not started, and left so): the K/V written, nothing chosen, and
    room left in the context for the prompt's last part (start + len(tokens) < the context)."""

    tokens: Sequence[int]
    start: int
    sampler: Sampler
    slot: int = 0
    fill: bool = False


@dataclass
class StepOut:
    """What a step gives back for one sequence: the chosen id, and the raw logits [V] (host) where its sampler
    asked for them. A prefill-only step (SeqStep.fill) chooses nothing (id -1) and gives nothing else but
    `snapshots`. A verification (k + 1 tokens) chooses nothing (id -1): it gives each position's argmax
    (`choices`, a plain greedy sampler without a mask or logprobs) or else their raw logits [k + 1, V]."""

    id: int
    logits: np.ndarray | None = field(default=None, repr=False)
    choices: list[int] | None = None
    setup_ms: float = 0.0  # of the step's time, what the backend spent making its decode ready (the prompt's
    #                        step: the sampler's upload, a graph's capture), for the engine to time apart
    snapshots: frozenset[int] | None = None  # a model with recurrent layers: the positions whose states the
    #                                          backend holds for the sequence after the step (SequenceCache.held)
