"""One call on a thread of its own, its result or exception handed back to the caller's thread."""

from __future__ import annotations

import threading
from typing import Any, Callable


class Background:
    """fn(*args) on a daemon thread: result() waits, then returns what fn returned or raises what it raised
    (BaseException included); wait() only waits."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str = "llamacli-background") -> None:
        self._out: list[Any] = []
        self._err: list[BaseException] = []

        def run() -> None:
            try:
                self._out.append(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread by result()
                self._err.append(exc)

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self.wait()
        if self._err:
            raise self._err[0]
        return self._out[0]
