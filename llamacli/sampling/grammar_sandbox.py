"""Compiling a schema or grammar where a crash or a hang cannot take llamacli down.

    text (checked by grammar_limits) -> content hash -> cached answer, or the worker process:
        python -I grammar_worker.py, limited to DEADLINE_S, MEMORY_BYTES of address space, no core file;
        converts, validates, compiles over a byte vocabulary and computes the first masks on a
        WORKER_STACK_BYTES stack
    -> its grammar text, or GrammarError with the reason (llguidance's, or: crashed, out of time, out of memory)

The compiled matcher cannot move between processes (llguidance's LLMatcher does not pickle, and it is built
over the model's vocabulary), so the worker only tries the schema or grammar and llamacli then compiles it
again in its own process, in a thread whose stack (LOCAL_STACK_BYTES) is many times the worker's: whatever
compiled there compiles here. The price is one start of Python with llguidance (tens of milliseconds), paid
once per distinct schema or grammar: answers, refusals included, are cached by content hash.

Written here rather than taken from a library: multiprocessing would fork a process that may hold CUDA state
and threads (or pay a full re-import of the parent to spawn); a plain subprocess with its own limits does not.
"""

from __future__ import annotations

import collections
import hashlib
import json
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from ..errors import GrammarError, LlamacliError

T = TypeVar("T")

WORKER = Path(__file__).with_name("grammar_worker.py")


@dataclass(frozen=True)
class Bounds:
    """What the worker may spend. The deadline and memory are far above what real schemas and grammars take
    (a large one compiles in well under a second and a few hundred MiB)."""

    deadline_s: float = 10.0  # wall clock, from start to answer
    memory_bytes: int = 2 << 30  # the worker's address space (RLIMIT_AS)
    worker_stack_bytes: int = 4 << 20  # the stack it compiles on: half the usual 8 MiB of a thread or main
    local_stack_bytes: int = 64 << 20  # the stack llamacli's own compile runs on (compile_with_stack)
    walk_steps: int = 16  # masks computed along a seeded walk, after the first
    concurrent: int = 2  # workers at a time (more requests wait their turn)


BOUNDS = Bounds()
CACHE_ENTRIES = 256
CACHE_BYTES = 64 << 20  # grammar texts kept, all entries together


class _Cache:
    """The worker's answers by content hash, least recently used dropped first."""

    def __init__(self) -> None:
        self.entries: collections.OrderedDict[str, tuple[bool, str]] = collections.OrderedDict()
        self.size = 0
        self.lock = threading.Lock()

    def get(self, key: str) -> tuple[bool, str] | None:
        with self.lock:
            hit = self.entries.get(key)
            if hit is not None:
                self.entries.move_to_end(key)
            return hit

    def put(self, key: str, answer: tuple[bool, str]) -> None:
        with self.lock:
            if key in self.entries or len(answer[1]) > CACHE_BYTES // 4:
                return
            self.entries[key] = answer
            self.size += len(answer[1])
            while len(self.entries) > CACHE_ENTRIES or self.size > CACHE_BYTES:
                _, old = self.entries.popitem(last=False)
                self.size -= len(old[1])

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.size = 0


cache = _Cache()
_slots_lock = threading.Lock()
_slots: dict[int, threading.BoundedSemaphore] = {}


def tried(kind: str, text: str, what: str) -> str:
    """llguidance's grammar text for `text` (kind "schema": JSON schema text; "grammar": GBNF or Lark) once the
    worker compiled it and followed it for a few steps; GrammarError("invalid {what}: reason") otherwise."""
    bounds = BOUNDS
    key = hashlib.sha256(f"{kind}\0{bounds}\0".encode() + text.encode("utf-8", "surrogatepass")).hexdigest()
    answer = cache.get(key)
    if answer is None:
        answer = _run_worker(kind, text, bounds)
        cache.put(key, answer)
    ok, value = answer
    if not ok:
        raise GrammarError(f"invalid {what}: {value}")
    return value


def _run_worker(kind: str, text: str, bounds: Bounds) -> tuple[bool, str]:
    import llguidance  # (imported already: its folder goes to the worker, which -I keeps from the environment)

    request = json.dumps({"kind": kind, "text": text, "memory": bounds.memory_bytes,
                          "cpu": int(bounds.deadline_s) + 1, "stack": bounds.worker_stack_bytes,
                          "walk": bounds.walk_steps, "path": str(Path(llguidance.__file__).resolve().parents[1])})
    with _slots_for(bounds.concurrent):
        try:
            p = subprocess.run([sys.executable, "-I", str(WORKER)], input=request.encode(), capture_output=True,
                               timeout=bounds.deadline_s)
        except subprocess.TimeoutExpired:
            return False, f"compiling it took longer than {bounds.deadline_s:g} s"
        except OSError as exc:  # not the input's fault, and not cached
            raise LlamacliError(f"cannot start the grammar check: {exc.strerror or exc}") from None
    if p.returncode == 0:
        try:
            reply = json.loads(p.stdout)
            return (True, reply["grammar"]) if reply["ok"] else (False, str(reply["reason"]))
        except (ValueError, KeyError, TypeError):
            pass
    return False, _crash_reason(p.returncode, p.stderr.decode("utf-8", "replace"), bounds)


def _crash_reason(code: int, err: str, bounds: Bounds) -> str:
    """What a worker that gave no answer died of, in words."""
    if "memory allocation" in err or "MemoryError" in err or "out of memory" in err:
        return f"compiling it needs more than {bounds.memory_bytes >> 20} MiB of memory"
    if "overflow" in err or code == -signal.SIGSEGV:
        return "it nests too deeply for llguidance's compiler (its stack overflowed)"
    if code in (-getattr(signal, "SIGXCPU", 0), -getattr(signal, "SIGKILL", 0)) and code:
        return f"compiling it took longer than {bounds.deadline_s:g} s"
    try:
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    except ValueError:
        how = f"signal {-code}"
    return f"llguidance's compiler crashed on it ({how})"


def _slots_for(n: int) -> threading.BoundedSemaphore:
    with _slots_lock:
        return _slots.setdefault(max(1, n), threading.BoundedSemaphore(max(1, n)))


_stack_lock = threading.Lock()


def compile_with_stack(fn: Callable[[], T], stack_bytes: int | None = None) -> T:
    """fn() in a thread with a large stack (BOUNDS.local_stack_bytes): llguidance's compile recurses on the
    native stack, and this one is many times what the worker had when it compiled the same text."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 (handed to the caller's thread)
            box["error"] = exc

    with _stack_lock:  # threading.stack_size is process-wide: set it for this one thread only
        try:
            old = threading.stack_size(stack_bytes or BOUNDS.local_stack_bytes)
        except (ValueError, RuntimeError):  # a platform that cannot: the caller's own thread
            return fn()
        try:
            thread = threading.Thread(target=run, name="llamacli-grammar", daemon=True)
            thread.start()
        finally:
            threading.stack_size(old)
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
