"""The sampling settings (SamplingParams) and their checks, apart from the sampler itself (sampling.py) and
without NumPy: a command checks its options with them before anything loads numpy (and a command handed to
the resident server, cli/keep_alive.py, never loads it)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from ..errors import UsageError
from ..textio import brief

# Penalties are applied in float32 (as llama.cpp and the CUDA kernel do): a value outside float32's normal
# range would round to 0 or inf there and divide by zero.
_F32_TINY, _F32_MAX = 2.0**-126, (2.0 - 2.0**-23) * 2.0**127  # numpy.finfo(float32)'s tiny and max


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; the defaults are llama.cpp's, except seed=None (fresh entropy each run)."""

    temperature: float = 0.8  # 0 = greedy (argmax)
    top_k: int = 40  # 0 = disabled
    top_p: float = 0.95  # 1 = disabled; must lie in (0, 1]
    min_p: float = 0.05  # 0 = disabled; must lie in [0, 1]
    repeat_penalty: float = 1.0  # 1 = disabled; must be > 0
    repeat_last_n: int = 64  # window of recent tokens that penalties see; 0 = none, -1 = all
    presence_penalty: float = 0.0  # subtracted once from every token in the window
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the window
    seed: int | None = None  # None = nondeterministic

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty changes a logit (a window of 0 turns them all off)."""
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

    def validate(self) -> SamplingParams:
        """Raise UsageError (one sentence) for a value that cannot work; return self otherwise."""
        t = self.temperature
        if not _is_real(t) or not (0 <= t and is_finite_real(t)):
            raise UsageError(f"temperature must be a finite number >= 0 (0 = greedy), got {brief(t)}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= _I32_MAX:
            raise UsageError(f"top-k must be an integer from 0 to {_I32_MAX} (0 = disabled), got {brief(self.top_k)}")
        if not _is_real(self.top_p) or not (0 < self.top_p <= 1):
            raise UsageError(f"top-p must lie in (0, 1] (1 = disabled), got {brief(self.top_p)}")
        if not _is_real(self.min_p) or not (0 <= self.min_p <= 1):
            raise UsageError(f"min-p must lie in [0, 1] (0 = disabled), got {brief(self.min_p)}")
        r = self.repeat_penalty
        if not _is_real(r) or not (0 < r and is_finite_real(r)):
            raise UsageError(f"repeat penalty must be a finite number > 0 (1 = disabled), got {brief(r)}")
        if not _F32_TINY <= r <= _F32_MAX:
            raise UsageError(f"repeat penalty must lie in [{_F32_TINY:.3g}, {_F32_MAX:.3g}] (float32), got {r!r}")
        if not _is_int(self.repeat_last_n) or not -1 <= self.repeat_last_n <= _I32_MAX:
            raise UsageError(f"repeat-last-n must be an integer from -1 to {_I32_MAX} (0 = none, -1 = whole "
                             f"context), got {brief(self.repeat_last_n)}")
        for name, v in (("presence penalty", self.presence_penalty), ("frequency penalty", self.frequency_penalty)):
            if not is_finite_real(v):
                raise UsageError(f"{name} must be a finite number, got {brief(v)}")
            if abs(v) > _F32_MAX:
                raise UsageError(f"{name} must lie in [{-_F32_MAX:.3g}, {_F32_MAX:.3g}] (float32), got {v!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _U64_MAX):
            raise UsageError(f"seed must be an integer from 0 to {_U64_MAX}, got {brief(self.seed)}")
        return self


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


_I32_MAX, _U64_MAX = 2**31 - 1, 2**64 - 1  # counts the kernels take as int32; seeds as llama.cpp's and OpenAI's


def is_finite_real(v: object) -> bool:
    """A real number (not a bool) that a float holds finitely: an integer of hundreds of digits is not one
    (float() overflows on it), nor are inf and NaN."""
    if not _is_real(v):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)
