"""The KV cache on the device: one K and one V array per layer, and the launchers that write and convert it.

Each layer's arrays have cfg.cache_rows(ctx) rows (ctx, or a sliding-window layer's ring: models/kv_cache.py; none
on a shared-KV layer, gemma4's, which reads its source layer's) and the layer's own Hkv and Dh (the config's, but on
gemma4, whose sliding and global layers differ: the writers and readers take them from the array, `heads`), and every
kernel takes them with its row count (the ring, kc.shape[0]): fp16 [rows, Hkv, Dh]; or (-ctk/-ctv
q8_0) one byte buffer [rows, Hkv, Dh + Dh/16] per cache, rows rounded up to 64, holding int8 codes [rows, Hkv,
Dh] and then fp16 scales [Hkv, rows, Dh/32] (kernels/attention_split.cu), with an fp16 [rows, Hkv, Dh] pair of
the largest rows (`pair`) that the prefill's writers and readers take instead (readable).

Cache slots (Backend.set_slots): each slot holds one sequence's arrays, alike; `use(slot)` makes a slot's the
ones k_cache / v_cache name (what the prefill pass, the decode step and the op-by-op path read and write), and
`tables(layer)` gives the device addresses of every slot's arrays of a layer, by which the batched step's
kernels (kernels/rope.cu rope_store_pfb_*, kernels/attention_simt.cu attention_batch_*) reach each sequence's own cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import DeviceMemoryError
from ...models.config import ModelConfig
from ...units import human_bytes
from . import loader as K


class KVCache:
    def __init__(self, cp: Any, cfg: ModelConfig, ctx: int, q8: bool):
        self.cp, self.cfg = cp, cfg
        # each layer's own KV heads and head dim (gemma4's sliding and global layers differ; every other model's
        # are the config's); a shared-KV layer has 0 rows (cache_rows): it reads its source layer's arrays
        heads = [(cfg.layer_kv_heads(i), cfg.layer_head_dim(i)) for i in range(cfg.n_layer)]
        rows = [-(-n // 64) * 64 for n in cfg.cache_rows(ctx)] if q8 else cfg.cache_rows(ctx)
        shapes = [(hkv, dh + dh // 16) if q8 else (hkv, dh) for hkv, dh in heads]
        self.q8 = q8
        self._layout = (rows, shapes, cp.uint8 if q8 else cp.float16)
        self.slot_caches = [self._allocate()]  # per slot: (K arrays, V arrays), one of each per layer
        self.slot = 0
        self.k_cache, self.v_cache = self.slot_caches[0]
        self.pair = None
        if q8 and len(set(heads)) == 1:  # one shape (the layers' own, which may not be the config's): its largest rows
            self.pair = tuple(cp.zeros((max(rows), *heads[0]), cp.float16) for _ in "kv")
        elif q8:  # (gemma4) as many values as the largest layer's rows, viewed in each layer's shape (pair_view)
            most = max(n * hkv * dh for n, (hkv, dh) in zip(rows, heads))
            self.pair = tuple(cp.zeros(most, cp.float16) for _ in "kv")
        self._tables: list[tuple[Any, Any]] | None = None

    def _allocate(self) -> tuple[list[Any], list[Any]]:
        rows, shapes, dtype = self._layout
        k = [self.cp.zeros((n, *shape), dtype=dtype) for n, shape in zip(rows, shapes)]
        return k, [self.cp.zeros_like(x) for x in k]

    @staticmethod
    def heads(kc: Any) -> tuple[int, int]:
        """(KV heads, head dim) of a layer's cache array: [rows, Hkv, Dh] fp16, or an 8-bit cache's bytes
        [rows, Hkv, Dh + Dh/16]."""
        width = kc.shape[2]
        return kc.shape[1], width if kc.dtype.itemsize == 2 else width * 16 // 17

    def pair_view(self, j: int, ring: int, hkv: int, dh: int) -> Any:
        """The fp16 pair's K (j 0) or V (j 1) as [ring, hkv, dh] (an 8-bit cache's readable form of one layer)."""
        x = self.pair[j]
        if x.ndim == 3:  # one shape for every layer: as it was made
            return x[:ring]
        return x[: ring * hkv * dh].reshape(ring, hkv, dh)

    @property
    def slot_bytes(self) -> int:
        """Device bytes of one slot's K and V arrays."""
        k, v = self.slot_caches[0]
        return sum(int(x.nbytes) for x in k + v)

    def set_slots(self, n: int, keep: int = 0) -> None:
        """Hold n slots: slot 0's arrays (and the first n of those held) stay, the others are allocated, zeroed,
        after checking that the GPU's free memory holds them and `keep` bytes more, or dropped. Slot 0 is the
        current one after."""
        more = n - len(self.slot_caches)
        if more > 0:
            free = self.cp.cuda.runtime.memGetInfo()[0] + self.cp.get_default_memory_pool().free_bytes()
            need = more * self.slot_bytes
            if need > free - keep:
                raise DeviceMemoryError(f"the KV caches of {n} sequences need {human_bytes(need)} more GPU memory "
                                        f"and the steps {human_bytes(keep)}, {human_bytes(free)} is free: run fewer "
                                        f"at once (--parallel) or a shorter context (-c)")
        held = len(self.slot_caches)
        try:
            while len(self.slot_caches) < n:
                self.slot_caches.append(self._allocate())
        except self.cp.cuda.memory.OutOfMemoryError:  # (the pool's free blocks counted above may not serve)
            del self.slot_caches[held:]
            raise DeviceMemoryError(f"the KV caches of {n} sequences do not fit in the GPU's free memory: run fewer "
                                    f"at once (--parallel) or a shorter context (-c)") from None
        del self.slot_caches[n:]
        self._tables = None
        self.use(0)
        self.tables(0)  # (made now: not inside a step's memory pool)

    def use(self, slot: int) -> None:
        """Make slot `slot`'s arrays the current cache (k_cache, v_cache)."""
        self.slot = slot
        self.k_cache, self.v_cache = self.slot_caches[slot]

    def tables(self, layer: int) -> tuple[Any, Any]:
        """uint64 [slots] device arrays: the address of each slot's K (and V) array of `layer`."""
        if self._tables is None:
            u64 = np.uint64
            self._tables = [tuple(self.cp.asarray(np.asarray([c[j][i].data.ptr for c in self.slot_caches], u64))
                                  for j in (0, 1)) for i in range(len(self.k_cache))]  # type: ignore[misc]
        return self._tables[layer]

    def rope_store_caches(self, layer: int) -> tuple[Any, Any]:
        """The K and V arrays the fp16 writers (rope_store*, which also leave the rotated K and V in f32 in their
        qkv rows) write into: the layer's cache, or an 8-bit cache's fp16 pair (scratch: readable overwrites
        it), the 8-bit cache then filled from those rows by store_q8."""
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        if kc.dtype != self.cp.uint8:
            return kc, vc
        return self.pair[0][: kc.shape[0]], self.pair[1][: kc.shape[0]]

    def store(self, kc: Any, vc: Any, k_ptr: int, v_ptr: int, stride: int, pos: Any, t: int) -> None:
        """K and V rows (f32, `stride` floats apart a token) of the t positions `pos` into a layer's cache:
        kv_store (fp16) or kv_store_q8 (an 8-bit cache: a warp per 32-value block, a thread per value)."""
        q8 = kc.dtype == self.cp.uint8
        hkv, dh = self.heads(kc)  # (the layer's own: the config's but on gemma4)
        n = t * hkv * dh * (2 if q8 else 1)  # threads
        K.launch("attention_simt", "kv_store_q8" if q8 else "kv_store", (min(K.cdiv(n, 256), 4096),), (256,), k=k_ptr,
                 k_stride=stride, v=v_ptr, v_stride=stride, T=t, Hkv=hkv, Dh=dh, pos=pos, kc=kc, vc=vc,
                 ring=kc.shape[0])

    def store_q8(self, layer: int, qkv: Any, stride: int, pos: Any, t: int) -> None:
        """An 8-bit cache's rows of the t positions `pos` from the rotated K and V in qkv's rows (`stride` floats
        apart: [q | K | V] as the QKV matvec or GEMM writes them); nothing for an fp16 cache."""
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        if kc.dtype != self.cp.uint8:
            return
        q_dim, kv_dim = self.cfg.q_dim, self.cfg.kv_dim
        self.store(kc, vc, qkv.data.ptr + 4 * q_dim, qkv.data.ptr + 4 * (q_dim + kv_dim), stride, pos, t)

    def readable(self, kc: Any, vc: Any, pos: Any, t: int) -> tuple[Any, Any]:
        """A layer's cache as the fp16 readers take it: itself, or (an 8-bit cache) its rows up to the highest of
        the t positions `pos` converted into the fp16 pair (kv_dequant_q8). attention_split reads the 8-bit cache
        itself (its _q8 forms): decode, where the bytes read are the cost; a prefill chunk's attention does far
        more work per key than the conversion."""
        if kc.dtype != self.cp.uint8:
            return kc, vc
        (hkv, dh), ring = self.heads(kc), kc.shape[0]
        k16, v16 = (self.pair_view(j, ring, hkv, dh) for j in (0, 1))
        K.launch("attention_simt", "kv_dequant_q8", (min(K.cdiv(ring * hkv * dh // 8, 256), 2048),), (256,), kc=kc,
                 vc=vc, ring=ring, Hkv=hkv, Dh=dh, pos=pos, T=t, k16=k16, v16=v16)
        return k16, v16
