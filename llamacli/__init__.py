"""llamacli: GGUF language models on NVIDIA GPUs from readable Python."""

__version__ = "0.1.0"

_started: list[float] = []  # time.perf_counter() when run() began: --verbose's start-up stages count from it


def started_at() -> float | None:
    """When the CLI's entry (run) began, in time.perf_counter() seconds; None outside the CLI."""
    return _started[0] if _started else None


def run() -> None:
    """The `llamacli` console script and `python -m llamacli`. It lives in this small module so that a Ctrl-C
    while the CLI's own imports (typer, rich, numpy) are still loading ends as every later one does: one line
    and exit code 130, no traceback."""
    import sys
    import time

    _started[:] = [time.perf_counter()]

    try:
        from .cli import main
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)
    main()


def load(path, backend: str = "auto", ctx: int | None = None, **kw):
    """Load a GGUF model: `llamacli.load("model.gguf", backend="numpy").generate("Hello")` streams text."""
    from .generate import load as _load

    return _load(path, backend=backend, ctx=ctx, **kw)
