"""Fake download sources for the registry and download tests: a loopback HTTP server that also plays the
Hugging Face hub and a package index, a small valid GGUF, and a user models.toml. Fixtures built on these
(`server`, `download_sandbox`) are in conftest.py. Nothing here reaches the internet.
"""

from __future__ import annotations

import hashlib
import http.server
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

GGUF = b"GGUF" + bytes(range(256)) * 16  # a small file that passes the magic check
GGUF_SHA = hashlib.sha256(GGUF).hexdigest()

Answer = Callable[[http.server.BaseHTTPRequestHandler, bool], None]  # (handler, send the body?)


@dataclass
class Route:
    """A fixed answer; the connection closes after it, so a short body reads as a cut connection."""

    body: bytes = GGUF
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    token: str | None = None  # required as "Authorization: Bearer <token>", else 401 GatedRepo
    length: int | None = None  # a Content-Length to declare instead of the true one (truncation)

    def __call__(self, h: http.server.BaseHTTPRequestHandler, body: bool) -> None:
        if self.token and h.headers.get("Authorization") != f"Bearer {self.token}":
            h.send_response(401)
            h.send_header("Connection", "close")
            h.send_header("X-Error-Code", "GatedRepo")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        h.send_response(self.status)
        h.send_header("Connection", "close")
        for k, v in self.headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(self.length or len(self.body)))
        h.end_headers()
        if body:
            h.wfile.write(self.body)


class Server:
    """Loopback HTTP: `routes[path](handler, body)` answers (a Route, or any function of that shape); GETs per
    path (without the query) and their Range headers are recorded. Shuts itself down after 60 s at the latest."""

    def __init__(self) -> None:
        self.routes: dict[str, Answer] = {}
        self.gets: Counter[str] = Counter()
        self.ranges: list[str | None] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                server.gets[self.path.split("?")[0]] += 1
                server.ranges.append(self.headers.get("Range"))
                self.dispatch(body=True)

            def do_HEAD(self) -> None:
                self.dispatch(body=False)

            def dispatch(self, body: bool) -> None:
                route = server.routes.get(self.path.split("?")[0])
                try:
                    if route is None:
                        self.send_response(404)
                        self.send_header("X-Error-Code", "EntryNotFound")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                    else:
                        route(self, body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.timer = threading.Timer(60.0, self.httpd.shutdown)
        self.timer.start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def hf(self, repo: str, filename: str, body: bytes = GGUF, token: str | None = None) -> None:
        """A file as the Hugging Face hub serves it: HEAD and GET on /<repo>/resolve/main/<file>."""
        self.routes[f"/{repo}/resolve/main/{filename}"] = Route(body, headers=hub_headers(body), token=token)

    def close(self) -> None:
        self.timer.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()


def hub_headers(body: bytes) -> dict[str, str]:
    """What huggingface_hub needs to place a file in its cache: the commit and the ETag (the sha256)."""
    return {"X-Repo-Commit": "0123456789abcdef0123456789abcdef01234567", "ETag": f'"{hashlib.sha256(body).hexdigest()}"'}


def isolate_network(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """No source reaches the internet: the hub and the package index are a closed loopback port until a test
    points them at its server; huggingface_hub's cache (read at import) is a private folder."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-hub-cache"))


def user_models(tmp_path: Path, monkeypatch, text: str | bytes) -> Path:  # noqa: ANN001
    """`text` as the user's models.toml ($LLAMACLI_MODELS)."""
    path = tmp_path / "user-models.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    monkeypatch.setenv("LLAMACLI_MODELS", str(path))
    return path


def partial_files(home: Path) -> list[Path]:
    """Anything a failed download may have left in a cache: .part files, staging folders."""
    return sorted(p for p in home.rglob("*") if ".part" in p.name) if home.exists() else []
