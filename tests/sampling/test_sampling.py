"""Sampling: hand-worked 4-token distributions, penalties, reproducibility, frequencies, edge cases."""

from __future__ import annotations

import math
import time
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llamacli.errors import NumericalError, UsageError
from llamacli.sampling.sampling import (
    SamplingParams,
    apply_penalties,
    categorical,
    greedy,
    make_rng,
    min_p_filter,
    sample,
    softmax,
    top_k_filter,
    top_p_filter,
)

NEG = -np.inf

# The distribution most tests use. Ranking (logit desc, id asc): id1 (0.5), id3 (0.25), id0 (0.125), id2 (0.125);
# id0 and id2 tie, so id0 comes first. In ascending id order the cumulative sums are [0.125, 0.625, 0.75, 1.0].
P = np.array([0.125, 0.5, 0.125, 0.25])
LOGITS = np.log(P).astype(np.float32)

# Every filter off, temperature 1: sample() draws straight from softmax(LOGITS) = P.
PLAIN = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


class FixedU:
    """A stand-in generator whose random() returns the given numbers, so the draw can be checked by hand."""

    def __init__(self, *us: float) -> None:
        self.us = list(us)

    def random(self) -> float:
        return self.us.pop(0)


def kept(x: np.ndarray) -> set[int]:
    return {int(i) for i in np.flatnonzero(x != NEG)}


# -- SamplingParams.validate ---------------------------------------------------------------------------------


def test_defaults_are_llama_cpp_and_valid():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty) == (1.0, 64, 0.0, 0.0)
    assert p.validate() is p and not p.greedy
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    "edge",
    [
        dict(temperature=0), dict(top_k=0), dict(top_p=1.0), dict(top_p=1e-9), dict(min_p=0.0), dict(min_p=1.0),
        dict(repeat_last_n=-1), dict(repeat_last_n=0), dict(presence_penalty=-2.0), dict(seed=0), dict(top_k=10**9),
    ],
)
def test_edge_values_are_valid(edge):
    SamplingParams(**edge).validate()


@pytest.mark.parametrize(
    "bad, word",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(top_k=-1), "top-k"),
        (dict(top_k=2.5), "top-k"),
        (dict(top_p=0.0), "top-p"),
        (dict(top_p=1.01), "top-p"),
        (dict(top_p=math.nan), "top-p"),
        (dict(min_p=-0.01), "min-p"),
        (dict(min_p=1.5), "min-p"),
        (dict(repeat_penalty=0.0), "repeat penalty"),
        (dict(repeat_penalty=-1.0), "repeat penalty"),
        (dict(repeat_last_n=-2), "repeat-last-n"),
        (dict(presence_penalty=math.inf), "presence penalty"),
        (dict(frequency_penalty=math.nan), "frequency penalty"),
        (dict(seed=-1), "seed"),
    ],
)
def test_invalid_values_raise_one_sentence(bad, word):
    with pytest.raises(UsageError) as e:
        SamplingParams(**bad).validate()
    assert word in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UsageError):  # sample validates too
        sample(LOGITS, SamplingParams(**bad), make_rng(0))


# -- greedy --------------------------------------------------------------------------------------------------


def test_greedy_is_argmax_with_lowest_id_on_ties():
    assert greedy(LOGITS) == 1
    assert greedy(np.array([1.0, 3.0, 3.0, 2.0], np.float32)) == 1  # tie between 1 and 2: lowest id
    assert greedy(np.array([NEG, NEG, -5.0], np.float32)) == 2
    assert greedy(np.array([7.0], np.float32)) == 0


def test_temperature_zero_draws_no_random_number_and_sees_penalties():
    rng = make_rng(5)
    before = rng.bit_generator.state
    g = SamplingParams(temperature=0.0, repeat_penalty=2.0)
    # [3.0, 2.9]: token 0 was just produced, 3.0 / 2 = 1.5 < 2.9, so the argmax moves to token 1.
    assert sample(np.array([3.0, 2.9], np.float32), g, rng, recent_tokens=[0]) == 1
    assert sample(np.array([3.0, 2.9], np.float32), g, rng) == 0
    assert rng.bit_generator.state == before


# -- penalties -----------------------------------------------------------------------------------------------


def test_penalties_by_hand():
    x = np.array([2.0, -1.0, 0.5, 3.0, 0.0], np.float32)
    recent = [0, 1, 1, 4, 1]  # counts: token 0 once, token 1 three times, token 4 once
    out = apply_penalties(x, recent, repeat_penalty=2.0, repeat_last_n=-1, frequency_penalty=0.5, presence_penalty=1.0)
    # token 0:  2.0 > 0 -> 2.0 / 2 = 1.0;   then - (1 * 0.5 + 1.0) = -0.5
    # token 1: -1.0 <= 0 -> -1.0 * 2 = -2.0 (once, not per occurrence); then - (3 * 0.5 + 1.0) = -4.5
    # token 2, 3: not in the window, unchanged
    # token 4:  0.0 <= 0 -> 0.0 * 2 = 0.0;  then - (1 * 0.5 + 1.0) = -1.5
    np.testing.assert_array_equal(out, np.array([-0.5, -4.5, 0.5, 3.0, -1.5], np.float32))
    np.testing.assert_array_equal(x, [2.0, -1.0, 0.5, 3.0, 0.0])  # input untouched


def test_repetition_penalty_alone_applies_once_per_distinct_token():
    x = np.array([2.0, -1.0, 0.5], np.float32)
    out = apply_penalties(x, [1, 1, 1, 0], repeat_penalty=2.0, repeat_last_n=-1)
    np.testing.assert_array_equal(out, [1.0, -2.0, 0.5])  # -1 * 2 = -2, not -1 * 2**3


def test_penalty_window_is_the_last_n_tokens():
    x = np.array([2.0, -1.0, 0.5, 3.0, 0.0], np.float32)
    out = apply_penalties(x, [0, 1, 1, 4, 1], repeat_penalty=2.0, repeat_last_n=2, presence_penalty=1.0)
    # window [4, 1]: token 1 -> -1 * 2 - 1 = -3; token 4 -> 0 * 2 - 1 = -1; token 0 is outside the window
    np.testing.assert_array_equal(out, [2.0, -3.0, 0.5, 3.0, -1.0])
    off = apply_penalties(x, [0, 1], repeat_penalty=2.0, repeat_last_n=0, presence_penalty=1.0)
    np.testing.assert_array_equal(off, x)
    for history in (np.array([0, 1, 1, 4, 1]), deque([0, 1, 1, 4, 1]), (0, 1, 1, 4, 1)):
        same = apply_penalties(x, history, repeat_penalty=2.0, repeat_last_n=2, presence_penalty=1.0)
        np.testing.assert_array_equal(same, out)


def test_penalties_keep_minus_inf_and_reject_foreign_ids():
    x = np.array([NEG, 1.0], np.float32)
    out = apply_penalties(x, [0, 1], repeat_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0)
    assert out[0] == NEG and out[1] == pytest.approx(1.0 / 1.5 - 2.0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        apply_penalties(x, [2], repeat_penalty=1.5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        apply_penalties(x, [-1], repeat_penalty=1.5)


# -- top-k, top-p, min-p -------------------------------------------------------------------------------------


def test_top_k_by_hand():
    assert kept(top_k_filter(LOGITS, 1)) == {1}
    assert kept(top_k_filter(LOGITS, 2)) == {1, 3}
    assert kept(top_k_filter(LOGITS, 3)) == {1, 3, 0}  # id0 and id2 tie at 0.125: the lower id stays
    assert kept(top_k_filter(LOGITS, 4)) == {0, 1, 2, 3}
    assert kept(top_k_filter(LOGITS, 40)) == {0, 1, 2, 3}  # k larger than the vocabulary
    assert kept(top_k_filter(LOGITS, 0)) == {0, 1, 2, 3}  # disabled
    out = top_k_filter(LOGITS, 2)
    np.testing.assert_array_equal(out[[1, 3]], LOGITS[[1, 3]])  # survivors keep their logits


def test_top_k_ties_and_minus_inf():
    flat = np.zeros(10, np.float32)
    assert kept(top_k_filter(flat, 3)) == {0, 1, 2}
    x = np.array([NEG, 1.0, NEG, 0.5], np.float32)
    assert kept(top_k_filter(x, 3)) == {1, 3}  # fewer finite tokens than k: all of them, no -inf revived


def test_top_p_by_hand():
    # ranking id1, id3, id0, id2 with cumulative probability 0.5, 0.75, 0.875, 1.0
    assert kept(top_p_filter(LOGITS, 0.4)) == {1}  # 0.5 >= 0.4
    assert kept(top_p_filter(LOGITS, 0.7)) == {1, 3}  # 0.5 < 0.7 <= 0.75
    assert kept(top_p_filter(LOGITS, 0.8)) == {1, 3, 0}  # 0.75 < 0.8 <= 0.875; id0 before id2 (tie)
    assert kept(top_p_filter(LOGITS, 0.9)) == {0, 1, 2, 3}  # 0.875 < 0.9
    assert kept(top_p_filter(LOGITS, 1.0)) == {0, 1, 2, 3}  # disabled
    assert kept(top_p_filter(LOGITS, 0.4, min_keep=3)) == {1, 3, 0}


def test_min_p_by_hand():
    # p_max = 0.5
    assert kept(min_p_filter(LOGITS, 0.6)) == {1}  # threshold 0.30
    assert kept(min_p_filter(LOGITS, 0.3)) == {1, 3}  # threshold 0.15: 0.25 passes, 0.125 does not
    assert kept(min_p_filter(LOGITS, 0.2)) == {0, 1, 2, 3}  # threshold 0.10
    assert kept(min_p_filter(LOGITS, 1.0)) == {1}  # only the best
    assert kept(min_p_filter(LOGITS, 0.0)) == {0, 1, 2, 3}  # disabled
    assert kept(min_p_filter(LOGITS, 0.6, min_keep=2)) == {1, 3}
    assert kept(min_p_filter(np.array([2.0, 2.0, 0.0], np.float32), 1.0)) == {0, 1}  # ties with the max pass


def test_filters_do_not_modify_their_input():
    x = LOGITS.copy()
    for out in (top_k_filter(x, 2), top_p_filter(x, 0.5), min_p_filter(x, 0.5), softmax(x, 0.5)):
        assert out is not None
    np.testing.assert_array_equal(x, LOGITS)


# -- temperature and the draw --------------------------------------------------------------------------------


def test_softmax_with_temperature_by_hand():
    np.testing.assert_allclose(softmax(LOGITS), P, rtol=1e-6)
    # T = 2: weights sqrt(P) = [0.35355, 0.70711, 0.35355, 0.5], sum 1.91421
    np.testing.assert_allclose(softmax(LOGITS, 2.0), [0.18470, 0.36940, 0.18470, 0.26120], atol=1e-5)
    # T = 0.5: weights P^2 = [1, 16, 1, 4] / 64, sum 22/64
    np.testing.assert_allclose(softmax(LOGITS, 0.5), np.array([1, 16, 1, 4]) / 22, rtol=1e-6)
    np.testing.assert_array_equal(softmax(LOGITS, 0.0), [0, 1, 0, 0])
    assert softmax(np.array([NEG, 0.0], np.float32))[0] == 0.0


@pytest.mark.parametrize("u, token", [(0.0, 0), (0.1, 0), (0.2, 1), (0.6, 1), (0.7, 2), (0.8, 3), (0.999, 3)])
def test_draw_walks_ascending_ids(u, token):
    # cumulative sums in id order: [0.125, 0.625, 0.75, 1.0]; the answer is the first one > u
    assert sample(LOGITS, PLAIN, FixedU(u)) == token
    assert categorical(P, FixedU(u)) == token


def test_draw_never_picks_zero_probability_tokens():
    x = np.array([NEG, 0.0, NEG, 0.0], np.float32)  # weights [0, 1, 0, 1], cumulative over kept ids [1, 2]
    assert sample(x, PLAIN, FixedU(0.0)) == 1
    assert sample(x, PLAIN, FixedU(0.49)) == 1  # 0.98 < 1
    assert sample(x, PLAIN, FixedU(0.5)) == 3  # u * sum = 1.0, first cumulative > 1.0 is token 3
    assert categorical(np.array([0.0, 0.5, 0.0, 0.5]), FixedU(0.0)) == 1


def test_chain_order_by_hand():
    p = SamplingParams(temperature=2.0, top_k=3, top_p=0.7, min_p=0.3)
    # top-k 3 keeps {1, 3, 0}, renormalized: 0.5/0.875 = 0.571, 0.25/0.875 = 0.286, 0.143
    # top-p 0.7: 0.571 < 0.7 <= 0.857 -> {1, 3}, now [2/3, 1/3]
    # min-p 0.3: threshold 0.3 * 2/3 = 0.2 <= 1/3 -> {1, 3}
    # T = 2: weights sqrt(0.5) = 0.7071, sqrt(0.25) = 0.5 -> [0.5858, 0.4142] in id order 1, 3
    assert sample(LOGITS, p, FixedU(0.58)) == 1
    assert sample(LOGITS, p, FixedU(0.59)) == 3
    rng = make_rng(2024)
    counts = np.bincount([sample(LOGITS, p, rng) for _ in range(20000)], minlength=4) / 20000
    # sigma = sqrt(0.5858 * 0.4142 / 20000) = 0.0035; 0.015 is over 4 sigma (and the seed is fixed)
    np.testing.assert_allclose(counts, [0, 0.5858, 0, 0.4142], atol=0.015)


def test_top_p_sees_probabilities_after_top_k_not_the_raw_ones():
    # top-k 2 leaves {1, 3} = [2/3, 1/3]; 2/3 >= 0.6, so top-p keeps only token 1 (over the raw
    # distribution 0.5 < 0.6 it would have kept two).
    p = SamplingParams(temperature=1.0, top_k=2, top_p=0.6, min_p=0.0)
    rng = make_rng(0)
    assert {sample(LOGITS, p, rng) for _ in range(200)} == {1}


def test_truncation_happens_before_temperature():
    # top-p 0.7 keeps {1, 3} at temperature 1; a huge temperature flattens only what is left
    p = SamplingParams(temperature=100.0, top_k=0, top_p=0.7, min_p=0.0)
    rng = make_rng(1)
    counts = np.bincount([sample(LOGITS, p, rng) for _ in range(4000)], minlength=4) / 4000
    assert counts[0] == counts[2] == 0
    np.testing.assert_allclose(counts[[1, 3]], [0.5, 0.5], atol=0.04)  # weights 0.5^0.01 vs 0.25^0.01, ~0.502


# -- reproducibility and frequencies ------------------------------------------------------------------------


def test_same_seed_same_tokens():
    logits = (np.random.default_rng(0).standard_normal(1000) * 2).astype(np.float32)
    p = SamplingParams(repeat_penalty=1.1, seed=42)

    def run(seed: int) -> list[int]:
        rng, recent = make_rng(seed), []
        for _ in range(50):
            recent.append(sample(logits, p, rng, recent))
        return recent

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_golden_draws_for_seed_0():
    # Pins the whole path (PCG64 stream, rng.random(), ascending-id walk). A change here changes what
    # `--seed 0` produces for users, and what a GPU sampler must reproduce.
    # make_rng(0).random(12) = 0.637 0.270 0.041 0.017 0.813 0.913 0.607 0.729 0.544 0.935 0.816 0.003;
    # against the id-order cumulative sums [0.125, 0.625, 0.75, 1.0] (first one > u):
    expected = [2, 1, 0, 0, 3, 3, 1, 2, 1, 3, 3, 0]
    np.testing.assert_allclose(make_rng(0).random(3), [0.63696169, 0.26978671, 0.04097352], atol=1e-8)
    rng = make_rng(0)
    assert [sample(LOGITS, PLAIN, rng) for _ in range(12)] == expected


def test_frequencies_match_the_distribution():
    rng = make_rng(1234)
    n = 20000
    counts = np.bincount([sample(LOGITS, PLAIN, rng) for _ in range(n)], minlength=4) / n
    # the largest sigma is sqrt(0.5 * 0.5 / 20000) = 0.0035; allow 0.015 (over 4 sigma)
    np.testing.assert_allclose(counts, P, atol=0.015)
    rng = make_rng(99)
    warm = SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0)
    counts = np.bincount([sample(LOGITS, warm, rng) for _ in range(n)], minlength=4) / n
    np.testing.assert_allclose(counts, [0.18470, 0.36940, 0.18470, 0.26120], atol=0.015)


# -- edge cases ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [SamplingParams(), PLAIN, SamplingParams(temperature=0), SamplingParams(top_k=1)])
def test_vocab_of_one(params):
    assert sample(np.array([-3.0], np.float32), params, make_rng(0), recent_tokens=[0, 0]) == 0


def test_all_equal_logits_with_top_k_keep_the_lowest_ids():
    rng = make_rng(3)
    p = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    seen = np.bincount([sample(np.zeros(10, np.float32), p, rng) for _ in range(3000)], minlength=10)
    assert set(np.flatnonzero(seen)) == {0, 1, 2}
    np.testing.assert_allclose(seen[:3] / 3000, [1 / 3] * 3, atol=0.04)
    assert sample(np.zeros(10, np.float32), SamplingParams(), rng) in range(10)  # defaults: 40 > 10 tokens


def test_minus_inf_entries_are_never_sampled():
    x = np.full(100, NEG, np.float32)
    x[[7, 50, 93]] = [0.0, 0.1, -0.1]
    rng = make_rng(0)
    for params in (SamplingParams(), PLAIN, SamplingParams(top_k=2), SamplingParams(temperature=5.0, min_p=0.0)):
        assert {sample(x, params, rng) for _ in range(300)} <= {7, 50, 93}


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_plus_inf_raise(bad):
    x = LOGITS.copy()
    x[2] = bad
    for call in (
        lambda: sample(x, SamplingParams(), make_rng(0)),
        lambda: sample(x, SamplingParams(temperature=0), make_rng(0)),
        lambda: top_k_filter(x, 2),
        lambda: top_p_filter(x, 0.5),
        lambda: min_p_filter(x, 0.1),
        lambda: apply_penalties(x, [0], repeat_penalty=1.2),
        lambda: greedy(x),
    ):
        with pytest.raises(NumericalError):
            call()


def test_all_minus_inf_raises():
    with pytest.raises(NumericalError, match="-inf"):
        sample(np.full(4, NEG, np.float32), SamplingParams(), make_rng(0))


def test_bad_shapes_are_programming_errors():
    with pytest.raises(ValueError):
        sample(np.zeros((2, 3), np.float32), SamplingParams(), make_rng(0))
    with pytest.raises(ValueError):
        sample(np.zeros(0, np.float32), SamplingParams(), make_rng(0))


# -- properties ----------------------------------------------------------------------------------------------


logit_vectors = st.lists(
    st.one_of(st.floats(-20, 20, allow_nan=False, width=32), st.just(-np.inf)), min_size=1, max_size=40
).filter(lambda v: any(np.isfinite(v)))


@settings(max_examples=150, deadline=None)
@given(
    v=logit_vectors,
    k=st.integers(0, 45),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    temperature=st.floats(0.05, 5.0),
    u=st.floats(0.0, 0.999999),
)
def test_sample_stays_inside_what_the_public_filters_keep(v, k, top_p, min_p, temperature, u):
    x = np.array(v, np.float32)
    p = SamplingParams(temperature=temperature, top_k=k, top_p=top_p, min_p=min_p)
    survivors = kept(min_p_filter(top_p_filter(top_k_filter(x, k), top_p), min_p))
    assert survivors and sample(x, p, FixedU(u)) in survivors


@settings(max_examples=150, deadline=None)
@given(v=logit_vectors, k=st.integers(1, 45))
def test_top_k_keeps_a_head_of_the_ranking(v, k):
    x = np.array(v, np.float32)
    out = top_k_filter(x, k)
    finite = np.flatnonzero(np.isfinite(x))
    keep = kept(out)
    assert len(keep) == min(k, finite.size)
    rank = sorted(finite, key=lambda i: (-x[i], i))
    assert keep == set(int(i) for i in rank[: len(keep)])


# -- speed ---------------------------------------------------------------------------------------------------


def _median_s(fn, n: int = 30) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def test_no_full_sort_of_a_152k_vocabulary():
    """The sampler selects candidates (argpartition) instead of sorting the vocabulary: per token it costs less
    than one argsort of the logits, timed on the same machine in the same run (a ratio, not a speed target)."""
    logits = (np.random.default_rng(0).standard_normal(151936) * 3).astype(np.float32)
    recent = list(np.random.default_rng(1).integers(0, 151936, 64))
    rng = make_rng(0)
    full_sort = _median_s(lambda: np.argsort(-logits))
    for params in (SamplingParams(), SamplingParams(repeat_penalty=1.1, frequency_penalty=0.1)):
        took = _median_s(lambda: sample(logits, params, rng, recent))
        assert took < full_sort, f"median {took * 1e3:.2f} ms per token, argsort {full_sort * 1e3:.2f} ms"


def test_has_penalties():
    assert not SamplingParams().has_penalties  # llama.cpp's defaults: repeat penalty 1, no presence/frequency
    assert SamplingParams(repeat_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties and SamplingParams(frequency_penalty=-0.2).has_penalties
    assert not SamplingParams(repeat_penalty=1.5, repeat_last_n=0).has_penalties  # an empty window


def test_penalties_that_overflow_keep_finite_logits_finite():
    """A finite logit penalised past float32's range stays the lowest finite value instead of becoming -inf
    (masked: all -inf would raise, and greedy could pick a masked token) or +inf; -inf stays -inf."""
    ninf = -np.inf
    x = np.array([ninf, -1e38, ninf], dtype=np.float32)
    p = SamplingParams(repeat_penalty=10.0)
    out = apply_penalties(x, [1], repeat_penalty=10.0)
    assert out[1] == -np.finfo(np.float32).max and np.isneginf(out[[0, 2]]).all()
    assert sample(x, p, make_rng(0), [1]) == 1  # the only candidate, penalised but not masked
    assert sample(x, SamplingParams(temperature=0.0, repeat_penalty=10.0), make_rng(0), [1]) == 1
    y = np.array([1.0, 2.0, 0.5], dtype=np.float32)
    huge = SamplingParams(frequency_penalty=3e38)
    assert sample(y, huge, make_rng(0), [0, 1, 0, 1]) == 2  # both penalised to the floor: token 2 wins
    assert np.isfinite(apply_penalties(y, [0, 1], presence_penalty=-3e38)).all()  # no +inf either
