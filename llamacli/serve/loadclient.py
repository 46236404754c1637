"""The clients of `llamacli bench --url` (loadgen.py runs them): one streamed completion at a time on a kept
connection, timed chunk by chunk, against any OpenAI-compatible server.

What a request leaves is an Outcome: its time to the first chunk that carries text, its end, the server's
counts (usage) and the chunks, or why it failed: an HTTP status, "timeout", "connection" (refused by nothing,
broken, ended before `data: [DONE]`), "stream" (not an event stream, a chunk that is not JSON, a line past
MAX_LINE, an error event). The gaps between text chunks go into a LogHistogram: fixed memory however many
tokens come. A server that cannot be connected to any more is Unreachable, which ends the run.

Bounds: each request is given `timeout` seconds in all (the watching thread shuts its socket when they are up,
Client.check; each read waits as long at most); an SSE line is read up to MAX_LINE bytes and any other answer
up to MAX_BODY; strings from the server reach a message only escaped and cut short.

Written on the standard library (http.client, one thread per client): httpx and aiohttp are not llamacli
dependencies, and nothing here needs more than blocking sockets, which the GIL does not hold back at the
request rates of a server generating tokens. http.client also gives the bounds above: readline(limit) for a
bounded line, and the socket to shut down at a deadline. No model, backend or server code is imported.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from ..textio import brief, printable

MAX_LINE = 1 << 20  # bytes of one SSE line (a chunk's JSON)
MAX_BODY = 4 << 20  # bytes of an answer that is not a stream (GET /v1/models, an error)
MAX_MESSAGE = 300  # characters of a server's error message kept for the report
FINISH_S = 1.0  # s to wait for the end of an answer after `data: [DONE]` (the chunked encoding's last chunk)


# -- where to send ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """The server: scheme, host, port and the path its API hangs under ('' at the root)."""

    scheme: str
    host: str
    port: int
    prefix: str

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.prefix}"

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        if self.scheme == "https":
            import ssl

            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout,
                                               context=ssl.create_default_context())
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)


def parse_url(text: str) -> Target:
    """--url as a Target: http(s)://HOST[:PORT][/PATH], the scheme http when left out, a trailing /v1 taken as
    the API's own (the routes are /v1/...). Anything else is a UsageError."""
    raw = text.strip()
    if not raw or any(c.isspace() or not c.isprintable() for c in raw):
        raise UsageError(f"--url must be http://HOST[:PORT][/PATH], got {brief(text)}")
    if "://" not in raw:
        raw = "http://" + raw
    try:
        parts = urllib.parse.urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise UsageError(f"--url {brief(text)} does not parse: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise UsageError(f"--url must be http:// or https://, got {brief(text)}")
    if not parts.hostname:
        raise UsageError(f"--url names no host: {brief(text)}")
    if parts.username is not None or parts.query or parts.fragment:
        raise UsageError(f"--url takes no user, query or fragment (the key goes in --api-key): {brief(text)}")
    prefix = parts.path.rstrip("/")
    if prefix.endswith("/v1"):
        prefix = prefix[:-3]
    return Target(parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), prefix)


# -- the gaps between chunks ---------------------------------------------------------------------------------


class LogHistogram:
    """Durations in seconds, counted in buckets whose edges grow by RATIO from LOW: at most BUCKETS counts
    whatever the number of samples, any percentile within half a bucket (0.5%) of the sample's value; min,
    max and the mean exact. (A list of every gap would grow with the tokens generated.)"""

    RATIO = 1.01
    LOW = 1e-6  # s; shorter is counted in the first bucket
    BUCKETS = math.ceil(math.log(1e4 / 1e-6) / math.log(1.01))  # up to 10,000 s

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}  # bucket -> samples (only the buckets that have some)
        self.n, self.total = 0, 0.0
        self.min, self.max = math.inf, -math.inf

    def add(self, x: float) -> None:
        i = 0 if x <= self.LOW else min(int(math.log(x / self.LOW) / math.log(self.RATIO)), self.BUCKETS - 1)
        self.counts[i] = self.counts.get(i, 0) + 1
        self.n += 1
        self.total += x
        self.min, self.max = min(self.min, x), max(self.max, x)

    def merge(self, other: LogHistogram) -> None:
        for i, c in other.counts.items():
            self.counts[i] = self.counts.get(i, 0) + c
        self.n += other.n
        self.total += other.total
        self.min, self.max = min(self.min, other.min), max(self.max, other.max)

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    def percentile(self, q: float) -> float | None:
        """The bucket of the sample at rank q% (as `percentile` ranks them), at its geometric middle, within
        [min, max]."""
        if not self.n:
            return None
        rank = round((self.n - 1) * q / 100)
        if rank <= 0 or rank >= self.n - 1:
            return self.min if rank <= 0 else self.max
        seen = 0
        for i in sorted(self.counts):
            seen += self.counts[i]
            if seen > rank:
                mid = self.LOW * self.RATIO ** (i + 0.5)
                return min(max(mid, self.min), self.max)
        return self.max


# -- one request ----------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one request left: its times (s from its start), its counts, or why it failed."""

    error: str | None = None  # None: answered; else an HTTP status ("503"), "timeout", "connection", "stream"
    message: str = ""  # the server's words or the failure's, for the report
    ttft: float | None = None
    e2e: float = 0.0
    prompt_tokens: int | None = None  # usage, where the server gave it
    gen_tokens: int | None = None
    chunks: int = 0  # chunks that carried text

    @property
    def tokens(self) -> int:
        return self.gen_tokens if self.gen_tokens is not None else self.chunks

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)


class Unreachable(Exception):
    """The server cannot be connected to (refused, no route, no such host): the run stops."""


class Client:
    """One client: a keep-alive connection, one request at a time, each given `timeout` seconds in all: the
    watching thread calls `check()`, which shuts the socket of a request past its deadline (a blocked read
    ends at once), and `abort()` to stop it whatever its deadline."""

    def __init__(self, target: Target, headers: dict[str, str], timeout: float):
        self.target, self.headers, self.timeout = target, headers, timeout
        self.itl = LogHistogram()  # the gaps of this client's answered requests
        self.conn: http.client.HTTPConnection | None = None
        self.deadline: float | None = None
        self.timed_out = self.aborted = False
        self.lock = threading.Lock()

    def check(self, now: float) -> None:
        with self.lock:
            if self.deadline is not None and now > self.deadline:
                self.timed_out = True
                self._shut()

    def abort(self) -> None:
        with self.lock:
            self.aborted = True
            self._shut()

    def _shut(self) -> None:
        sock = self.conn.sock if self.conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        with self.lock:
            if self.conn is not None:
                self.conn.close()
                self.conn = None

    def _open(self) -> None:
        """A new connection, or Unreachable where the server cannot be reached (refused, no route, no such host)."""
        self.close()
        conn = self.target.connection(self.timeout)
        try:
            conn.connect()
        except TimeoutError:  # (socket.timeout is TimeoutError)
            conn.close()
            raise
        except OSError as exc:
            conn.close()
            raise Unreachable(f"cannot connect to {self.target.url}: {reason(exc)}") from None
        # http.client writes a request's headers and body in two sends: with Nagle's algorithm the body waits
        # for the server's delayed ACK of the headers (40 ms on Linux) on every request of a kept connection.
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.lock:
            self.conn = conn

    def send(self, method: str, path: str, body: dict | None) -> tuple[http.client.HTTPResponse, float]:
        """Send a request on the kept connection (a new one where the server closed it while it was idle) ->
        (the response, once its status line came; the time the request went out). Arms the deadline."""
        data = json.dumps(body).encode() if body is not None else None
        headers = dict(self.headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        with self.lock:
            self.deadline = time.monotonic() + self.timeout
        for attempt in range(2):
            reused = self.conn is not None
            if not reused:
                self._open()
            assert self.conn is not None
            t0 = time.perf_counter()
            try:
                self.conn.request(method, self.target.prefix + path, body=data, headers=headers)
                return self.conn.getresponse(), t0
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if not reused or attempt or self.timed_out or self.aborted:
                    raise
        raise AssertionError("unreachable")

    def done(self) -> None:
        """The request is over: no deadline until the next."""
        with self.lock:
            self.deadline = None
            self.timed_out = self.aborted = False

    def request(self, path: str, body: dict, chat: bool) -> Outcome:
        """One streamed completion, measured: an Outcome, its failure's reason in it (Unreachable is raised)."""
        out = Outcome()
        gaps = LogHistogram()
        t0 = time.perf_counter()
        try:
            resp, t0 = self.send("POST", path, body)
            if resp.status != 200:
                out.error, out.message = str(resp.status), error_message(read_body(resp))
            else:
                self._stream(resp, t0, chat, out, gaps)
            self._finish(resp)
        except Unreachable:
            raise
        except _BadStream as exc:
            out.error, out.message = "stream", str(exc)
        except (OSError, http.client.HTTPException) as exc:  # (TimeoutError is an OSError)
            late = self.timed_out or isinstance(exc, TimeoutError)
            out.error = "timeout" if late else "connection"
            out.message = f"no answer within --timeout {self.timeout:g} s" if late else \
                f"the connection broke: {reason(exc)}"
        finally:
            self.done()
        if out.error is not None:
            self.close()
            out.e2e = time.perf_counter() - t0
        else:
            self.itl.merge(gaps)
        return out

    def _stream(self, resp: http.client.HTTPResponse, t0: float, chat: bool, out: Outcome, gaps: LogHistogram) -> None:
        """Read the server-sent events to `data: [DONE]`, timing the chunks that carry text."""
        kind = resp.getheader("Content-Type", "")
        if "text/event-stream" not in kind:
            raise _BadStream(f"the answer is not an event stream (Content-Type {brief(kind)})")
        last = None
        while True:
            line = resp.readline(MAX_LINE + 1)
            if not line:  # (the server closed the connection, or went away)
                raise ConnectionResetError("the stream ended before data: [DONE]")
            if len(line) > MAX_LINE:
                raise _BadStream(f"a line of the stream is longer than {MAX_LINE >> 20} MiB")
            if not line.startswith(b"data:"):
                continue  # blank lines between events, comments (":"), event: and id: fields
            payload = line[5:].strip()
            if payload == b"[DONE]":
                out.e2e = time.perf_counter() - t0
                return
            try:
                obj = json.loads(payload)
            except (ValueError, RecursionError):
                raise _BadStream(f"a chunk is not JSON: {brief(payload.decode('utf-8', 'replace'))}") from None
            if not isinstance(obj, dict):
                raise _BadStream("a chunk is not a JSON object")
            if obj.get("error") is not None:
                raise _BadStream(f"the server reported an error mid-stream: {error_message(obj)}")
            usage = obj.get("usage")
            if isinstance(usage, dict):
                out.prompt_tokens = _count(usage.get("prompt_tokens"), out.prompt_tokens)
                out.gen_tokens = _count(usage.get("completion_tokens"), out.gen_tokens)
            if _carries_text(obj, chat):
                now = time.perf_counter()
                if last is None:
                    out.ttft = now - t0
                else:
                    gaps.add(now - last)
                last = now
                out.chunks += 1

    def _finish(self, resp: http.client.HTTPResponse) -> None:
        """Keep the connection for the next request where the answer's end is framed (chunks, a length) and
        comes within MAX_LINE bytes and FINISH_S seconds (the request is measured by now); else close it."""
        if resp.will_close or self.conn is None or self.conn.sock is None:
            self.close()
            return
        try:
            self.conn.sock.settimeout(FINISH_S)
            resp.read(MAX_LINE)
            self.conn.sock.settimeout(self.timeout)
        except (OSError, http.client.HTTPException):
            pass
        if not resp.isclosed():
            self.close()


class _BadStream(Exception):
    pass


def _carries_text(obj: dict, chat: bool) -> bool:
    """Whether a chunk carries generated output: completions' text; chat's content, reasoning (llamacli's and
    llama-server's reasoning_content, vLLM's reasoning) or tool calls."""
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return False
    for c in choices:
        if not isinstance(c, dict):
            continue
        if not chat:
            if c.get("text"):
                return True
            continue
        delta = c.get("delta")
        if isinstance(delta, dict) and any(delta.get(k) for k in ("content", "reasoning_content", "reasoning",
                                                                  "tool_calls")):
            return True
    return False


def _count(value: Any, old: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else old


def read_body(resp: http.client.HTTPResponse) -> bytes:
    try:
        return resp.read(MAX_BODY)
    except (OSError, http.client.HTTPException):
        return b""


def error_message(body: bytes | dict) -> str:
    """An error answer's message (OpenAI's {"error": {"message"}}, llama-server's, a plain {"detail"} or
    text), escaped and cut short."""
    obj: Any = body
    if isinstance(body, bytes):
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            obj = body.decode("utf-8", "replace")
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        msg = err.get("message", err.get("detail")) if isinstance(err, dict) else err
        obj = msg if isinstance(msg, str) else "(no message)"
    text = " ".join(str(obj).split())
    return printable(text[:MAX_MESSAGE] + ("..." if len(text) > MAX_MESSAGE else ""))


def reason(exc: BaseException) -> str:
    if isinstance(exc, socket.gaierror):
        return f"no such host ({exc.strerror or exc})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return printable(str(exc)) or type(exc).__name__
