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


class FamilyServers:
    """The serve tests' servers over tiny random models of each tool-call family with its real chat template
    (llama.cpp's models/templates, testing.tool_vocab), one per family, started on first use (on BACKEND) and
    stopped by close(). get(family, client) -> (client(base url), model, server), the same each time."""

    def __init__(self, tmp_path_factory, templates):  # noqa: ANN001 (pytest's factory; a Path)
        self.tmp, self.templates = tmp_path_factory, templates
        self.running: dict[str, tuple] = {}

    def get(self, family: str, client):  # noqa: ANN001, ANN201 (a callable of the url; its client)
        import pytest

        from llamacli.engine.generate import Model
        from llamacli.testing import variant, write_model
        from llamacli.testing.tool_vocab import FAMILIES, tool_vocab

        if family not in self.running:
            path = self.templates / FAMILIES[family][0]
            if not path.exists():
                pytest.skip(f"{path.name} is not in this llama.cpp release")
            spec = variant("tiny-llama", context_length=8192, name=f"tiny-{family}")
            gguf = write_model(self.tmp.mktemp(family) / "m.gguf", spec, "F32",
                               vocab=tool_vocab(family, path.read_text(encoding="utf-8")))
            model = Model(gguf, backend=BACKEND, ctx=8192)
            url, server, thread = start(model, family)
            self.running[family] = (client(url), model, server, thread)
        return self.running[family][:3]

    def close(self) -> None:
        for _, model, server, thread in self.running.values():
            stop(server, thread)
            model.close()
