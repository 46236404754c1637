"""When the CLI's entry (llamacli.run) began, which --verbose's start-up stages count from. Here, not in
llamacli/__init__.py, so that the commands read it without importing the package's entry."""

from __future__ import annotations

_started: list[float] = []  # time.perf_counter() when run() began


def mark_start(t: float | None) -> None:
    """run() calls it first, with time.perf_counter(); the resident server (cli/resident.py) with the start of
    the command it runs (perf_counter is the system's monotonic clock: one process's reading means the same
    in another), or None where that command did not say."""
    _started[:] = [] if t is None else [t]


def started_at() -> float | None:
    """When the CLI's entry (run) began, in time.perf_counter() seconds; None outside the CLI."""
    return _started[0] if _started else None
