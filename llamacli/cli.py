"""The command line: thin typer commands over the library. Rich lives here, not in the model code.

stdout carries only what the user asked for (text, JSON); notices, progress and timings go to stderr.
Every LlamacliError becomes one line `error: ...` on stderr and its exit code (2 bad input, 1 runtime,
130 Ctrl-C); `--debug` adds the traceback.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from . import __version__
from .errors import Interrupted, LlamacliError, UsageError

app = typer.Typer(
    name="llamacli",
    help="Run GGUF language models on NVIDIA GPUs (CuPy + our CUDA kernels), with a NumPy reference backend.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)

_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        print(f"llamacli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and log kernel launches.")] = False,
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = None,
) -> None:
    """llamacli: GGUF inference from readable Python."""
    _state["debug"] = debug
    if debug:
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s: %(message)s")


def fail(message: str) -> None:
    """Raise a usage error from a command (exit 2)."""
    raise UsageError(message)


# -- inspect -----------------------------------------------------------------------------------------------


@app.command()
def inspect(
    model: Annotated[str, typer.Argument(help="A GGUF file.")],
    tensors: Annotated[bool, typer.Option("--tensors", help="Add the tensor table.")] = False,
    metadata: Annotated[bool, typer.Option("--metadata", help="Add every metadata key (long arrays abbreviated).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
    ctx: Annotated[Optional[int], typer.Option("--ctx", help="Also size the KV cache at this context length.")] = None,
) -> None:
    """Show what is inside a GGUF file: architecture, sizes, quantization mix, tokenizer, memory needs."""
    from .inspect import inspect_model, render_summary

    if ctx is not None and ctx <= 0:
        fail(f"--ctx must be positive, got {ctx}")
    info = inspect_model(model, ctx=ctx, with_tensors=tensors, with_metadata=metadata)
    if as_json:
        print(json.dumps(info, ensure_ascii=False))
    else:
        render_summary(out, info)


# -- entry point -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Console-script entry: run the app, turning every failure into one line and an exit code."""
    try:
        app(args=argv, standalone_mode=False)
    except LlamacliError as exc:
        _report(exc, exc.exit_code)
    except (KeyboardInterrupt, Interrupted) as exc:
        _report(exc, 130, "interrupted")
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        _report(None, 130, "interrupted")
    except _CLICK_ERRORS as exc:
        # Bad options and arguments: click's own message, one line, exit 2.
        if _state["debug"]:
            traceback.print_exc()
        msg = exc.format_message().replace("\n", " ")
        err.print(f"error: {msg}", markup=False)
        sys.exit(2)
    except BrokenPipeError:
        # `llamacli generate ... | head`: the reader left; not an error of ours.
        sys.stderr.close()
        sys.exit(0)
    except MemoryError:
        _report(None, 1, "out of host memory")
    except Exception as exc:  # a bug of ours: still one line, unless --debug
        _report(exc, 1, f"internal error: {type(exc).__name__}: {exc}")
    sys.exit(0)


def _click_errors() -> tuple[type[BaseException], ...]:
    """Usage errors from the option parser: click's, or the copy of click that newer typer vendors."""
    found: list[type[BaseException]] = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(__import__(module, fromlist=["ClickException"]).ClickException)
        except ImportError:
            pass
    return tuple(found)


_CLICK_ERRORS = _click_errors()


def _report(exc: BaseException | None, code: int, message: str | None = None) -> None:
    if _state["debug"] and exc is not None:
        traceback.print_exception(type(exc), exc, exc.__traceback__)
    text = message or str(exc) or type(exc).__name__
    if isinstance(exc, Interrupted) and str(exc):
        text = str(exc)
    err.print("error: " + " ".join(text.split()), markup=False)
    sys.exit(code)


if __name__ == "__main__":
    main()
