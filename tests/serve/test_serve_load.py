"""`llamacli serve` under hostile load (issue 46, class 4): a prompt that cannot fit the context is refused
before it is tokenized whole, and clients sending megabytes do not hold up a small request; connections are
bounded in time (nothing sent, headers or a body a byte at a time, a stream nobody reads, an idle keep-alive)
and in number; a body declared too large is refused unread; and a server out of file descriptors logs one
line, serves the connections it has and recovers.

Real servers on loopback ports: in this process over a small random model with SmolLM2's vocabulary (its
tokenizer is the real one, its weights are quick), with short time limits; and one `llamacli serve` process
under a low RLIMIT_NOFILE."""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_runner import start, stop  # noqa: E402

from llamacli.engine.generate import Model  # noqa: E402

SENTENCE = "The quick brown fox jumps over the lazy dog. "  # some 10 tokens for 45 bytes


@pytest.fixture(scope="module")
def model(random_model, smollm2):
    with Model(random_model("tiny-llama", vocab_file=smollm2), backend="numpy", ctx=512) as m:
        yield m


@contextmanager
def serving(model: Model, **limits):
    """A running server on a free port, with connections.Limits(**limits) where given: (port, server)."""
    kw = {}
    if limits:
        from llamacli.serve.connections import Limits

        kw["limits"] = Limits(**limits)
    url, server, thread = start(model, "m", **kw)
    try:
        yield int(url.rsplit(":", 1)[1]), server
    finally:
        stop(server, thread)


def post(port: int, path: str, body, timeout: float = 60) -> tuple[int, dict, float]:
    """(status, JSON reply, seconds taken) of a POST whose body is a JSON object or bytes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}"), time.monotonic() - t0
    finally:
        conn.close()


def health(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def answered_or_closed(sock: socket.socket, within: float) -> bytes | None:
    """None if the server sends nothing on `sock` and keeps it open for `within` seconds; else what it sends
    until it closes the connection (or 5 s more)."""
    if not select.select([sock], [], [], within)[0]:
        return None
    got, deadline = b"", time.monotonic() + 5
    while (left := deadline - time.monotonic()) > 0 and select.select([sock], [], [], left)[0]:
        try:
            part = sock.recv(65536)
        except ConnectionResetError:
            break
        if not part:
            break
        got += part
    return got


def trickle(sock: socket.socket, pieces: list[bytes], every: float, within: float) -> tuple[bytes | None, float]:
    """Send `pieces` one every `every` seconds (each well inside any deadline) until the server answers or
    closes: (what it sent, or None if it never did within `within` seconds, seconds taken)."""
    t0 = time.monotonic()
    for piece in pieces:
        try:
            sock.sendall(piece)
        except OSError:
            break
        got = answered_or_closed(sock, every)
        if got is not None:
            return got, time.monotonic() - t0
        if time.monotonic() - t0 > within:
            return None, time.monotonic() - t0
    return answered_or_closed(sock, max(0.0, within - (time.monotonic() - t0))), time.monotonic() - t0


# -- prompts too long for the context -------------------------------------------------------------------------


def test_prompts_that_cannot_fit_are_refused_before_they_are_tokenized(model):
    """Megabytes of prompt (the whole text took seconds to tokenize: 8 MiB some 8 s here) are refused at once,
    by completions, chat (after the template) and as token ids; a prompt that fits still runs."""
    big = SENTENCE * ((8 << 20) // len(SENTENCE))
    requests = [
        ("/v1/completions", {"prompt": big, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [big], "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [1] * 600_000, "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": big[: 6 << 20]}], "max_tokens": 1},
         "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": SENTENCE * 30}]
                                  + [{"role": "user", "content": SENTENCE * 30}] * 2000, "max_tokens": 1}, "messages"),
    ]
    with serving(model) as (port, _):
        for path, body, param in requests:
            status, reply, seconds = post(port, path, body)
            assert status == 400 and reply["error"]["code"] == "context_length_exceeded", (path, reply)
            assert reply["error"]["param"] == param and "context holds 512" in reply["error"]["message"]
            assert seconds < 3, f"{path}: refused after {seconds:.1f} s"
        status, reply, _ = post(port, "/v1/completions", {"prompt": SENTENCE * 40, "max_tokens": 2})
        assert status == 200 and reply["usage"]["completion_tokens"] == 2  # 400 tokens: fits
        status, reply, _ = post(port, "/v1/completions", {"prompt": SENTENCE * 60, "max_tokens": 2})
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded"  # 600: partway through


def test_clients_sending_megabytes_do_not_hold_up_a_small_request(model):
    """Ten clients each send a 6 MiB prompt; a small request that comes a moment later is answered as quickly
    as alone (it used to queue behind their tokenizing, on a pool they filled), and theirs are refused:
    400 for a prompt too long, or 503 once their bodies fill the memory set aside for large bodies."""
    big = json.dumps({"prompt": SENTENCE * ((6 << 20) // len(SENTENCE)), "max_tokens": 1}).encode()
    with serving(model) as (port, _):
        results: list[tuple[int, dict, float]] = []
        flood = [threading.Thread(target=lambda: results.append(post(port, "/v1/completions", big, 120)))
                 for _ in range(10)]
        for t in flood:
            t.start()
        time.sleep(1.0)  # their bodies are in: the small request comes after them
        status, reply, seconds = post(port, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        for t in flood:
            t.join(120)
        assert status == 200 and reply["usage"]["completion_tokens"] == 2
        assert seconds < 3, f"the small request took {seconds:.1f} s"
        assert len(results) == 10 and {r[0] for r in results} <= {400, 503}, [r[:2] for r in results]
        assert all(r[1]["error"]["code"] in ("context_length_exceeded", "overloaded") for r in results)


def test_a_body_declared_too_large_is_refused_before_it_is_read(model):
    """A Content-Length past the 16 MiB cap is answered 413 at once (the body is never read) and the
    connection closes."""
    with serving(model) as (port, _):
        s = socket.create_connection(("127.0.0.1", port))
        with s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 104857600\r\n\r\n{\"prompt\": \"")
            got = answered_or_closed(s, 3)
        assert got is not None and got.startswith(b"HTTP/1.1 413"), got
        assert b"larger than 16 MiB" in got


# -- slow, idle and many connections ---------------------------------------------------------------------------


def test_idle_and_slow_clients_are_cut_off(model):
    """With 1-second limits: a connection that sends nothing, headers a line every 0.2 s, or a body a byte
    every 0.2 s gets 408 and is closed within about a second (each used to be held for ever); an idle
    keep-alive connection is closed; the server goes on serving."""
    with serving(model, head_s=1, body_s=1, keep_alive_s=1, stall_s=1) as (port, _):
        with socket.create_connection(("127.0.0.1", port)) as s:
            got = answered_or_closed(s, 4)
        assert got is not None and got.startswith(b"HTTP/1.1 408"), got

        head = [b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"] + [b"X-Slow-%d: 1\r\n" % i for i in range(50)]
        with socket.create_connection(("127.0.0.1", port)) as s:
            got, seconds = trickle(s, head, 0.2, 5)
        assert got is not None and got.startswith(b"HTTP/1.1 408") and seconds < 3, (got, seconds)

        body = json.dumps({"prompt": "Hello " * 20, "max_tokens": 1}).encode()
        start = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % len(body)
        with socket.create_connection(("127.0.0.1", port)) as s:
            got, seconds = trickle(s, [start] + [body[i:i + 1] for i in range(len(body))], 0.2, 5)
        assert got is not None and got.startswith(b"HTTP/1.1 408") and seconds < 3, (got, seconds)

        with socket.create_connection(("127.0.0.1", port)) as s:  # a keep-alive connection, idle after an answer
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            got = answered_or_closed(s, 4)
        assert got is not None and got.startswith(b"HTTP/1.1 200"), got
        assert health(port)["status"] == "ok"


def test_connections_past_the_limit_wait_for_a_free_one(model):
    """At most max_connections are open: one more waits in the listen backlog, unanswered, until one of them
    closes, and is then served."""
    with serving(model, max_connections=3, head_s=30) as (port, _):
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        extra = socket.create_connection(("127.0.0.1", port))
        try:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert answered_or_closed(extra, 1.0) is None, "a connection past the limit was served"
            idle[0].close()
            got = answered_or_closed(extra, 5)
            assert got is not None and got.startswith(b"HTTP/1.1 200"), got
        finally:
            for s in (*idle, extra):
                s.close()


def test_a_stream_nobody_reads_is_dropped_and_frees_the_queue(model):
    """A client that asks for a stream and never reads it: once the socket is full the generation would wait
    for room for ever, and every request behind it too. After stall_s the connection is dropped and the
    generation stops, long before its 400 tokens."""
    with serving(model, stall_s=1) as (port, server):
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "logprobs": 20,
                           "temperature": 1.0, "seed": 7}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        try:
            # Small socket buffers on both sides, so that the stream fills them within its 400 tokens (a
            # loopback socket's own grow to megabytes).
            deadline = time.monotonic() + 10
            while not server.server_state.connections:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            for connection in list(server.server_state.connections):
                connection.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % len(body)
                      + body)
            busy_seen, deadline = False, time.monotonic() + 20
            while time.monotonic() < deadline:
                busy = health(port)["busy"]
                busy_seen |= busy
                if busy_seen and not busy:
                    break
                time.sleep(0.1)
            assert busy_seen and not busy, "the generation of a stream nobody reads went on"
            assert len(model.seq) < len(model.tokenize("Once upon a time")) + 300
        finally:
            s.close()
        status, reply, _ = post(port, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert status == 200


# -- out of file descriptors ---------------------------------------------------------------------------------


def test_out_of_file_descriptors_one_line_and_recovers(random_model):
    """`llamacli serve` with RLIMIT_NOFILE at 64 and 150 connections thrown at it: accept() fails for want of
    descriptors. One line says so (asyncio logged a traceback per failed accept: thousands of lines a
    second); the connection it already has gets its chat answered meanwhile; once the flood goes, new
    connections are served again."""
    resource = pytest.importorskip("resource")

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "llamacli", "serve", str(random_model()), "--backend", "numpy", "--port", "0"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=low_limit)
    flood: list[socket.socket] = []
    try:
        first = p.stderr.readline()
        found = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", first)
        assert found, first
        port = int(found.group(1))
        kept = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        kept.request("GET", "/health")
        assert kept.getresponse().read() and True
        for _ in range(150):
            try:
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=0.5))
            except OSError:  # the listen backlog is full too
                break
        time.sleep(1.0)
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "ignore_eos": True}  # (2 always)
        kept.request("POST", "/v1/chat/completions", json.dumps(chat), {"Content-Type": "application/json"})
        r = kept.getresponse()
        reply = json.loads(r.read())
        assert r.status == 200 and reply["usage"]["completion_tokens"] == 2, reply
        kept.request("POST", "/v1/chat/completions", json.dumps({**chat, "stream": True}),
                     {"Content-Type": "application/json"})
        r = kept.getresponse()
        events = r.read().decode()
        assert r.status == 200 and events.rstrip().endswith("data: [DONE]"), events
        kept.close()
        for s in flood:
            s.close()
        deadline, status = time.monotonic() + 15, None
        while status != "ok" and time.monotonic() < deadline:
            try:
                status = health(port)["status"]
            except OSError:
                time.sleep(0.2)
        assert status == "ok", "no new connection was served after the flood"
    finally:
        for s in flood:
            s.close()
        p.terminate()
        err = p.stderr.read()
        p.wait(timeout=30)
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err[:2000]
    assert sum("file descriptors" in line for line in lines) == 1, lines[:20]
    notices = [line for line in lines if not line.startswith("POST /v1/chat/completions: ")]  # (the request log)
    assert len(notices) <= 2, lines[:20]  # "serving ..." and the one above


def test_connections_run_without_nagle(model):
    """Every accepted connection has TCP_NODELAY. socket.create_server's socket (server.listen) says proto 0,
    so asyncio does not set it: then each small chunk of a stream on a kept connection waited for the client's
    delayed ACK of the one before (40 ms on Linux), and a keep-alive client (`bench --url`, the openai
    library's pool) saw the first token and the rest of the stream 40 ms late, in bursts."""
    with serving(model) as (port, server), socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # kept open after its answer
        assert select.select([s], [], [], 10)[0] and s.recv(65536).startswith(b"HTTP/1.1 200")
        mine = s.getsockname()
        open_ = [p.transport.get_extra_info("socket") for p in list(server.server_state.connections)
                 if p.transport is not None and not p.transport.is_closing()]
        served = [sock for sock in open_ if sock.getpeername() == mine]
        assert len(served) == 1
        assert served[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
