"""The KV cache types (-ctk / -ctv): names, sizes, the q8_0 rounding against our own float64 rendering of
ggml's quantize_row_q8_0_ref, and a q8_0 cache in the NumPy backend's forward pass."""

from __future__ import annotations

import numpy as np
import pytest

from clirun import run
from llamacli.engine.generate import Model
from llamacli.errors import UsageError
from llamacli.models.block import run as forward
from llamacli.models.kv_cache import cache_row_bytes, check_cache_types, parse_cache_type, q8_0_roundtrip


def q8_0_ref(x: np.ndarray) -> np.ndarray:
    """ggml's Q8_0 reference rounding, block by block in float64: d = max|x| / 127 (float32), codes
    round-half-away(x / d), the scale stored as fp16; what a cache read returns: code x fp16(d)."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    out = np.empty(blocks.shape, np.float64)
    for i, b in enumerate(blocks):
        d = np.float32(np.abs(b).max() / np.float32(127.0))
        inv = np.float32(1.0) / d if d else np.float32(0.0)
        v = b * inv
        codes = np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)
        out[i] = codes * np.float64(np.float16(d))
    return out.reshape(x.shape)


def test_cache_type_names_and_sizes() -> None:
    assert parse_cache_type("F16", "-ctk") == "f16" and parse_cache_type("q8_0", "-ctv") == "q8_0"
    for bad in ("q4_0", "fp16", "", None, 8):
        with pytest.raises(UsageError, match="unsupported KV cache type"):
            parse_cache_type(bad, "--cache-type-k")
    assert cache_row_bytes("f16", 128) == 256 and cache_row_bytes("q8_0", 128) == 136
    check_cache_types(64, ("q8_0", "f16"))
    with pytest.raises(UsageError, match="multiple of 32"):
        check_cache_types(80, ("f16", "q8_0"))


def test_q8_0_roundtrip_matches_ggml_rounding() -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((7, 3, 64)) * rng.uniform(0.01, 300, size=(7, 3, 1))).astype(np.float32)
    x[0, 0, :32] = 0.0  # an all-zero block (d = 0)
    x[1, 2, :32] = 0.5 * (np.arange(32) - 15)  # d = 127 / 127 = 1: exact ties x.5, rounded away from zero
    x[1, 2, 31] = 127.0
    got = q8_0_roundtrip(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got, q8_0_ref(x).astype(np.float32))
    assert not got[0, 0, :32].any()
    np.testing.assert_array_equal(got[1, 2, 12:19], [-2.0, -1.0, -1.0, 0.0, 1.0, 1.0, 2.0])  # -1.5 .. 1.5
    # within half a step of each block: |err| <= d / 2 (plus the fp16 rounding of d)
    d = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
    assert (np.abs(got - x).reshape(-1, 32) <= d * 0.5 + d * 127 * 2.0**-11 + 1e-12).all()
    bad = x.copy()
    bad[2, 1, 40] = np.inf
    out = q8_0_roundtrip(bad)
    assert np.isnan(out[2, 1, 32:]).all() and np.isfinite(out[2, 1, :32]).all()


def test_numpy_forward_with_a_q8_0_cache(random_model) -> None:
    """The NumPy backend's q8_0 cache holds exactly the rounded rows (layer 0, whose K/V do not depend on the
    cache), and the logits stay close to the f16 cache's without equalling them."""
    path = random_model("small-llama", "Q8_0")
    ids = np.arange(3, 40) % 200
    out = {}
    for types in (("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "f16")):
        m = Model(path, backend="numpy", ctx=64, cache_types=types)
        be = m.backend
        logits = be.to_host(forward(be, m.cfg, be.token_ids(ids), be.positions(0, len(ids))))[-1]
        out[types] = (logits, be.k_cache[0][: len(ids)].copy(), be.v_cache[0][: len(ids)].copy())
    f16, q8, k8 = out[("f16", "f16")], out[("q8_0", "q8_0")], out[("q8_0", "f16")]
    np.testing.assert_array_equal(q8[1], q8_0_roundtrip(f16[1]))
    np.testing.assert_array_equal(q8[2], q8_0_roundtrip(f16[2]))
    np.testing.assert_array_equal(k8[2], f16[2])  # V stays f16 there
    rel = np.linalg.norm(q8[0] - f16[0]) / np.linalg.norm(f16[0])
    assert 0 < rel < 0.05, rel


def test_cli_cache_types(random_model) -> None:
    path = str(random_model("small-llama", "Q8_0"))
    r = run("generate", "-m", path, "--backend", "numpy", "-p", "hello", "-n", "4", "--greedy", "-ctk", "q8_0",
            "-ctv", "q8_0", "-q")
    assert r.code == 0, r.err
    base = run("generate", "-m", path, "--backend", "numpy", "-p", "hello", "-n", "4", "--greedy", "-q")
    assert base.code == 0 and r.out and base.out
    r = run("generate", "-m", path, "--backend", "numpy", "-p", "hi", "--cache-type-k", "q4_0")
    assert r.code == 2 and r.one_line_error().startswith("error: --cache-type-k: unsupported KV cache type 'q4_0'")
    tiny = str(random_model("tiny-llama", "F32"))  # head dim 16
    r = run("bench", "-m", tiny, "--backend", "numpy", "-p", "8", "-n", "2", "-r", "1", "-ctv", "q8_0")
    assert r.code == 2 and "multiple of 32" in r.one_line_error()


# -- sliding-window rings ----------------------------------------------------------------------------------


def test_ring_rows_hold_the_window_and_a_chunk():
    from llamacli.models.kv_cache import RING_ALIGN, RING_CHUNK, ring_rows, ring_span

    assert ring_rows(0, 4096) == 4096  # a global layer: a row per position
    assert ring_rows(512, 32768) == 1024  # Gemma 3: window 512 + a 512-token chunk - 1, to 128
    assert ring_rows(4096, 8192) == 4608 and ring_rows(128, 131072) == 640 and ring_rows(1024, 131072) == 1536
    assert ring_rows(512, 700) == 700  # no smaller than the context: the whole context
    for w in (1, 7, 127, 128, 129, 500, 4096):
        rows = ring_rows(w, 1 << 20)
        assert rows % RING_ALIGN == 0 and w + RING_CHUNK - 1 <= rows < w + RING_CHUNK - 1 + RING_ALIGN
        assert ring_span(w, rows, 1 << 20) >= RING_CHUNK
    assert ring_span(512, 4096, 4096) == 4096  # a full cache takes any chunk


def test_ring_keeps_only_prefixes_whose_window_is_still_held():
    from llamacli.models.kv_cache import ring_keeps

    layers = [(0, 2048), (8, 128)]  # a global layer and a window-8 ring of 128 rows (ctx 2048)
    assert ring_keeps(0, 5000, layers, 2048)  # nothing to keep
    assert ring_keeps(100, 120, layers, 2048)  # positions 93..99 not yet overwritten (that needs 221..227)
    # keep 100 needs keys 93..99: position 221 wrote 93's row
    assert ring_keeps(100, 220, layers, 2048) and not ring_keeps(100, 221, layers, 2048)
    assert ring_keeps(5, 127, layers, 2048) and not ring_keeps(5, 128, layers, 2048)  # keys 0..4: 128 wrote 0's
    assert ring_keeps(100, 10**6, [(0, 2048), (8, 2048)], 2048)  # no ring: a full cache keeps everything


def test_kv_cache_bytes_count_the_rings():
    from llamacli.backends.memory_fit import largest_ctx
    from llamacli.models.config import ModelConfig
    from llamacli.testing import SHAPES, model_metadata

    cfg = ModelConfig.from_gguf(model_metadata(SHAPES["gemma3-270m"], 262144))
    rows = cfg.cache_rows(32768)
    assert rows == [1024 if plan.window else 32768 for plan in cfg.layers] and rows.count(32768) == 3
    assert cfg.kv_cache_bytes(32768) == (3 * 32768 + 15 * 1024) * 2 * 256 * 2  # 116 MB, not 18 layers' 604 MB
    assert cfg.kv_cache_bytes(1000) == 18 * 1000 * 1024  # below the ring size every layer holds every position
    room = cfg.kv_cache_bytes(20480)
    assert largest_ctx(cfg, room) == 20480 and largest_ctx(cfg, room - 1) == 20480 - 256


def _ring_model(path, monkeypatch, ring: bool, ctx: int = 512) -> Model:
    """The NumPy backend with rings of 128 rows on window-8 layers (a 16-token chunk instead of 512), or
    (ring False) a row per position on every layer."""
    from llamacli.models import config, kv_cache

    monkeypatch.setattr(kv_cache, "RING_CHUNK", 16)
    if not ring:
        monkeypatch.setattr(config, "ring_rows", lambda window, ctx: ctx)
    m = Model(path, backend="numpy", ctx=ctx)
    monkeypatch.undo()
    return m


@pytest.mark.parametrize("shape", ["tiny-gemma3", "tiny-gemma2", "tiny-gpt-oss"])
def test_numpy_rings_give_the_full_cache_logits(random_model, monkeypatch, shape):
    """A 300-token prompt in one pass (into the 128-row rings in passes of 121: kv_cache.ring_span), then 40
    decode steps past the ring's wrap: the logits of every step as with a row per position (the same keys,
    another grouping of query rows: float32 rounding only)."""
    path = random_model(shape, "F32")
    ids = np.random.default_rng(3).integers(0, 200, size=340)
    out = {}
    for ring in (True, False):
        m = _ring_model(path, monkeypatch, ring)
        be, cfg = m.backend, m.cfg
        assert {k.shape[0] for k, p in zip(be.k_cache, cfg.layers) if p.window} == {128 if ring else 512}
        steps = [be.to_host(forward(be, cfg, be.token_ids(ids[:300]), be.positions(0, 300)))[-1]]
        for i in range(300, 340):
            steps.append(be.to_host(forward(be, cfg, be.token_ids(ids[i : i + 1]), be.positions(i, 1)))[-1])
        out[ring] = np.array(steps)
    np.testing.assert_allclose(out[True], out[False], rtol=0, atol=1e-5 * float(np.abs(out[False]).max()))


def test_generate_reuses_a_prefix_only_while_the_rings_hold_it(random_model, monkeypatch):
    """Model.run keeps the longest common prefix of the cache unless a ring has overwritten the window before
    it (kv_cache.ring_keeps): then the prompt is prefilled whole. Either way the top-5 logprobs of every step
    are a fresh model's; keeping the prefix regardless gives others (the check that the fallback matters)."""
    from llamacli.models import seq_cache

    path = random_model("tiny-gemma3", "F32")
    rng = np.random.default_rng(11)
    a = [int(x) for x in rng.integers(3, 200, size=300)]
    b = a[:100] + [int(x) for x in rng.integers(3, 200, size=20)]
    def top(c):
        return [[x["logprob"] for x in e["top_logprobs"]] for e in c.logprobs]

    fresh = _ring_model(path, monkeypatch, True).complete(b, max_tokens=6, temperature=0, logprobs=5)
    want = top(fresh)

    m = _ring_model(path, monkeypatch, True)
    m.complete(a[:60], max_tokens=4, temperature=0)
    c = m.complete(b, max_tokens=6, temperature=0, logprobs=5)  # positions 0..63 written: 0..59 still held
    assert c.timings.prompt_tokens == len(b) - 60
    assert c.tokens == fresh.tokens
    np.testing.assert_allclose(top(c), want, rtol=0, atol=1e-4)
    m.complete(a, max_tokens=4, temperature=0)  # reuses 100, writes up to 303: keys 93..99 overwritten
    c = m.complete(b, max_tokens=6, temperature=0, logprobs=5)
    assert c.timings.prompt_tokens == len(b)  # prefilled whole
    np.testing.assert_allclose(top(c), want, rtol=0, atol=1e-4)

    monkeypatch.setattr(seq_cache, "ring_keeps", lambda *a: True)
    m.complete(a, max_tokens=4, temperature=0)
    c = m.complete(b, max_tokens=6, temperature=0, logprobs=5)
    assert c.timings.prompt_tokens == len(b) - 100
    assert not np.allclose(top(c), want, rtol=0, atol=1e-4)


def test_generate_reuses_a_prefix_after_the_ring_wrapped_and_swa_full_keeps_all(random_model, monkeypatch):
    """A chat's common case: the cache holds 300 + 4 positions (the 128-row rings wrapped twice) and the next
    prompt extends them: only the new tokens are prefilled, with the logprobs of a fresh model. --swa-full
    (Model(swa_full=True)) keeps a row per position on the window layers, so a prefix that departs far back
    is still reused there, where the rings prefill the prompt whole."""
    path = random_model("tiny-gemma3", "F32")
    rng = np.random.default_rng(12)
    a = [int(x) for x in rng.integers(3, 200, size=300)]

    def top(c):
        return [[x["logprob"] for x in e["top_logprobs"]] for e in c.logprobs]

    m = _ring_model(path, monkeypatch, True)
    first = m.complete(a, max_tokens=4, temperature=0)
    b = a + first.tokens + [int(x) for x in rng.integers(3, 200, size=9)]
    held = len(m.seq)
    assert held > 2 * 128 and b[:held] == m.seq.ids
    c = m.complete(b, max_tokens=5, temperature=0, logprobs=5)
    assert c.timings.prompt_tokens == len(b) - held
    fresh = _ring_model(path, monkeypatch, True).complete(b, max_tokens=5, temperature=0, logprobs=5)
    np.testing.assert_allclose(top(c), top(fresh), rtol=0, atol=1e-4)

    from llamacli.models import kv_cache

    monkeypatch.setattr(kv_cache, "RING_CHUNK", 16)
    full = Model(path, backend="numpy", ctx=512, swa_full=True)
    monkeypatch.undo()
    assert {k.shape[0] for k in full.backend.k_cache} == {512}
    full.complete(a, max_tokens=4, temperature=0)
    c = full.complete(a[:100] + [5, 6, 7], max_tokens=5, temperature=0, logprobs=5)
    assert c.timings.prompt_tokens == 3  # the rings would have prefilled 103
    np.testing.assert_allclose(top(c), top(_ring_model(path, monkeypatch, True).complete(
        a[:100] + [5, 6, 7], max_tokens=5, temperature=0, logprobs=5)), rtol=0, atol=1e-4)
