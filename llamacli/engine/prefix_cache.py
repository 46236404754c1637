"""A prefix cache across requests: a prompt's K/V rows kept in blocks that any later sequence, in any cache slot,
copies into its own slot before its prefill, so that a shared system prompt or a resent conversation is computed
once (vLLM's automatic prefix caching, over our contiguous slots).

    prompt ids -> blocks of BLOCK ids -> a chain of keys, each a keyed hash of (the previous key, the block's ids)
              -> the longest chain the cache holds -> its rows copied into the slot -> the prefill starts after it

A block's key stands for the whole prefix up to its end (the previous key is hashed in), so a block is found only
behind the same blocks it was stored behind. The chain's root is b"" for unsalted requests and a keyed hash of
the request's cache salt otherwise (vLLM's `cache_salt`, which it hashes into the first block's key): a salted
prompt finds only blocks stored under the same salt, an unsalted one only unsalted blocks. The salt is that of
the slot the blocks are stored from (SequenceCache.salt: the requests that filled it). The keys are BLAKE2b with a key drawn at start: a client cannot make
two prefixes collide (vLLM went from Python's hash to SHA-256 for that reason), and each block keeps its ids,
compared on every match besides. The rows live in a pool the backend holds apart from the slots
(Backend.alloc_kv_pool: host RAM on the CPU and NumPy backends, GPU memory on CUDA), `capacity` blocks of BLOCK positions
bounded by the memory given; when it is full, the block used least recently goes (a leaf of the tree the chains
form: a block is touched with the blocks behind it, last, so those behind are never older; blocks of the prefix
being stored are never taken). A block is stored once, whoever computed it.

When blocks are stored: after a prompt's step (its prompt's whole blocks) and when its sequence ends (the reply's
blocks too: a conversation resent with the reply and one more turn finds them). When they are used: before a
prompt's step, when they cover more of the prompt than the slot's own cache keeps (SequenceCache.reusable); the
prompt's last id is always prefilled (its logits give the first id), so a prompt that ends on a block's end
keeps all but that id.

Layers whose cache is a ring (a sliding window: models/kv_cache.py) hold only their last rows: a block keeps the
ring's rows where the ring still held them when it was stored (every position above `written - rows`,
SequenceCache), and a chain is used only where the blocks over the window before the prefill's start have them
(the chain's end, or the prompt's last id); the rows of that window are copied back then. Models with recurrent layers (Gated DeltaNet) get no prefix
cache: their state resumes only where the backend stored one, and those stored states stay in their slot
(SequenceCache.reusable still resumes a slot's own prompt there).

Why not a library: the cache is the index (a dict of keys and an LRU order) over rows the backends copy; no
package keeps K/V rows of our layouts.
"""

from __future__ import annotations

import collections
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..errors import LlamacliError
from ..models.seq_cache import LayerCache, SequenceCache

BLOCK = 16  # positions per block (vLLM's default block size)
MAX_BLOCKS = 1 << 18  # blocks at most, whatever the bound (the index costs some 500 bytes a block)
DEFAULT_MAX_BYTES = 8192 << 20  # llama-server's --cache-ram default (8192 MiB)


class PrefixCacheOff(LlamacliError):
    """The prefix cache cannot run here (a model with recurrent layers, a backend with no pool, a bound smaller
    than a block): the reason, for a notice."""

    exit_code = 2


@dataclass(eq=False)
class _Block:
    key: bytes
    parent: _Block | None
    ids: tuple[int, ...]
    index: int  # its rows in the pool: index * BLOCK .. index * BLOCK + BLOCK - 1
    ring: bool  # whether the ring layers' rows were stored too
    children: int = field(default=0)


class PrefixCache:
    """Blocks of K/V rows of `backend`'s layers (`layers`: the model's, as layer_caches says at `ctx`), at most
    `budget` bytes of them: see the module doc. Used from one thread (the scheduler's worker, or the caller of
    Model.run): restore() before a prompt's step, store() after it and when its sequence ends."""

    def __init__(self, backend: Any, layers: Sequence[LayerCache], ctx: int, budget: int, block: int = BLOCK):
        if any(c.kind == "recurrent" for c in layers):
            raise PrefixCacheOff("the prefix cache is off for models with recurrent layers (their states resume "
                                 "only where their own slot stored one)")
        row = backend.kv_row_bytes()
        if not row:
            raise PrefixCacheOff(f"the {backend.name} backend keeps no prefix cache")
        if type(budget) is not int or budget < 0:
            raise PrefixCacheOff(f"the prefix cache's bound must be a number of bytes >= 0, got {budget!r}")
        self.block = block
        self.capacity = min(budget // (row * block), MAX_BLOCKS)  # blocks
        if self.capacity < 1:
            raise PrefixCacheOff(f"the prefix cache's bound ({budget:,} bytes) holds no block of {block} positions "
                                 f"({row * block:,} bytes)")
        self.backend = backend
        self.block_bytes = row * block
        backend.alloc_kv_pool(self.capacity * block)
        kv = [(i, c) for i, c in enumerate(layers) if c.kind == "kv"]
        self.full_layers = [i for i, c in kv if not c.window or c.rows >= ctx]
        rings: dict[tuple[int, int], list[int]] = {}
        for i, c in kv:
            if c.window and c.rows < ctx:
                rings.setdefault((c.window, c.rows), []).append(i)
        self.rings = rings  # (window, rows) -> the ring layers of that shape
        self.ring_layers = [i for layers in rings.values() for i in layers]
        self.window = max((w for w, _ in rings), default=0)  # the most past positions a ring layer reads
        self._salt = os.urandom(16)
        self.blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()  # least recent first
        self.free = list(range(self.capacity - 1, -1, -1))  # pool blocks holding no block
        self.queried = 0  # prompt tokens looked up
        self.hits = 0  # prompt tokens copied from the cache (beyond what their slot held)
        self.evictions = 0

    # -- keys ------------------------------------------------------------------------------------------------
    def _key(self, parent: bytes, ids: Sequence[int]) -> bytes:
        data = parent + np.asarray(ids, dtype=np.int64).tobytes()
        return hashlib.blake2b(data, key=self._salt, digest_size=16).digest()

    def _root(self, salt: str | None) -> bytes:
        """The key a chain starts from: b"" unsalted, else the salt's keyed hash (its own personalization, so that
        no block's key can equal it; lone surrogates, which JSON may carry, encoded as they are)."""
        if salt is None:
            return b""
        data = salt.encode("utf-8", "surrogatepass")
        return hashlib.blake2b(data, key=self._salt, digest_size=16, person=b"cache_salt").digest()

    def _chain(self, ids: Sequence[int], salt: str | None = None) -> list[_Block]:
        """The blocks the cache holds for the leading whole blocks of `ids` under `salt`, in order (up to the first
        missing)."""
        chain, key, b = [], self._root(salt), self.block
        for j in range(len(ids) // b):
            part = tuple(ids[j * b : (j + 1) * b])
            key = self._key(key, part)
            node = self.blocks.get(key)
            if node is None or node.ids != part:
                break
            chain.append(node)
        return chain

    def _usable(self, chain: list[_Block], n: int) -> int:
        """How many leading blocks of `chain` a prompt of n ids may start behind: every block over the ring layers'
        window before where its prefill starts (the chain's end, or n - 1) keeps the rings' rows."""
        k = len(chain)
        if not self.rings:
            return k
        while k > 0:
            lo = max(0, min(k * self.block, n - 1) - self.window + 1) // self.block
            if all(node.ring for node in chain[lo:k]):
                break
            k -= 1
        return k

    def _touch(self, chain: list[_Block]) -> None:
        """Mark the chain used now, the blocks behind last (so that they are never older than those after)."""
        for node in reversed(chain):
            self.blocks.move_to_end(node.key)

    def _rows(self, chain: list[_Block], positions: np.ndarray) -> np.ndarray:
        """The pool rows of `positions` (in the chain's blocks)."""
        index = np.array([node.index for node in chain], dtype=np.int64)
        return index[positions // self.block] * self.block + positions % self.block

    # -- use -------------------------------------------------------------------------------------------------
    def restore(self, seq: SequenceCache, ids: Sequence[int], keep: int, salt: str | None = None) -> int:
        """Before a prompt's step of cache salt `salt` in `seq`'s slot, whose cache keeps its first `keep` ids
        (SequenceCache.reusable under the same salt): where the cache holds more of the prompt under that salt,
        those rows are copied into the slot (and `seq` says it holds them) -> the ids kept now (at most
        len(ids) - 1)."""
        self.queried += len(ids)
        chain = self._chain(ids, salt)
        k = self._usable(chain, len(ids))
        m = k * self.block
        new_keep = min(m, len(ids) - 1)
        if new_keep <= keep:
            self._touch(chain[:k])
            return keep
        chain = chain[:k]
        try:
            first = keep // self.block * self.block  # (the slot's own rows serve the blocks before keep's)
            positions = np.arange(first, m, dtype=np.int64)
            self.backend.copy_kv_rows(seq.slot, self.full_layers, positions, self._rows(chain, positions), False)
            high = -1
            for (window, rows), layers in self.rings.items():  # the window before the prefill, on each ring
                positions = np.arange(max(0, new_keep - window + 1), m, dtype=np.int64)
                self.backend.copy_kv_rows(seq.slot, layers, positions, self._rows(chain, positions), False)
                high = max(high, m - window + rows)
        except BaseException:
            seq.clear()  # (what the slot holds is unknown now)
            raise
        # A ring holds the window before the prefill now (from new_keep - window + 1 >= m - window), and what is
        # written after it: `high` makes SequenceCache count no older position of a ring as held (written - rows
        # >= m - window).
        seq.restored(ids[:new_keep], high, keep, salt)
        self._touch(chain)
        self.hits += new_keep - keep
        return new_keep

    def store(self, seq: SequenceCache) -> None:
        """Keep the whole blocks of the ids `seq`'s slot holds that the cache does not hold yet, under the salt the
        slot was filled under (and the rings' rows of blocks stored without them, where the slot's rings still
        hold them)."""
        ids, b = seq.ids, self.block
        chain: list[_Block] = []
        new: list[int] = []  # chain places of the blocks stored now
        rings: list[int] = []  # chain places of the blocks whose ring rows go in now
        pinned: set[bytes] = set()
        key, parent = self._root(seq.salt), None
        for j in range(len(ids) // b):
            part = tuple(ids[j * b : (j + 1) * b])
            key = self._key(key, part)
            ring = bool(self.rings) and self._ring_held(seq, j * b)
            node = self.blocks.get(key)
            if node is None:
                index = self._take(pinned)
                if index is None:  # every block is this prefix's: the cache holds no more of it
                    break
                node = _Block(key, parent, part, index, False)
                new.append(j)
            elif node.ids != part:
                break
            if ring and not node.ring:
                rings.append(j)
            chain.append(node)
            pinned.add(key)
            parent = node
        try:
            if new:
                self._copy_out(seq, self.full_layers, chain, new)
            if rings:
                self._copy_out(seq, self.ring_layers, chain, rings)
        except BaseException:
            self.free.extend(chain[j].index for j in new)
            raise
        for j in new:
            node = chain[j]
            self.blocks[node.key] = node
            if node.parent is not None:
                node.parent.children += 1
        for j in rings:
            chain[j].ring = True
        self._touch(chain)

    def _copy_out(self, seq: SequenceCache, layers: list[int], chain: list[_Block], which: list[int]) -> None:
        """The rows of the chain's blocks at places `which` into the pool, on `layers`."""
        places = np.asarray(which, dtype=np.int64)
        positions = (places[:, None] * self.block + np.arange(self.block)).reshape(-1)
        self.backend.copy_kv_rows(seq.slot, layers, positions, self._rows(chain, positions), True)

    def _ring_held(self, seq: SequenceCache, start: int) -> bool:
        """Whether every ring of the slot still holds positions start .. start + BLOCK - 1 (none was overwritten:
        above written - rows; SequenceCache.written)."""
        return all(start > seq.written - rows for _, rows in self.rings)

    def _take(self, pinned: set[bytes]) -> int | None:
        """A free pool block, the least recently used block's where none is free (a block that no other follows,
        and not one of `pinned`); None where every block is pinned or followed."""
        if self.free:
            return self.free.pop()
        for key, node in self.blocks.items():
            if node.children == 0 and key not in pinned:
                del self.blocks[key]
                if node.parent is not None:
                    node.parent.children -= 1
                self.evictions += 1
                return node.index
        return None

    # -- what it holds -----------------------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        """Positions the cache holds (whole blocks)."""
        return len(self.blocks) * self.block

    def clear(self) -> None:
        """Forget every block (the pool stays)."""
        self.blocks.clear()
        self.free = list(range(self.capacity - 1, -1, -1))


def default_budget(backend: Any, positions: int) -> int:
    """The prefix cache's bound when none is given: as many positions as the slots hold (`positions`), at most
    DEFAULT_MAX_BYTES (llama-server's --cache-ram default) and a quarter of the memory the backend has free."""
    budget = min(DEFAULT_MAX_BYTES, positions * backend.kv_row_bytes())
    free = backend.free_memory()
    return budget if free is None else min(budget, free // 4)
