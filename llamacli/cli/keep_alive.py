"""--keep-alive: run/generate/chat hand their work to a llamacli process that keeps the model loaded, as ollama's
keep_alive does (the commands about those processes, ps and stop, are in ps.py; the process itself is
resident.py).

Why: a command spends most of a short answer's time before its first token (issue 46: the interpreter and
imports, the GPU's context, the kernel modules, the weights' upload, the tokenizer). A server that already
holds the model answers the next command after its options are parsed.

The default is off. ollama keeps a model 5 minutes by default because ollama is a daemon the user started;
llamacli is a command in llama.cpp's tradition, and a default on would leave a process behind, holding GPU
memory (or gigabytes of host memory on the NumPy backend), after every command of a user who never asked for
one. `--keep-alive 5m` on a command, or LLAMACLI_KEEP_ALIVE=5m in the environment, asks for it.

What a command does with --keep-alive DURATION (cli/generate.py deliver):
  1. It parses and checks its options and reads its inputs (prompt file, grammar) as always; then, instead of
     loading, it finds the model's file (the registry, a download on first use) and its key: the file's
     identity (resolved path, size, mtime, inode, device) and what changes what is loaded or computed (the
     backend asked for, the context, the KV cache types, --swa-full, CUDA_VISIBLE_DEVICES), with the version,
     the package's folder and the Python that runs it, so that another install's server never answers.
  2. It connects to KEY.sock in the rendezvous directory (cli/rendezvous.py: its checks, the lock). Where no
     server answers and the lock is free, it spawns one (`llamacli keep-alive-server`, a session of its own,
     no terminal) and hands it the lock; where another command holds the lock, that command's server is
     loading, and it waits for the socket.
  3. A hello both ways (the server names its key), then the request: the Task (cli/generate.py) and what the
     command would have used itself: its standard streams and working directory as descriptors (SCM_RIGHTS),
     their encodings, the environment (for rich's colours and widths), the umask, -v/--debug and -t, and its
     clock. The server runs the Task in its main thread with those streams in place of its own
     (cli/resident.py): stdout, stderr and the exit code are what the command would have made, the output
     written straight to the command's own stdout and stderr.
  4. The server answers {"queued": n} at once, {"start"} as it begins and {"exit": code} at the end; the
     command exits with that code. Each command sets the server's idle time (ollama's rule): DURATION after
     it ends, -1 never, 0 right after it (and 0 starts no server where none runs).

Ctrl-C: the command passes it on ({"op": "cancel"}); the server raises KeyboardInterrupt in the task, which
ends as in the process (a partial reply, `error: interrupted`, 130; in a chat, what a Ctrl-C does there).
A server that does not acknowledge it within CANCEL_S is left to itself: the command exits 130. A command
that goes away (killed) is seen by the server, which drops its streams and stops its task.

When the command runs the model itself instead (one notice line on stderr, unless --quiet): the rendezvous
directory or a file in it is not safe (RendezvousError), the server does not answer in time or answers what
no llamacli server says, or the server it started ends before taking the request. A server that ends while
running the request is one line, exit 1 (its output may be partly printed: running again would repeat it).
Nothing waits without a bound before the request is taken: HANDSHAKE_S to connect and be answered, SPAWN_S for
a new server's first answer, LOAD_WAIT_S for another command's server to load.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import Interrupted, LlamacliError
from ..textio import ClosedStream, printable
from ..units import FOREVER, human_duration
from ..version import __version__
from .app import check_gpu_layers, command_state, dim, find_model, is_verbose

if TYPE_CHECKING:
    import socket
    import subprocess

    from .rendezvous import Rendezvous

PROTOCOL = 1
HANDSHAKE_S = 5.0  # to connect, and for each answer before the request is queued
SPAWN_S = 60.0  # for a server this command started to answer (its interpreter and imports)
LOAD_WAIT_S = 600.0  # for a server another command started to load the model
CANCEL_S = 10.0  # for a server to acknowledge Ctrl-C
PACKAGE = Path(__file__).resolve().parents[1]  # llamacli/


class ServerGone(LlamacliError):
    """The server ended while it ran this command's request."""


class _Unusable(Exception):
    """The hand-off cannot happen: the message says why (the command then loads the model itself)."""


_GONE = object()  # the server left before it took the request: look again


def hand_off(load: dict[str, Any], task: dict[str, Any], keep_alive: float) -> int | None:
    """Run `task` (Task.as_json()) on the resident server for the model and load options `load` (load_model's
    keyword arguments): its exit code, or None where this command must load the model itself (a notice said
    why, unless --quiet; `keep_alive` 0 with no server resident says nothing)."""
    from ..models.kv_cache import parse_cache_types
    from ..startup import started_at
    from .rendezvous import MAX_FRAME, encode

    quiet = bool(load.get("quiet"))
    check_gpu_layers(load.get("gpu_layers"))  # (the checks load_model makes first, with its words)
    cache_types = parse_cache_types(*load["cache_types"])
    streams = _streams()
    if streams is None:
        if is_verbose():
            dim("--keep-alive: the standard streams are not files here; the model loads in this process")
        return None
    fds, described = streams
    try:
        looked_up = time.perf_counter()
        path = find_model(load["model"])
        found = time.perf_counter()
        identity = model_identity(path, load, cache_types)
        key = server_key(identity)
        request = encode({
            "op": "run", "task": task, "keep_alive": -1 if keep_alive == FOREVER else keep_alive,
            "load": {**load, "cache_types": list(cache_types), "path": identity["model"], "name": path.name,
                     "identity": identity},
            "env": dict(os.environ), "umask": _umask(), "streams": described, "state": command_state(),
            "clock": {"started": started_at(), "looked_up": looked_up, "found": found}})
        if len(request) > MAX_FRAME:
            raise _Unusable("the request is too large to hand over")
        return _deliver(key, request, fds, keep_alive, quiet, load["backend"])
    except _Unusable as exc:
        if not quiet:
            dim(f"--keep-alive: {exc}; the model loads in this process")
        return None
    except KeyboardInterrupt:
        raise Interrupted("interrupted") from None
    finally:
        for fd in fds:
            os.close(fd)


def model_identity(path: Path, load: dict[str, Any], cache_types) -> dict[str, Any]:
    """What a resident server must share with a command to answer it (the key is its hash)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return {"llamacli": __version__, "package": str(PACKAGE), "python": sys.executable, "model": real,
            "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "device": st.st_dev,
            "backend": load["backend"], "ctx": load["ctx"], "cache_types": list(cache_types),
            "swa_full": bool(load["swa_full"]), "split": load.get("split"),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def server_key(identity: dict[str, Any]) -> str:
    """The name a model_identity's server goes by in the rendezvous directory."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _streams() -> tuple[list[int], list[dict[str, Any]]] | None:
    """Descriptors for the server (copies of stdin, stdout, stderr, and the working directory) and how each
    stream reads or writes; None where a stream has no descriptor (an embedding program's in-memory streams):
    the model then loads here."""
    fds: list[int] = []
    described = []
    try:
        for stream in (sys.stdin, sys.stdout, sys.stderr):
            if isinstance(stream, ClosedStream):
                fds.append(os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))
                described.append({"closed": True})
                continue
            fd = stream.fileno()
            fds.append(os.dup(fd))
            described.append({"closed": False, "encoding": stream.encoding, "errors": stream.errors,
                              "line_buffering": bool(getattr(stream, "line_buffering", False)),
                              "write_through": bool(getattr(stream, "write_through", False))})
            if stream is not sys.stdin:
                stream.flush()
        # (O_PATH where there is one: a directory the user may enter but not list is still one to work in)
        fds.append(os.open(".", getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC))
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        for fd in fds:
            os.close(fd)
        return None
    return fds, described


def _deliver(key: str, request: bytes, fds: list[int], keep_alive: float, quiet: bool, backend: str) -> int | None:
    from .rendezvous import Rendezvous, RendezvousError

    try:
        rv = Rendezvous(create=keep_alive != 0)
    except FileNotFoundError:  # (--keep-alive 0, and no server was ever started here)
        return None
    except RendezvousError as exc:
        raise _Unusable(str(exc)) from None
    with rv:
        if keep_alive == 0:  # a resident server serves it and unloads; none is started, none waited for
            return _once(rv, key, request, fds, quiet)
        for _ in range(3):
            refused: Exception | None = None
            try:
                conn = rv.connect(key, HANDSHAKE_S)
            except (RendezvousError, TimeoutError) as exc:
                conn, refused = None, exc
            if conn is not None:
                try:
                    outcome = exchange(conn, key, request, fds, quiet, None)
                except NotOurs as exc:
                    refused = exc
                else:
                    if outcome is not _GONE:
                        return outcome
                    continue
            try:
                lock = rv.lock(key)
            except RendezvousError as exc:
                raise _Unusable(str(exc)) from None
            if lock is None:  # a server holds it: loading, or alive with a socket we could not use
                if refused is not None:
                    raise _Unusable(f"the server's socket cannot be used ({refused})")
                conn = _wait_for_server(rv, key, quiet)
                if conn is None:  # the server that was loading has gone: look again
                    continue
                try:
                    outcome = exchange(conn, key, request, fds, quiet, None)
                except NotOurs as exc:
                    raise _Unusable(str(exc)) from None
                if outcome is not _GONE:
                    return outcome
                continue
            try:
                try:
                    rv.clear(key)  # a stale socket, or whatever else was there
                except RendezvousError as exc:
                    raise _Unusable(str(exc)) from None
                conn, proc = _spawn(rv, lock, backend)
            finally:
                os.close(lock)  # (the server holds the lock now, through its copy)
            try:
                outcome = exchange(conn, key, request, fds, quiet, proc)
            except NotOurs as exc:
                raise _Unusable(str(exc)) from None
            if outcome is _GONE:
                raise _Unusable(f"the llamacli server it started ended before taking the request{_status(proc)}")
            return outcome
    raise _Unusable("the llamacli server went away before taking the request, three times")


def _once(rv: Rendezvous, key: str, request: bytes, fds: list[int], quiet: bool) -> int | None:
    """--keep-alive 0: the resident server's exit code, or None (this command loads the model) where none
    answers."""
    from .rendezvous import RendezvousError

    try:
        conn = rv.connect(key, HANDSHAKE_S)
    except (RendezvousError, TimeoutError) as exc:
        raise _Unusable(f"the server's socket cannot be used ({exc})") from None
    if conn is None:
        return None
    try:
        outcome = exchange(conn, key, request, fds, quiet, None)
    except NotOurs as exc:
        raise _Unusable(str(exc)) from None
    return None if outcome is _GONE else outcome


def _spawn(rv: Rendezvous, lock: int, backend: str) -> tuple[socket.socket, subprocess.Popen]:
    """A new server (the lock handed to it), and this end of its first connection."""
    import socket
    import subprocess

    if not sys.executable:
        raise _Unusable("there is no Python executable to start a server with")
    ours, theirs = socket.socketpair()
    env = dict(os.environ)
    if not _installed():  # a checkout (run from its folder, or on PYTHONPATH): the server imports the same one
        env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE.parent), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    command_line = [sys.executable, "-m", "llamacli", "keep-alive-server", "--fd", str(theirs.fileno()),
                    "--lock-fd", str(lock), "--dir", str(rv.path), "--backend", backend]
    try:
        proc = subprocess.Popen(command_line, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(), lock), cwd="/", env=env,
                                start_new_session=True)
    except OSError as exc:
        ours.close()
        raise _Unusable(f"cannot start a llamacli server: {exc.strerror or exc}") from None
    finally:
        theirs.close()
    return ours, proc


def _installed() -> bool:
    """Whether this llamacli is in one of Python's site-packages folders (a new interpreter finds it there)."""
    import site

    folders = [*getattr(site, "getsitepackages", list)(), site.getusersitepackages()]
    return os.path.realpath(PACKAGE.parent) in {os.path.realpath(f) for f in folders}


def _status(proc: subprocess.Popen | None) -> str:
    code = None if proc is None else proc.poll()
    if code is None:
        return ""
    return f" (killed by signal {-code})" if code < 0 else f" (exit status {code})"


def _wait_for_server(rv: Rendezvous, key: str, quiet: bool) -> socket.socket | None:
    """A connection to the server another command started, once it listens; None where the lock comes free
    first (that server has gone)."""
    from .rendezvous import RendezvousError

    begun = time.monotonic()
    told = False
    while True:
        try:
            conn = rv.connect(key, HANDSHAKE_S)
        except (RendezvousError, TimeoutError) as exc:
            raise _Unusable(f"the server's socket cannot be used ({exc})") from None
        if conn is not None:
            return conn
        lock = rv.lock(key)
        if lock is not None:
            os.close(lock)
            return None
        waited = time.monotonic() - begun
        if waited > LOAD_WAIT_S:
            raise _Unusable(f"the llamacli server (pid {rv.holder(key)}) has not finished loading in "
                            f"{human_duration(LOAD_WAIT_S)}")
        if not told and waited > 1 and not quiet:
            dim(f"--keep-alive: waiting for the llamacli server (pid {rv.holder(key)}) that holds this model's "
                "lock (loading the model, or leaving)")
            told = True
        time.sleep(0.05)


class NotOurs(Exception):
    """What answered is not a llamacli server for this key (or it did not answer in time)."""


def exchange(conn: socket.socket, key: str, request: bytes, fds: list[int], quiet: bool,
              proc: subprocess.Popen | None) -> int | object:
    """Hand the request over on `conn` and follow it to its exit code; _GONE where the server left before it
    took the request. Ctrl-C before the server begins is Interrupted here (the server drops the request when
    the connection closes); after, it is passed on."""
    from .rendezvous import FrameError, send_frame

    with conn, _Interrupts() as interrupts:
        try:
            send_frame(conn, {"op": "hello", "llamacli": PROTOCOL, "key": key})
            hello = _recv(conn, interrupts, SPAWN_S if proc is not None else HANDSHAKE_S)
            if hello.get("hello") != key or type(hello.get("pid")) is not int:
                raise NotOurs(f"what answers on its socket is not a llamacli server for this model: {brief_frame(hello)}")
            pid = hello["pid"]
            send_frame(conn, request, fds)
            queued = _recv(conn, interrupts, HANDSHAKE_S)
        except EOFError:
            return _GONE
        except (BrokenPipeError, ConnectionResetError):
            return _GONE
        except (FrameError, OSError) as exc:  # TimeoutError included
            raise NotOurs(f"the server's answer: {exc or type(exc).__name__}") from None
        if "error" in queued:
            raise NotOurs(f"the llamacli server refused the request: {printable(str(queued['error']))[:200]}")
        ahead = queued.get("queued")
        if type(ahead) is not int:
            raise NotOurs(f"what answers on its socket is not a llamacli server: {brief_frame(queued)}")
        if ahead and not quiet:
            dim(f"--keep-alive: waiting for the llamacli server (pid {pid}): {ahead} command"
                f"{'s' if ahead > 1 else ''} ahead")
        return _follow(conn, pid, proc, interrupts)


def _recv(conn: socket.socket, interrupts: _Interrupts, timeout: float) -> dict:
    """The next frame, within `timeout` (TimeoutError); Interrupted on Ctrl-C."""
    from .rendezvous import recv_frame

    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer in time")
        what = interrupts.wait(conn, left)
        if what == "interrupt":
            raise Interrupted("interrupted")
        if what == "ready":
            conn.settimeout(max(left, 0.5))  # (the rest of a frame that has begun)
            try:
                return recv_frame(conn)[0]
            finally:
                conn.settimeout(None)


def _follow(conn: socket.socket, pid: int, proc: subprocess.Popen | None, interrupts: _Interrupts) -> int | object:
    """The request's frames until its exit code; Ctrl-C passed on once the server has begun."""
    from .rendezvous import FrameError, recv_frame, send_frame

    started = False
    cancel_sent: float | None = None
    while True:
        timeout = None if cancel_sent is None else cancel_sent + CANCEL_S - time.monotonic()
        what = "timeout" if timeout is not None and timeout <= 0 else interrupts.wait(conn, timeout)
        if what == "interrupt":
            if not started:
                raise Interrupted("interrupted")
            try:
                send_frame(conn, {"op": "cancel"})
            except OSError:
                pass
            cancel_sent = cancel_sent or time.monotonic()
            continue
        if what == "timeout":
            raise Interrupted(f"interrupted (the llamacli server, pid {pid}, did not stop in {CANCEL_S:.0f} s)")
        try:
            frame, _ = recv_frame(conn)
        except (EOFError, FrameError, OSError):
            if not started:
                return _GONE
            raise ServerGone(f"the llamacli server (pid {pid}) that ran this command ended unexpectedly"
                             f"{_status(proc)}") from None
        if frame.get("start") is True:
            started = True
        elif "exit" in frame:
            code = frame["exit"]
            return code if type(code) is int and 0 <= code <= 255 else 1
        elif frame.get("interrupted") is True:
            cancel_sent = None


def brief_frame(frame: dict) -> str:
    import json

    return printable(json.dumps(frame)[:120])


class _Interrupts:
    """Ctrl-C (SIGINT) while a request is handed over: counted, and seen by wait() at once, instead of a
    KeyboardInterrupt that could land in the middle of reading a frame. Only in the main thread (where Python
    runs signal handlers); elsewhere wait() only waits."""

    def __init__(self) -> None:
        self.count = 0
        self._seen = 0
        self._old: Any = None
        self._pipe: tuple[socket.socket, socket.socket] | None = None
        self._old_fd = -1

    def __enter__(self) -> _Interrupts:
        import signal
        import socket
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        self._pipe = socket.socketpair()
        for end in self._pipe:
            end.setblocking(False)
        self._old = signal.signal(signal.SIGINT, self._handler)
        self._old_fd = signal.set_wakeup_fd(self._pipe[1].fileno(), warn_on_full_buffer=False)
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        self.count += 1

    def __exit__(self, *exc: object) -> None:
        import signal

        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._old_fd)
        signal.signal(signal.SIGINT, self._old)
        for end in self._pipe:
            end.close()

    def wait(self, conn: socket.socket, timeout: float | None) -> str:
        """"interrupt" (a Ctrl-C not seen yet), "ready" (`conn` is readable) or "timeout"."""
        import select

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.count > self._seen:
                self._seen += 1
                return "interrupt"
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            watched = [conn] + ([self._pipe[0]] if self._pipe else [])
            ready = select.select(watched, [], [], left)[0]
            if self._pipe and self._pipe[0] in ready:
                try:
                    self._pipe[0].recv(64)
                except BlockingIOError:
                    pass
            if self.count > self._seen:
                continue
            if conn in ready:
                return "ready"
            if deadline is not None and time.monotonic() >= deadline:
                return "timeout"


# -- ps, stop ----------------------------------------------------------------------------------------------


def servers(timeout: float = 2.0) -> list[dict[str, Any]]:
    """Each live server's status, as it answers {"op": "status"}; servers that do not answer are left out."""
    from .rendezvous import Rendezvous, RendezvousError

    try:
        rv = Rendezvous(create=False)
    except FileNotFoundError:
        return []
    except RendezvousError as exc:
        raise LlamacliError(str(exc)) from None
    found = []
    with rv:
        for key in rv.keys():
            answer = ask(rv, key, {"op": "status", "llamacli": PROTOCOL, "key": key}, timeout)
            if answer is not None and isinstance(answer.get("status"), dict):
                found.append(answer["status"])
    return found


def ask(rv: Rendezvous, key: str, message: dict, timeout: float) -> dict | None:
    from .rendezvous import FrameError, RendezvousError, recv_frame, send_frame

    try:
        conn = rv.connect(key, timeout)
    except (RendezvousError, TimeoutError):
        return None
    if conn is None:
        return None
    with conn:
        try:
            send_frame(conn, message)
            return recv_frame(conn)[0]
        except (EOFError, FrameError, OSError):
            return None
