"""Measuring the CUDA backend: `bench --profile`'s time per kernel family and bench's GPU clock (`elapsed`).
`bench --kernels`' micro-benchmarks of single kernels are kernel_bench.py.

Profiling: each Backend operation is wrapped in `profiled(family)` and each part of the fused prefill and
decode step in `profiler.section(name)`; while `Profiler.profile()` runs they record CUDA events around their
launches and count them, otherwise they cost one attribute test.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

from . import loader as K


class _Section:
    """Events around one family's launches (Profiler.profile)."""

    def __init__(self, profiler: "Profiler", name: str):
        self.profiler, self.name = profiler, name

    def __enter__(self) -> None:
        self.n0 = K.launch_count()
        self.a = self.profiler.cp.cuda.Event()
        self.a.record()

    def __exit__(self, *exc: object) -> None:
        b = self.profiler.cp.cuda.Event()
        b.record()
        if self.profiler.records is not None:
            self.profiler.records.append((self.name, self.a, b, K.launch_count() - self.n0))


_NULL = contextlib.nullcontext()


def profiled(fam: str | None = None) -> Callable:
    """Time a method of an object with a `profiler` (a Profiler) under `fam` while profiling (matmul: the
    family of its weight, args[1])."""

    def deco(op: Callable) -> Callable:
        @functools.wraps(op)
        def timed(self: Any, *args: Any, **kw: Any) -> Any:
            prof = self.profiler
            if prof.records is None:
                return op(self, *args, **kw)
            with _Section(prof, fam or prof.families.get(id(args[1]), "other")):
                return op(self, *args, **kw)

        return timed

    return deco


class Profiler:
    """The CUDA backend's measuring part: the sections being recorded (while profile() runs) and the kernel
    family of each weight (the profile's rows for matmul)."""

    def __init__(self, cp: Any):
        self.cp = cp
        self.records: list | None = None  # (section, start event, end event, our launches) while profiling
        self.families: dict[int, str] = {}  # id(weight handle) -> kernel family

    @property
    def active(self) -> bool:
        return self.records is not None

    def section(self, name: str) -> Any:
        """Context for one kernel family's launches: CUDA events around them while profiling, else nothing."""
        if self.records is None:
            return _NULL
        return _Section(self, name)

    def profile(self, fn: Callable[[], Any], spin_ms: float = 50.0) -> tuple[list[tuple[str, float, int]], float]:
        """Run fn() (op-by-op or un-captured launches) with events around each section; -> ([(section, ms,
        our launches)] in first-seen order, total ms). A spin kernel holds the GPU while the host queues
        the work, so the kernels run back to back as in a graph replay (no host launch gaps); if queueing
        takes longer than the spin, the gaps show up in the total but not in the sections."""
        cp = self.cp
        K.launch("elementwise", "spin_ns", (1,), (1,), ns=int(spin_ms * 1e6))
        self.records = []
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        try:
            fn()
        finally:
            end.record()
            recs, self.records = self.records, None
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
