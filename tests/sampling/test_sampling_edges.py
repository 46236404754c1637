"""Sampling options at the edges of floating point: subnormal and huge temperatures, penalties and
thresholds either work (no NumPy warning, no NaN) or are refused in one line with exit 2."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from clirun import run, run_subprocess
from llamacli.errors import UsageError
from llamacli.sampling.sampling import SamplingParams, make_rng, sample

# Two tied best tokens (1, 2), a huge one that penalties push around (4), a masked one (5).
LOGITS = np.array([1.0, 3.0, 3.0, -2.0, 1e30, -np.inf], np.float32)
HISTORY = [0, 1, 3, 3, 4]


@pytest.mark.parametrize("edge", [
    dict(temperature=1e-320), dict(temperature=5e-324), dict(temperature=1e-300), dict(temperature=1e308),
    dict(top_p=5e-324), dict(min_p=5e-324), dict(min_p=1e-320),
    dict(repeat_penalty=1.2e-38), dict(repeat_penalty=3.4e38),
    dict(presence_penalty=3.4e38), dict(frequency_penalty=-3.4e38), dict(presence_penalty=1e-320),
])
def test_edge_values_sample_without_warnings(edge):
    p = SamplingParams(**{**dict(top_k=0, top_p=1.0, min_p=0.0, repeat_last_n=-1), **edge})  # no truncation:
    # every token reaches the arithmetic
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a NumPy RuntimeWarning fails the test
        tokens = {sample(LOGITS, p, make_rng(s), HISTORY) for s in range(8)}
    assert tokens <= {0, 1, 2, 3, 4}


def test_a_vanishing_temperature_keeps_only_the_best_tokens():
    """(l - l_max) / 1e-320 overflows to -inf for every token below the best: weight 0, the limit of the
    formula, so only the tied best tokens are drawn."""
    x = LOGITS[:4]
    for t in (1e-320, 5e-324):
        assert {sample(x, SamplingParams(temperature=t, top_k=0), make_rng(s)) for s in range(16)} == {1, 2}


@pytest.mark.parametrize("bad, word", [
    (dict(repeat_penalty=1e-50), "repeat penalty"), (dict(repeat_penalty=1e-320), "repeat penalty"),
    (dict(repeat_penalty=1e-39), "repeat penalty"), (dict(repeat_penalty=1e300), "repeat penalty"),
    (dict(presence_penalty=1e300), "presence penalty"), (dict(frequency_penalty=-1e39), "frequency penalty"),
])
def test_penalties_float32_cannot_hold_are_refused(bad, word):
    """Penalties are float32 arithmetic (as in llama.cpp and the CUDA kernel): 1e-50 would be 0 there."""
    with pytest.raises(UsageError, match=word):
        SamplingParams(**bad).validate()


BIG = 10**400  # a JSON number of 401 digits: float() overflows on it


@pytest.mark.parametrize("bad, word", [
    (dict(temperature=BIG), "temperature"), (dict(temperature=-BIG), "temperature"),
    (dict(repeat_penalty=BIG), "repeat penalty"), (dict(presence_penalty=-BIG), "presence penalty"),
    (dict(top_k=BIG), "top-k"), (dict(top_k=2**31), "top-k"), (dict(repeat_last_n=2**31), "repeat-last-n"),
    (dict(seed=2**64), "seed"), (dict(seed=-BIG), "seed"),
])
def test_numbers_no_kernel_or_float_holds_are_refused_briefly(bad, word):
    """Integers past what a float, an int32 count or a 64-bit seed holds are refused in one short sentence
    (the value cut, not printed in full), where a float() once overflowed into an internal error."""
    with pytest.raises(UsageError, match=word) as exc:
        SamplingParams(**bad).validate()
    assert len(str(exc.value)) < 160
    assert SamplingParams(top_k=2**31 - 1, repeat_last_n=2**31 - 1, seed=2**64 - 1).validate()


@pytest.mark.parametrize("option", [["--repeat-penalty", "1e-50"], ["--repeat-penalty", "1e-320"],
                                    ["--presence-penalty", "1e300"], ["--frequency-penalty", "-1e300"]])
def test_cli_refuses_them_in_one_line(random_model, option):
    r = run("generate", "-m", str(random_model()), "--backend", "numpy", "-p", "hi", "-n", "2", *option)
    assert r.code == 2 and option[0][2:].replace("-", " ") in r.one_line_error()


def test_cli_tiny_temperature_is_greedy_and_quiet(random_model):
    """In a real process, where a NumPy warning would reach stderr."""
    common = ["-m", str(random_model()), "--backend", "numpy", "-p", "hello", "-n", "8", "--seed", "1", "-q"]
    r = run_subprocess("generate", *common, "--temp", "1e-320", "--min-p", "0")
    assert (r.code, r.err) == (0, "")
    greedy = run("generate", *common, "--greedy")
    assert greedy.code == 0 and r.out == greedy.out
