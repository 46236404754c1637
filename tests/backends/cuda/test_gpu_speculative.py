"""Speculative decoding on the CUDA backend against the NumPy reference: the verification pass
(CudaBackend.forward_verify: up to 8 tokens through the operations one by one, more through the fused prefill pass
with every row's LM head, captured and replayed), its argmax on the device (verify_greedy), the cache it leaves
for the step after a rejection; and the engine's greedy replies with drafts equal to those without, on random
models and on SmolLM2 with an echo task. Needs a GPU (marker gpu)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

cp = pytest.importorskip("cupy")

from gpu_checks import rel_l2  # noqa: E402

from llamacli.backends.cuda import CudaBackend, cuda_available  # noqa: E402
from llamacli.backends.numpy_backend import NumpyBackend  # noqa: E402
from llamacli.ggufio.file import open_gguf  # noqa: E402
from llamacli.models.block import prefill  # noqa: E402
from llamacli.models.config import ModelConfig  # noqa: E402
from llamacli.models.weights import check_tensors  # noqa: E402

_ok, _why = cuda_available()
if not _ok:
    pytest.skip(_why, allow_module_level=True)
pytestmark = pytest.mark.gpu

CASES = [("tiny-llama", QT.F32), ("small-llama", "Q4_K_M"), ("tiny-qwen3", QT.Q8_0), ("tiny-gemma3", QT.Q8_0),
         ("tiny-gemma2", QT.Q8_0), ("tiny-qwen3moe", "Q4_K_M"), ("tiny-gpt-oss", "MXFP4_MOE")]
IDS = ["llama-f32", "llama-q4km", "qwen3-q8", "gemma3-q8", "gemma2-q8", "qwen3moe-q4km", "gpt-oss"]


def loaded(path, backend, ctx=256):
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    check_tensors(g, cfg, backend.runnable_types)
    backend.load(g, cfg, ctx)
    return cfg, backend


@pytest.mark.parametrize("batched", [True, False], ids=["batched-step", "op-by-op-or-prefill"])
@pytest.mark.parametrize("shape,qtype", CASES, ids=IDS)
def test_verification_matches_numpy(random_model, shape, qtype, batched) -> None:
    """forward_verify of 4, 9 and 17 tokens after a 40-token prompt, run three times (direct, captured, replayed):
    through the batched step's pass (verify_batched, the default), or else op by op (4) and the fused prefill pass
    with every row's LM head (9, 17). Every row's logits within 1e-2 of NumPy's; verify_greedy the argmax of the
    CUDA rows; and a decode step after it, at a position inside the drafts (a rejection), as NumPy's."""
    path = random_model(shape, qtype)
    cfg, ref = loaded(path, NumpyBackend())
    _, be = loaded(path, CudaBackend())
    be.verify_batched = batched
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, cfg.vocab_size, 40)
    prefill(ref, cfg, prompt, 0)
    prefill(be, cfg, prompt, 0)
    for t in (4, 9, 17):
        ids = rng.integers(0, cfg.vocab_size, t)
        want = ref.to_host(ref.forward_verify(ids, 40))
        runs = [be.to_host(be.forward_verify(ids, 40)).copy() for _ in range(3)]
        assert runs[0].shape == want.shape == (t, cfg.vocab_size)
        assert np.isfinite(runs[0]).all(), t
        for row in range(t):
            assert rel_l2(runs[0][row], want[row]) <= 1e-2, (t, row)
        for r in runs[1:]:
            assert rel_l2(r, runs[0]) <= 1e-6, t
        assert be.verify_greedy(ids, 40) == [int(np.argmax(r)) for r in runs[-1]], t
        # the step after a rejection: position 42 (two drafts kept) takes another token
        tok = int(rng.integers(0, cfg.vocab_size))
        step_ref = ref.to_host(ref.decode(tok, 42))[-1]
        step = be.to_host(be.decode(tok, 42))[-1]
        assert rel_l2(step, step_ref) <= 1e-2, t


def test_a_verification_after_a_greedy_step_queued_ahead(random_model) -> None:
    """decode_greedy queues the next step ahead (its K/V at the next position); a verification there replaces it
    and gives NumPy's rows; the greedy step after it is not the stale one queued."""
    path = random_model("small-llama", "Q8_0")
    cfg, ref = loaded(path, NumpyBackend())
    _, be = loaded(path, CudaBackend())
    prompt = np.random.default_rng(5).integers(0, cfg.vocab_size, 20)
    prefill(ref, cfg, prompt, 0)
    prefill(be, cfg, prompt, 0)
    be.prepare_decode(("greedy",), pos=20)
    first = be.decode_greedy(7, 20)  # queues (first, 21) ahead
    assert first == int(np.argmax(ref.to_host(ref.decode(7, 20))[-1]))
    ids = np.asarray([first, 3, 9, 4, 11, 2, 6, 8, 1, 5], np.int64)  # 10 tokens: the fused pass
    want = ref.to_host(ref.forward_verify(ids, 21))
    got = be.to_host(be.forward_verify(ids, 21))
    for row in range(ids.size):
        assert rel_l2(got[row], want[row]) <= 1e-2, row
    nxt = be.decode_greedy(12, 23)  # after keeping one draft
    assert nxt == int(np.argmax(ref.to_host(ref.decode(12, 23))[-1]))


@pytest.mark.parametrize("shape,qtype", [("small-llama", "Q4_K_M"), ("tiny-gemma3", QT.Q8_0),
                                         ("tiny-gpt-oss", "MXFP4_MOE")], ids=["llama", "gemma3", "gpt-oss"])
def test_greedy_replies_with_drafts_are_the_plain_ones(random_model, shape, qtype) -> None:
    """The engine on CUDA: n-gram drafts (draft-max 4 and 16: both verification paths) and a draft model (the same
    weights at Q8_0, on its own CUDA backend) give the plain greedy reply; drafts were accepted."""
    from llamacli.engine.generate import Model
    from llamacli.engine.speculative import SpecSettings

    path = random_model(shape, qtype)
    m = Model(path, backend="cuda", ctx=256)
    try:
        m.attach_draft(Model(random_model(shape, QT.Q8_0), backend="cuda", ctx=256))
        prompt = [5, 9, 2, 40, 7, 7, 1, 5, 9, 2, 40, 7, 11, 60, 61, 62, 5, 9, 2]
        want = m.complete(prompt, max_tokens=64, temperature=0.0, ignore_eos=True).tokens
        accepted = 0
        for spec in (SpecSettings(("ngram-simple",), 4, 0, 1), SpecSettings(("ngram-simple",), 16, 0, 2),
                     SpecSettings(("draft-simple",), 6)):
            c = m.complete(prompt, max_tokens=64, temperature=0.0, ignore_eos=True, speculative=spec)
            assert c.tokens == want, spec
            accepted += c.timings.accepted
            plain_greedy = m.complete(prompt, max_tokens=64, temperature=0.0, speculative=spec)  # (no mask: argmax rows)
            assert plain_greedy.tokens == m.complete(prompt, max_tokens=64, temperature=0.0).tokens, spec
        assert accepted > 0
    finally:
        m.close()


def test_smollm2_echo_task_with_ngram_drafts() -> None:
    """SmolLM2 on its bench echo task (engine/bench.py echo_prompt), greedy: with ngram-simple (n 12, up to 16
    drafts) the reply is the plain one, or parts from it only at a near-tie of the plain run's logits (the
    verification's kernels round otherwise than the decode step's); most drafts are accepted."""
    from llamacli.engine.bench import echo_prompt
    from llamacli.engine.generate import load
    from llamacli.engine.speculative import SpecSettings

    path = os.environ.get("LLAMACLI_TEST_MODEL")
    if not path:
        try:
            from llamacli.testing import data as testdata

            path = str(testdata.smollm2_path())
        except Exception as exc:  # no network on the GPU machine
            pytest.skip(f"SmolLM2 not available: {exc}")
    m = load(path, backend="cuda", ctx=2048)
    try:
        text = echo_prompt()
        plain = m.complete(text, max_tokens=200, temperature=0.0, logprobs=2)
        spec = m.complete(text, max_tokens=200, temperature=0.0, speculative=SpecSettings(("ngram-simple",), 16, 0, 12))
        t = spec.timings
        # the drafts do find the reply's echoes of the prompt (an H200 run of 2026-11-28 accepted 41 of 130)
        assert t.drafted >= 20 and t.accepted >= 0.2 * t.drafted, (t.drafted, t.accepted)
        assert t.passes < len(spec.tokens) * 0.8
        if spec.tokens != plain.tokens:
            at = next((i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b),
                      min(len(spec.tokens), len(plain.tokens)))
            assert at < len(plain.logprobs), f"the plain reply ended at {at}, the speculative one went on"
            top = plain.logprobs[at]["top_logprobs"]
            assert top[0]["logprob"] - top[1]["logprob"] < 0.02, (at, top)
    finally:
        m.close()


def test_speculative_requests_in_the_batched_step(random_model) -> None:
    """Two cache slots (the batched decode step): speculative and plain greedy requests at once in the scheduler,
    one with penalties (its decode steps batched, its verifications one pass each; the step after a rejection
    starts past the drafts kept): each reply is the one it gets alone, or parts from it only at a near-tie (the
    batched step's fp16 products round otherwise than a lone step's): there the NumPy reference's penalized
    logits of the two ids lie within 2% of the largest |logit| (the batched step's logits stay within 1e-2
    relative L2 of the reference's: test_gpu_batch)."""
    import threading

    from llamacli.engine.generate import Completion, Model
    from llamacli.engine.scheduler import Scheduler
    from llamacli.engine.speculative import SpecSettings

    path = random_model("small-llama", "Q8_0")
    m = Model(path, backend="cuda", ctx=256, slots=2)
    prompt = [5, 9, 2, 40, 7, 7, 1, 5, 9, 2, 40, 7, 11, 60, 61, 62, 5, 9, 2]
    cases = [(SpecSettings(("ngram-simple",), 4, 0, 1), {}), (SpecSettings(), {}),
             (SpecSettings(("ngram-simple",), 12, 0, 1), {"repeat_penalty": 1.3}), (SpecSettings(), {"repeat_penalty": 1.3})]
    alone = [m.complete(prompt, max_tokens=48, temperature=0.0, ignore_eos=True, speculative=spec, **kw).tokens
             for spec, kw in cases]
    sched = Scheduler(m)
    got: dict[int, tuple[list[int], int]] = {}

    def one(i: int) -> None:
        spec, kw = cases[i]
        c = Completion()
        for _ in m.run(list(prompt), completion=c, max_tokens=48, temperature=0.0, ignore_eos=True, scheduler=sched,
                       speculative=spec, **kw):
            pass
        got[i] = (c.tokens, c.timings.drafted)

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sched.close()
        m.close()
    for i, (spec, kw) in enumerate(cases):
        mine, want = got[i][0], alone[i]
        if mine == want:
            continue
        at = next(j for j, (a, b) in enumerate(zip(mine, want)) if a != b)
        pen = _reference_logits(path, prompt + want[:at], kw.get("repeat_penalty", 1.0))
        gap = abs(float(pen[mine[at]]) - float(pen[want[at]]))
        assert gap <= 0.02 * float(np.abs(pen).max()), (i, at, gap, float(np.abs(pen).max()))
    assert got[0][1] > 0 and got[2][1] > 0


def _reference_logits(path: str, tokens: list[int], repeat_penalty: float) -> np.ndarray:
    """The NumPy reference's logits after `tokens` (a greedy step alone), with the repeat penalty over them as
    the sampler applies it."""
    from llamacli.backends.step import Sampler, SeqStep
    from llamacli.sampling.sampling import SamplingParams, apply_penalties, make_rng

    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    be = NumpyBackend()
    be.load(g, cfg, 256)
    out = be.step([SeqStep(tokens, 0, Sampler(SamplingParams(temperature=0.0), make_rng(0), [], logits=True))])[0]
    return apply_penalties(np.asarray(out.logits, np.float64).reshape(-1), tokens, repeat_penalty=repeat_penalty)
