"""The connections of `llamacli serve`, bounded in number and in time. uvicorn parses HTTP (h11) and runs the
app; this module adds what it leaves open to a hostile client, in two pieces of our own:

- GuardedH11, uvicorn's h11 protocol with deadlines. uvicorn arms one timer, the keep-alive, and only once a
  response is complete: a connection that sends nothing, or its headers or body a byte at a time
  (slowloris), is held forever. Here a request's line and headers must arrive within `head_s` of the
  connection's start or of the previous response's end, its body within `body_s` of the headers (else
  408 and the connection closes), and a response the client stops reading is dropped after `stall_s`: a
  stream that nobody reads would keep its generation, and the queue behind it, waiting for room in the
  socket.
- Acceptor, our own accept loop in place of asyncio's (loop.create_server). When accept() fails for want
  of file descriptors (EMFILE, ENFILE), asyncio logs a traceback and tries again for the rest of the
  backlog, a traceback each, and schedules a retry for each (thousands of lines a second: CPython's
  selector_events._accept_connection). Here connections may not take the last RESERVE_FDS descriptors,
  so that those already open are still served (answering one may open a file: a module imported on first
  use, /proc for the template watchdog): accepting pauses while fewer are free, with one line of log at
  most every `log_every_s`, and resumes by itself once they are. It also stops accepting at
  `max_connections`. Either way the rest wait in the kernel's backlog, costing this process no
  descriptor.

uvicorn is imported here at the top: server.py imports this module only once the serve extra is known to be
installed. What GuardedH11 uses of H11Protocol (its constructor; conn, cycle, flow, transport, loop;
connection_made/lost, data_received, handle_events, on_response_complete, pause/resume_writing) and
Server.startup's part (self.servers with close() and wait_closed(), self.started) are alike from uvicorn
0.29, the oldest the serve extra takes, to today's.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class Limits:
    """What one server allows its clients. The defaults suit a model served to a few programs or people:
    a long conversation's request arrives well inside them, a stalled or hostile one is cut off."""

    max_connections: int = 64  # open at once; more wait in the listen backlog until one closes
    backlog: int = 128  # connections the kernel holds for us while we do not accept
    head_s: float = 10.0  # a request line and headers, from the connection's start or the last answer's end
    body_s: float = 60.0  # a request body, from the end of its headers (16 MiB at 2.2 Mbit/s)
    keep_alive_s: float = 5.0  # an idle connection between two requests
    stall_s: float = 60.0  # a response the client does not read while the socket is full
    max_head_bytes: int = 16 << 10  # a request line and headers (h11's default; larger: 400)
    log_every_s: float = 60.0  # at most one line this often about accept() failing
    max_waiting: int = 64  # requests waiting for a free slot (engine/scheduler.py); more: 503 with Retry-After


RETRY_ACCEPT_S = 0.25  # after accept() failed (no descriptor free): when to try again
RESERVE_FDS = 16  # descriptors connections may not take: the server's own, for the connections it has
LINGER_S = 2.0  # after a 408: how long what the client still sends is read and dropped before closing
ACCEPT_BATCH = 64  # connections accepted in one go before the loop serves others


def _canned(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, in OpenAI's error shape."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": None}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


_TOO_SLOW = _canned(408, "Request Timeout", "the request did not arrive in time; the connection is closed")


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with deadlines on the request head, the body and a stalled response (see the
    module doc). One deadline runs at a time for the request (head, then body); the stall one apart."""

    def __init__(self, *args: Any, limits: Limits, on_close: Callable[[], None], **kw: Any):
        super().__init__(*args, **kw)
        self.limits = limits
        self._on_close: Callable[[], None] | None = on_close
        self._deadline: asyncio.TimerHandle | None = None  # the head's or the body's
        self._deadline_for = ""  # "head" | "body"
        self._stall: asyncio.TimerHandle | None = None
        self._lingering = False
        self.made = False

    # -- the connection ------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        self.made = True
        super().connection_made(transport)  # type: ignore[arg-type]
        self._update()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        try:
            super().connection_lost(exc)
        finally:
            self.closed()

    def closed(self) -> None:
        """Tell the acceptor once that this connection's descriptor is free."""
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

    # -- reading: the head, then the body ------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if not self._lingering:
            super().data_received(data)

    def handle_events(self) -> None:  # (after every piece of data received, and after a response)
        super().handle_events()
        self._update()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update()

    def _update(self) -> None:
        """The deadline for where the connection is: its client sending a body ("body", from the end of the
        headers), or between requests ("head": from the connection's start or the last response's end, not
        from each byte, so that a trickle cannot keep it open; uvicorn's keep-alive timer closes an idle one
        sooner); none while the app works on a request."""
        if self.transport.is_closing() or self._lingering:
            return
        if self.conn.their_state is h11.SEND_BODY:
            want = "body"
        elif self.cycle is None or self.cycle.response_complete:
            want = "head"
        else:
            want = ""
        if want != self._deadline_for:
            self._disarm()
            if want:
                seconds = self.limits.head_s if want == "head" else self.limits.body_s
                self._deadline, self._deadline_for = self.loop.call_later(seconds, self._too_slow), want

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._deadline_for = None, ""

    def _too_slow(self) -> None:
        """The head or the body is late: 408 where nothing was answered yet, and the connection closes. After
        the 408 the connection is shut for writing and what the client still sends is read and dropped for
        LINGER_S: closed at once, the kernel would answer that with a reset, which can destroy the 408
        before the client reads it."""
        self._deadline, self._deadline_for = None, ""
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:  # (an answer under way before its request's body came)
                self.transport.abort()
                return
            cycle.disconnected = True  # the app reading the body sees the client gone
            cycle.message_event.set()
        self._lingering = True
        self.flow.resume_reading()
        self.transport.write(_TOO_SLOW)
        self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.abort)

    # -- writing: a client that stops reading --------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.limits.stall_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        """The client has read nothing for stall_s: drop the connection and what waits to be sent (close()
        would wait for the client to read it). The app sees the client gone and stops its generation."""
        self._stall = None
        self.transport.abort()


class Acceptor:
    """Accepts connections on a listening socket for the loop, at most `max_connections` open at once, and
    rides out a shortage of file descriptors (see the module doc). Has asyncio.Server's close() and
    wait_closed(), which is what uvicorn's shutdown calls."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 make_protocol: Callable[[Callable[[], None]], GuardedH11], limits: Limits,
                 log: Callable[[str], None]):
        self.loop, self.sock, self.make_protocol, self.limits, self.log = loop, sock, make_protocol, limits, log
        self.open = 0  # accepted and not yet closed
        self.reading = self.closed = False
        self.retry: asyncio.TimerHandle | None = None
        self.last_warning = -math.inf
        self.tasks: set[asyncio.Task] = set()
        self.reserve: list[int] = []  # held only while accepting
        sock.setblocking(False)
        sock.listen(limits.backlog)
        self._read()

    def _read(self) -> None:
        """Watch the socket for connections, unless closed, full, or waiting to retry."""
        if not (self.reading or self.closed or self.retry is not None or self.open >= self.limits.max_connections):
            self.loop.add_reader(self.sock.fileno(), self._accept)
            self.reading = True

    def _stop_reading(self) -> None:
        if self.reading:
            self.loop.remove_reader(self.sock.fileno())
            self.reading = False

    def _accept(self) -> None:
        # Connections may not take the last RESERVE_FDS descriptors: they are held while accepting, and free
        # again for the open connections' own needs once this returns.
        short = self._take_reserve()
        if short is not None:
            self._pause(short)
            return
        try:
            for _ in range(ACCEPT_BATCH):
                if self.open >= self.limits.max_connections:
                    self._stop_reading()  # until a connection closes (_closed)
                    return
                try:
                    conn, _ = self.sock.accept()
                except (BlockingIOError, InterruptedError):
                    return
                except ConnectionAbortedError:
                    continue
                except OSError as exc:  # EMFILE, ENFILE (another process took the last ones), ENOBUFS, ENOMEM
                    self._pause(exc)
                    return
                self.open += 1
                task = self.loop.create_task(self._serve(conn))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        finally:
            self._let_go_of_reserve()

    def _pause(self, exc: OSError) -> None:
        """Stop accepting for RETRY_ACCEPT_S; say why, at most once every log_every_s."""
        self._stop_reading()
        self.retry = self.loop.call_later(RETRY_ACCEPT_S, self._retry)
        self._warn(exc)

    def _retry(self) -> None:
        self.retry = None
        self._read()

    def _take_reserve(self) -> OSError | None:
        """Hold RESERVE_FDS descriptors (of /dev/null), or let go of those had and return why not."""
        try:
            while len(self.reserve) < RESERVE_FDS:
                self.reserve.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as exc:
            self._let_go_of_reserve()
            return exc
        return None

    def _let_go_of_reserve(self) -> None:
        while self.reserve:
            os.close(self.reserve.pop())

    def _warn(self, exc: OSError) -> None:
        now = time.monotonic()
        if now - self.last_warning < self.limits.log_every_s:
            return
        self.last_warning = now
        why = exc.strerror or str(exc)
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            self.log(f"out of file descriptors ({why}): new connections wait until some of the {self.open} open "
                     "ones close (raise the limit with ulimit -n)")
        else:
            self.log(f"cannot accept connections for now ({why}); trying again")

    async def _serve(self, conn: socket.socket) -> None:
        made: list[GuardedH11] = []

        def protocol() -> GuardedH11:
            made.append(self.make_protocol(self._closed))
            return made[0]

        try:
            conn.setblocking(False)
            # No Nagle: asyncio turns it off only on sockets whose proto says TCP, and socket.create_server's
            # (server.listen) say 0. With it, each streamed chunk on a kept connection waits for the client's
            # delayed ACK of the one before (40 ms on Linux): the first token and the whole stream come late.
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await self.loop.connect_accepted_socket(protocol, conn)
        except Exception:  # noqa: BLE001 (the client left at once, or no memory for it: drop it)
            conn.close()
            if not made:
                self._closed()
            elif not made[0].made:
                made[0].closed()

    def _closed(self) -> None:
        self.open -= 1
        self._read()

    def close(self) -> None:
        self.closed = True
        self._stop_reading()
        if self.retry is not None:
            self.retry.cancel()
            self.retry = None

    async def wait_closed(self) -> None:
        return None


class Server(uvicorn.Server):
    """uvicorn's server, serving the given listening sockets through Acceptor and GuardedH11."""

    def __init__(self, config: uvicorn.Config, limits: Limits, log: Callable[[str], None]):
        super().__init__(config)
        self.limits, self.log = limits, log

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if not sockets:
            raise ValueError("llamacli's server runs on sockets bound beforehand (serve.server.listen)")
        await self.lifespan.startup()
        loop = asyncio.get_running_loop()
        config = self.config

        def make_protocol(on_close: Callable[[], None]) -> GuardedH11:
            return GuardedH11(config=config, server_state=self.server_state, app_state=self.lifespan.state,
                              _loop=loop, limits=self.limits, on_close=on_close)

        self.servers = [Acceptor(loop, sock, make_protocol, self.limits, self.log) for sock in sockets]  # type: ignore[misc]
        self.started = True


class OneLineLog(logging.Handler):
    """uvicorn's own log lines (a malformed request, an error in the app) through `log`: one line each, no
    traceback, and the same line at most once every `every_s` seconds, so that a client cannot flood stderr."""

    def __init__(self, log: Callable[[str], None], every_s: float = 60.0):
        super().__init__(logging.WARNING)
        self.log, self.every_s = log, every_s
        self.last: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = record.getMessage().splitlines()[0] if record.getMessage() else record.levelname
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                line = f"{line.rstrip(':')}: {type(exc).__name__}: {exc}"
            now = time.monotonic()
            if now - self.last.get(line, -math.inf) < self.every_s:
                return
            if len(self.last) > 1000:
                self.last.clear()
            self.last[line] = now
            self.log(line)
        except Exception:  # noqa: BLE001 (a log line must never take the server down)
            pass


def route_uvicorn_logs(log: Callable[[str], None], every_s: float) -> None:
    """uvicorn's loggers write through OneLineLog only (with log_config=None they would reach Python's
    last-resort handler: every line, tracebacks included)."""
    logger = logging.getLogger("uvicorn")  # (uvicorn.error and uvicorn.access pass their lines up to it)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.addHandler(OneLineLog(log, every_s))
    logger.propagate = False
