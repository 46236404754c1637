"""Measuring the CUDA backend: `bench --profile`'s time per kernel family and bench's GPU clock (`elapsed`).
`bench --kernels`' micro-benchmarks of single kernels are kernel_bench.py.

Profiling: each Backend operation is wrapped in `profiled(family)` and each part of the fused prefill and
decode step in `self._section(name)`; while `profile()` runs they record CUDA events around their launches
and count them, otherwise they cost one attribute test.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

from . import loader as K


class _Section:
    """Events around one family's launches (CudaBackend.profile)."""

    def __init__(self, be: Any, name: str):
        self.be, self.name = be, name

    def __enter__(self) -> None:
        self.n0 = K.launch_count()
        self.a = self.be.cp.cuda.Event()
        self.a.record()

    def __exit__(self, *exc: object) -> None:
        b = self.be.cp.cuda.Event()
        b.record()
        if self.be._prof is not None:
            self.be._prof.append((self.name, self.a, b, K.launch_count() - self.n0))


_NULL = contextlib.nullcontext()


def profiled(fam: str | None = None) -> Callable:
    """Time a Backend operation under `fam` while profiling (matmul: the weight's family)."""

    def deco(op: Callable) -> Callable:
        @functools.wraps(op)
        def timed(self: Any, *args: Any, **kw: Any) -> Any:
            if self._prof is None:
                return op(self, *args, **kw)
            with _Section(self, fam or self._wfam.get(id(args[1]), "other")):
                return op(self, *args, **kw)

        return timed

    return deco


class ProfileMixin:
    """CudaBackend's measuring hooks (mixed into backend.CudaBackend)."""

    cp: Any
    _prof: list | None  # (section, start event, end event, our launches) while profiling

    def _section(self, name: str) -> Any:
        """Context for one kernel family's launches: CUDA events around them while profiling, else nothing."""
        if self._prof is None:
            return _NULL
        return _Section(self, name)

    def profile(self, fn: Callable[[], Any], spin_ms: float = 50.0) -> tuple[list[tuple[str, float, int]], float]:
        """Run fn() (op-by-op or un-captured launches) with events around each section; -> ([(section, ms,
        our launches)] in first-seen order, total ms). A spin kernel holds the GPU while the host queues
        the work, so the kernels run back to back as in a graph replay (no host launch gaps); if queueing
        takes longer than the spin, the gaps show up in the total but not in the sections."""
        cp = self.cp
        K.launch("elementwise", "spin_ns", (1,), (1,), ns=int(spin_ms * 1e6))
        self._prof = []
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        try:
            fn()
        finally:
            end.record()
            recs, self._prof = self._prof, None
        end.synchronize()
        agg: dict[str, list] = {}
        for name, a, b, n in recs:
            v = agg.setdefault(name, [0.0, 0])
            v[0] += cp.cuda.get_elapsed_time(a, b)
            v[1] += n
        return [(k, v[0], v[1]) for k, v in agg.items()], cp.cuda.get_elapsed_time(start, end)

    def elapsed(self, fn: Callable[[], Any]) -> float:
        """Seconds fn() takes on the GPU timeline (CUDA events around it; bench's clock)."""
        cp = self.cp
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        return cp.cuda.get_elapsed_time(a, b) / 1e3
