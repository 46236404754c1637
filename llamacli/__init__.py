"""llamacli: GGUF language models on NVIDIA GPUs from readable Python."""

from . import startup
from .startup import started_at  # noqa: F401 (API: when run() began)
from .version import __version__  # noqa: F401 (API)


def run() -> None:
    """The `llamacli` console script and `python -m llamacli`. It lives in this small module so that a Ctrl-C
    while the CLI's own imports (typer, rich, numpy) are still loading ends as every later one does: one line
    and exit code 130, no traceback; so that the GPU's driver starts before those imports where the command
    loads a model (llamacli.gpu_driver); and so that such a command, once done, leaves at once (_leave)."""
    import gc
    import sys
    import time

    startup.mark_start(time.perf_counter())
    argv = sys.argv[1:]
    loads = False
    code: object = 0
    try:
        try:
            from . import gpu_driver
            from .collector import paused
            from .textio import hold_closed_fds

            loads = gpu_driver.loads_model(argv)
            if gpu_driver.wanted(argv):  # the driver starts while the imports below load
                hold_closed_fds()  # first: the driver's own descriptors must not take a closed 0-2
                gpu_driver.start()
            # The modules' objects stay: no collection walks them while they load (llamacli.collector), nor
            # later (frozen, before the collector runs again).
            with paused():
                from .cli import main

                gc.freeze()
        except KeyboardInterrupt:
            sys.stderr.write("error: interrupted\n")
            sys.exit(130)
        main()
    except SystemExit as exc:
        if not loads:
            raise
        code = exc.code
    except BaseException:  # not through main's handlers: the thread leaves the driver before the interpreter ends
        try:
            from . import gpu_driver

            gpu_driver.wait()
        except BaseException:  # noqa: BLE001 - a second Ctrl-C while waiting: the first stands
            pass
        raise
    if loads:
        _leave(code)


def _leave(code: object) -> None:
    """End the process with SystemExit(code)'s status, the standard streams flushed, without the
    interpreter's teardown: after a model's run that is CuPy's memory pools and the GPU's context let go
    object by object and every module's objects collected (measurable on the GPU machine: docs/perf-log.md)
    that no one waits for. Nor does it wait for the driver's thread (gpu_driver): _exit ends it as a kill
    would, whatever call it is in. atexit hooks do not run: the CLI registers none, and what it wrote is
    flushed here."""
    import os
    import sys

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): the interpreter would print it and exit 1
        sys.stderr.write(f"{code}\n")
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone, a closed stream: nothing more can be said there
            pass
    os._exit(status & 0xFF)


def load(path, backend: str = "auto", ctx: int | None = None, **kw):
    """Load a GGUF model: `llamacli.load("model.gguf", backend="numpy").generate("Hello")` streams text."""
    from .engine.generate import load as _load

    return _load(path, backend=backend, ctx=ctx, **kw)
