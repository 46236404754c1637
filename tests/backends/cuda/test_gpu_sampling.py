"""Sampling inside the captured decode step (decode_sampled; kernels/sampling.cu's _step kernels) against
llamacli.sampling.sampling: the same ids for a seed, with penalties, across top-k / top-p / min-p / temperature, step by
step on random logits and through generate on random models and SmolLM2; greedy unchanged. Needs a GPU
(marker gpu)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

cp = pytest.importorskip("cupy")

from test_gpu_backend import _smollm2_path  # noqa: E402  (the real test model, or a skip)

from llamacli.backends.cuda import CudaBackend, cuda_available  # noqa: E402
from llamacli.backends.cuda.device import DeviceModel  # noqa: E402
from llamacli.backends.cuda.sampling import TOPK_MAX, UNIFORM_RING, check_flag  # noqa: E402
from llamacli.engine.generate import load  # noqa: E402
from llamacli.errors import BackendError, NumericalError  # noqa: E402
from llamacli.models.config import ROPE_NORMAL, ModelConfig  # noqa: E402
from llamacli.sampling import sampling as S  # noqa: E402

_ok, _why = cuda_available()
if not _ok:
    pytest.skip(_why, allow_module_level=True)
pytestmark = pytest.mark.gpu

SETTINGS = [
    S.SamplingParams(temperature=0.8, seed=1),  # the CLI's defaults: top-k 40, top-p 0.95, min-p 0.05
    S.SamplingParams(temperature=1.3, top_k=7, top_p=1.0, min_p=0.0, repeat_penalty=1.3, frequency_penalty=0.2,
                     presence_penalty=0.5, repeat_last_n=64, seed=2),
    S.SamplingParams(temperature=0.0, repeat_penalty=1.5, repeat_last_n=-1),  # greedy with penalties
    S.SamplingParams(temperature=0.7, top_k=TOPK_MAX, top_p=0.5, seed=3),
    S.SamplingParams(temperature=2.0, top_k=200, top_p=0.8, min_p=0.3, presence_penalty=-0.5, repeat_last_n=5),
    S.SamplingParams(temperature=0.4, top_k=60, top_p=0.99, min_p=0.0, frequency_penalty=1.0, repeat_last_n=-1),
    S.SamplingParams(temperature=1.0, top_k=1),
    S.SamplingParams(temperature=1.0, top_k=TOPK_MAX, top_p=1.0, min_p=1.0),  # only the best (and its ties)
]


def make_cfg(vocab: int) -> ModelConfig:
    return ModelConfig(
        architecture="llama", name="t", n_layer=1, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128,
        vocab_size=vocab, context_length=4096, rope_type=ROPE_NORMAL, rope_dim=16, rope_freq_base=10000.0,
        rope_scaling="none", rope_scaling_factor=1.0, rope_original_context=4096, rope_attn_factor=1.0,
        rms_eps=1e-5, tied_embeddings=False, bos_token_id=None, eos_token_id=None,
    )


def step_tail(vocab: int, ctx: int) -> tuple[CudaBackend, Callable[[int, int, np.ndarray], tuple[int, int]]]:
    """A backend with only the step's I/O (no model) and a function that runs the step's sampling kernels
    (the tail of decode.DecodeStep.launch_step after the LM head) on the logits given, as the captured step does."""
    be = CudaBackend(use_graph=False)
    be.attach(DeviceModel(make_cfg(vocab), ctx, None, (), None))
    logits = cp.empty((1, vocab), cp.float32)
    step: list = []
    be.sampler.step_tail(step, logits, be.decoder.step_ids, be.decoder.step_pos)

    def run(token: int, pos: int, values: np.ndarray) -> tuple[int, int]:
        logits[0].set(values)
        be.decoder.step_ids[:1].set(np.asarray([token], np.int32))
        be.decoder.step_pos.set(np.asarray([pos], np.int32))
        be.sampler.feed_uniforms(pos)
        for _, _, _, launch in step:
            launch(False)
        tok, flag = (int(a) for a in be.decoder.step_ids.get())
        assert int(be.decoder.step_pos.get()[0]) == pos + 1  # the step moves the device on, as the fused argmax does
        return tok, flag

    return be, run


def random_logits(rng: np.random.Generator, v: int) -> np.ndarray:
    x = (rng.standard_normal(v) * 3).astype(np.float32)
    x[rng.choice(v, 30)] = x.max()  # ties at the top
    x[rng.choice(v, 20)] = -np.inf
    return x


@pytest.mark.parametrize("v", [3001, 20001])
@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_step_sampler_matches_sampling_py_step_by_step(params, v) -> None:
    """The step's kernels (penalties over the history by position, top-k, the draw with the ring's uniform
    number of that position) pick what llamacli.sampling.sampling.sample picks with the same generator and history,
    for more steps than the ring holds (so it is refilled while the generation runs). A 20,001-token
    vocabulary takes top_k <= 64 through five blocks' candidates (topk_part_step_f32; the last one short)."""
    ctx = 4096
    be, run = step_tail(v, ctx)
    rng = np.random.default_rng(11)
    history = [int(t) for t in rng.integers(0, v, size=300)]
    host, dev = np.random.default_rng(params.seed or 0), np.random.default_rng(params.seed or 0)
    assert be.start_sampling(params, dev, history)
    token = int(rng.integers(0, v))
    for pos in range(len(history), len(history) + UNIFORM_RING + 200):
        x = random_logits(rng, v)
        history.append(token)
        want = S.sample(x, params, host, history)
        got, flag = run(token, pos, x)
        assert flag == 0 and got == want, (pos, params)
        token = got if pos % 3 else int(rng.integers(0, v))  # repeats, and tokens the sampler did not choose


@pytest.mark.parametrize("k", [1, 40, 64, 65])
def test_step_top_k_ties_across_blocks_keep_the_lowest_ids(k) -> None:
    """Logits equal at the cut in every 4096-logit block, and more of them than the top k take (all equal; a
    few above them in the last block; NaN-free, -inf elsewhere): the candidates are the lowest ids, as
    sampling.py's ranking keeps them, so the draws match it; a NaN in the last block is flagged."""
    v = 3 * 4096 + 500
    be, run = step_tail(v, 256)
    params = S.SamplingParams(temperature=1.0, top_k=k, top_p=1.0, min_p=0.0, seed=4)
    host, dev = np.random.default_rng(4), np.random.default_rng(4)
    assert be.start_sampling(params, dev, [])
    cases = [np.zeros(v, np.float32), np.full(v, -np.inf, np.float32), np.zeros(v, np.float32)]
    cases[1][np.arange(5, v, 97)] = 2.5  # ties spread over every block
    cases[2][v - 3 :] = 1.0  # the best three in the short last block, then ties at 0 from id 0
    history: list[int] = []
    for pos, x in enumerate(cases * 3):
        history.append(7)
        want = S.sample(x, params, host, history)
        got, flag = run(7, pos, x)
        assert flag == 0 and got == want, (pos, k)
    x = np.zeros(v, np.float32)
    x[v - 1] = np.nan
    assert run(7, 9, x)[1] == 1


def test_step_sampler_flags_broken_logits() -> None:
    v = 1000
    be, run = step_tail(v, 64)
    assert be.start_sampling(S.SamplingParams(temperature=0.8, seed=0), np.random.default_rng(0), [1, 2, 3])
    x = np.zeros(v, np.float32)
    x[17] = np.nan
    assert run(5, 3, x)[1] == 1
    x[17] = -np.nan  # a NaN with its sign bit set ranks above +inf too
    assert run(5, 4, x)[1] == 1
    with pytest.raises(NumericalError, match="-inf"):
        check_flag(run(5, 5, np.full(v, -np.inf, np.float32))[1], v)


def _sampled_settings() -> list[dict]:
    return [dict(temperature=0.8, seed=1),
            dict(temperature=1.3, top_k=7, top_p=0.9, min_p=0.0, repeat_penalty=1.3, frequency_penalty=0.2,
                 presence_penalty=0.5, repeat_last_n=16, seed=2),
            dict(temperature=1.0, top_k=TOPK_MAX, top_p=1.0, min_p=0.0, repeat_penalty=1.1, repeat_last_n=-1, seed=3),
            dict(temperature=0.0, repeat_penalty=1.4, repeat_last_n=32)]


def _host(m, prompt, n, settings):
    """generate with each step's logits sampled on the host by llamacli.sampling.sampling (logprobs moves them there)."""
    m.seq.clear()
    return m.complete(prompt, max_tokens=n, logprobs=0, **settings).tokens


def _device(m, prompt, n, settings):
    m.seq.clear()
    return m.complete(prompt, max_tokens=n, **settings).tokens


@pytest.mark.parametrize("shape,qtype", [("small-llama", QT.Q8_0), ("small-qwen2", QT.Q4_K), ("tiny-gemma2", QT.Q8_0),
                                         ("tiny-qwen3", "Q4_K_M")], ids=["llama", "qwen2", "gemma2", "qwen3"])
def test_generate_sampled_in_the_graph_equals_host_sampling(random_model, shape, qtype) -> None:
    """generate's default path (the sampler inside the captured step, the next step queued ahead) gives the
    ids that sampling each step's logits on the host gives, for the same seed: penalties, top-k up to 1024,
    greedy with penalties; with graphs and without; over more tokens than the uniform ring holds."""
    m = load(random_model(shape, qtype), backend="cuda", ctx=2048)
    m.tokenizer.eog_ids = frozenset()  # every generation runs to max_tokens
    assert {"greedy", "sampled"} <= m.backend.decoder.captured  # captured at load, before any timed step
    prompt = [1, 30, 31, 32, 33, 34, 35]
    for settings in _sampled_settings():
        n = UNIFORM_RING + 100 if settings.get("seed") == 1 else 96
        want = _host(m, prompt, n, settings)
        assert len(want) == n
        assert _device(m, prompt, n, settings) == want, settings
        m.backend.use_graph = False
        assert _device(m, prompt, n, settings) == want, settings
        m.backend.use_graph = True


def test_greedy_is_unchanged(random_model) -> None:
    """Plain greedy still runs the fused argmax (decode_greedy): the host's argmax ids, also right after a
    sampled generation (whose step queued ahead it must not take)."""
    m = load(random_model("small-qwen2", QT.Q4_K), backend="cuda", ctx=512)
    m.tokenizer.eog_ids = frozenset()
    prompt = [1, 30, 31, 32]
    want = _host(m, prompt, 64, dict(temperature=0.0))
    assert _device(m, prompt, 64, dict(temperature=0.0)) == want
    m.complete(prompt, max_tokens=8, temperature=0.9, seed=5)
    assert _device(m, prompt, 64, dict(temperature=0.0)) == want


def test_sampled_step_queued_ahead_is_taken_only_when_it_matches(random_model) -> None:
    """decode_sampled queues the next step (its id at pos + 1) before it reads the id; a different token, a
    prefill in between or a new start_sampling recomputes: the same ids as the plain launches."""
    path = random_model("small-qwen2", QT.Q4_K)
    m = load(path, backend="cuda", ctx=256)
    be, v = m.backend, m.cfg.vocab_size
    rng = np.random.default_rng(5)
    p, q = [int(t) for t in rng.integers(0, v, 20)], [int(t) for t in rng.integers(0, v, 21)]
    params = S.SamplingParams(temperature=1.1, repeat_penalty=1.2, repeat_last_n=8)

    def script(use_graph: bool) -> list[int]:
        be.use_graph = use_graph
        be.forward_prompt(np.asarray(p), 0)
        assert be.start_sampling(params, np.random.default_rng(9), p)
        a = be.decode_sampled(3, 20)
        assert (be.queued_ahead is not None) == use_graph and (not use_graph or be.queued_ahead == (a, 21))
        b = be.decode_sampled((a + 1) % v, 21)  # not the step queued
        c = be.decode_sampled(b, 22)  # the step queued
        be.forward_prompt(np.asarray(q), 0)  # the step queued now, (c, 23), saw the old cache
        assert be.queued_ahead is None
        d = be.decode_sampled(c, 23)
        e = be.decode_greedy(d, 24)  # a greedy step does not take the sampled one queued
        f = be.decode_sampled(e, 25)
        return [a, b, c, d, e, f]

    for _ in range(2):
        assert script(True) == script(False)


def test_smollm2_sampled_64_tokens_equal_host_sampling() -> None:
    m = load(_smollm2_path(), backend="cuda", ctx=1024)
    for prompt in ("The capital of France is", "Write a haiku about GPUs", "List three colors:"):
        ids = m.prompt_ids(prompt)
        for settings in _sampled_settings():
            assert _device(m, ids, 64, settings) == _host(m, ids, 64, settings), (prompt, settings)


@pytest.mark.parametrize("vocab", [1000, 4133])
def test_sample_allowed_on_the_device_equals_the_host(vocab: int) -> None:
    """CudaBackend.sample_allowed (the mask words to the device, mask_logits_f32, the device sampler) picks
    the ids Backend.sample_allowed picks on the host (np.where over the unpacked words, then sampling.py), for
    every setting and seed, with NaN / +inf in masked-out slots (masked away, not flagged), a mask that allows
    one id, and a vocabulary not a multiple of 32; the logits are left as they were."""
    from llamacli.backends.base import Backend
    from llamacli.backends.numpy_backend import NumpyBackend
    from llamacli.sampling.structured import pack_words

    be = CudaBackend(use_graph=False)
    be.attach(DeviceModel(make_cfg(vocab), 64, None, (), None))
    ref = NumpyBackend()
    rng = np.random.default_rng(vocab)
    n_words = -(-vocab // 32)
    for trial, params in enumerate(SETTINGS + [S.SamplingParams(temperature=0.0), S.SamplingParams(top_k=0, seed=9)]):
        x = rng.normal(0.0, 3.0, (1, vocab)).astype(np.float32)
        bits = rng.random(vocab) < (0.02 if trial % 2 else 0.3)
        if trial == 3:
            bits[:] = False
            bits[vocab - 2] = True  # one allowed id
        x[0, np.flatnonzero(~bits)[:3]] = [np.nan, np.inf, np.nan]
        words = pack_words(bits)
        assert words.size == n_words
        recent = rng.integers(0, vocab, 20).tolist()
        xd = cp.asarray(x)
        for seed in range(3):
            got = be.sample_allowed(xd, words, params, np.random.default_rng(seed), recent)
            want = Backend.sample_allowed(ref, x, words, params, np.random.default_rng(seed), recent)
            assert got == want and bits[got], (trial, seed, got, want)
        assert np.array_equal(xd.get(), x, equal_nan=True)
    with pytest.raises(BackendError, match="bit words"):
        be.sample_allowed(cp.asarray(x), words[:-1].copy(), SETTINGS[0], rng, [])


def test_constrained_generation_on_the_device_equals_the_host_path(random_model) -> None:
    """A constraint without logprobs masks on the device (decode_allowed: greedy takes the masked argmax into
    the step's ids and queues the next step; other settings sample_allowed): the ids the host path gives
    (logprobs=0 takes it: the logits to the host, np.where, sampling.py), with graphs and without; a plain
    greedy generation afterwards does not take the queued step."""
    pytest.importorskip("llguidance")
    from llamacli.sampling.structured import json_schema_constraint

    m = load(random_model("small-llama", QT.Q8_0), backend="cuda", ctx=512)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy", "zzz"]},
              "c": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 6}},
              "required": ["a", "b", "c"], "x-guidance": {"whitespace_flexible": False}}
    constraint = json_schema_constraint(m, schema)
    prompt = [1, 30, 31, 32]
    for settings in (dict(temperature=0.0), dict(temperature=0.0, repeat_penalty=1.3),
                     dict(temperature=0.9, seed=4), dict(temperature=1.5, top_k=0, seed=5)):
        m.seq.clear()
        want = m.complete(prompt, max_tokens=48, constraint=constraint, logprobs=0, **settings)
        for graph in (True, False):
            m.backend.use_graph = graph
            m.seq.clear()
            got = m.complete(prompt, max_tokens=48, constraint=constraint, **settings)
            assert got.tokens == want.tokens and got.finish_reason == want.finish_reason, (settings, graph)
        m.backend.use_graph = True
    m.tokenizer.eog_ids = frozenset()
    plain = _host(m, prompt, 32, dict(temperature=0.0))
    m.complete(prompt, max_tokens=8, temperature=0.0, constraint=constraint)  # leaves a step queued
    assert _device(m, prompt, 32, dict(temperature=0.0)) == plain


def test_decode_allowed_queued_step_is_taken_only_when_it_matches(random_model) -> None:
    """decode_allowed (greedy) queues the following logits step for (its id, pos + 1): decode_allowed for
    that pair takes it; decode_allowed for another token, decode_greedy and decode at that pair recompute; each
    result equals the host's (the step's logits brought back and masked on the host). A mask that leaves no id
    is the NumericalError the host raises (argmax_f32's flag 2), with and without graphs."""
    from llamacli.models.block import prefill
    from llamacli.sampling.structured import pack_words

    m = load(random_model("small-llama", QT.Q8_0), backend="cuda", ctx=256)
    be, v = m.backend, m.cfg.vocab_size
    bits = np.random.default_rng(0).random(v) < 0.5
    words = pack_words(bits)
    greedy = S.SamplingParams(temperature=0.0)
    prompt = [1, 30, 31, 32]
    p = len(prompt)

    def start() -> int:
        logits = be.to_host(prefill(be, m.cfg, prompt, 0))[-1]
        return int(np.argmax(np.where(bits, logits, -np.inf)))

    def host(token: int, pos: int, masked: bool) -> int:
        x = be.to_host(be.decode(token, pos))[-1]
        return int(np.argmax(np.where(bits, x, -np.inf) if masked else x))

    t0 = start()
    t1 = host(t0, p, True)
    want_masked, want_plain = host(t1, p + 1, True), host(t1, p + 1, False)
    other = (t1 + 1) % v
    want_other = host(other, p + 1, True)
    for follow in ("allowed", "other", "greedy", "logits"):
        start()
        assert be.decode_allowed(t0, p, lambda: words, greedy, None, []) == t1
        assert be.queued_ahead == (t1, p + 1)
        if follow == "allowed":
            assert be.decode_allowed(t1, p + 1, lambda: words, greedy, None, []) == want_masked
        elif follow == "other":
            assert be.decode_allowed(other, p + 1, lambda: words, greedy, None, []) == want_other
        elif follow == "greedy":
            assert be.decode_greedy(t1, p + 1) == want_plain
        else:
            assert int(np.argmax(be.to_host(be.decode(t1, p + 1))[-1])) == want_plain
    none = np.zeros_like(words)
    for graph in (True, False):
        be.use_graph = graph
        start()
        with pytest.raises(NumericalError, match="-inf"):
            be.decode_allowed(t0, p, lambda: none, greedy, None, [])
    be.use_graph = True
