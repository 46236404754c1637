"""When the CLI's entry (llamacli.run) began, which --verbose's start-up stages count from. Here, not in
llamacli/__init__.py, so that the commands read it without importing the package's entry."""

from __future__ import annotations

_started: list[float] = []  # time.perf_counter() when run() began


def mark_start(t: float) -> None:
    """run() calls it first, with time.perf_counter()."""
    _started[:] = [t]


def started_at() -> float | None:
    """When the CLI's entry (run) began, in time.perf_counter() seconds; None outside the CLI."""
    return _started[0] if _started else None
