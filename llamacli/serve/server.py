"""The server over one model: the listening socket (bound before the model loads) and the uvicorn server on
it (app.py's Starlette app; connections.py's accept loop and deadlines, within connections.Limits). uvicorn
is imported when a server is made, so that llamacli works without the serve extra; `llamacli serve`
(cli/serve.py) runs it."""

from __future__ import annotations

import importlib
import socket

from ..errors import LlamacliError


class ServeError(LlamacliError):
    """The server cannot start: the extra is missing, or the address is taken."""


def need_extra():
    """uvicorn, or ServeError where the serve extra (Starlette, uvicorn, prometheus_client) is not installed."""
    try:
        importlib.import_module("starlette")
        importlib.import_module("prometheus_client")
        import uvicorn
    except ImportError:
        raise ServeError("llamacli serve needs the serve extra: pip install 'llamacli[serve]'") from None
    return uvicorn


def listen(host: str, port: int, backlog: int = 128) -> socket.socket:
    """The listening socket, bound before the model loads: a taken port is one error line, not a log."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    backlog=backlog, reuse_port=False)
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def make_server(model, name: str, sock: socket.socket, api_key: str | None = None, log=None, limits=None,
                prefill_budget: int | None = None):
    """A uvicorn server for `model` on `sock` (not started): server.run([sock]) serves until stopped.
    `limits` (connections.Limits) bounds the connections in number and time; `log` takes one-line notices
    (a request done, uvicorn's warnings, running out of file descriptors); `prefill_budget`: the scheduler's
    prompt tokens per turn (engine/scheduler.py; None: its default)."""
    uvicorn = need_extra()
    import ipaddress

    from .app import Engine, build_app
    from .connections import Limits, Server, route_uvicorn_logs

    limits = limits or Limits()
    log = log or (lambda line: None)
    engine = Engine(model, name, log, max_waiting=limits.max_waiting, connections=limits.max_connections,
                    prefill_budget=prefill_budget)
    app = build_app(engine, api_key, loopback=ipaddress.ip_address(sock.getsockname()[0]).is_loopback)
    # h11 and asyncio's own loop whatever else is installed (httptools, uvloop): connections.py adds its
    # deadlines to uvicorn's h11 protocol and accepts on asyncio's loop. limit_concurrency: requests still
    # running after their client left count against it too (connections never pass max_connections).
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=3, server_header=False, http="h11", loop="asyncio",
                            timeout_keep_alive=limits.keep_alive_s, limit_concurrency=limits.max_connections + 1,
                            backlog=limits.backlog, h11_max_incomplete_event_size=limits.max_head_bytes)
    route_uvicorn_logs(log, limits.log_every_s)
    server = Server(config, limits, log)
    server.engine = engine
    return server
