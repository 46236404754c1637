"""Python's cyclic garbage collector paused while start-up builds objects that stay: the CLI's modules (their
functions, classes and tables) and a vocabulary's (a tokenizer's dicts, lists and pairs: Llama 3's 128k tokens
and 280k merges).

None of them is garbage, yet every 700 new container objects start a collection that walks the young ones, and
the older generations are walked again as they grow: hundreds of collections that free nothing, in the
tokenizer's thread and the CLI's imports (docs/perf-log.md has the figures). Nothing in these phases makes
reference cycles that must be freed before they end; the collector runs again as soon as the last pause ends.

Pauses are counted, so that threads pausing at once (the tokenizer's beside the model's load) leave the
collector as the first one found it: enabled again when the last one ends, unless it was disabled already.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_state = {"pauses": 0, "enabled": True}  # pauses under way; whether the collector ran before the first


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside this block (gc.collect() still works)."""
    with _lock:
        if _state["pauses"] == 0:
            _state["enabled"] = gc.isenabled()
            gc.disable()
        _state["pauses"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["pauses"] -= 1
            if _state["pauses"] == 0 and _state["enabled"]:
                gc.enable()
