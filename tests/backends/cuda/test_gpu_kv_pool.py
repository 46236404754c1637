"""The prefix cache's pool on the device (backends/cuda/kv_pool.py): rows copied between a slot's KV cache and
the pool come back bit for bit, at each position's row (a ring's: p mod its rows), fp16 and 8-bit caches
alike, and nothing else is written; and a prompt whose prefix the cache gives gets the ids it gets prefilled
whole. Needs a GPU (marker gpu)."""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from llamacli.backends.cuda import cuda_available  # noqa: E402
from llamacli.backends.cuda.kv import KVCache  # noqa: E402
from llamacli.backends.cuda.kv_pool import KVPool  # noqa: E402
from llamacli.engine.generate import Completion, Model  # noqa: E402
from llamacli.ggufio.file import open_gguf  # noqa: E402
from llamacli.models.config import ModelConfig  # noqa: E402

_ok, _why = cuda_available()
if not _ok:
    pytest.skip(_why, allow_module_level=True)
pytestmark = pytest.mark.gpu


def config(path) -> ModelConfig:
    g = open_gguf(path)
    return ModelConfig.from_gguf(g.metadata, set(g.tensors))


def rows_of(buf, q8: bool) -> list[np.ndarray]:
    """A cache or pool array on the host as arrays whose axis 0 is the row: [fp16 rows] or [codes, scales]."""
    if not q8:
        return [buf.get().view(np.uint16)]  # (bits: random bytes make NaNs)
    rows, hkv, w = buf.shape
    dh = w * 16 // 17
    b = buf.get().reshape(-1)
    n = rows * hkv * dh
    return [b[:n].view(np.int8).reshape(rows, hkv, dh),
            b[n : n + 2 * hkv * rows * (dh // 32)].view(np.uint16).reshape(hkv, rows, dh // 32).transpose(1, 0, 2)]


def fill(kv: KVCache, seed: int) -> None:
    """Random bytes in every K and V array (any bit pattern: the copies move bytes)."""
    rng = cp.random.RandomState(seed)
    for x in (*kv.k_cache, *kv.v_cache):
        raw = x.view(cp.uint8)
        raw[...] = rng.randint(0, 256, size=raw.shape, dtype=cp.int64).astype(cp.uint8)


@pytest.mark.parametrize("q8", [False, True], ids=["f16", "q8_0"])
@pytest.mark.parametrize("shape", ["small-llama", "tiny-gemma3"])
def test_rows_go_to_the_pool_and_back_bit_for_bit(random_model, shape, q8):
    cfg = config(random_model(shape, "Q8_0"))
    ctx = 1024  # tiny-gemma3: rings of 640 rows (704 with q8_0's rounding) beside full layers
    src, dst = KVCache(cp, cfg, ctx, q8), KVCache(cp, cfg, ctx, q8)
    fill(src, 1)
    fill(dst, 2)
    before = [[p.copy() for p in rows_of(x, q8)] for x in (*dst.k_cache, *dst.v_cache)]
    pool = KVPool(cp, src, 96)
    layers = list(range(cfg.n_layer))
    positions = np.arange(700, 748, dtype=np.int64)  # past a ring's end: rows p mod 640 (or 704)
    rows = np.random.default_rng(3).permutation(96)[:48].astype(np.int64)
    pool.copy((src.k_cache, src.v_cache), layers, positions, rows, True)
    pool.copy((dst.k_cache, dst.v_cache), layers, positions, rows, False)
    cp.cuda.get_current_stream().synchronize()
    for i, (s, d) in enumerate(zip((*src.k_cache, *src.v_cache), (*dst.k_cache, *dst.v_cache))):
        at = positions % s.shape[0]
        untouched = np.setdiff1d(np.arange(s.shape[0]), at)
        for sp, dp, bp in zip(rows_of(s, q8), rows_of(d, q8), before[i]):
            np.testing.assert_array_equal(dp[at], sp[at])
            np.testing.assert_array_equal(dp[untouched], bp[untouched])
    per_head = cfg.head_dim + cfg.head_dim // 16 if q8 else 2 * cfg.head_dim  # bytes: codes and scales, or fp16
    assert KVPool.row_bytes(src) == 2 * cfg.n_layer * cfg.n_head_kv * per_head


def greedy(model, prompt, n=8) -> Completion:
    c = Completion()
    for _ in model.run(prompt, completion=c, max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2):
        pass
    return c


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
@pytest.mark.parametrize("shape", ["small-llama", "tiny-gemma3"])
def test_a_prompt_from_the_prefix_cache_gets_the_ids_of_a_whole_prefill(random_model, shape, cache):
    """One slot: A (a 700-id prefix and a question), then X (the slot moves on), then B (the same prefix, another
    question): B's prefix comes from the pool (on gemma3's rings, the window before it), and B's greedy ids are
    those of B prefilled whole, its logprobs within fp16's rounding."""
    path = random_model(shape, "Q4_K_M")
    types = (cache, cache)
    m = Model(path, backend="cuda", ctx=1024, cache_types=types)
    ref = Model(path, backend="cuda", ctx=1024, cache_types=types)
    try:
        m.enable_prefix_cache(64 << 20)
        rng = np.random.default_rng(5)
        vocab = m.cfg.vocab_size
        prefix = rng.integers(10, vocab - 10, size=700).tolist()
        greedy(m, prefix + rng.integers(10, vocab - 10, size=20).tolist())
        greedy(m, rng.integers(10, vocab - 10, size=5).tolist())
        b = prefix + rng.integers(10, vocab - 10, size=20).tolist()
        got = greedy(m, b)
        assert got.timings.prefix_cached_tokens == 688
        ref.seq.clear()
        want = greedy(ref, b)
        assert got.tokens == want.tokens
        for x, y in zip(got.logprobs, want.logprobs):
            assert abs(x["logprob"] - y["logprob"]) <= 2e-2
    finally:
        m.close()
        ref.close()


@pytest.mark.parametrize("shape", ["small-llama", "tiny-gemma3"])
def test_a_prefix_computed_in_one_slot_serves_another(random_model, shape):
    """Two cache slots under the scheduler: a request held in slot 0 stored the 700-id prefix; a request in slot 1
    copies it from the pool (a device-to-device copy into another slot's arrays) and gets the ids of its prompt
    prefilled whole."""
    from llamacli.engine.scheduler import Scheduler

    path = random_model(shape, "Q4_K_M")
    m = Model(path, backend="cuda", ctx=1024, slots=2)
    ref = Model(path, backend="cuda", ctx=1024)
    sched = None
    try:
        m.enable_prefix_cache(64 << 20)
        sched = Scheduler(m)
        rng = np.random.default_rng(6)
        vocab = m.cfg.vocab_size
        prefix = rng.integers(10, vocab - 10, size=700).tolist()
        held = m.run(prefix + rng.integers(10, vocab - 10, size=20).tolist(), completion=Completion(),
                     max_tokens=50, temperature=0.0, ignore_eos=True, scheduler=sched)
        next(held)  # slot 0 kept: its consumer reads no further
        b = prefix + rng.integers(10, vocab - 10, size=20).tolist()
        got = Completion()
        for _ in m.run(b, completion=got, max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2,
                       scheduler=sched):
            pass
        assert got.timings.prefix_cached_tokens == 688
        want = greedy(ref, b)
        assert got.tokens == want.tokens
        for x, y in zip(got.logprobs, want.logprobs):
            assert abs(x["logprob"] - y["logprob"]) <= 2e-2
        held.close()
    finally:
        if sched is not None:
            sched.close()
        m.close()
        ref.close()
