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

from dataclasses import dataclass
from typing import Iterable, Sequence

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
