"""Prefill-only steps (backends/step.py SeqStep.fill) on the CUDA backend: a prompt in parts gives the logits of the
prompt whole (within the CUDA tests' tolerance: the parts are other passes, bgemm for up to 64 rows, cuBLAS above),
and the scheduler's chunked prefill (engine/scheduler.py) keeps a streaming request flowing while a long prompt joins
in parts. Needs a GPU (marker gpu)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

cp = pytest.importorskip("cupy")

from gpu_checks import rel_l2  # noqa: E402

from llamacli.backends.cuda import CudaBackend, cuda_available  # noqa: E402
from llamacli.backends.step import Sampler, SeqStep  # noqa: E402
from llamacli.engine.generate import Completion, Model  # noqa: E402
from llamacli.engine.scheduler import Scheduler  # noqa: E402
from llamacli.ggufio.file import open_gguf  # noqa: E402
from llamacli.models.config import ModelConfig  # noqa: E402
from llamacli.sampling.sampling import SamplingParams, make_rng  # noqa: E402

_ok, _why = cuda_available()
if not _ok:
    pytest.skip(_why, allow_module_level=True)
pytestmark = pytest.mark.gpu

CTX = 320


@pytest.mark.parametrize("parts", [[1], [9], [70], [5, 64], [100, 100, 30]])
def test_a_prompt_in_parts_gives_the_whole_prompts_logits(random_model, parts) -> None:
    """Fill parts of the given sizes from position 0 in slot 1 (beside slot 0's), then the rest as the prompt step:
    id -1 and the sampler not started after each part; the prompt step's logits within 1e-2 (relative L2) of the
    whole prompt's in another slot, and the same greedy id."""
    path = random_model("small-qwen2", QT.Q4_K)
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    be = CudaBackend()
    be.load(g, cfg, CTX)
    be.set_slots(2)
    prompt = np.random.default_rng(sum(parts)).integers(0, cfg.vocab_size, size=sum(parts) + 7).tolist()

    def sampler() -> Sampler:
        return Sampler(SamplingParams(temperature=0.0), make_rng(0), list(prompt), logits=True)

    whole = be.step([SeqStep(prompt, 0, sampler(), slot=0)])[0]
    s, at = sampler(), 0
    for n in parts:
        out = be.step([SeqStep(prompt[at : at + n], at, s, slot=1, fill=True)])[0]
        assert out.id == -1 and out.logits is None and s.position == -1
        at += n
    last = be.step([SeqStep(prompt[at:], at, s, slot=1)])[0]
    assert rel_l2(last.logits, whole.logits) <= 1e-2
    assert last.id == whole.id
    be.close()


def test_the_scheduler_chunks_a_long_prompt_on_cuda(random_model) -> None:
    """A 200-id prompt joins at a budget of 48 while another request streams: it runs as parts (recorded at the
    backend), the streaming request's decode steps between them; both get what they get alone (greedy ids equal,
    or parting only at a near-tie of the lone run: top two logprobs within 0.05)."""
    path = random_model("small-llama", "Q8_0")
    m = Model(path, backend="cuda", ctx=CTX, slots=2)
    ref = Model(path, backend="cuda", ctx=CTX)
    seen: list[list[tuple[int, bool, int, int]]] = []
    real = m.backend.step

    def recorded(batch):
        seen.append([(q.slot, q.fill, q.start, len(q.tokens)) for q in batch])
        return real(batch)

    m.backend.step = recorded
    rng = np.random.default_rng(4)
    short, long = rng.integers(10, 200, size=5).tolist(), rng.integers(10, 200, size=200).tolist()
    kw = dict(temperature=0.0, ignore_eos=True, logprobs=2)

    def alone(prompt, n):
        c = Completion()
        for _ in ref.run(prompt, completion=c, max_tokens=n, **kw):
            pass
        return c

    want_a, want_b = alone(short, 40), alone(long, 8)
    sched = Scheduler(m, prefill_budget=48)
    a, b = Completion(), Completion()
    try:
        g = m.run(short, completion=a, scheduler=sched, max_tokens=40, **kw)
        next(g)
        t = threading.Thread(target=lambda: [None for _ in g])
        t.start()
        for _ in m.run(long, completion=b, scheduler=sched, max_tokens=8, **kw):
            pass
        t.join(120)
    finally:
        sched.close()
        m.close()
        ref.close()
    for got, want in ((a, want_a), (b, want_b)):
        if got.tokens != want.tokens:
            at = next(i for i, (x, y) in enumerate(zip(got.tokens, want.tokens)) if x != y)
            top = want.logprobs[at]["top_logprobs"]
            assert top[0]["logprob"] - top[1]["logprob"] < 0.05, (at, top)
    parts = [(st, n) for batch in seen for (s, f, st, n) in batch if f]
    assert parts and parts[0] == (0, 48) and all(n <= 48 for _, n in parts)
    assert sum(n for _, n in parts) + next(n for batch in seen for (s, f, st, n) in batch
                                             if not f and n > 1 and st > 0) == 200
