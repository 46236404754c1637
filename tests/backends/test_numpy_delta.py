"""The gated delta rule's two NumPy forms (llamacli/backends/numpy_delta.py): the chunked form equals the token-by-token
recurrence from any state, at chunk lengths that are odd, one, or more than the chunk; chained chunks equal one
recurrence; and both equal the rule written out by hand on a two-token case. Tolerance: float32, atol 1e-5 +
rtol 1e-4 * |ref|."""

from __future__ import annotations

import numpy as np
import pytest

from llamacli.backends.numpy_delta import CHUNK, chunked, recurrent


def inputs(h: int, t: int, dk: int, dv: int, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((h, t, dk)).astype(np.float32)
    k = rng.standard_normal((h, t, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # L2-normalised as the layer feeds them
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    v = rng.standard_normal((h, t, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 3.0, (h, t)).astype(np.float32)  # log decays, some near 0 (no forgetting), some strong
    beta = rng.uniform(0.0, 1.0, (h, t)).astype(np.float32)
    s = rng.standard_normal((h, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, s


def near(a: np.ndarray, b: np.ndarray) -> None:
    assert np.all(np.abs(a - b) <= 1e-5 + 1e-4 * np.abs(b)), float(np.abs(a - b).max())


@pytest.mark.parametrize("t", [1, 2, 7, CHUNK - 1, CHUNK, CHUNK + 1, 130])
def test_chunked_equals_the_recurrence(t):
    q, k, v, g, beta, s = inputs(3, t, 16, 8, seed=t)
    o_ref, s_ref = recurrent(q, k, v, g, beta, s)
    o, end = chunked(q, k, v, g, beta, s)
    near(o, o_ref)
    near(end, s_ref)


def test_chunks_chain_through_the_state():
    q, k, v, g, beta, s = inputs(2, 150, 8, 8, seed=1)
    o_ref, s_ref = recurrent(q, k, v, g, beta, s)
    parts, state = [], s
    for c0, c1 in ((0, 64), (64, 128), (128, 150)):
        o, state = chunked(q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], g[:, c0:c1], beta[:, c0:c1], state)
        parts.append(o)
    near(np.concatenate(parts, axis=1), o_ref)
    near(state, s_ref)


def test_the_rule_by_hand():
    """One head, d_k = d_v = 2: S0 = 0; token 1 writes beta1 k1 v1^T; token 2 decays it, corrects toward v2."""
    k = np.array([[[1.0, 0.0], [0.6, 0.8]]], np.float32)
    q = np.array([[[0.0, 1.0], [1.0, 0.0]]], np.float32)
    v = np.array([[[2.0, -1.0], [1.0, 1.0]]], np.float32)
    g = np.log(np.array([[1.0, 0.5]], np.float32))
    beta = np.array([[0.5, 1.0]], np.float32)
    s1 = 0.5 * np.outer(k[0, 0], v[0, 0])
    s1d = 0.5 * s1
    s2 = s1d + np.outer(k[0, 1], 1.0 * (v[0, 1] - s1d.T @ k[0, 1]))
    want = np.stack([s1.T @ q[0, 0], s2.T @ q[0, 1]])[None]
    for form in (recurrent, chunked):
        o, end = form(q, k, v, g, beta, np.zeros((1, 2, 2), np.float32))
        near(o, want)
        near(end, s2[None])


def test_a_strong_decay_does_not_overflow():
    """Log decays summing to -1e4 over a chunk: the chunked form forms only ratios <= 1 (no inf or NaN)."""
    q, k, v, g, beta, s = inputs(1, CHUNK, 4, 4, seed=3)
    g[:] = -200.0
    o, end = chunked(q, k, v, g, beta, s)
    o_ref, s_ref = recurrent(q, k, v, g, beta, s)
    assert np.isfinite(o).all() and np.isfinite(end).all()
    near(o, o_ref)
    near(end, s_ref)
