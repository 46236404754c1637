"""What the CUDA GPU tests compare with (imported by the test_gpu_* modules beside it): closeness of a result to its
reference, elementwise (atol + rtol * |ref|) and as one relative L2 error, and the whole-model checks of an
architecture that runs op by op (the hybrids, Gemma 4) against the NumPy backend."""

from __future__ import annotations

import numpy as np


def case_id(c) -> str:
    """A parametrized case's id: a shape's name (a string, or a ModelSpec's name) or a weight type's name."""
    return c if isinstance(c, str) else getattr(c, "name", str(c))


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


def check_slots_schedule(cfg, ref, be, snapshots: bool = False) -> None:
    """Three cache slots of `be` and `ref` (loaded from one file): prompts of 5, 40 and 17 tokens in one step, then
    decode steps of all three together (slot 1's sequence leaving after four and a new one taking its slot): each
    sequence's ids, and its logits within 1e-2 (relative L2), are the reference's under the same schedule (and the
    snapshot positions its steps report, with `snapshots`)."""
    from llamacli.backends.step import Sampler, SeqStep
    from llamacli.sampling.sampling import SamplingParams, make_rng

    def greedy() -> Sampler:
        return Sampler(SamplingParams(temperature=0.0), make_rng(0), [], logits=True)

    be.set_slots(3)
    ref.set_slots(3)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (5, 40, 17)]
    seqs = {slot: (p, greedy(), greedy()) for slot, p in enumerate(prompts)}
    pos = {slot: 0 for slot in seqs}
    last: dict[int, list[int]] = {}
    for step in range(10):
        if step == 5:  # slot 1's sequence leaves; a new one takes the slot
            seqs[1] = (rng.integers(0, cfg.vocab_size, size=9).tolist(), greedy(), greedy())
            pos[1] = 0
            last.pop(1)
        batch_be, batch_ref = [], []
        for slot, (prompt, s, r) in seqs.items():
            tokens = prompt if slot not in last else last[slot]
            batch_be.append(SeqStep(tokens, pos[slot], s, slot))
            batch_ref.append(SeqStep(tokens, pos[slot], r, slot))
        got, want = be.step(batch_be), ref.step(batch_ref)
        for seq, g, w in zip(batch_be, got, want):
            assert g.id == w.id and rel_l2(g.logits, w.logits) <= 1e-2
            assert not snapshots or g.snapshots == w.snapshots
            pos[seq.slot] += len(seq.tokens)
            last[seq.slot] = [g.id]
