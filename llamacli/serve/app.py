"""The HTTP side of `llamacli serve`: a Starlette app over one loaded Model.

    request -> api key? -> body (bounded) -> a preparing lane: JSON, api.read_job (template, tokens)
            -> the scheduler (engine/scheduler.py): a cache slot, its steps batched with the others'
            -> the request's text stream (Model.run over the scheduler's ids) on a stream thread
            -> disconnected? stop : text -> JSON answer or SSE chunks

The model runs on the scheduler's worker thread alone (CUDA state stays with one thread): each request gets a
cache slot of its own when one is free (`--parallel`, in arrival order), joins the running batch at the next
step and leaves it when done. A slot keeps its cache between requests, and a request takes the free slot that
holds most of its prompt, so a chat client that resends the conversation prefills only the new turn; with the
prefix cache (engine/prefix_cache.py, `serve --cache-ram`) a prompt's blocks computed in any slot serve any
later request, in any slot. Each
request's text stream (detokenizing, stop strings) runs on a thread of the stream pool while it waits for its
ids; between two pieces the request is asked whether its client is still there, and one that left is taken
out of the batch. Too many requests waiting for a slot is a 503 with Retry-After.

Before its turn, a request is read and prepared (parsed, rendered, tokenized) off the event loop, in one of
two lanes, each a thread taking requests in arrival order: bodies up to SMALL_BODY in one, larger ones in
the other, so that a client sending megabytes never holds up a small request. A prompt that cannot fit the
context is refused from its length or partway through tokenizing it (api.read_job), so each request costs at
most a context's worth of tokenizing. Large bodies held at once share LARGE_BODIES bytes; past that a
request is answered 503 at once. Slow and idle connections are connections.py's business.

What GET /metrics shows is counted in metrics.py: requests by route, by CountRequests around the app (a new
route needs nothing more); generations, in Engine.pieces; a stream that fails after its headers, in _events.
Anthropic's Messages API (/v1/messages) is messages_api.py's: it reads its requests into the same Jobs, in
the same lanes and queue, and writes its own answers, events and error shape.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..chat.reasoning import make_splitter
from ..engine.generate import Completion
from ..engine.scheduler import Scheduler
from ..textio import printable
from . import messages_api, responses_api, tool_api
from .api import ApiError, Job, api_error, chunk, finish_reason, model_entry, read_job, response, usage_chunk
from .metrics import CONTENT_TYPE, CountRequests, Metrics

STREAM_SPARE = 16  # stream threads beyond one per connection (requests whose clients have just left)
DISCONNECT_POLL_S = 0.5  # how often a request waiting for its next piece asks whether its client is still there
MAX_BODY = 16 << 20  # bytes: a long conversation fits; a runaway upload does not
SMALL_BODY = 256 << 10  # bytes: a body up to this is prepared in the small lane
LARGE_BODIES = 64 << 20  # bytes of bodies larger than SMALL_BODY held at once (read, parsed, tokenized)
_END = object()


class Engine:
    """The model, its scheduler, the stream threads and the preparing lanes."""

    def __init__(self, model, name: str, log: Callable[[str], None] | None = None, max_waiting: int = 64,
                 connections: int = 64, prefill_budget: int | None = None):
        self.model, self.name = model, printable(name)
        self.scheduler = Scheduler(model, max_waiting=max_waiting, **({} if prefill_budget is None else
                                                                      {"prefill_budget": prefill_budget}))
        # A request's text stream waits on its ids on a thread of this pool, waiting for a slot included: one
        # thread per request whose client is there (at most `connections`, connections.py's bound), and those
        # whose client left give theirs back at once (pieces cancels them).
        self.streams = ThreadPoolExecutor(max_workers=connections + STREAM_SPARE,
                                          thread_name_prefix="llamacli-stream")
        self.lanes = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="llamacli-prepare-small"),
                      ThreadPoolExecutor(max_workers=1, thread_name_prefix="llamacli-prepare-large"))
        self.large_bytes = 0  # held by bodies larger than SMALL_BODY (LARGE_BODIES at most)
        self.preparing = 0  # requests in the lanes
        self.served = 0
        self.log = log or (lambda line: None)
        self.metrics = Metrics(self)

    @property
    def running(self) -> int:
        return self.scheduler.load["running"]

    @property
    def waiting(self) -> int:
        return self.scheduler.load["waiting"]

    async def prepare(self, data: bytes | bytearray, chat: bool, read: Callable | None = None) -> Any:
        """The body as a Job (`read(model, body, chat)`'s answer: api.read_job's by default), in the lane for its
        size (see the module doc)."""
        lane = self.lanes[len(data) > SMALL_BODY]
        self.preparing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(lane, _read_job, self.model, data, chat, read)
        finally:
            self.preparing -= 1

    def room(self) -> None:
        """SchedulerBusy (503) when a generation asked for now would find the queue full: the generating routes
        ask before they answer, while a stream's answer can still be a 503 (once its headers went out, only an
        error event could say so)."""
        self.scheduler.check_room()

    def close(self) -> None:
        """Stop the scheduler (what waits or runs ends with SchedulerClosed), the stream threads and the lanes."""
        self.scheduler.close()
        for pool in (*self.lanes, self.streams):
            pool.shutdown(wait=True, cancel_futures=True)

    async def pieces(self, job: Job, c: Completion, request: Request) -> AsyncIterator[str]:
        """The text of `job` as it is generated, in a cache slot of the scheduler's. A client that left stops
        the generation between two pieces (its stream is closed: the scheduler takes it out of the batch)."""
        gen = self.model.run(list(job.ids), completion=c, scheduler=self.scheduler, **job.run_kwargs())
        job_next = None  # the next() of the stream in flight on a stream thread
        try:
            while True:
                if await request.is_disconnected():
                    c.finish_reason = "disconnected"
                    return
                job_next = self.streams.submit(next, gen, _END)
                pending = asyncio.wrap_future(job_next)
                # While it waits (for a slot, or for the next id), the client is asked now and then whether it
                # is still there: one that left is cancelled, which ends the wait.
                while not (await asyncio.wait({pending}, timeout=DISCONNECT_POLL_S))[0]:
                    if await request.is_disconnected():
                        c.finish_reason = "disconnected"
                        return
                piece = pending.result()
                if piece is _END:
                    return
                yield piece
        finally:
            if c.cancel is not None:
                c.cancel()  # (taken out of the queue or the batch: the next() in flight returns)
            # A generator cannot be closed while its next() runs: it is closed once that returns, on that thread
            # (at once, on this one, where none runs).
            if job_next is None:
                gen.close()
            else:
                job_next.add_done_callback(lambda _: gen.close())
            self.served += 1
            self.metrics.generated(request.scope, c)

    def health(self) -> dict[str, Any]:
        load, cache = self.scheduler.load, self.model.prefix_cache
        return {"status": "ok", "model": self.name,
                "scheduling": ("one request at a time" if len(self.model.seqs) == 1 else
                               f"{len(self.model.seqs)} requests at once") + ", the rest waiting in arrival order",
                "slots": len(self.model.seqs), "running": load["running"], "busy": load["running"] > 0,
                "queue_length": load["waiting"], "served": self.served,
                "cached_tokens": sum(len(seq) for seq in self.model.seqs), "context": self.model.ctx,
                "prefix_cache_tokens": cache.tokens if cache is not None else 0}


def build_app(engine: Engine, api_key: str | None = None, loopback: bool = False) -> Starlette:
    """The routes over `engine`; with `api_key`, every request must carry `Authorization: Bearer KEY` (or, as
    Anthropic's clients send it, `x-api-key: KEY`), GET /health and GET /metrics too: what they show of the queue
    and the model is the operator's, and Prometheus sends the key as configured (`authorization:
    {credentials_file: ...}`). Errors on Anthropic's routes (/v1/messages...) take its shape. CountRequests counts
    every request (metrics.py).
    A browser's cross-origin request is refused (_SameOrigin), and with `loopback` (the server listens on
    this machine only) so is a request addressed to any other host name (a DNS-rebinding page's)."""

    async def chat_completions(request: Request) -> Response:
        return await _guarded(engine, request, _complete(engine, request, chat=True))

    async def completions(request: Request) -> Response:
        return await _guarded(engine, request, _complete(engine, request, chat=False))

    async def messages(request: Request) -> Response:
        return await _guarded(engine, request, messages_api.create(engine, request, _read_body, _log_done))

    async def count_tokens(request: Request) -> Response:
        return await _guarded(engine, request, messages_api.count_tokens(engine, request, _read_body))

    store = responses_api.ResponseStore()

    async def responses(request: Request) -> Response:
        return await _guarded(engine, request, _respond(engine, store, request))

    async def stored_response(request: Request) -> Response:
        rid = request.path_params["response_id"]
        try:
            return JSONResponse(store.delete(rid) if request.method == "DELETE" else store.retrieve(rid))
        except ApiError as exc:
            return _error(exc, request.url.path)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_entry(engine.name, engine.model)]})

    async def health(request: Request) -> Response:
        return JSONResponse(engine.health())

    async def metrics(request: Request) -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(ApiError(f"{exc.detail}: {request.method} {request.url.path}", exc.status_code, kind=kind),
                      request.url.path)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.state.responses = store
    if api_key is not None:
        app.add_middleware(_KeyCheck, key=api_key)
    app.add_middleware(_SameOrigin, loopback=loopback)
    app.add_middleware(CountRequests, metrics=engine.metrics)  # (added last: it runs first, and counts all)
    return app


class _SameOrigin:
    """What a web page in a browser could send is refused with 403 before anything else runs:
    - a request carrying an Origin other than the server's own (the browser names the page's origin on a
      cross-site POST, which it sends without asking when the body is text/plain or a form);
    - on a loopback server, a request whose Host is not this machine's (localhost, 127.0.0.0/8, [::1]): a page
      whose own name has been made to resolve to 127.0.0.1 (DNS rebinding) is same-origin to itself.
    Clients that are not browsers (curl, the openai library) send no Origin and the Host they dialled."""

    def __init__(self, app, loopback: bool):
        self.app, self.loopback = app, loopback

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            host = headers.get(b"host", b"").decode("latin-1").strip().lower()
            origin = headers.get(b"origin")
            why = None
            if self.loopback and not _loopback_name(host):
                why = "this server answers only requests addressed to this machine (localhost, 127.0.0.1, [::1])"
            elif origin is not None and _netloc(origin.decode("latin-1")) != host:
                why = "cross-origin requests from web pages are not served"
            if why is not None:
                await _error(ApiError(why, 403, kind="permission_error"), scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _netloc(origin: str) -> str:
    """An Origin header's host[:port], lower-case ("null" and anything unparsable: "")."""
    from urllib.parse import urlsplit

    try:
        return urlsplit(origin.strip()).netloc.lower()
    except ValueError:
        return ""


def _loopback_name(host: str) -> bool:
    """Whether a Host header (name[:port], [v6][:port]) names this machine: localhost or a loopback address."""
    import ipaddress

    name = host.rpartition("]")[0].lstrip("[") if host.startswith("[") else host.rsplit(":", 1)[0]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class _KeyCheck:
    """Every request carries the key (`Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's clients
    send it), compared in constant time; else 401."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
            if not bearer and not hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.key):
                err = ApiError("a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)", 401,
                               code="invalid_api_key", kind="authentication_error")
                await _error(err, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _guarded(engine: Engine, request: Request, work) -> Response:
    """The handler's answer, or its failure in OpenAI's error shape (Starlette's catch-all handler would
    also print the traceback). A client that left while sending its body gets nothing (there is no one to
    answer) and no log line."""
    try:
        return await work
    except ClientDisconnect:
        return Response(status_code=400)
    except Exception as exc:  # noqa: BLE001
        err = api_error(exc)
        if err.status >= 500 and err.status != 503:
            engine.log(f"error in {request.method} {request.url.path}: {type(exc).__name__}: {exc}")
        return _error(err, request.url.path)


class _BodyRefused(ApiError):
    """A body refused before it was all read: the answer closes the connection (the rest of the body would
    otherwise be read as the next request)."""


def _error(exc: ApiError, path: str = "") -> JSONResponse:
    """The error in OpenAI's shape, or Anthropic's on its routes."""
    headers = {"Connection": "close"} if isinstance(exc, _BodyRefused) else {}
    if exc.status == 503:  # busy: a client may try again (the scheduler's queue, large bodies)
        headers["Retry-After"] = "1"
    body = messages_api.error_body(exc) if messages_api.is_route(path) else exc.body()
    return JSONResponse(body, status_code=exc.status, headers=headers)


async def _read_body(engine: Engine, request: Request) -> tuple[bytearray, int]:
    """The body, at most MAX_BODY bytes, and the bytes of LARGE_BODIES it holds (release them with
    engine.large_bytes -= held): a body past SMALL_BODY takes its share as it grows, and is refused with 503
    where the others leave no room."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise _BodyRefused(f"the request body is larger than {MAX_BODY >> 20} MiB", 413)
    data, held = bytearray(), 0
    try:
        async for part in request.stream():
            data += part
            if len(data) > MAX_BODY:
                raise _BodyRefused(f"the request body is larger than {MAX_BODY >> 20} MiB", 413)
            if len(data) > SMALL_BODY:
                more = len(data) - held
                if engine.large_bytes + more > LARGE_BODIES:
                    raise _BodyRefused("the server is busy reading other large requests; try again shortly", 503,
                                       kind="server_error", code="overloaded")
                engine.large_bytes += more
                held += more
    except BaseException:
        engine.large_bytes -= held
        raise
    return data, held


def _read_job(model, data: bytes | bytearray, chat: bool, read: Callable | None = None) -> Any:
    """The JSON body as a Job (api.read_job, or `read`), on a lane's thread: parsing megabytes takes a while too."""
    return (read or read_job)(model, _json(data), chat)


def _json(data: bytes | bytearray, **options: Any) -> Any:
    """The body's JSON (`options`: json.loads's)."""
    try:
        return json.loads(data, **options)
    except RecursionError:
        raise ApiError("the request body nests arrays and objects too deeply to read") from None
    except ValueError:
        raise ApiError("the request body is not valid JSON") from None


async def _complete(engine: Engine, request: Request, chat: bool) -> Response:
    t0 = time.perf_counter()
    data, held = await _read_body(engine, request)
    try:
        job = await engine.prepare(data, chat)
    finally:
        engine.large_bytes -= held
        del data
    engine.room()
    if job.stream:
        return StreamingResponse(_events(engine, job, request, t0), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    c = Completion()
    pieces = []
    async for piece in engine.pieces(job, c, request):
        pieces.append(piece)
    _log_done(engine, request, job, c, t0)
    answer = response(job, c, engine.name)
    if job.tools is not None:  # the reply read for tool calls
        answer = tool_api.fill_response(answer, job.tools, c, "".join(pieces))
    return JSONResponse(answer)


async def _events(engine: Engine, job: Job, request: Request, t0: float) -> AsyncIterator[str]:
    """Server-sent events: a first chunk with the role, then the text as it comes (a thinking model's
    reasoning as reasoning_content), the finish reason, the usage if asked, and `[DONE]`. A failure after
    the headers went out is an error event before `[DONE]`."""
    c = Completion()
    splitter = None
    sent_logprobs = 0  # Completion.logprobs entries already sent
    text_offset = 0
    if job.chat:
        yield _sse(chunk(job, engine.name, role=True))
    try:
        async for piece in engine.pieces(job, c, request):
            if splitter is None:
                splitter = (tool_api.ToolStream(job.tools, c) if job.tools else make_splitter(c)) if job.chat else None
            think, answer = splitter.feed(piece) if splitter else ("", piece)
            calls = splitter.deltas() if job.tools else None
            entries, sent_logprobs = _new_logprobs(job, c, sent_logprobs)
            if think or answer or entries or calls:
                yield _sse(chunk(job, engine.name, content=answer, reasoning=think, entries=entries,
                                 text_offset=text_offset, tool_calls=calls))
                text_offset += len(answer)
        if c.finish_reason == "disconnected":
            _log_done(engine, request, job, c, t0)
            return
        think, answer = splitter.finish() if splitter else ("", "")
        calls = splitter.deltas() if job.tools and splitter else None
        finish = "tool_calls" if job.tools and splitter and splitter.called and c.finish_reason != "length" \
            else finish_reason(c)
        entries, sent_logprobs = _new_logprobs(job, c, sent_logprobs)
        yield _sse(chunk(job, engine.name, content=answer, reasoning=think, entries=entries,
                         finish=finish, text_offset=text_offset, tool_calls=calls))
        if job.include_usage:
            yield _sse(usage_chunk(job, c, engine.name))
    except Exception as exc:  # noqa: BLE001
        engine.log(f"error in a stream: {type(exc).__name__}: {exc}")
        err = api_error(exc)
        Metrics.stream_failed(request.scope, err.status)
        yield _sse(err.body())
    _log_done(engine, request, job, c, t0)
    yield "data: [DONE]\n\n"


async def _respond(engine: Engine, store: responses_api.ResponseStore, request: Request) -> Response:
    """POST /v1/responses: as _complete, the body read by responses_api (in the lane for its size) and the reply
    written as its output items (responses_api.Output), whole or as events."""
    t0 = time.perf_counter()
    data, held = await _read_body(engine, request)
    try:
        lane = engine.lanes[len(data) > SMALL_BODY]
        rjob = await asyncio.get_running_loop().run_in_executor(lane, _read_response, engine.model, data, store)
    finally:
        engine.large_bytes -= held
        del data
    engine.room()
    out = responses_api.Output(rjob, Completion(), engine.name)
    if rjob.stream:
        return StreamingResponse(_response_events(engine, out, request, t0), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    async for piece in engine.pieces(rjob.job, out.c, request):
        out.feed(piece)
    out.finish()
    _log_done(engine, request, rjob.job, out.c, t0)
    return JSONResponse(out.final)


def _read_response(model, data: bytes | bytearray, store: responses_api.ResponseStore) -> responses_api.ResponseJob:
    return responses_api.read(model, _json(data, **responses_api.JSON_OPTIONS), store)


async def _response_events(engine: Engine, out: responses_api.Output, request: Request, t0: float
                           ) -> AsyncIterator[str]:
    """The Responses API's events: response.created, the items' events as the text comes, and
    response.completed or response.incomplete; a failure after the headers went out is an `error` event and
    response.failed."""
    job = out.r.job
    yield out.start()
    try:
        async for piece in engine.pieces(job, out.c, request):
            events = out.feed(piece)
            if events:
                yield events
        if out.c.finish_reason == "disconnected":
            _log_done(engine, request, job, out.c, t0)
            return
        yield out.finish()
    except Exception as exc:  # noqa: BLE001
        engine.log(f"error in a stream: {type(exc).__name__}: {exc}")
        yield out.fail(api_error(exc))
    _log_done(engine, request, job, out.c, t0)


def _new_logprobs(job: Job, c: Completion, sent: int) -> tuple[list[dict] | None, int]:
    if job.logprobs is None:
        return None, sent
    entries = getattr(c, "logprobs", None) or []
    return entries[sent:], len(entries)


def _sse(obj: dict[str, Any]) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def _log_done(engine: Engine, request: Request, job: Job, c: Completion, t0: float) -> None:
    ms = (time.perf_counter() - t0) * 1e3
    engine.log(f"{request.method} {request.url.path}: {len(job.ids)} prompt tokens "
               f"({c.timings.prompt_tokens} prefilled), {len(c.tokens)} generated, {c.finish_reason}, {ms:.0f} ms")


def stderr_log(line: str) -> None:
    """A log line on stderr, escaped: paths and messages come from the network."""
    try:
        sys.stderr.write(printable(line) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
