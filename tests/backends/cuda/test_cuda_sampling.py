"""The host side of sampling inside the captured decode step (llamacli/backends/cuda/sampling.py), without a
GPU: the uniform numbers reach the device ring in the generator's order, the settings record matches
kernels/sampling.cu's SampleParams, and a NumPy stand-in for the step (the uniform number and the penalty
window read by position, as the kernels do) gives generate the same tokens as sampling on the host."""

from __future__ import annotations

import re

import numpy as np
import pytest

from llamacli.backends.cuda import loader as K
from llamacli.backends.cuda.sampling import STEP_PARAMS, TOPK_MAX, UniformFeed, on_device, step_params
from llamacli.backends.numpy_backend import NumpyBackend
from llamacli.engine.generate import Model
from llamacli.sampling import sampling as S


def test_feed_gives_the_generators_numbers_in_order_at_their_slots() -> None:
    """Draw d sits in slot d % size once need(d) has run, and equals the d-th rng.random() call; the ring is
    refilled a half at a time while generation runs one step ahead (need(pos + 1) after need(pos))."""
    size = 16
    want = np.random.default_rng(7)
    ref = [want.random() for _ in range(300)]
    feed, ring = UniformFeed(size), np.full(size, np.nan)
    ring[:] = feed.start(np.random.default_rng(7))
    writes = 0
    for d in range(250):
        for ahead in (d, d + 1):  # the step, then the one queued ahead
            for slot, values in feed.need(ahead):
                assert slot % (size // 2) == 0 and values.size == size // 2
                ring[slot : slot + values.size] = values
                writes += 1
            assert feed.filled - size <= max(0, ahead - 1) and ahead < feed.filled  # the step before still there
        assert ring[d % size] == ref[d] and ring[(d + 1) % size] == ref[d + 1]
    assert writes == (251 - size) // (size // 2) + 1
    with pytest.raises(ValueError, match="no longer in the ring"):
        feed.need(250 - size)  # a step far behind the ring (never asked for by generation)
    with pytest.raises(ValueError, match="power of two"):
        UniformFeed(12)


def test_step_params_match_the_kernels_struct() -> None:
    """STEP_PARAMS is SampleParams field for field (names, C types, order) and 56 bytes, as the C layout."""
    src = K.kernel_source("sampling")
    body = re.search(r"struct SampleParams \{(.*?)\};", src, re.S).group(1)
    fields = []
    for ctype, names in re.findall(r"^\s*(double|float|int)\s+([\w, ]+);", body, re.M):
        fields += [(n.strip(), {"double": "<f8", "float": "<f4", "int": "<i4"}[ctype]) for n in names.split(",")]
    assert fields == [(n, STEP_PARAMS.fields[n][0].str) for n in STEP_PARAMS.names]
    assert STEP_PARAMS.itemsize == 56


def test_step_params_values() -> None:
    p = step_params(S.SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repeat_penalty=1.1,
                                     repeat_last_n=32, presence_penalty=0.5), vocab=100, base=12)
    assert (float(p["temperature"]), int(p["top_k"]), float(p["top_p"])) == (0.7, 40, 0.9)
    assert float(p["log_min_p"]) == pytest.approx(np.log(0.05))
    assert int(p["window"]) == 32 and int(p["base"]) == 12 and int(p["ring"]) & (int(p["ring"]) - 1) == 0
    g = step_params(S.SamplingParams(temperature=0.0, repeat_penalty=1.3, repeat_last_n=-1), vocab=100, base=0)
    assert (float(g["temperature"]), int(g["top_k"]), int(g["window"])) == (0.0, 1, -1)  # greedy: the best of 1
    off = step_params(S.SamplingParams(top_k=500, min_p=0.0, repeat_last_n=64), vocab=100, base=0)
    assert int(off["window"]) == 0 and int(off["top_k"]) == 100 and float(off["log_min_p"]) == -np.inf
    assert on_device(S.SamplingParams(top_k=TOPK_MAX)) and on_device(S.SamplingParams(temperature=0, top_k=0))
    assert not on_device(S.SamplingParams(top_k=0)) and not on_device(S.SamplingParams(top_k=TOPK_MAX + 1))


class _Fixed:
    """A generator whose one number is given: the uniform the step reads from its ring."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


class StepSampler(NumpyBackend):
    """The NumPy reference with decode_sampled computed as the CUDA step does: start_sampling writes what
    cuda.sampling writes (the settings record, the penalty window's tail of the history, the first ring of
    uniform numbers), each step appends its input token to the history by position and reads its uniform
    number at slot (pos - base) mod ring, and the feed refills the ring before the step and the one queued
    ahead."""

    RING = 16  # small, so that a short generation refills it many times

    def start_sampling(self, params, rng, recent) -> bool:
        if not on_device(params):
            return False
        self.params, base = params, len(recent)
        self.rec = step_params(params, self.cfg.vocab_size, base)
        self.hist = np.full(self.ctx, -1, np.int64)
        w = int(self.rec["window"])
        lo = 0 if w < 0 else max(0, base - w + 1)
        if w:
            self.hist[lo:base] = recent[lo:base]
        self.feed, self.ring = UniformFeed(self.RING), np.full(self.RING, np.nan)
        if not params.greedy:
            self.ring[:] = self.feed.start(rng)
        return True

    def _fill(self, pos: int) -> None:
        if not self.params.greedy:
            for slot, values in self.feed.need(pos - int(self.rec["base"])):
                self.ring[slot : slot + values.size] = values

    def decode_sampled(self, token: int, pos: int) -> int:
        self._fill(pos)
        logits = self.to_host(self.decode(token, pos))[-1]
        self.hist[pos] = token  # penalties_step_f32
        w = int(self.rec["window"])
        window = self.hist[0 if w < 0 else max(0, pos + 1 - w) : pos + 1] if w else []
        assert (np.asarray(window) >= 0).all()  # every position of the window was written
        u = self.ring[(pos - int(self.rec["base"])) & (self.RING - 1)]
        token = S.sample(logits, self.params, _Fixed(u), window)
        self._fill(pos + 1)  # the step queued ahead
        return token


SETTINGS = [
    dict(temperature=0.8, seed=1),
    dict(temperature=1.5, top_k=7, top_p=0.9, min_p=0.0, repeat_penalty=1.3, frequency_penalty=0.2,
         presence_penalty=0.4, repeat_last_n=8, seed=2),
    dict(temperature=1.2, top_k=300, top_p=1.0, min_p=0.01, repeat_penalty=1.2, repeat_last_n=-1, seed=3),
    dict(temperature=0.0, repeat_penalty=1.5, repeat_last_n=16),  # greedy with penalties: no draws
    dict(temperature=0.9, top_k=0, seed=4),  # the host path (start_sampling says no)
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_generate_with_the_step_sampler_equals_host_sampling(random_model, settings) -> None:
    """generate through decode_sampled (draws taken from the ring by position, penalties from the history by
    position) gives the ids of generate sampling each step on the host, for the same seed: over two turns,
    the second reusing the first's cache and long enough to refill the ring several times."""
    path = random_model("tiny-llama", "F32")
    ref, emu = Model(path, backend="numpy", ctx=256), Model(path, backend="numpy", ctx=256)
    emu.backend = StepSampler()
    emu.backend.load(emu.gguf, emu.cfg, emu.ctx)
    ref.tokenizer.eog_ids = emu.tokenizer.eog_ids = frozenset()  # every generation runs to max_tokens
    prompt = [1, 40, 41, 42, 43, 44, 45, 46]
    for turn in range(2):
        want = ref.complete(prompt, max_tokens=60, **settings)
        got = emu.complete(prompt, max_tokens=60, **settings)
        assert got.tokens == want.tokens and len(got.tokens) == 60
        prompt = prompt + want.tokens + [50, 51]
