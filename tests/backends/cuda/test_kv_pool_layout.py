"""The device pool's copies (backends/cuda/kv_pool.py) over NumPy arrays standing in for CuPy's (the same indexing):
the rows of an fp16 cache and of an 8-bit one (codes [rows, Hkv, Dh], then scales [Hkv, rows, Dh/32]) go to the
pool and back bit for bit, at each position's row (a ring's: p mod its rows), and nothing else is written. No GPU
needed; test_gpu_kv_pool.py runs the same on the device."""

from __future__ import annotations

import numpy as np
import pytest

from llamacli.backends.cuda.kv import KVCache
from llamacli.backends.cuda.kv_pool import KVPool
from llamacli.ggufio.file import open_gguf
from llamacli.models.config import ModelConfig


def parts(buf: np.ndarray, q8: bool) -> list[np.ndarray]:
    """Rows on axis 0: [fp16 bits] or [codes, scales]."""
    if not q8:
        return [buf.view(np.uint16)]
    rows, hkv, w = buf.shape
    dh = w * 16 // 17
    flat = buf.reshape(-1)
    n = rows * hkv * dh
    return [flat[:n].reshape(rows, hkv, dh), flat[n:].view(np.uint16).reshape(hkv, rows, dh // 32).transpose(1, 0, 2)]


@pytest.mark.parametrize("q8", [False, True], ids=["f16", "q8_0"])
@pytest.mark.parametrize("shape", ["small-llama", "tiny-gemma3"])
def test_rows_go_to_the_pool_and_back(random_model, shape, q8):
    g = open_gguf(random_model(shape, "F32"))
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    src, dst = KVCache(np, cfg, 1024, q8), KVCache(np, cfg, 1024, q8)  # gemma3: rings of 640 rows
    rng = np.random.default_rng(0)
    for x in (*src.k_cache, *src.v_cache, *dst.k_cache, *dst.v_cache):
        raw = x.view(np.uint8)
        raw[...] = rng.integers(0, 256, size=raw.shape)
    before = [x.copy() for x in (*dst.k_cache, *dst.v_cache)]
    pool = KVPool(np, src, 96)
    positions = np.arange(700, 748, dtype=np.int64)
    rows = rng.permutation(96)[:48].astype(np.int64)
    pool.copy((src.k_cache, src.v_cache), range(cfg.n_layer), positions, rows, True)
    pool.copy((dst.k_cache, dst.v_cache), range(cfg.n_layer), positions, rows, False)
    for s, d, b in zip((*src.k_cache, *src.v_cache), (*dst.k_cache, *dst.v_cache), before):
        at = positions % s.shape[0]
        untouched = np.setdiff1d(np.arange(s.shape[0]), at)
        for sp, dp, bp in zip(parts(s, q8), parts(d, q8), parts(b, q8)):
            np.testing.assert_array_equal(dp[at], sp[at])
            np.testing.assert_array_equal(dp[untouched], bp[untouched])
    per_head = cfg.head_dim + cfg.head_dim // 16 if q8 else 2 * cfg.head_dim
    assert KVPool.row_bytes(src) == 2 * cfg.n_layer * cfg.n_head_kv * per_head
