"""What `llamacli serve` shows at GET /metrics: Prometheus's text exposition format, version 0.0.4.

Written with prometheus_client, the Prometheus project's own Python client: it keeps the counts thread-safe,
writes the format (HELP and TYPE lines, counters ending in _total, label values escaped) and its parser reads
it back in the tests. Each server has a registry of its own, not the library's global one, so that two servers
in one process never mix their counts. prometheus_client also writes each counter's and histogram's creation
time, as a gauge NAME_created.

What is counted, and where:
- every HTTP request, by CountRequests, an ASGI middleware outside the app's own (a 401 or a 403 counts too):
  by endpoint, the path of the route it matched as the route declares it (a route added to the app is counted
  with no more code; a path that no route has is "other", so that clients cannot make up label values) and
  by status code; the duration of those answered without error; errors (a status of 400 or more, or a stream
  that failed after its 200 went out: `Metrics.stream_failed`) by endpoint and code;
- every generation, by Engine.pieces (`Metrics.generated`): its prompt tokens, those prefilled, those that
  were not (their K/V were cached: in the request's slot, or copied from the prefix cache) and of those the
  prefix cache's, the tokens generated, the seconds spent prefilling and decoding, how it finished, and the
  time from the request's arrival to its first token;
- read when scraped: requests generating (one at a time), waiting for the model and being read and prepared
  (app.py's queue and lanes); the KV cache's cells (context positions) in use and in all; the positions the
  prefix cache (engine/prefix_cache.py) holds and may hold; the model (its
  served name, file, architecture, backend and cache types as labels; context lengths, parameters, size and
  load time as gauges); the process (CPU, memory, file descriptors: prometheus_client's ProcessCollector,
  on Linux).

Strings from the model's file name and metadata reach label values through textio.printable (no character a
terminal acts on, no lone surrogate that UTF-8 cannot hold); the format's own escaping then takes quotes,
backslashes and newlines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector, generate_latest
from starlette.routing import Match

from ..textio import printable
from .api import model_entry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OTHER = "other"  # the endpoint label of a path that no route has
SCOPE_KEY = "llamacli.metrics"  # the request's Tally in its ASGI scope

# Seconds: a first token on a GPU comes in tens of milliseconds, on the NumPy backend or after a long prompt in
# seconds to minutes; a whole request may stream for many minutes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


@dataclass
class Tally:
    """One request's record, kept in its scope (SCOPE_KEY) from its arrival to its answer's end."""

    arrived: float  # time.perf_counter()
    failed: int = 0  # the status of an error reported after the answer's headers went out (a stream's)


class Metrics:
    """The counts of one server over `engine` (app.Engine: its model, queue and name)."""

    def __init__(self, engine: Any):
        r = self.registry = CollectorRegistry()
        model = engine.model
        self.requests = Counter("llamacli_requests", "HTTP requests answered, by endpoint (the route's path) and "
                                "status code", ["endpoint", "code"], registry=r)
        self.errors = Counter("llamacli_request_errors", "Requests answered with an error: a status of 400 or more, "
                              "or a stream that failed after its headers (the error's status)",
                              ["endpoint", "code"], registry=r)
        self.duration = Histogram("llamacli_request_duration_seconds", "Time from a request's arrival to the end "
                                  "of its answer (a stream's last event), requests answered without error",
                                  ["endpoint"], buckets=DURATION_BUCKETS, registry=r)
        self.prompt_tokens = Counter("llamacli_prompt_tokens", "Prompt tokens of the generations run", registry=r)
        self.prefill_tokens = Counter("llamacli_prefill_tokens", "Prompt tokens prefilled (the rest of each prompt "
                                      "was in the KV cache already)", registry=r)
        self.cached_tokens = Counter("llamacli_prompt_cached_tokens", "Prompt tokens not prefilled: their K/V were "
                                     "in the request's cache slot or came from the prefix cache", registry=r)
        self.prefix_tokens = Counter("llamacli_prefix_cache_hit_tokens", "Prompt tokens whose K/V the prefix cache "
                                     "gave (computed for an earlier request, copied into the request's slot)",
                                     registry=r)
        self.generated_tokens = Counter("llamacli_generated_tokens", "Tokens generated", registry=r)
        self.prefill_seconds = Counter("llamacli_prefill_seconds", "Time spent prefilling prompts", registry=r)
        self.decode_seconds = Counter("llamacli_decode_seconds", "Time spent generating after the first token",
                                      registry=r)
        self.generations = Counter("llamacli_generations", "Generations run, by how they finished (eos, stop, "
                                   "length, disconnected; unfinished: stopped by an error or a cancelled request)",
                                   ["finish_reason"], registry=r)
        self.ttft = Histogram("llamacli_time_to_first_token_seconds", "Time from a request's arrival to its first "
                              "token (its wait in the queue and its prefill included)", buckets=TTFT_BUCKETS,
                              registry=r)
        gauges = (
            ("llamacli_requests_running", "Requests generating, each in a cache slot", lambda: engine.running),
            ("llamacli_requests_waiting", "Requests prepared and waiting for a free slot", lambda: engine.waiting),
            ("llamacli_requests_preparing", "Requests being read, parsed and tokenized", lambda: engine.preparing),
            ("llamacli_kv_cache_used_cells", "KV cache cells (context positions of every slot) holding tokens",
             lambda: sum(len(seq) for seq in model.seqs)),
            ("llamacli_kv_cache_cells", "KV cache cells (context positions of every slot) in all",
             lambda: model.ctx * len(model.seqs)),
            ("llamacli_kv_cache_usage_ratio", "KV cache cells in use over all of them",
             lambda: sum(len(seq) for seq in model.seqs) / (model.ctx * len(model.seqs))),
            ("llamacli_slots", "Sequences the server generates at once (--parallel)", lambda: len(model.seqs)),
            ("llamacli_prefix_cache_tokens", "Positions the prefix cache holds (whole blocks)",
             lambda: model.prefix_cache.tokens if model.prefix_cache is not None else 0),
            ("llamacli_prefix_cache_capacity_tokens", "Positions the prefix cache may hold (--cache-ram; 0: off)",
             lambda: model.prefix_cache.capacity * model.prefix_cache.block if model.prefix_cache is not None else 0),
        )
        for name, doc, read in gauges:
            Gauge(name, doc, registry=r).set_function(read)
        meta = model_entry(engine.name, model)["meta"]
        for name, doc, value in (
            ("llamacli_model_context_length", "The context this server runs with (--ctx), in tokens", meta["n_ctx"]),
            ("llamacli_model_train_context_length", "The context the model was trained for, in tokens",
             meta["n_ctx_train"]),
            ("llamacli_model_parameters", "The model's parameters", meta["n_params"]),
            ("llamacli_model_size_bytes", "The size of the model's tensors", meta["size"]),
            ("llamacli_model_load_seconds", "Time the model took to load", model.load_ms / 1e3),
        ):
            Gauge(name, doc, registry=r).set(value)
        info = {"name": engine.name, "file": model.path.name, "architecture": model.cfg.architecture,
                "backend": model.backend.name, "cache_type_k": model.cache_types[0],
                "cache_type_v": model.cache_types[1]}
        Info("llamacli_model", "The model served", registry=r).info({k: printable(str(v)) for k, v in info.items()})
        ProcessCollector(registry=r)

    def render(self) -> bytes:
        """The text the /metrics route answers with (CONTENT_TYPE)."""
        return generate_latest(self.registry)

    def answered(self, endpoint: str, status: int, tally: Tally) -> None:
        """A request's answer is over (CountRequests)."""
        code = tally.failed if status < 400 and tally.failed else status
        self.requests.labels(endpoint, str(status)).inc()
        if code >= 400:
            self.errors.labels(endpoint, str(code)).inc()
        else:
            self.duration.labels(endpoint).observe(time.perf_counter() - tally.arrived)

    def generated(self, scope: dict, c: Any) -> None:
        """A generation is over (Engine.pieces): `c` is its engine.generate.Completion, `scope` its request's."""
        t = c.timings
        self.prompt_tokens.inc(len(c.prompt_tokens))
        self.prefill_tokens.inc(t.prompt_tokens)
        self.cached_tokens.inc(t.cached_tokens)
        self.prefix_tokens.inc(t.prefix_cached_tokens)
        self.generated_tokens.inc(len(c.tokens))
        self.prefill_seconds.inc(t.prompt_ms / 1e3)
        self.decode_seconds.inc(t.eval_ms / 1e3)
        self.generations.labels(c.finish_reason or "unfinished").inc()
        tally = scope.get(SCOPE_KEY)
        if tally is not None and t.first_token_at > 0:
            self.ttft.observe(max(0.0, t.first_token_at - tally.arrived))

    @staticmethod
    def stream_failed(scope: dict, status: int) -> None:
        """The request of `scope` failed after its answer's headers went out (an error event in a stream): it
        counts as an error with `status`, though its HTTP status was 200."""
        tally = scope.get(SCOPE_KEY)
        if tally is not None:
            tally.failed = status


def endpoint(scope: dict) -> str:
    """The endpoint label of a request: the path of the app's route that matches it (as Starlette's router
    matches: a route whose path matches but not its method answers 405 and counts under its path), else OTHER."""
    found = OTHER
    for route in getattr(scope.get("app"), "routes", ()):
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route.path
        if match is Match.PARTIAL and found is OTHER:
            found = route.path
    return found


class CountRequests:
    """ASGI middleware: every HTTP request counted by endpoint and status code when its answer is over (see the
    module doc). It runs outside the app's other middleware, so refusals (401, 403) count too."""

    def __init__(self, app: Any, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tally = scope[SCOPE_KEY] = Tally(time.perf_counter())
        where = endpoint(scope)
        status = 500  # where the app fails before answering, Starlette's outer handler answers 500

        async def counted_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            self.metrics.answered(where, status, tally)
