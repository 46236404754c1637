"""The watchdog a chat template compiles and renders under: layer 2 of the sandbox's bounds (template_limits.py
is layer 1; template_sandbox.py puts the two together).

Everything written in Python (Jinja's loops, macros, generators, the filters written in Python) runs
under a watchdog thread that wakes every few milliseconds and raises in the rendering thread, at the
next bytecode, once the wall-clock deadline passes or the process's anonymous memory (Linux:
/proc/self/statm) has grown by more than the memory budget since the render began. Because layer 1
keeps each C call small, the deadline holds to within one such call.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from typing import Callable

from .template_limits import Limit

MIN_MEMORY_BYTES = 256 * 1024 * 1024  # the memory budget of a render: this, or 32 bytes per max_chars
POLL_S = 0.01  # how often the watchdog looks at the clock and the memory
REFIRE_S = 0.5  # when it fires a second time if the render goes on


class Timeout(Limit):
    """Raised inside the rendering thread by the watchdog: the deadline passed."""


class OutOfMemory(Limit):
    """Raised inside the rendering thread by the watchdog: the memory budget is spent."""


def memory_budget(max_chars: int) -> int:
    """The bytes a render may add to the process: enough for strings of `max_chars` several times over."""
    return max(MIN_MEMORY_BYTES, 32 * max_chars)


def _anonymous_memory() -> Callable[[], int | None] | None:
    """A cheap reader of the process's resident anonymous memory in bytes (resident minus file-backed pages,
    so pages mapped from files, such as shared libraries, do not count), or None where /proc is missing. The
    reader gives None when it cannot open the file (a server out of file descriptors): that reading is skipped."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return None
    os.close(fd)
    page = os.sysconf("SC_PAGE_SIZE")

    def read() -> int | None:
        try:
            with open("/proc/self/statm", "rb") as f:
                fields = f.read().split()
        except OSError:
            return None
        return (int(fields[1]) - int(fields[2])) * page

    return read


_MEMORY = _anonymous_memory()


class Watchdog:
    """Raises Timeout in the current thread once `seconds` have passed, or OutOfMemory once the process's
    anonymous memory has grown by `budget` bytes, at the next bytecode boundary: it stops any Python-level
    loop, at little cost while it waits (unlike sys.settrace). A long single C call is not interrupted: the
    sandbox's size checks keep those small. Use as a context manager."""

    def __init__(self, seconds: float, budget: int):
        self.deadline = time.monotonic() + seconds
        self.budget = budget
        self.thread_id = threading.get_ident()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.done = self.fired = False
        self.base = _MEMORY() if _MEMORY else None  # (None: memory not watched)
        self.thread = threading.Thread(target=self._watch, daemon=True, name="template-watchdog")

    def _watch(self) -> None:
        while not self.stop.wait(max(0.0, min(POLL_S, self.deadline - time.monotonic()))):
            reason = Timeout if time.monotonic() >= self.deadline else None
            if reason is None and _MEMORY and self.base is not None:
                now = _MEMORY()
                if now is not None and now - self.base > self.budget:
                    reason = OutOfMemory
            if reason is not None:
                self._fire(reason)
                # Once more if the render is still running half a second later: an exception that lands inside
                # a finalizer or a weakref callback is swallowed there (see _quiet_unraisable), not raised.
                if not self.stop.wait(REFIRE_S):
                    self._fire(reason)
                return

    def _fire(self, exc: type[Limit]) -> None:
        with self.lock:
            if not self.done:
                self.fired = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), ctypes.py_object(exc))

    def __enter__(self) -> "Watchdog":
        self.previous_hook = sys.unraisablehook
        sys.unraisablehook = self._quiet_unraisable
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Disarm: no firing after this, a pending one withdrawn. Idempotent. The caller calls it again where it
        handles Limit: a firing that lands inside __enter__ (a deadline shorter than the time to enter) leaves
        the with-statement without __exit__, and the watchdog would fire once more, REFIRE_S later, into
        whatever the thread runs then."""
        try:
            with self.lock:
                self.done = True
                if self.fired:  # fired, but maybe not delivered yet: withdraw it (NULL clears a pending one)
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)
        finally:
            self.stop.set()
            if hasattr(self, "previous_hook"):
                sys.unraisablehook = self.previous_hook

    def _quiet_unraisable(self, unraisable: "sys.UnraisableHookArgs") -> None:
        """Our own exception, delivered where Python cannot raise it (a finalizer, a weakref callback), would be
        printed as "Exception ignored in ..." on stderr: drop it (the next firing stops the render). A
        RecursionError there too: a template that recursed to the end of the stack makes finalizers fail so, and
        the render itself ends in one error line. Anything else goes on to the previous hook. The hook never
        raises: it may run with the stack nearly spent, and a hook that fails prints its own traceback."""
        try:
            if isinstance(unraisable.exc_value, (Limit, RecursionError)):
                return
            self.previous_hook(unraisable)
        except BaseException:  # noqa: S110 (nowhere to report it: stderr carries one error line)
            pass
