"""The prefix cache's pool on the device: K and V rows kept apart from the slots' caches (engine/prefix_cache.py),
copied into a slot's cache before a prompt's prefill and out of it after.

One K and one V array per layer with a KV cache, in that layer's cache layout (kv.py): fp16 [rows, Hkv, Dh]; or
an 8-bit cache's byte buffer [rows, Hkv, Dh + Dh/16], int8 codes [rows, Hkv, Dh] then fp16 scales [Hkv, rows,
Dh/32] (attention_simt.cu kv_store_q8). A copy moves whole rows, codes and scales alike, so a row comes back
bit for bit. Each copy is CuPy's fancy indexing (a gather into a scatter), queued on the current stream, the one
the steps run on: it sees every K/V row the steps queued before it, and the steps after it see what it wrote.
A position's row in a cache is p mod the cache's rows (a ring's; p itself in a full cache).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .kv import KVCache


def _parts(cp: Any, buf: Any, q8: bool) -> list[tuple[Any, int]]:
    """A cache or pool array as (view, the axis its rows lie on): [(array, 0)] for fp16; an 8-bit buffer's codes
    [rows, Hkv, Dh] (axis 0) and scales [Hkv, rows, Dh/32] (axis 1)."""
    if not q8:
        return [(buf, 0)]
    rows, hkv, width = buf.shape
    dh = width * 16 // 17  # width = Dh + Dh/16
    flat = buf.reshape(-1)
    codes = flat[: rows * hkv * dh].reshape(rows, hkv, dh)
    scales = flat[rows * hkv * dh : rows * hkv * dh + 2 * hkv * rows * (dh // 32)].view(cp.uint16)
    return [(codes, 0), (scales.reshape(hkv, rows, dh // 32), 1)]


class KVPool:
    """`rows` positions of K and V per layer with a KV cache, laid out as `kv`'s caches."""

    def __init__(self, cp: Any, kv: KVCache, rows: int):
        self.cp, self.q8 = cp, kv.q8
        self.rows = rows
        self.k = [cp.zeros((rows, *k.shape[1:]), dtype=k.dtype) if k.shape[0] else None for k in kv.k_cache]
        self.v = [cp.zeros_like(k) if k is not None else None for k in self.k]

    @staticmethod
    def row_bytes(kv: KVCache) -> int:
        """Bytes of one position's K and V over every layer (the caches' own row sizes)."""
        return sum(2 * k[0].nbytes for k in kv.k_cache if k.shape[0])

    def copy(self, caches: tuple[Sequence[Any], Sequence[Any]], layers: Sequence[int], positions: np.ndarray,
             rows: np.ndarray, to_pool: bool) -> None:
        """K and V of `positions` in one slot's caches (its K arrays and V arrays, one of each per layer:
        KVCache.slot_caches[slot]) to pool rows `rows` (to_pool), or back (see the module doc)."""
        cp = self.cp
        k_cache, v_cache = caches
        pos = cp.asarray(np.asarray(positions, dtype=np.int64))
        at = cp.asarray(np.asarray(rows, dtype=np.int64))
        for layer in layers:
            for cache, pool in ((k_cache[layer], self.k[layer]), (v_cache[layer], self.v[layer])):
                if pool is None:
                    raise ValueError(f"layer {layer} has no prefix-cache pool")
                crow = pos % cache.shape[0]
                for (c, axis), (p, _) in zip(_parts(cp, cache, self.q8), _parts(cp, pool, self.q8)):
                    if axis == 0:
                        if to_pool:
                            p[at] = c[crow]
                        else:
                            c[crow] = p[at]
                    elif to_pool:
                        p[:, at] = c[:, crow]
                    else:
                        c[:, crow] = p[:, at]
