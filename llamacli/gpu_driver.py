"""The CUDA driver's start (cuInit and GPU 0's primary context, the one CuPy's runtime then uses) through
libcuda directly, on a thread of its own.

ctypes releases the GIL for each call, so the driver's slow start (docs/perf-log.md) overlaps whatever Python
does meanwhile.
This module imports nothing beyond the standard library: the CLI's entry (llamacli.run) starts the thread
before typer, rich, NumPy and CuPy load, for the commands that load a model (`wanted`), so the driver's
start hides behind those imports. backends.start_early waits for that thread (or makes the context itself
where none ran: `llamacli.load`) before CuPy's own check.

Only where CuPy is installed (else the CUDA backend cannot run and no context should be made), and once per
process: anything missing (no driver, no GPU) is left for backends.cuda_status to report, and `release` lets
the context go where the CUDA backend is not taken after all. The process never ends with the thread inside
the driver except through os._exit (a model command's end, llamacli._leave), which stops it as a kill would.
"""

from __future__ import annotations

import os
import threading

# The commands that load a model (their aliases included; llamacli/cli/parser.py ALIASES has none of these).
MODEL_COMMANDS = frozenset({"generate", "chat", "run", "bench", "serve", "keep-alive-server"})


def loads_model(argv: list[str]) -> bool:
    """Whether this command line loads a model: its command (the first word that is not an option; the root
    options are flags) is one of MODEL_COMMANDS, without --help or --version (either answers, then exits)."""
    words = [a for a in argv if not a.startswith("-")]
    return bool(words) and words[0] in MODEL_COMMANDS and not {"--help", "-h", "--version"} & set(argv)


def wanted(argv: list[str]) -> bool:
    """Whether this command line loads a model and may take the CUDA backend (not `--backend numpy` or `cpu`), in
    this process (not with --keep-alive, or LLAMACLI_KEEP_ALIVE, other than 0: the resident server loads it). A
    guess from the words alone: a wrong one costs a context made and not used, or made late."""
    host = ("numpy", "cpu")
    if not loads_model(argv) or any(f"--backend={b}" in argv for b in host) or _keeps_alive(argv):
        return False
    return not any(a == "--backend" and b in host for a, b in zip(argv, argv[1:]))


def _keeps_alive(argv: list[str]) -> bool:
    from .units import parse_duration

    value = os.environ.get("LLAMACLI_KEEP_ALIVE")
    for a, b in zip(argv, argv[1:] + [""]):
        if a == "--keep-alive":
            value = b
        elif a.startswith("--keep-alive="):
            value = a.partition("=")[2]
    try:
        return value is not None and bool(value.strip()) and parse_duration(value) != 0
    except ValueError:
        return False


class DriverStart:
    """The driver's start in one process: at most one thread (start), at most one primary context retained
    (context; release lets it go). The module's functions act on PROCESS, this process's own; a test puts a
    fresh one in its place to start from nothing."""

    def __init__(self) -> None:
        self.retained: tuple | None = None  # (libcuda, device) whose primary context context() retained, or None
        self.thread: threading.Thread | None = None  # the thread start() began
        self._lock = threading.Lock()  # context and release: one at a time
        self._thread_lock = threading.Lock()

    def context(self) -> None:
        """The driver's start and GPU 0's primary context, retained once; nothing where CuPy is not installed or
        the driver or the GPU is missing."""
        import ctypes
        import importlib.util

        with self._lock:
            if self.retained is not None or importlib.util.find_spec("cupy") is None:
                return
            try:
                cu = ctypes.CDLL("libcuda.so.1")
                dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
                if (cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
                        and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0):
                    self.retained = (cu, dev)
            except (OSError, AttributeError):
                pass

    def _quietly(self) -> None:
        try:
            self.context()
        except BaseException:  # noqa: BLE001 - what failed here is found again and reported by cuda_status
            pass

    def start(self) -> None:
        """Begin context() on a thread of its own (nothing if one already began)."""
        with self._thread_lock:
            if self.thread is not None:
                return
            thread = threading.Thread(target=self._quietly, name="llamacli-cuda-driver", daemon=True)
            thread.start()
            self.thread = thread

    def wait(self) -> None:
        """Wait for the thread start() began, if any."""
        if self.thread is not None:
            self.thread.join()

    def release(self) -> None:
        """Release the primary context context() retained (a CPU backend runs after all)."""
        self.wait()
        with self._lock:
            retained, self.retained = self.retained, None
        if retained is not None:
            cu, dev = retained
            cu.cuDevicePrimaryCtxRelease(dev)


PROCESS = DriverStart()


def driver_context() -> None:
    """PROCESS.context(): the driver's start and GPU 0's primary context, retained once per process."""
    PROCESS.context()


def start() -> None:
    """PROCESS.start(): driver_context on a thread of its own, once per process."""
    PROCESS.start()


def wait() -> None:
    """PROCESS.wait(): wait for the thread start() began, if any."""
    PROCESS.wait()


def release() -> None:
    """PROCESS.release(): let the retained context go (a CPU backend runs after all)."""
    PROCESS.release()
