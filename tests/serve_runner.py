"""A `llamacli serve` server running in a thread of the test process, on a free loopback port (the serve
tests' one way to start and stop it)."""

from __future__ import annotations

import os
import threading
import time

from llamacli.serve.server import listen, make_server

# The backend the serve tests' family models run on: NumPy in CI; LLAMACLI_TEST_BACKEND=cuda runs the same
# tests on the GPU machine (the agents' APIs on both backends). Scripted replies patch the NumPy backend's
# sampling, so those tests skip elsewhere.
BACKEND = os.environ.get("LLAMACLI_TEST_BACKEND", "numpy")


def start(model, name: str, api_key: str | None = None, **kw):  # noqa: ANN001, ANN003
    """A running server on a free port (make_server's keywords: limits, log) -> (base url, server, thread)."""
    sock = listen("127.0.0.1", 0)
    server = make_server(model, name, sock, api_key, **kw)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def stop(server, thread) -> None:  # noqa: ANN001
    server.should_exit = True
    thread.join(10)
    server.engine.close()  # (its scheduler's worker, stream threads and lanes)
