"""The batched decode step (backends/cuda/batch.py) against the NumPy reference: sequences in their own cache
slots, of different lengths, joining and leaving, stepped together through Backend.step, each getting the ids
and logits it gets alone. Needs a GPU (marker gpu)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

cp = pytest.importorskip("cupy")

from gpu_checks import case_id, rel_l2  # noqa: E402

from llamacli.backends.base import StepErrors  # noqa: E402
from llamacli.backends.cuda import CudaBackend, cuda_available  # noqa: E402
from llamacli.backends.numpy_backend import NumpyBackend  # noqa: E402
from llamacli.backends.step import Sampler, SeqStep  # noqa: E402
from llamacli.errors import BackendError, DeviceMemoryError  # noqa: E402
from llamacli.ggufio.file import open_gguf  # noqa: E402
from llamacli.models.config import ModelConfig  # noqa: E402
from llamacli.sampling.sampling import SamplingParams, make_rng  # noqa: E402
from llamacli.testing import variant  # noqa: E402

_ok, _why = cuda_available()
if not _ok:
    pytest.skip(_why, allow_module_level=True)
pytestmark = pytest.mark.gpu

CTX = 256


def loaded(path, backend, ctx=CTX, cache_types=("f16", "f16")):
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    backend.load(g, cfg, ctx, cache_types=cache_types)
    return cfg, backend


def greedy(logits: bool) -> Sampler:
    return Sampler(SamplingParams(temperature=0.0), make_rng(0), [], logits=logits)


def alone(path, prompt, n):
    """A sequence alone on the NumPy reference: its n greedy ids and each step's logits."""
    _, be = loaded(path, NumpyBackend())
    s = greedy(True)
    out = be.step([SeqStep(prompt, 0, s)])[0]
    got = [(out.id, out.logits)]
    for i in range(n - 1):
        out = be.step([SeqStep([got[-1][0]], len(prompt) + i, s)])[0]
        got.append((out.id, out.logits))
    return got


GEMMA3_D128 = variant("tiny-gemma3", head_dim=128, window=24, name="gemma3-w24")  # a ring the batch passes
GPTOSS_D64 = variant("tiny-gpt-oss", n_embd=128, head_dim=64, window=20, name="gpt-oss-w20")  # sinks, window
CASES = [("tiny-llama", QT.Q8_0), ("small-qwen2", QT.Q4_K), ("tiny-qwen3", "Q4_K_M"), (GEMMA3_D128, QT.Q6_K),
         ("tiny-gemma2", QT.Q8_0), ("tiny-qwen3moe", QT.Q8_0), (GPTOSS_D64, "MXFP4_MOE"), ("small-phi3", QT.Q5_0)]


@pytest.mark.parametrize("shape,qtype", CASES, ids=case_id)
def test_sequences_decode_together_as_they_would_alone(random_model, shape, qtype) -> None:
    """Eleven sequences in eleven slots (prompts of 1 to 60 tokens: the op-by-op prefill and the fused pass), their
    decode steps together (up to 11 rows), two joining late and some leaving
    early; half bring their logits back (the host path), half take the device argmax. Each sequence's ids equal
    the reference's alone, and its logits agree within the tolerance of the CUDA backend's own tests."""
    path = random_model(shape, qtype)
    cfg, be = loaded(path, CudaBackend())
    be.set_slots(11)
    # fp16 activations and weights (bgemm) in the batches, int8 activations for the K-quants and MXFP4 in a lone
    # step (rounded per 32 values, llama.cpp's MMVQ numerics): the logits move up to about 1e-2 from the reference
    tol = 2e-2 if qtype in ("Q4_K_M", "MXFP4_MOE", QT.Q4_K, QT.Q5_K, QT.Q6_K) else 1e-2
    rng = np.random.default_rng(5)
    lengths = (5, 1, 12, 7, 60, 3, 9, 2, 17, 30, 4)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in lengths]
    steps = [12, 12, 8, 12, 12, 5, 12, 12, 10, 12, 12]
    want = [alone(path, p, n) for p, n in zip(prompts, steps)]
    samplers = [greedy(i % 2 == 0) for i in range(11)]
    got: list[list[tuple[int, np.ndarray | None]]] = [[] for _ in prompts]
    late = {9: 2, 10: 4}  # sequence -> the round it joins
    for rnd in range(16):
        batch = []
        for i, p in enumerate(prompts):
            if late.get(i, 0) > rnd or len(got[i]) >= steps[i]:
                continue
            if not got[i]:
                batch.append(SeqStep(p, 0, samplers[i], slot=i))
            else:
                batch.append(SeqStep([got[i][-1][0]], len(p) + len(got[i]) - 1, samplers[i], slot=i))
        if not batch:
            break
        for seq, out in zip(batch, be.step(batch)):
            got[seq.slot].append((out.id, out.logits))
    for i in range(11):
        assert [t for t, _ in got[i]] == [t for t, _ in want[i]], i
        if samplers[i].logits:
            for (_, a), (_, b) in zip(got[i], want[i]):
                assert np.isfinite(a).all()
                assert rel_l2(a, b) <= tol, i


def test_a_row_is_the_same_whatever_runs_beside_it(random_model) -> None:
    """Batch invariance on a dense model: a sequence's logits are bit for bit the same in a batch of 2, 7, 9 and 12
    (bgemm's sums, their K splits and the attention's splits depend on the shapes, never on the batch); so a
    seeded sampled request draws the same ids whatever else runs beside it."""
    path = random_model("small-qwen2", QT.Q4_K)
    cfg, be = loaded(path, CudaBackend())
    be.set_slots(12)
    prompt = [3, 17, 5, 9, 11, 2]

    def run(companions: int) -> list[tuple[int, np.ndarray]]:
        s = Sampler(SamplingParams(temperature=0.9, seed=7), make_rng(7), list(prompt), logits=True)
        others = [Sampler(SamplingParams(temperature=0.0), make_rng(0), []) for _ in range(companions)]
        out = be.step([SeqStep(prompt, 0, s, slot=0)] + [SeqStep([i + 1] * (i + 2), 0, o, slot=i + 1)
                                                         for i, o in enumerate(others)])
        mine, last = [(out[0].id, out[0].logits)], [o.id for o in out[1:]]
        for k in range(6):
            batch = [SeqStep([mine[-1][0]], len(prompt) + k, s, slot=0)]
            batch += [SeqStep([last[i]], i + 2 + k, o, slot=i + 1) for i, o in enumerate(others)]
            out = be.step(batch)
            mine.append((out[0].id, out[0].logits))
            last = [o.id for o in out[1:]]
        return mine

    first = run(1)
    for many in (6, 8, 11):
        a, b = first, run(many)
        assert [t for t, _ in a] == [t for t, _ in b]
        for (_, x), (_, y) in zip(a[1:], b[1:]):  # (the prompt's step is the prefill's, alone in both)
            np.testing.assert_array_equal(x, y)


def test_a_failing_row_is_its_own(random_model) -> None:
    """A row whose constraint's mask raises fails alone; the others get their ids, and the failed sequence must
    start again."""
    path = random_model("tiny-llama", QT.Q8_0)
    cfg, be = loaded(path, CudaBackend())
    be.set_slots(3)
    samplers = [greedy(False), Sampler(SamplingParams(temperature=0.0), make_rng(0), []), greedy(True)]
    firsts = be.step([SeqStep([1, 2, 3], 0, s, slot=i) for i, s in enumerate(samplers)])

    def broken():
        raise ValueError("mask failed")

    samplers[1].mask = broken
    batch = [SeqStep([firsts[i].id], 3, s, slot=i) for i, s in enumerate(samplers)]
    with pytest.raises(StepErrors) as err:
        be.step(batch)
    assert set(err.value.errors) == {1}
    assert err.value.outs[0] is not None and err.value.outs[2] is not None
    with pytest.raises(BackendError, match="no longer holds this sequence"):
        be.step([SeqStep([firsts[1].id], 3, samplers[1], slot=1)])


def test_slots_that_do_not_fit_are_refused_in_one_line(random_model) -> None:
    path = random_model("tiny-llama", QT.Q8_0)
    _, be = loaded(path, CudaBackend(), ctx=4096)
    free = cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()  # (what set_slots counts)
    n = int(free // be.kv.slot_bytes) + 2
    with pytest.raises(DeviceMemoryError, match="--parallel"):
        be.set_slots(n)
    be.set_slots(2)  # what fits still does
    assert be.slots == 2


def test_slots_shrink_and_grow_again(random_model) -> None:
    """A slot dropped and made again holds new arrays: a prompt there (its prefill graph captured before) gives
    what a fresh backend gives; a sequence decoding batched goes on alone on the fused step when the slots go
    back to one."""
    path = random_model("small-qwen2", QT.Q8_0)
    cfg, be = loaded(path, CudaBackend())
    prompt = list(range(3, 23))  # 20 tokens: the fused prefill pass, captured the second time
    be.set_slots(3)
    for _ in range(2):
        be.step([SeqStep(prompt, 0, greedy(True), slot=2)])
    be.set_slots(2)
    be.set_slots(3)
    got = be.step([SeqStep(prompt, 0, greedy(True), slot=2)])[0].logits
    _, fresh = loaded(path, CudaBackend())
    want = fresh.step([SeqStep(prompt, 0, greedy(True))])[0].logits
    assert rel_l2(got, want) <= 1e-5

    s = Sampler(SamplingParams(temperature=0.8, seed=3), make_rng(3), [], logits=True)
    other = greedy(False)
    outs = be.step([SeqStep([5, 6, 7], 0, s, slot=0), SeqStep([8, 9], 0, other, slot=1)])
    outs = be.step([SeqStep([outs[0].id], 3, s, slot=0), SeqStep([outs[1].id], 2, other, slot=1)])
    be.set_slots(1)  # slot 0 and its sequence stay
    out = be.step([SeqStep([outs[0].id], 4, s)])[0]
    assert np.isfinite(out.logits).all() and 0 <= out.id < cfg.vocab_size


def test_an_8bit_cache_with_several_slots(random_model) -> None:
    """With -ctk/-ctv q8_0 the sequences take turns on the fused step (no batched step reads that cache): each
    one's greedy ids are those it gets alone."""
    path = random_model("small-llama", QT.Q8_0)  # (an 8-bit cache needs a head dim of whole 32-value blocks)
    prompts = [[1, 5, 9], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22], [7]]

    def run(slots: int, which: list[int]) -> dict[int, list[int]]:
        _, be = loaded(path, CudaBackend(), cache_types=("q8_0", "q8_0"))
        be.set_slots(slots)
        ss = {i: greedy(False) for i in which}
        got = {i: [] for i in which}
        outs = be.step([SeqStep(prompts[i], 0, ss[i], slot=k) for k, i in enumerate(which)])
        for i, o in zip(which, outs):
            got[i].append(o.id)
        for n in range(8):
            outs = be.step([SeqStep([got[i][-1]], len(prompts[i]) + n, ss[i], slot=k) for k, i in enumerate(which)])
            for i, o in zip(which, outs):
                got[i].append(o.id)
        return got

    together = run(3, [0, 1, 2])
    for i in range(3):
        assert together[i] == run(1, [i])[i], i
