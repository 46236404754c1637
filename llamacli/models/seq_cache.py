"""A sequence's cache: what one cache slot keeps per layer, which ids it holds, and what a new prompt may reuse.

Per layer a slot keeps one of two kinds of memory:

- **KV rows** (`LayerCache.kind == "kv"`): a row per position on a global layer, or a ring of the last rows on a
  sliding-window layer (kv_cache.ring_rows). Rows can be rewound: a prompt that shares a prefix with what the
  slot holds starts after it, as long as every ring still holds that prefix's last window (kv_cache.ring_keeps).
- **Nothing** (`"shared"`): a layer that reads an earlier layer's KV rows (gemma4's shared-KV layers): the rows it
  reads are that layer's, rewound with them.
- **A recurrent state** (`"recurrent"`: the linear-attention layers of hybrid models, Qwen3.5's Gated DeltaNet: a
  short convolution window and a d_k x d_v state per head): its size does not grow with the context, but it is
  the state *after* the last position it ran, which a failed step or a step run ahead of time (the decode's
  warm-up, the look-ahead) moves on in place, so it cannot be rewound. A prompt resumes only at a position
  whose state the backend stored (`stored(pos)`, or the whole set after each step: `held`); any other prompt
  starts from 0. Where the backends store one (SNAPSHOT_EVERY, MAX_SNAPSHOTS below): at the end of each prompt
  (a chat's next turn continues from it when the template drops the reply's reasoning), after the latest decode
  step (it continues from there when the reply comes back as it was generated), and at each multiple of
  SNAPSHOT_EVERY positions a prompt passes (prompts that share a long beginning, a system prompt, resume near
  where they part); MAX_SNAPSHOTS of them at most, the highest positions kept.

SequenceCache is the engine's record of one slot: its layers' kinds, the ids it holds (positions 0..len-1),
the highest position written since it was last filled from 0 (what a ring may have overwritten past the
ids it holds: a failed step, a decode graph's warm-up), and the cache salt of the requests that filled it
(vLLM's `cache_salt`; None: unsalted): a prompt of another salt keeps nothing of the slot, so that clients of
different salts never learn from each other's K/V, not even by the time their prompt takes. The backend keeps the memory itself, one slot per
sequence it can hold (SeqStep.slot); the backends hold one slot today.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from ..errors import BackendError
from .config import ModelConfig
from .kv_cache import ring_keeps

KINDS = ("kv", "recurrent", "shared")
SNAPSHOT_EVERY = 256  # a prompt stores the recurrent state at each multiple of this many positions it passes
MAX_SNAPSHOTS = 8  # stored states kept per sequence (each the size of ModelConfig.recurrent_state_bytes)


@dataclass(frozen=True)
class LayerCache:
    """What one layer keeps per sequence: KV rows (`rows` of them, a ring when `window` > 0 and rows < ctx), a
    recurrent state, or nothing ("shared": gemma4's shared-KV layers read an earlier layer's rows)."""

    kind: str = "kv"
    window: int = 0
    rows: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown layer cache kind {self.kind!r}")


def layer_caches(cfg: ModelConfig, ctx: int) -> tuple[LayerCache, ...]:
    """Each layer's cache at a context of `ctx` positions, as the backends allocate it (ModelConfig.cache_rows; a
    delta-net layer's recurrent state instead)."""
    return tuple(LayerCache("recurrent") if plan.recurrent else LayerCache("shared") if plan.shares_kv else
                 LayerCache("kv", plan.window, rows) for plan, rows in zip(cfg.layers, cfg.cache_rows(ctx)))


@dataclass
class LayerState:
    """One delta-net layer's live recurrent state in a slot: each part is the state after position pos - 1 of its
    `*_pos` (the Conv and DeltaRule operations move them on in turn); arrays of the backend's kind."""

    conv: Any  # [K - 1, C] the convolution's last K - 1 inputs
    conv_pos: int
    ssm: Any  # [Hv, d_k, d_v] the delta rule's state per value head
    ssm_pos: int


@dataclass
class RecurrentSlot:
    """One cache slot's delta-net states as a backend keeps them (the NumPy backend's and CUDA's delta.DeltaNet's):
    the live one per layer, the stored ones, position -> layer -> [conv window, state] (copies; where
    snapshot_positions says, and the latest step's end), the positions pinned (ends of prompts), and the last
    verification pass (Backend.step with drafts): its first position, its ids, and whether that position was
    pinned before (the state there is kept until the next step says how many drafts stay: rollback). The
    bookkeeping is here; the backends copy the arrays."""

    states: dict[int, LayerState] = field(default_factory=dict)
    stored: dict[int, dict[int, list]] = field(default_factory=dict)
    pinned: set[int] = field(default_factory=set)
    verified: tuple[int, np.ndarray, bool] | None = None

    def trim(self, n_layers: int) -> None:
        """Keep the stored states that are whole (each of the n_layers delta-net layers' two parts), at an end of a
        prompt (`pinned`), a multiple of SNAPSHOT_EVERY or the highest position (the latest step's end),
        MAX_SNAPSHOTS of them at most, the highest positions first."""
        whole = sorted((p for p, layers in self.stored.items()
                        if len(layers) == n_layers and all(x is not None for parts in layers.values() for x in parts)),
                       reverse=True)
        keep = [p for i, p in enumerate(whole) if i == 0 or p in self.pinned or p % SNAPSHOT_EVERY == 0][:MAX_SNAPSHOTS]
        self.stored = {p: self.stored[p] for p in keep}
        self.pinned &= set(keep)

    def unpin_verified(self) -> None:
        """Forget the last verification (its first position unpinned unless a prompt's end pinned it before)."""
        if self.verified is not None:
            start, _, was_pinned = self.verified
            if not was_pinned:
                self.pinned.discard(start)
            self.verified = None

    def begin_verify(self, ids: Any, start: int) -> None:
        """A verification pass of ids from `start`: the state stored at start (by the step before) kept through it."""
        self.unpin_verified()
        self.verified = (start, np.asarray(ids).copy(), start in self.pinned)
        self.pinned.add(start)

    def take_verified(self, pos: int) -> tuple[int, np.ndarray] | None:
        """After the last verification, whose drafts were rejected from `pos` on: (its first position, the ids it
        kept from there: positions start .. pos - 1), whose states the backend restores and runs again; None where
        there is nothing to do. The verification is forgotten either way."""
        verified = self.verified
        self.unpin_verified()
        if verified is None:
            return None
        start, ids, _ = verified
        if pos >= start + ids.size:
            return None
        return start, ids[: pos - start]

    def resume_at(self, pos: int, n_layers: int) -> dict[int, list] | None:
        """Backend.resume's bookkeeping: the states stored past pos forgotten (those of replaced ids) -> the states
        stored at pos, layer -> [conv window, state], for the backend to make live; None at 0 (each layer's first
        pass starts from zeros). BackendError where none is stored at pos."""
        self.unpin_verified()  # (a verification whose next step never came)
        self.stored = {p: x for p, x in self.stored.items() if p <= pos}
        self.pinned = {p for p in self.pinned if p <= pos}
        if pos == 0:
            return None
        self.trim(n_layers)
        if pos not in self.stored:
            raise BackendError(f"no recurrent state is stored at position {pos} (stored: {sorted(self.stored)}): a "
                               "prompt starts at 0 or where a state was stored")
        return self.stored[pos]

    def snapshots(self, n_layers: int, prompt_end: int | None = None) -> frozenset[int]:
        """Backend.snapshots: the positions whose states the slot holds (`prompt_end` pinned first)."""
        if prompt_end is not None:
            self.pinned.add(prompt_end)
        self.trim(n_layers)
        return frozenset(self.stored)


def snapshot_positions(start: int, n: int) -> list[int]:
    """Where a pass over positions start .. start + n - 1 stores the recurrent state (the state after position
    p - 1 for each p listed): each multiple of SNAPSHOT_EVERY inside it, and its end start + n."""
    first = start // SNAPSHOT_EVERY * SNAPSHOT_EVERY + SNAPSHOT_EVERY
    return list(range(first, start + n, SNAPSHOT_EVERY)) + [start + n]


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """The number of leading ids a and b share, at most `limit`."""
    n = 0
    for x, y in zip(a, b):
        if x != y or n >= limit:
            break
        n += 1
    return n


class SequenceCache:
    """The ids one cache slot holds for one sequence, and the positions a new prompt may start from."""

    def __init__(self, layers: Sequence[LayerCache], ctx: int, slot: int = 0):
        self.layers = tuple(layers)
        self.ctx = ctx
        self.slot = slot
        self.ids: list[int] = []  # the ids whose K/V (and state) the slot holds, positions 0..len-1
        self.written = -1  # the highest position whose K/V may have been written since a fill from 0
        self.snapshots: set[int] = set()  # positions p where every recurrent layer's state after p - 1 is stored
        self.salt: str | None = None  # the cache salt its ids were filled under (None: unsalted)
        self._kv_layers = [(c.window, c.rows) for c in self.layers if c.kind == "kv"]
        self.recurrent = any(c.kind == "recurrent" for c in self.layers)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def full(self) -> bool:
        return len(self.ids) >= self.ctx

    def reusable(self, ids: Sequence[int], salt: str | None = None) -> int:
        """How many leading ids of a new prompt (of cache salt `salt`) the slot can keep: none where the slot was
        filled under another salt; else the prefix it shares with them, short of the prompt's last id (whose
        logits the step needs), cut back to a position every layer can resume from: each ring still holding the
        window before it, each recurrent state stored there."""
        if salt != self.salt:
            return 0
        keep = common_prefix(self.ids, ids, len(ids) - 1)
        if self.recurrent:
            keep = max((p for p in self.snapshots if p <= keep), default=0)
        if not ring_keeps(keep, self.written, self._kv_layers, self.ctx):
            keep = 0
        return keep

    def begin_prompt(self, keep: int, n_ids: int, salt: str | None = None) -> None:
        """Before a prompt's step (of cache salt `salt`) that keeps the first `keep` ids and runs the prompt to
        `n_ids` positions: the ids past `keep` are dropped now (a failed step leaves them unknown), and the step
        may write up to position n_ids (the decode's warm-up step at n_ids included). The slot is the salt's
        from now on."""
        if keep and salt != self.salt:
            raise ValueError("a prompt keeps a slot's ids filled under another cache salt")
        self.salt = salt
        del self.ids[keep:]
        self.snapshots = {p for p in self.snapshots if p <= keep}
        self.written = max(self.written if keep else -1, n_ids)

    def restored(self, ids: Sequence[int], high: int = -1, kept: int = 0, salt: str | None = None) -> None:
        """The K/V rows of `ids` (positions 0..len-1) past the first `kept` (which the slot held) were copied into
        the slot (the prefix cache, engine/prefix_cache.py, from blocks stored under cache salt `salt`), a
        ring's only over the window before their end: `written` becomes at least `high`, so that no older
        position counts as held on a ring (-1: none)."""
        if kept and salt != self.salt:
            raise ValueError("a prompt keeps a slot's ids filled under another cache salt")
        self.salt = salt
        self.ids = list(ids)
        self.snapshots = set()
        self.written = max(self.written if kept else -1, high)

    def prompt_done(self, ids: Sequence[int]) -> None:
        """After the prompt's step ran whole (or a prefill-only part of it, `ids` then the prompt up to its end):
        the slot holds `ids`."""
        self.ids = list(ids)

    def begin_decode(self, pos: int) -> None:
        """Before a decode step at `pos` (it writes that position; a step queued ahead may write the next)."""
        self.written = max(self.written, pos + 1)

    def begin_verify(self, pos: int, n: int) -> None:
        """Before a verification step of `n` tokens at `pos` (the last id and its drafts: it writes positions pos ..
        pos + n - 1, and those past the drafts the engine accepts stay written, unheld)."""
        self.written = max(self.written, pos + n - 1)

    def token_done(self, token: int) -> None:
        """After a decode step ran whole: its token's K/V are in the slot."""
        self.ids.append(token)

    def stored(self, pos: int) -> None:
        """The backend stored every recurrent layer's state after position pos - 1 (a snapshot): a prompt that
        shares pos ids with the slot may resume there."""
        if not 0 < pos <= len(self.ids):
            raise ValueError(f"a snapshot at {pos} of a slot holding {len(self.ids)} ids")
        self.snapshots.add(pos)

    def held(self, positions: Iterable[int]) -> None:
        """The backend now holds stored states at exactly these positions (Backend.step says so after each step of
        a model with recurrent layers): a prompt may resume at those within the ids the slot holds."""
        self.snapshots = {p for p in positions if 0 < p <= len(self.ids)}

    def clear(self) -> None:
        """Forget what the slot holds (its memory was overwritten outside the engine, or a fresh start is wanted):
        the next prompt starts from 0 (begin_prompt(0, n) then resets `written`)."""
        self.ids = []
        self.snapshots = set()
        self.salt = None
