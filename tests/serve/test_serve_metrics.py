"""GET /metrics and GET /v1/models of `llamacli serve`, on a real server (tests/serve_runner.py) over a tiny random
model whose file name and served name are hostile (quotes, backslashes, a newline, an escape sequence, a byte
that is not UTF-8): after known requests every counter has moved by exactly what they did, the text is
Prometheus's format 0.0.4 as its own parser and a strict line-by-line check read it, and the hostile names come
back from the labels intact (as textio.printable writes them)."""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from serve_runner import start, stop  # noqa: E402

from llamacli.engine.generate import Model  # noqa: E402
from llamacli.errors import LlamacliError  # noqa: E402
from llamacli.testing import write_model  # noqa: E402
from llamacli.textio import printable  # noqa: E402

KEY = "sk-metrics"
CTX = 128
HOSTILE = 'evil "quoted" \\back\\slash\\" x\nnew line \x1b[31m red \udcff end'
FILE = 'model "q" \\ \\n\nx \udcff.gguf'  # (a file name may hold any byte but / and NUL)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("metrics") / FILE, "tiny-llama", "F32")
    model = Model(path, backend="numpy", ctx=CTX)
    url, server, thread = start(model, HOSTILE, KEY)
    yield url, model
    stop(server, thread)
    model.close()


def call(url: str, path: str, body: dict | None = None, key: str | None = KEY, method: str | None = None):
    """(status, headers, body bytes) of one request."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """The samples of /metrics, {(name, labels): value}, after checking the text strictly."""
    status, headers, data = call(url, "/metrics")
    assert status == 200 and headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = data.decode("utf-8")  # (strictly: a lone surrogate could not have been encoded)
    check_format(text)
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def series(samples: dict, name: str) -> dict[frozenset, float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def delta(before: dict, after: dict, name: str) -> dict[frozenset, float]:
    """The series of `name` that moved, and by how much."""
    old, new = series(before, name), series(after, name)
    moved = {k: new.get(k, 0.0) - old.get(k, 0.0) for k in {*old, *new}}
    return {k: d for k, d in moved.items() if d}


def labels(**kw: str) -> frozenset:
    return frozenset(kw.items())


NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
SAMPLE = re.compile(rf"({NAME})(?:\{{{LABEL}(?:,{LABEL})*,?\}})? ([^ ]+)(?: -?[0-9]+)?")
KINDS = {"counter", "gauge", "histogram", "summary", "untyped"}


def check_format(text: str) -> None:
    """Prometheus's text format 0.0.4, line by line: each family a HELP line, then its TYPE line, then its
    samples (a histogram's _bucket, _sum and _count; a summary's quantiles, _sum and _count), every sample line
    NAME{label="value",...} VALUE with values escaped as the format says (\\\\, \\", \\n and nothing else);
    counters' names end in _total; no family twice; and no character a terminal acts on anywhere."""
    assert text.endswith("\n")
    assert all(c == "\n" or c.isprintable() for c in text), "a control character in the metrics text"
    family, kind, seen = None, None, set()
    for line in text.split("\n")[:-1]:
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert re.fullmatch(NAME, name) and name not in seen, line
            assert re.fullmatch(r"(?:[^\\]|\\[\\n])*", line.split(" ", 3)[3] if line.count(" ") >= 3 else ""), line
            family, kind = name, None
            seen.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name == family and kind in KINDS, line
            assert kind != "counter" or name.endswith("_total"), line
        else:
            assert not line.startswith("#") and kind is not None, line
            m = SAMPLE.fullmatch(line)
            assert m, f"not a sample line: {line!r}"
            float(m.group(2))  # (+Inf, NaN and exponents included)
            parts = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}.get(kind, ("",))
            assert m.group(1) in {family + p for p in parts}, line


def test_counters_move_by_exactly_the_requests_made(served):
    url, model = served
    before = scrape(url)
    status, _, body = call(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there"}],
                                                          "max_tokens": 4, "temperature": 0})
    assert status == 200
    chat = json.loads(body)["usage"]
    status, _, body = call(url, "/v1/completions", {"prompt": "Once upon", "max_tokens": 3, "temperature": 0,
                                                    "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: {")]
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
    streamed = events[-1]["usage"]
    assert call(url, "/v1/chat/completions", {"messages": []})[0] == 400  # refused: no generation
    assert call(url, "/v1/models", key=None)[0] == 401
    assert call(url, "/v1/models", key="wrong")[0] == 401
    assert call(url, "/no/such/route")[0] == 404
    assert call(url, "/v1/chat/completions", method="GET")[0] == 405
    after = scrape(url)

    assert delta(before, after, "llamacli_requests_total") == {
        labels(endpoint="/v1/chat/completions", code="200"): 1,
        labels(endpoint="/v1/completions", code="200"): 1,
        labels(endpoint="/v1/chat/completions", code="400"): 1,
        labels(endpoint="/v1/models", code="401"): 2,
        labels(endpoint="other", code="404"): 1,
        labels(endpoint="/v1/chat/completions", code="405"): 1,
        labels(endpoint="/metrics", code="200"): 1,  # the first scrape (a scrape is counted once answered)
    }
    assert delta(before, after, "llamacli_request_errors_total") == {
        labels(endpoint="/v1/chat/completions", code="400"): 1,
        labels(endpoint="/v1/models", code="401"): 2,
        labels(endpoint="other", code="404"): 1,
        labels(endpoint="/v1/chat/completions", code="405"): 1,
    }
    assert delta(before, after, "llamacli_request_duration_seconds_count") == {
        labels(endpoint="/v1/chat/completions"): 1, labels(endpoint="/v1/completions"): 1,
        labels(endpoint="/metrics"): 1}
    prompt = chat["prompt_tokens"] + streamed["prompt_tokens"]
    generated = chat["completion_tokens"] + streamed["completion_tokens"]
    assert delta(before, after, "llamacli_prompt_tokens_total") == {labels(): prompt}
    assert delta(before, after, "llamacli_generated_tokens_total") == {labels(): generated}
    prefilled = delta(before, after, "llamacli_prefill_tokens_total")[labels()]
    assert 2 <= prefilled <= prompt  # (at least the last token of each prompt; the rest may be cached)
    assert sum(delta(before, after, "llamacli_generations_total").values()) == 2
    assert delta(before, after, "llamacli_time_to_first_token_seconds_count") == {labels(): 2}
    assert value(after, "llamacli_prefill_seconds_total") > value(before, "llamacli_prefill_seconds_total")
    # Read when scraped: nothing runs now; the cache holds the last prompt and its reply.
    assert value(after, "llamacli_requests_running") == value(after, "llamacli_requests_waiting") == 0
    assert value(after, "llamacli_requests_preparing") == 0
    assert value(after, "llamacli_kv_cache_used_cells") == len(model.seq) > 0
    assert value(after, "llamacli_kv_cache_cells") == CTX
    assert value(after, "llamacli_kv_cache_usage_ratio") == pytest.approx(len(model.seq) / CTX)
    assert value(after, "llamacli_model_context_length") == CTX
    assert value(after, "llamacli_model_train_context_length") == model.cfg.context_length


def test_the_text_is_prometheus_format_and_hostile_names_stay_inside_their_labels(served):
    """The model's name and file name come back from the labels as printable wrote them (the format's escaping
    held); a request for a path full of quotes, backslashes and an encoded newline is counted under "other"
    and reaches no label."""
    url, model = served
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", '/v1/x"y\\z%0A%22}%20{q="1', headers={"Authorization": f"Bearer {KEY}"})
    assert conn.getresponse().status == 404
    conn.close()
    samples = scrape(url)
    (info,) = series(samples, "llamacli_model_info")
    info = dict(info)
    assert info["name"] == printable(HOSTILE) and info["file"] == printable(FILE)
    assert info["architecture"] == "llama" and info["backend"] == "numpy"
    endpoints = {dict(k)["endpoint"] for k in series(samples, "llamacli_requests_total")}
    assert endpoints <= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "other"}
    assert value(samples, "llamacli_requests_total", endpoint="other", code="404") >= 1


def test_metrics_need_the_api_key_as_health_does(served):
    url, _ = served
    for path in ("/metrics", "/health"):
        assert call(url, path, key=None)[0] == 401
        assert call(url, path, key="wrong")[0] == 401
        assert call(url, path)[0] == 200


def test_models_report_the_context_length(served):
    """/v1/models: the context this server runs with as vLLM (max_model_len) and OpenRouter (context_length) name
    it, llama-server's meta (n_ctx_train and the rest); the hostile name as every answer carries it."""
    url, model = served
    status, _, body = call(url, "/v1/models")
    assert status == 200
    (entry,) = json.loads(body)["data"]
    assert entry["id"] == printable(HOSTILE) and entry["object"] == "model"
    assert entry["max_model_len"] == entry["context_length"] == CTX
    tensors = model.gguf.tensors.values()
    assert entry["meta"] == {"n_ctx": CTX, "n_ctx_train": model.cfg.context_length, "n_vocab": model.cfg.vocab_size,
                             "n_embd": model.cfg.n_embd, "n_params": sum(t.n_elements for t in tensors),
                             "size": sum(t.n_bytes for t in tensors)}
    status, _, body = call(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert status == 200 and json.loads(body)["model"] == printable(HOSTILE)


def test_running_waiting_and_preparing_requests(served, monkeypatch):
    """One request generating (held in its first step), one queued behind it for the one slot, one held while
    its prompt is tokenized: the gauges say 1, 1 and 1, then 0 once they are let go."""
    url, model = served
    generating, tokenizing = threading.Event(), threading.Event()
    step, tokenize = model.backend.step, model.tokenize

    def held_step(batch):
        generating.wait(30)
        return step(batch)

    def held_tokenize(text, **kw):
        if text == "hold me":
            tokenizing.wait(30)
        return tokenize(text, **kw)

    monkeypatch.setattr(model.backend, "step", held_step)
    monkeypatch.setattr(model, "tokenize", held_tokenize)
    answers: list[int] = []

    def ask(prompt: str) -> None:
        answers.append(call(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1})[0])

    def until(name: str, want: float) -> None:
        deadline = time.monotonic() + 20
        while value(scrape(url), name) != want:
            assert time.monotonic() < deadline, f"{name} never reached {want}"
            time.sleep(0.02)

    threads = [threading.Thread(target=ask, args=(p,)) for p in ("first", "second", "hold me")]
    try:
        threads[0].start()
        until("llamacli_requests_running", 1)
        threads[1].start()
        until("llamacli_requests_waiting", 1)
        threads[2].start()
        until("llamacli_requests_preparing", 1)
        samples = scrape(url)
        assert [value(samples, f"llamacli_requests_{n}") for n in ("running", "waiting", "preparing")] == [1, 1, 1]
    finally:
        generating.set()
        tokenizing.set()
        for t in threads:
            t.join(60)
    assert answers == [200, 200, 200]
    samples = scrape(url)
    assert [value(samples, f"llamacli_requests_{n}") for n in ("running", "waiting", "preparing")] == [0, 0, 0]


def test_a_stream_that_fails_after_its_headers_counts_as_an_error(served, monkeypatch):
    url, model = served

    def failing_run(*args, **kw):
        yield "partial"
        raise LlamacliError("the model failed")

    monkeypatch.setattr(model, "run", failing_run)
    before = scrape(url)
    status, _, body = call(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 0,
                                                    "stream": True})
    assert status == 200 and b"the model failed" in body
    after = scrape(url)
    assert delta(before, after, "llamacli_request_errors_total") == {labels(endpoint="/v1/completions", code="500"): 1}
    assert delta(before, after, "llamacli_requests_total") == {labels(endpoint="/v1/completions", code="200"): 1,
                                                               labels(endpoint="/metrics", code="200"): 1}
    assert delta(before, after, "llamacli_request_duration_seconds_count") == {labels(endpoint="/metrics"): 1}
    assert delta(before, after, "llamacli_generations_total") == {labels(finish_reason="unfinished"): 1}
