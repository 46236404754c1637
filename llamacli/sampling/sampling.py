"""Sampling: pure functions from logits [vocab] to the next token id, with an explicit seeded generator.

After llama2.c (run.c) and mlx-lm (sample_utils.py); the order of the steps is llama.cpp's default sampler
chain (common/sampling.cpp, with the samplers we do not have left out):

    logits [vocab] float32
      -> apply_penalties   repetition, frequency and presence penalties over the last N tokens
      -> top_k_filter      keep the k best tokens
      -> top_p_filter      keep the smallest head of the ranking whose probability reaches top_p
      -> min_p_filter      keep tokens with p >= min_p * p_max
      -> softmax(logits / temperature), one uniform number u from the generator -> token id

Every filter takes logits and returns logits with the dropped tokens set to -inf; none modifies its input
(one may return its input unchanged when it has nothing to do). `sample` runs the whole chain.

The semantics, stated once; a GPU sampler must reproduce them exactly:

- Ranking. Truncation uses one total order over tokens: logit descending, then token id ascending. "The
  best k" means the first k in that order, so ties at the cut keep the lowest ids. Tokens whose logit is
  -inf are never candidates (they have probability 0 and are never sampled).
- Penalties (llama.cpp `penalties`). The window is the last `repeat_last_n` entries of `recent_tokens`
  (0 = no penalties at all, -1 = all of them). For each distinct token t in the window, occurring c times:
  repetition first: logit > 0 -> logit / repeat_penalty, else logit * repeat_penalty (once per distinct
  token, whatever c); then logit -= c * frequency_penalty + presence_penalty. Arithmetic in float32, so a
  penalty float32 cannot hold (a repeat penalty of 1e-50 would round to 0) is refused by validate().
- Truncation sees probabilities at temperature 1: top-p and min-p use softmax(logits) before temperature,
  because temperature comes last in llama.cpp's chain (mlx-lm does the same; Hugging Face transformers
  applies temperature first, so its top-p keeps a different set when temperature != 1).
- Each filter sees only the candidates the step before kept, so probabilities are renormalized between
  steps (as in llama.cpp): after top-k 2 of [0.5, 0.25, ...], top-p sees [2/3, 1/3].
- top_k: 0 disables; k >= number of candidates keeps them all.
- top_p: 1 disables. With w_i = exp(l_i - l_max) over the candidates (float64), keep the shortest head of
  the ranking whose cumulative weight is >= top_p * sum(w), and at least min_keep tokens.
- min_p: 0 disables. Keep l_i >= l_max + ln(min_p) (the same as p_i >= min_p * p_max), compared in
  float64, and at least min_keep tokens. The best token always passes.
- min_keep is 1 in `sample` (llama.cpp's default, 0, behaves as 1: both filters always keep the best).
- Temperature 0 is greedy: the argmax of the penalized logits, lowest id on ties; no filter runs (each
  keeps the argmax anyway) and no random number is drawn.
- Draw. Weights w_i = exp((l_i - l_max) / temperature) over the kept tokens, in float64. One number
  u = rng.random() (a float64 in [0, 1)) per call. Walking the kept tokens in ascending id order, the
  answer is the first token whose cumulative weight exceeds u * sum(w). A temperature so small (1e-320)
  that (l_i - l_max) / temperature overflows gives those tokens weight 0, the limit: only the best remain.
- Errors. NaN or +inf in the logits raises NumericalError (a broken model), as do logits that are all -inf.

Deviations from llama.cpp, and why:
- Ties: llama.cpp's partial sort leaves equal logits in no particular order, so which tied token survives
  top-k is unspecified there; here the lowest id survives, so results are reproducible.
- Draw order: llama.cpp walks the candidates in their current order (sorted by probability once top-p has
  run) with a double from mt19937 and the test cum >= u * sum; we walk ascending ids with numpy's PCG64
  and the test cum > u * sum (so a zero-weight token is never chosen). The distribution is the same; a
  seed maps to different tokens than in llama.cpp, as it would anyway with another generator. Ascending ids
  need no sort, which suits a GPU kernel (a mask and a prefix sum).
- -inf tokens: llama.cpp keeps them as zero-probability candidates that can fill top-k slots; dropping
  them changes no probability.
- Precision: llama.cpp works in float32 (expf, a float32 running sum in top-p, logf in min-p); we compute
  weights, sums and the min-p threshold in float64. Results differ only when a cumulative sum or a ratio
  lands within float32 rounding of its threshold.
- repeat_last_n = -1: llama.cpp turns -1 into the context size when it parses arguments; here -1 means all
  of `recent_tokens`, which the caller bounds by the context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..errors import NumericalError
from .params import SamplingParams, is_finite_real  # noqa: F401 (SamplingParams: the API names it here too)

__all__ = [
    "SamplingParams",
    "make_rng",
    "apply_penalties",
    "top_k_filter",
    "top_p_filter",
    "min_p_filter",
    "softmax",
    "categorical",
    "greedy",
    "sample",
]

_NEG_INF = np.float32(-np.inf)

def make_rng(seed: int | None) -> np.random.Generator:
    """The generator `sample` draws from: PCG64 seeded with `seed` (None = fresh OS entropy)."""
    return np.random.Generator(np.random.PCG64(seed))


# -- checks and the candidate form --------------------------------------------------------------------------
#
# Inside, a step works on the candidates only: ids [n] int64 ascending (tokens whose logit is not -inf) and
# their logits vals [n] float32. Filtering with a boolean mask keeps ids ascending. kernels/sampling.cu runs
# the same chain over its top-k candidates on the device (tests/backends/cuda/test_gpu_kernels.py holds the two together).


def _as_logits(logits: np.ndarray) -> np.ndarray:
    """The logits as a 1-D float32 array, after the checks every step makes."""
    x = np.asarray(logits, dtype=np.float32)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D array [vocab], got shape {x.shape}")
    top = x.max()  # NaN propagates through max: one pass checks for NaN, +inf and all -inf
    if np.isnan(top):
        raise NumericalError(f"the logits contain NaN ({int(np.isnan(x).sum())} of {x.size}): the model output is broken")
    if top == np.inf:
        raise NumericalError("the logits contain +inf: the model output is broken")
    if top == -np.inf:
        raise NumericalError(f"all {x.size} logits are -inf: no token can be sampled")
    return x


def _candidates(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids = np.flatnonzero(x != _NEG_INF)
    return ids, x[ids]


def _scatter(size: int, ids: np.ndarray, vals: np.ndarray) -> np.ndarray:
    out = np.full(size, _NEG_INF, dtype=np.float32)
    out[ids] = vals
    return out


def _keep_best(ids: np.ndarray, vals: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The first k candidates in the ranking (logit desc, id asc), still in ascending id order."""
    n = vals.size
    if k >= n:
        return ids, vals
    kth = np.partition(vals, n - k)[n - k]  # the k-th largest logit
    keep = vals > kth
    ties = np.flatnonzero(vals == kth)  # ascending ids: the lowest tied ids come first
    keep[ties[: k - int(keep.sum())]] = True
    return ids[keep], vals[keep]


# -- the steps -----------------------------------------------------------------------------------------------


def apply_penalties(
    logits: np.ndarray,
    recent_tokens: Sequence[int] | np.ndarray | None,
    *,
    repeat_penalty: float = 1.0,
    repeat_last_n: int = 64,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> np.ndarray:
    """Penalize tokens seen in the last `repeat_last_n` of `recent_tokens` (llama.cpp's `penalties`)."""
    x = _as_logits(logits)
    if recent_tokens is None or repeat_last_n == 0:
        return x
    if repeat_penalty == 1.0 and presence_penalty == 0.0 and frequency_penalty == 0.0:
        return x
    if repeat_last_n > 0:  # slice first: the history may be the whole context
        try:
            recent_tokens = recent_tokens[-repeat_last_n:]
        except TypeError:  # a deque, say
            recent_tokens = list(recent_tokens)[-repeat_last_n:]
    window = np.asarray(recent_tokens, dtype=np.int64).reshape(-1)
    if window.size == 0:
        return x
    if window.min() < 0 or window.max() >= x.size:
        bad = window[(window < 0) | (window >= x.size)][0]
        raise ValueError(f"recent token id {bad} is outside the vocabulary [0, {x.size})")
    tokens, counts = np.unique(window, return_counts=True)  # each distinct token once
    old = x[tokens]
    # Dividing a negative logit would raise its probability: multiply those instead (llama.cpp, CTRL paper fix).
    with np.errstate(over="ignore"):
        v = np.where(old > 0, old / np.float32(repeat_penalty), old * np.float32(repeat_penalty))
        v = v - (counts * np.float32(frequency_penalty) + np.float32(presence_penalty)).astype(np.float32)
    # A finite logit stays finite: a huge penalty that overflows float32 must not turn it into -inf (masked,
    # or all -inf) or +inf; a -inf logit (masked) stays -inf.
    finite = np.finfo(np.float32).max
    v = np.where(np.isneginf(old), old, np.clip(v, -finite, finite))
    out = x.copy()
    out[tokens] = v
    return out


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the k best tokens (ties at the cut: lowest ids); k <= 0 keeps all."""
    x = _as_logits(logits)
    if k <= 0 or k >= x.size:
        return x
    return _scatter(x.size, *_top_k(x, k))


def _top_k(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The candidates that top-k keeps, straight from the full logits [vocab] (no 152k-long gather)."""
    if k <= 0 or k >= x.size:
        return _candidates(x)
    kth = np.partition(x, x.size - k)[x.size - k]  # the k-th largest logit
    if kth == _NEG_INF:  # fewer than k candidates: keep them all
        return _candidates(x)
    above = np.flatnonzero(x > kth)
    ties = np.flatnonzero(x == kth)[: k - above.size]  # ascending ids: the lowest tied ids
    ids = np.sort(np.concatenate([above, ties]))
    return ids, x[ids]


def top_p_filter(logits: np.ndarray, top_p: float, min_keep: int = 1) -> np.ndarray:
    """Nucleus: keep the shortest head of the ranking whose probability reaches top_p (at least min_keep)."""
    x = _as_logits(logits)
    if top_p >= 1.0:
        return x
    return _scatter(x.size, *_top_p(*_candidates(x), top_p, min_keep))


def _top_p(ids: np.ndarray, vals: np.ndarray, top_p: float, min_keep: int) -> tuple[np.ndarray, np.ndarray]:
    if top_p >= 1.0 or vals.size <= max(min_keep, 1):
        return ids, vals
    desc = np.sort(vals)[::-1].astype(np.float64)  # ties have equal weights, so their order does not matter
    cum = np.cumsum(np.exp(desc - desc[0]))
    k = int(np.searchsorted(cum, top_p * cum[-1], side="left")) + 1  # first prefix with cum >= p * total
    return _keep_best(ids, vals, max(k, min_keep, 1))


def min_p_filter(logits: np.ndarray, min_p: float, min_keep: int = 1) -> np.ndarray:
    """Keep tokens whose probability is at least min_p times the best one's (at least min_keep)."""
    x = _as_logits(logits)
    if min_p <= 0.0:
        return x
    return _scatter(x.size, *_min_p(*_candidates(x), min_p, min_keep))


def _min_p(ids: np.ndarray, vals: np.ndarray, min_p: float, min_keep: int) -> tuple[np.ndarray, np.ndarray]:
    if min_p <= 0.0:
        return ids, vals
    threshold = float(vals.max()) + math.log(min_p)  # p_i >= min_p * p_max  <=>  l_i >= l_max + ln(min_p)
    keep = vals.astype(np.float64) >= threshold
    if int(keep.sum()) < min_keep:
        return _keep_best(ids, vals, min_keep)
    return ids[keep], vals[keep]


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Probabilities [vocab] float64 of softmax(logits / temperature); temperature 0 gives the argmax one-hot."""
    x = _as_logits(logits)
    probs = np.zeros(x.size, dtype=np.float64)
    if temperature == 0:
        probs[int(np.argmax(x))] = 1.0
        return probs
    ids, vals = _candidates(x)
    w = _weights(vals, temperature)
    probs[ids] = w / w.sum()
    return probs


def _weights(vals: np.ndarray, temperature: float) -> np.ndarray:
    """exp((l - l_max) / T) in float64. A temperature so small (1e-320) that a gap overflows to -inf gives
    weight 0, the limit the formula tends to: only the best tokens stay, as in greedy."""
    v = vals.astype(np.float64)
    with np.errstate(over="ignore"):
        return np.exp((v - v.max()) / temperature)


def categorical(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw a token id from probabilities (or any nonnegative weights) [vocab]: see `_draw`."""
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1 or p.size == 0 or not np.all(np.isfinite(p)) or p.min() < 0 or p.max() <= 0:
        raise NumericalError("probabilities must be finite, nonnegative and not all zero")
    ids = np.flatnonzero(p > 0)
    return int(ids[_draw(p[ids], rng)])


def _draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """Index of the first weight (in the order given) whose running sum exceeds u * sum, u = rng.random()."""
    cum = np.cumsum(weights)
    i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    if i >= weights.size:  # u * sum rounded up to sum: take the last token that has weight
        i = int(np.flatnonzero(weights > 0)[-1])
    return i


def greedy(logits: np.ndarray) -> int:
    """argmax, lowest id on ties."""
    return int(np.argmax(_as_logits(logits)))


def sample(
    logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    recent_tokens: Sequence[int] | np.ndarray | None = None,
) -> int:
    """The next token id: penalties -> top-k -> top-p -> min-p -> temperature -> draw (module docstring)."""
    params.validate()
    x = apply_penalties(
        logits,
        recent_tokens,
        repeat_penalty=params.repeat_penalty,
        repeat_last_n=params.repeat_last_n,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
    )
    if params.greedy:
        return int(np.argmax(x))
    ids, vals = _top_k(x, params.top_k)
    ids, vals = _top_p(ids, vals, params.top_p, 1)
    ids, vals = _min_p(ids, vals, params.min_p, 1)
    return int(ids[_draw(_weights(vals, params.temperature), rng)])
