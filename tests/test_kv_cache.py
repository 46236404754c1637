"""The KV cache types (-ctk / -ctv): names, sizes, the q8_0 rounding against our own float64 rendering of
ggml's quantize_row_q8_0_ref, and a q8_0 cache in the NumPy backend's forward pass."""

from __future__ import annotations

import numpy as np
import pytest

from llamacli.errors import UsageError
from llamacli.generate import Model
from llamacli.kv_cache import cache_row_bytes, check_cache_types, parse_cache_type, q8_0_roundtrip
from llamacli.model import forward

from clirun import run


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
        out[types] = (logits, be.k_cache[0, : len(ids)].copy(), be.v_cache[0, : len(ids)].copy())
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
