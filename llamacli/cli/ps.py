"""The commands about the models that --keep-alive keeps loaded, as ollama's: `ps` lists them, `stop MODEL`
unloads one; and the hidden `keep-alive-server`, the process that keeps one (resident.py). The hand-off
itself is keep_alive.py, imported when a command runs (this module is imported at every start)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..errors import LlamacliError
from ..textio import json_text, printable
from ..units import human_bytes, human_duration
from .app import command, dim, err, fail, out

ASK_S = 5.0  # a resident server's answer to status or stop (it answers between two commands' steps)


def _until(status: dict[str, Any]) -> str:
    left = status.get("expires_in")
    if status.get("busy"):
        return "busy"
    if left is None:
        return "forever"
    return f"{human_duration(max(0.0, float(left)))} from now"


@command()
def ps(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON array of the servers' states.")] = False,
) -> None:
    """List the models that llamacli servers keep loaded (--keep-alive), as ollama ps: the model, the server's
    pid, the backend, the context and when it unloads."""
    from .keep_alive import servers

    found = servers()
    if as_json:
        print(json_text(found))
        return
    if not found:
        dim("no model is kept loaded (--keep-alive DURATION on run, generate or chat keeps one)")
        return
    rows = [("NAME", "PID", "BACKEND", "CONTEXT", "SIZE", "UNTIL")]
    for s in found:
        rows.append((printable(str(s.get("name"))), str(s.get("pid")), printable(str(s.get("backend"))),
                     str(s.get("ctx")), human_bytes(float(s.get("size") or 0)), _until(s)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.print("   ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip(), markup=False,
                  highlight=False)


@command()
def stop(
    model_arg: Annotated[Optional[str], typer.Argument(
        metavar="MODEL", help="The model, as -m names it (a path, a registry name or the file's name).",
        show_default=False)] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="The model, as the argument.")] = None,
    every: Annotated[bool, typer.Option("--all", help="Stop every llamacli server.")] = False,
) -> None:
    """Unload a model that a llamacli server keeps loaded (--keep-alive), as ollama stop: its servers (one per
    set of load options) end after the command they are running, if any."""
    if model_arg is not None and model is not None:
        fail(f"the model is given twice ({model_arg!r} and -m {model!r}): give it once")
    spec = model_arg if model_arg is not None else model
    if spec is None and not every:
        fail("name the model to stop (llamacli ps lists them), or --all")
    from .keep_alive import PROTOCOL, ask
    from .rendezvous import Rendezvous, RendezvousError

    stopped = []
    try:
        rv = Rendezvous(create=False)
    except FileNotFoundError:
        rv = None
    except RendezvousError as exc:
        raise LlamacliError(str(exc)) from None
    with rv or contextlib.nullcontext():
        for key in rv.keys() if rv else ():
            answer = ask(rv, key, {"op": "status", "llamacli": PROTOCOL, "key": key}, ASK_S)
            status = answer.get("status") if answer else None
            if not isinstance(status, dict) or not (every or _names(spec, status)):
                continue
            if ask(rv, key, {"op": "stop", "llamacli": PROTOCOL, "key": key}, ASK_S) is not None:
                stopped.append(status)
    if not stopped and not every:
        raise LlamacliError(f"no llamacli server keeps {printable(str(spec))} loaded (llamacli ps lists them)")
    for s in stopped:
        err.print(f"stopped {printable(str(s.get('name')))} (pid {s.get('pid')})", style="dim", markup=False)


def _names(spec: str | None, status: dict[str, Any]) -> bool:
    """Whether `spec` (as -m takes it) names the model a server holds: as it was given, by its path, or by
    the file's name or stem. A registry name is not resolved (nothing is downloaded to stop a server)."""
    if spec is None:
        return False
    if spec in (status.get("spec"), status.get("name"), Path(str(status.get("name"))).stem):
        return True
    try:
        return os.path.realpath(os.path.expanduser(spec)) == status.get("path")
    except (OSError, ValueError):
        return False


@command("keep-alive-server", hidden=True)
def keep_alive_server(
    fd: Annotated[int, typer.Option("--fd", help="The socket pair's end the spawning command talks on.")],
    lock_fd: Annotated[int, typer.Option("--lock-fd", help="The locked KEY.lock this server holds for life.")],
    directory: Annotated[str, typer.Option("--dir", help="The rendezvous directory.")],
    backend: Annotated[str, typer.Option("--backend", help="The backend asked for (for the GPU driver's early "
                                                           "start, llamacli.gpu_driver).")] = "auto",
) -> None:
    """The server that --keep-alive starts (cli/resident.py); not for direct use."""
    from .resident import serve_resident

    serve_resident(fd, lock_fd, Path(directory))
