"""What the CUDA GPU tests compare with (imported by the test_gpu_* modules beside it): closeness of a result to its
reference, elementwise (atol + rtol * |ref|) and as one relative L2 error, and the whole-model check of an
architecture that runs op by op (the hybrids, Gemma 4) against the NumPy backend."""

from __future__ import annotations

import numpy as np


def assert_close(got, ref, atol, rtol, what=""):
    """Every value of `got` finite and within atol + rtol * |ref| of `ref` (float64; the same shape)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isfinite(got).all(), f"{what}: {int((~np.isfinite(got)).sum())} non-finite (unwritten?) values"
    err = np.abs(got - ref)
    bad = err > atol + rtol * np.abs(ref)
    assert not bad.any(), f"{what}: {int(bad.sum())}/{bad.size} beyond atol+rtol*|ref|, max err {err.max():.3g}"


def rel_l2(a, b) -> float:
    """|a - b| / |b| over all values (float64)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check_logits_and_greedy_ids(cfg, ref, be, steps: int = 32) -> None:
    """A model that runs op by op on CUDA (`be`, loaded) against the NumPy backend (`ref`, the same file): every
    position's logits of a 13-token prompt (block.run) within 1e-2 (relative L2: the last row, and all), and `steps`
    greedy ids through the step contract equal (the decode op by op, the argmax on the host)."""
    from llamacli.backends.step import Sampler, SeqStep
    from llamacli.models.block import run as forward
    from llamacli.sampling.sampling import SamplingParams, make_rng

    assert be.op_path and be.prefill_graph_lengths == frozenset()
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, size=13)
    want = ref.to_host(forward(ref, cfg, ref.token_ids(prompt), ref.positions(0, 13), True))
    got = be.to_host(forward(be, cfg, be.token_ids(prompt), be.positions(0, 13), True))
    assert np.isfinite(got).all()
    assert rel_l2(got[-1], want[-1]) <= 1e-2 and rel_l2(got, want) <= 1e-2

    def ids(backend) -> list[int]:
        s = Sampler(SamplingParams(temperature=0.0), make_rng(0), [])
        out = [backend.step([SeqStep(prompt.tolist(), 0, s)])[0].id]
        for i in range(steps - 1):
            out.append(backend.step([SeqStep([out[-1]], 13 + i, s)])[0].id)
        return out

    assert ids(be) == ids(ref)
