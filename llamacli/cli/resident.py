"""The llamacli server that --keep-alive starts (`llamacli keep-alive-server`, not for direct use): it keeps one
model loaded and runs the Tasks that run/generate/chat hand it (cli/keep_alive.py says how a command gets
here), one at a time, until it has been idle for the keep-alive duration.

A command's task runs in this process's main thread, as it would have run in the command: the command's
stdin, stdout and stderr (received as descriptors) are put on descriptors 0, 1 and 2 for its time, with text
streams of the command's encodings over them, its working directory, umask, -v/--debug/-t state and clock
(for --verbose's start-up line), and rich's consoles made again for its terminal and environment. The task
is cli/generate.py's Task.run under app.guarded, which turns failures into the one `error:` line and exit
code the command itself would give; the same code, so the same output (no second generation loop: Model.run
in both). After it, the descriptors go back to /dev/null (a command's pipe is never held open after it), the
exit code goes to the command, and the model's cache is cleared before the next task, which starts as a
fresh process would.

The first command (the one that spawned the server, on a socket pair) is served with the load inside it: the
progress bar, the load's notices and a load's error reach that command as they would have; only then does
the server listen on KEY.sock, so others queue behind it. Later commands get the load's notices again
(recorded), and --verbose says the model was handed over rather than loaded (the start-up stages: the
hand-off's time, and for the first command the server's start and its load).

Threads: the main thread runs tasks; the acceptor takes connections (checks the peer's uid; each connection
then has a thread that reads its hello and request within HEADER_S and watches it afterwards). A command's
Ctrl-C ({"op": "cancel"}) becomes a SIGINT sent to the main thread, whose handler raises KeyboardInterrupt
only inside that command's task; a command that goes away (EOF) has its descriptors replaced by /dev/null at
once, then its task is interrupted the same way. Queued commands that leave are dropped.

It exits when idle for the keep-alive duration that the last command set (0: after that command), on
`llamacli stop`, or when its socket has been removed or replaced: the socket is unlinked first, queued
commands see their connection close before their turn and look again (a new server), and the lock goes
with the process.
"""

from __future__ import annotations

import io
import os
import queue
import signal
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import OutputError, UsageError
from ..textio import ClosedStream
from ..units import FOREVER, human_duration
from .app import (
    adopt_state,
    after_load,
    dim,
    guarded,
    is_verbose,
    open_model,
    reset_consoles,
    threads_notice,
)
from .generate import Task
from .keep_alive import PROTOCOL
from .rendezvous import (
    FrameError,
    Rendezvous,
    RendezvousError,
    encode,
    is_key,
    peer_credentials,
    recv_frame,
    send_frame,
)

HEADER_S = 10.0  # for a connection's hello and request to arrive
FIRST_S = 30.0  # for the spawning command's request
MAX_CONNECTIONS = 64  # open at once; more are closed at once
DEFAULT_KEEP_ALIVE = 300.0  # (every request names its own; ollama's default)


@dataclass
class Request:
    """One command's task and what it runs with."""

    conn: socket.socket
    fds: list[int]  # stdin, stdout, stderr, working directory
    task: Task
    load: dict[str, Any]
    keep_alive: float  # seconds, FOREVER
    env: dict[str, str]
    umask: int
    streams: list[dict[str, Any]]
    state: dict[str, Any]
    clock: dict[str, Any]
    phase: str = "new"  # new, queued, running, done, gone
    left: bool = False  # its command has gone (its connection closed)
    sending: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: dict) -> bool:
        """One small frame, without waiting: a command that does not read what it is sent (its socket's buffer
        full) has its connection cut, rather than the server held up."""
        data = encode(message)
        with self.sending:
            try:
                if self.conn.send(len(data).to_bytes(4, "big") + data, socket.MSG_DONTWAIT) == len(data) + 4:
                    return True
            except OSError:
                pass
            try:
                self.conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return False

    def close_fds(self) -> None:
        while self.fds:
            os.close(self.fds.pop())


class BadRequest(Exception):
    pass


def read_request(message: dict, fds: list[int]) -> dict[str, Any]:
    """A request's fields, checked (BadRequest says what is wrong; the caller closes `fds`)."""
    if message.get("op") != "run" or len(fds) != 4:
        raise BadRequest("a request is a run with four descriptors")
    try:
        task = Task.from_json(message.get("task"))
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    load, env, streams = message.get("load"), message.get("env"), message.get("streams")
    state, clock, umask, keep_alive = message.get("state"), message.get("clock"), message.get("umask"), \
        message.get("keep_alive")
    shapes = {"path": (str,), "backend": (str,), "ctx": (int, type(None)), "cache_types": (list,), "swa_full": (bool,),
              "quiet": (bool,), "gpu_layers": (str, type(None)), "flash_attn": (bool,)}
    if not isinstance(load, dict) or not all(type(load.get(name)) in types for name, types in shapes.items()):
        raise BadRequest("a request's load options")
    from ..backends.split_plan import SplitOptions

    try:
        if load.get("split") is not None:
            SplitOptions.from_json(load["split"])
    except ValueError:
        raise BadRequest("a request's split options") from None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise BadRequest("a request's environment")
    if not (isinstance(streams, list) and len(streams) == 3 and all(isinstance(s, dict) for s in streams)):
        raise BadRequest("a request's streams")
    for s in streams:
        if not s.get("closed") and not (isinstance(s.get("encoding"), str) and isinstance(s.get("errors"), str)):
            raise BadRequest("a request's stream encodings")
    if not isinstance(state, dict) or not isinstance(clock, dict) or type(umask) is not int or not 0 <= umask <= 0o777:
        raise BadRequest("a request's state, clock or umask")
    kinds = {"debug": (bool,), "verbose": (bool,), "threads": (int, type(None)), "threads_set": (int, type(None)),
             "threads_from": (str, type(None))}
    if not all(type(state.get(name)) in types for name, types in kinds.items()):
        raise BadRequest("a request's -v, --debug or -t")
    if type(keep_alive) not in (int, float) or keep_alive != keep_alive:
        raise BadRequest("a request's keep-alive")
    return {"task": task, "load": load, "keep_alive": FOREVER if keep_alive < 0 else float(keep_alive), "env": env,
            "umask": umask, "streams": streams, "state": state, "clock": clock}


class Resident:
    """The server: its model, the queue of commands, the one running (see the module doc)."""

    def __init__(self, channel: socket.socket, lock_fd: int, directory: Path):
        self.channel, self.lock_fd, self.directory = channel, lock_fd, directory
        self.key: str | None = None
        self.model: Any = None
        self.load: dict[str, Any] = {}  # the first command's load options (what `llamacli ps` shows)
        self.said: list[str] = []  # the load's notices, repeated to each command
        self.own: tuple[float, float, list] = (0.0, 0.0, [])  # the model's load_started, load_ms, load_stages
        self.queue: queue.Queue[Request | None] = queue.Queue()
        self.mutex = threading.Lock()  # current, phases, the descriptors 0-2, stopping
        self.current: Request | None = None
        self.interrupt_for: Request | None = None
        self.interruptible = False
        self.stopping = False
        self.served = 0
        self.keep_alive = DEFAULT_KEEP_ALIVE
        self.idle_since = time.monotonic()
        self.started = time.time()
        self.rendezvous: Rendezvous | None = None
        self.listener: socket.socket | None = None
        self.inode = 0
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.null = (sys.stdin, sys.stdout, sys.stderr)
        self.umask = os.umask(0o077)
        os.umask(self.umask)
        self.main = threading.get_ident()
        self.threads: int | None = None  # the BLAS threads the last command asked for (-t)

    # -- the process -------------------------------------------------------------------------------------------
    def run(self) -> None:
        for fd in (self.lock_fd, self.channel.fileno()):  # (no program this server starts holds the lock)
            os.set_inheritable(fd, False)
        os.chdir("/")
        signal.signal(signal.SIGINT, self._sigint)
        first = self._first()
        if first is None:
            return
        if not self._holds_the_lock():
            first.close_fds()
            self._end(first)
            return
        Rendezvous.write_pid(self.lock_fd, os.getpid())
        self._serve(first, first=True)
        if self.model is None or self.listener is None or first.keep_alive == 0:
            self._leave()
            return
        self.keep_alive = first.keep_alive
        self._loop()
        self._leave()

    def _first(self) -> Request | None:
        """The spawning command's request, on the socket pair."""
        conn = self.channel
        conn.settimeout(FIRST_S)
        request = self._handshake(conn)
        if request is None:
            conn.close()
            return None
        with self.mutex:
            request.phase = "queued"
        request.send({"queued": 0})
        conn.settimeout(None)
        threading.Thread(target=self._watch, args=(request,), name="llamacli-watch", daemon=True).start()
        return request

    def _holds_the_lock(self) -> bool:
        """Whether --lock-fd is the rendezvous directory's KEY.lock for the key the first command named (the
        server writes its pid there, and only there)."""
        try:
            self.rendezvous = Rendezvous(self.directory, create=False)
            named = os.stat(f"{self.key}.lock", dir_fd=self.rendezvous.fd, follow_symlinks=False)
            held = os.fstat(self.lock_fd)
        except (OSError, RendezvousError):
            return False
        return stat.S_ISREG(held.st_mode) and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

    def _loop(self) -> None:
        while True:
            with self.mutex:
                if self.stopping:
                    return
            left = None if self.keep_alive == FOREVER else self.idle_since + self.keep_alive - time.monotonic()
            if left is not None and left <= 0 and self.queue.empty():
                return
            try:
                request = self.queue.get(timeout=1.0 if left is None else min(1.0, max(left, 0.0)))
            except queue.Empty:
                if not self._socket_is_ours():
                    return
                continue
            if request is None:  # stop
                return
            with self.mutex:
                gone = request.phase == "gone"
            if gone:
                request.close_fds()
                self._end(request)
                continue
            self._serve(request)
            self.keep_alive = request.keep_alive
            if request.keep_alive == 0:
                return

    def _leave(self) -> None:
        """Stop listening, let queued commands go (they look again), close the model."""
        with self.mutex:
            self.stopping = True
        if self.rendezvous is not None and self.key is not None:
            try:
                self.rendezvous.unlink_if(self.key, self.inode)
            except (OSError, RendezvousError):
                pass
        if self.listener is not None:
            try:
                self.listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.listener.close()
        while True:
            try:
                request = self.queue.get_nowait()
            except queue.Empty:
                break
            if request is not None:
                request.close_fds()
                self._end(request)
        if self.model is not None:
            self.model.close()

    def _socket_is_ours(self) -> bool:
        if self.rendezvous is None or self.key is None:
            return False
        try:
            state, inode = self.rendezvous.socket_state(self.key)
        except OSError:
            return False
        return state == "socket" and inode == self.inode

    def _listen(self) -> None:
        """KEY.sock, once the model is loaded; where that fails, the first command is served and no other."""
        try:
            self.listener, self.inode = self.rendezvous.listen(self.key)
        except (OSError, RendezvousError) as exc:
            if is_verbose():
                dim(f"keep-alive: the server cannot listen ({exc}); it ends after this command")
            return
        threading.Thread(target=self._accept, name="llamacli-accept", daemon=True).start()

    # -- connections (their own threads) -----------------------------------------------------------------------
    def _accept(self) -> None:
        listener = self.listener
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                with self.mutex:
                    if self.stopping:
                        return
                time.sleep(0.1)  # out of descriptors, say: try again
                continue
            if not self.slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._connection, args=(conn,), name="llamacli-connection", daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        try:
            peer = peer_credentials(conn)
            if peer is not None and peer[1] != os.getuid():
                conn.close()
                return
            conn.settimeout(HEADER_S)
            request = self._handshake(conn)
            if request is None:
                conn.close()
                return
            with self.mutex:
                if self.stopping:
                    request.close_fds()
                    conn.close()
                    return
                ahead = self.queue.qsize() + (self.current is not None)
                request.phase = "queued"
            request.send({"queued": ahead})
            self.queue.put(request)
            conn.settimeout(None)
            self._watch(request)
        except Exception:  # noqa: BLE001 - a connection's trouble never reaches the server
            try:
                conn.close()
            except OSError:
                pass
        finally:
            self.slots.release()

    def _handshake(self, conn: socket.socket) -> Request | None:
        """The hello (or a status or stop), then the request: None where the connection has nothing for us
        (answered, refused, or not our protocol)."""
        try:
            hello, _ = recv_frame(conn)
            op, key = hello.get("op"), hello.get("key")
            if hello.get("llamacli") != PROTOCOL or not is_key(key):
                send_frame(conn, {"error": "not this protocol"})
                return None
            if self.key is None:
                self.key = key
            if key != self.key:
                send_frame(conn, {"error": "this server holds another model"})
                return None
            if op == "status":
                send_frame(conn, {"status": self.status()})
                return None
            if op == "stop":
                with self.mutex:
                    self.stopping = True
                if self.rendezvous is not None:  # new commands find no server (and start one) from now on
                    try:
                        self.rendezvous.unlink_if(key, self.inode)
                    except (OSError, RendezvousError):
                        pass
                try:  # answered before the worker is told: it may end the process at once
                    send_frame(conn, {"stopping": True})
                finally:
                    self.queue.put(None)
                return None
            if op != "hello":
                send_frame(conn, {"error": "unknown operation"})
                return None
            send_frame(conn, {"hello": key, "pid": os.getpid()})
            message, fds = recv_frame(conn, max_fds=4)
        except (EOFError, FrameError, OSError):
            return None
        try:
            fields = read_request(message, fds)
        except BadRequest as exc:
            for fd in fds:
                os.close(fd)
            try:
                send_frame(conn, {"error": str(exc)})
            except OSError:
                pass
            return None
        return Request(conn, fds, **fields)

    def _watch(self, request: Request) -> None:
        """A request's connection after its hand-off: a cancel interrupts it; its end (the command has gone)
        drops it, or detaches and interrupts it while it runs."""
        try:
            while True:
                message, _ = recv_frame(request.conn)
                if message.get("op") == "cancel":
                    self._interrupt(request, gone=False)
        except (EOFError, FrameError, OSError):
            self._interrupt(request, gone=True)
        finally:
            request.conn.close()

    def _interrupt(self, request: Request, gone: bool) -> None:
        with self.mutex:
            request.left = request.left or gone
            if request.phase in ("new", "queued"):
                request.phase = "gone"
                request.close_fds()  # the command's pipes and terminal are let go now, not at its turn
                return
            if request.phase != "running" or self.current is not request:
                return
            if gone:
                _null_fds()  # the command's terminal or pipe is let go at once
            self.interrupt_for = request
            signal.pthread_kill(self.main, signal.SIGINT)
        if not gone:
            request.send({"interrupted": True})

    def _sigint(self, signum: int, frame: Any) -> None:
        if self.interruptible and self.interrupt_for is not None and self.interrupt_for is self.current:
            self.interrupt_for = None
            raise KeyboardInterrupt

    def status(self) -> dict[str, Any]:
        m, load = self.model, self.load
        with self.mutex:
            busy = self.current is not None
        left = None if self.keep_alive == FOREVER else max(0.0, self.idle_since + self.keep_alive - time.monotonic())
        return {"pid": os.getpid(), "key": self.key, "name": load.get("name"), "path": load.get("path"),
                "spec": load.get("model"), "backend": m.backend.name if m else None, "ctx": m.ctx if m else None,
                "cache_types": load.get("cache_types"), "swa_full": load.get("swa_full"),
                "size": (load.get("identity") or {}).get("size"), "busy": busy, "queued": self.queue.qsize(),
                "served": self.served, "started": self.started,
                "keep_alive": -1 if self.keep_alive == FOREVER else self.keep_alive,
                "expires_in": None if left is None else round(left, 1)}

    # -- a command's task --------------------------------------------------------------------------------------
    def _serve(self, request: Request, first: bool = False) -> None:
        with self.mutex:
            if request.phase == "gone":
                request.close_fds()
                self._end(request)
                return
            request.phase = "running"
            self.current = request
        code = 1
        begun = time.perf_counter()
        try:
            if request.left:
                return
            try:
                self._attach(request)
            except OSError as exc:  # a descriptor that cannot be used: said on the command's stderr if possible
                _say(request, f"error: the llamacli server cannot take this command's streams: {exc.strerror or exc}")
                return
            request.send({"start": True})
            self.interruptible = True
            try:
                guarded(lambda: self._task(request, first, begun))
            except SystemExit as exc:
                code = _exit_status(exc.code)
            finally:
                self.interruptible = False
        except KeyboardInterrupt:  # one that came as the task ended
            self.interruptible = False
            code = 130
        finally:
            self.interruptible = False
            request.close_fds()
            self._detach()
            with self.mutex:
                self.current = None
                request.phase = "done"
            request.send({"exit": code})
            self._end(request)
            self.served += 1
            self.idle_since = time.monotonic()

    @staticmethod
    def _end(request: Request) -> None:
        """The server is done with the request's connection (its watcher closes it)."""
        try:
            request.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _task(self, request: Request, first: bool, begun: float) -> None:
        load = request.load
        quiet = bool(load.get("quiet"))
        if is_verbose():
            n = self.served
            started = "started for this command" if first else f"resident, {n} command{'s' * (n != 1)} served"
            then = ("keeps the model loaded until `llamacli stop`" if request.keep_alive == FOREVER else
                    "unloads the model after this command" if request.keep_alive == 0 else
                    f"keeps the model loaded for {human_duration(request.keep_alive)} after this command")
            dim(f"keep-alive: the llamacli server (pid {os.getpid()}, {started}) {then}")
        if first:
            self.load = load
            threads_notice(quiet)
            m = open_model(Path(load["path"]), load["backend"], load["ctx"], quiet, tuple(load["cache_types"]),
                           bool(load["swa_full"]), said=self.said, split=load.get("split"))
            self.model = m
            self.own = (m.load_started, m.load_ms, list(m.load_stages))
            after_load(m, quiet, load.get("gpu_layers"), bool(load.get("flash_attn")), True)
            self._listen()
        else:
            m = self.model
            threads_notice(quiet)
            if not quiet:
                for line in self.said:
                    dim(line)
            after_load(m, quiet, load.get("gpu_layers"), bool(load.get("flash_attn")), True)
        self._clock(m, request, first, begun)
        m.seq.clear()  # each command starts with an empty cache, as in its own process
        request.task.run(m)

    def _clock(self, m: Any, request: Request, first: bool, begun: float) -> None:
        """--verbose's start-up stages for this command: its own lookup, then the server's start and load (the
        first command) or the hand-off (the others), on the command's clock (the same monotonic clock)."""
        clock = request.clock
        looked_up, found = clock.get("looked_up"), clock.get("found")
        if not isinstance(looked_up, (int, float)) or not isinstance(found, (int, float)):
            return
        pid = os.getpid()
        load_started, load_ms, stages = self.own
        if first:
            stages = [(f"llamacli server start (pid {pid})", (load_started - found) * 1e3), *stages]
            ready = load_started + load_ms / 1e3
        else:
            ready = time.perf_counter()
            stages = [(f"hand-off to the llamacli server (pid {pid})", (ready - found) * 1e3)]
        m.lookup = (looked_up, found)
        m.load_started, m.load_ms, m.load_stages = found, (ready - found) * 1e3, stages

    def _attach(self, request: Request) -> None:
        """The command's streams on 0, 1 and 2, its directory, umask, state, consoles and clock."""
        from ..cpu_threads import set_threads
        from ..startup import mark_start

        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        stdin, stdout, stderr, cwd = request.fds
        with self.mutex:
            os.dup2(stdin, 0)
            os.dup2(stdout, 1)
            os.dup2(stderr, 2)
            if request.left:  # it left while we got here
                _null_fds()
        try:
            os.fchdir(cwd)
        except OSError:
            os.chdir("/")
        request.close_fds()
        os.umask(request.umask)
        names = (("standard input", UsageError), ("standard output", OutputError), ("standard error", None))
        sys.stdin, sys.stdout, sys.stderr = (_stream(fd, spec, name, error) for fd, spec, (name, error)
                                             in zip((0, 1, 2), request.streams, names))
        reset_consoles(request.env)
        adopt_state(request.state)
        threads = request.state.get("threads_set")
        if type(threads) is int and 0 < threads and threads != self.threads:  # -t as the command came to it
            set_threads(threads)
            self.threads = threads
        started = request.clock.get("started")
        mark_start(started if isinstance(started, (int, float)) else None)

    def _detach(self) -> None:
        from ..startup import mark_start

        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        readline = sys.modules.get("readline")
        if readline is not None:  # (a chat's lines are not the next command's history)
            readline.clear_history()
        sys.stdin, sys.stdout, sys.stderr = self.null
        with self.mutex:
            _null_fds()
        os.chdir("/")
        os.umask(self.umask)
        reset_consoles()
        adopt_state(None)
        mark_start(None)


def _say(request: Request, line: str) -> None:
    try:
        os.write(request.fds[2] if len(request.fds) > 2 else 2, (line + "\n").encode())
    except OSError:
        pass


def _null_fds() -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _stream(fd: int, spec: dict[str, Any], name: str, error: Any) -> Any:
    """A text stream over `fd` as the command had it (its encoding, errors, buffering), or a ClosedStream where
    the command's was closed."""
    if spec.get("closed"):
        return ClosedStream(name, error)
    raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
    buffered = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
    try:
        return io.TextIOWrapper(buffered, encoding=spec["encoding"], errors=spec["errors"], newline="\n",
                                line_buffering=bool(spec.get("line_buffering")),
                                write_through=bool(spec.get("write_through")))
    except LookupError:  # an encoding this Python does not know (the command's Python is this one)
        return io.TextIOWrapper(buffered, encoding="utf-8", errors="backslashreplace", newline="\n")


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


def serve_resident(fd: int, lock_fd: int, directory: Path) -> None:
    """`llamacli keep-alive-server`: serve on the socket pair `fd` (the spawning command), holding the lock
    `lock_fd`, then on the rendezvous directory's socket."""
    try:
        channel = socket.socket(fileno=fd)
        os.fstat(lock_fd)
    except OSError as exc:
        raise UsageError(f"keep-alive-server is started by --keep-alive, not by hand ({exc.strerror or exc})") from None
    Resident(channel, lock_fd, directory).run()
