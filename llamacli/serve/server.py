"""The server over one model: the listening socket (bound before the model loads) and the uvicorn server on
it (app.py's Starlette app). uvicorn is imported when a server is made, so that llamacli works without the
serve extra; `llamacli serve` (cli/serve.py) runs it."""

from __future__ import annotations

import importlib
import socket

from ..errors import LlamacliError


class ServeError(LlamacliError):
    """The server cannot start: the extra is missing, or the address is taken."""


def need_extra():
    """uvicorn, or ServeError where the serve extra (Starlette, uvicorn) is not installed."""
    try:
        importlib.import_module("starlette")
        import uvicorn
    except ImportError:
        raise ServeError("llamacli serve needs the serve extra: pip install 'llamacli[serve]'") from None
    return uvicorn


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a taken port is one error line, not a log."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    backlog=128, reuse_port=False)
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def make_server(model, name: str, sock: socket.socket, api_key: str | None = None, log=None):
    """A uvicorn server for `model` on `sock` (not started): server.run([sock]) serves until stopped."""
    uvicorn = need_extra()
    import ipaddress

    from .app import Engine, build_app

    engine = Engine(model, name, log)
    app = build_app(engine, api_key, loopback=ipaddress.ip_address(sock.getsockname()[0]).is_loopback)
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=3, server_header=False)
    server = uvicorn.Server(config)
    server.engine = engine
    return server
