"""`llamacli bench --url`: the load tool (llamacli/serve/loadgen.py, loadclient.py) against a real `llamacli serve` in this
process (a tiny random model on the NumPy backend, four requests at once), and against a scripted server for
what a real one does not do on cue (a status now and then, a stall, a broken stream, dying mid-run).

The counts must be the server's own (its request log says what each request was given and generated), the
latencies ordered, every output format parse, and each failure a user can meet end in one error line."""

from __future__ import annotations

import csv
import io
import json
import random
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_runner import start, stop  # noqa: E402

from clirun import run  # noqa: E402
from llamacli.engine.generate import Model  # noqa: E402
from llamacli.serve.loadclient import LogHistogram, parse_url  # noqa: E402
from llamacli.serve.loadgen import percentile  # noqa: E402

SLOTS = 4
LOG = re.compile(r"POST (/v1/\S+): (\d+) prompt tokens \((\d+) prefilled\), (\d+) generated")


@pytest.fixture(scope="module")
def path(random_model):
    return random_model("tiny-llama", "Q8_0")


@pytest.fixture(scope="module")
def served(path):
    """A server running SLOTS requests at once -> (url, its request log: (route, prompt, prefilled, generated))."""
    model = Model(path, backend="numpy", ctx=512, slots=SLOTS)
    lines: list[tuple[str, int, int, int]] = []

    def log(line: str) -> None:
        m = LOG.match(line)
        if m:
            lines.append((m[1], int(m[2]), int(m[3]), int(m[4])))

    url, server, thread = start(model, "tiny", log=log)
    try:
        yield url, lines
    finally:
        stop(server, thread)
        model.close()


def bench(url: str, *args: str):
    return run("bench", "--url", url, *args)


def ordered(row: dict) -> None:
    for name in ("ttft", "itl", "tpot", "e2e"):
        assert row[f"{name}_ms_p50"] <= row[f"{name}_ms_p99"], name
    assert row["ttft_ms_p50"] <= row["e2e_ms_p50"] and row["ttft_ms_p99"] <= row["e2e_ms_p99"]
    assert 0 < row["ttft_ms_p50"] and 0 < row["itl_ms_p50"]


def test_counts_are_the_servers_and_latencies_are_ordered(served):
    url, lines = served
    lines.clear()
    r = bench(url, "-npl", "1,4", "-p", "16", "-n", "6", "--requests", "8", "--seed", "1", "-o", "json")
    assert r.code == 0, r.err
    rows = json.loads(r.out)
    assert [row["clients"] for row in rows] == [1, 4]
    assert len(lines) == 2 + 8 + 8  # two warm-ups, then each level's requests, level after level
    for row, level in zip(rows, (lines[2:10], lines[10:18])):
        assert (row["requests"], row["ok"], row["failed"], row["errors"]) == (8, 8, 0, {})
        assert row["tokens_from"] == "usage"
        assert row["prompt_tokens"] == sum(line[1] for line in level)
        assert row["gen_tokens"] == sum(line[3] for line in level) > 0
        assert row["gen_tps"] == pytest.approx(row["gen_tokens"] / row["duration_s"], rel=1e-3)
        assert row["req_per_s"] == pytest.approx(8 / row["duration_s"], rel=1e-3)
        assert row["model"] == "tiny" and row["endpoint"] == "/v1/completions" and row["url"] == url
        assert row["n_prompt"] == 16 and row["n_predict"] == 6
        ordered(row)
        # Each prompt differs from its first word: little more than the BOS comes from a slot's cache.
        reused = sorted(prompt - prefilled for _, prompt, prefilled, _ in level)
        assert reused[len(reused) // 2] <= 4, reused
    # Prompts of about -p tokens: the warm-ups measured the server's tokens a word.
    assert 8 * 10 <= rows[0]["prompt_tokens"] <= 8 * 24
    assert "running 1 client, 8 requests" in r.err and "running 4 clients, 8 requests" in r.err


def test_chat_with_a_shared_prefix_reuses_the_servers_cache(served):
    url, lines = served
    lines.clear()
    r = bench(url, "--chat", "--clients", "2", "-p", "100", "--shared-prefix", "80", "-n", "4", "--requests", "8",
              "--seed", "2", "-o", "json")
    assert r.code == 0, r.err
    (row,) = json.loads(r.out)
    assert row["endpoint"] == "/v1/chat/completions" and row["ok"] == 8 and row["shared_prefix"] == 80
    level = lines[-8:]
    assert all(route == "/v1/chat/completions" for route, *_ in level)
    assert row["prompt_tokens"] == sum(line[1] for line in level)
    assert row["gen_tokens"] == sum(line[3] for line in level)
    ordered(row)
    # The system message is the same in all: a request after its slot's first prefills only its own part.
    reused = [prompt - prefilled for _, prompt, prefilled, _ in level]
    assert sum(n >= 40 for n in reused) >= 8 - 2, reused


def test_markdown_and_csv(served):
    url, _ = served
    md = bench(url, "-npl", "1,2", "-p", "8", "-n", "3", "--requests", "2")
    assert md.code == 0, md.err
    lines = md.out.strip().splitlines()
    assert lines[0] == f"server: {url}/v1/completions; model: tiny; -p 8, -n 3; latencies in ms"
    head = [c.strip() for c in lines[2].strip("|").split("|")]
    assert head == ["clients", "requests", "errors", "prompt tok", "gen tok", "tok/s", "req/s", "TTFT p50",
                    "TTFT p99", "ITL p50", "ITL p99", "TPOT p50", "e2e p50", "e2e p99"]
    body = [[c.strip() for c in l.strip("|").split("|")] for l in lines[4:]]
    assert [b[:3] for b in body] == [["1", "2", "0"], ["2", "2", "0"]] and all(float(b[5]) > 0 for b in body)
    assert "running" not in md.out and "warmed up" in md.err  # progress on stderr only
    c = bench(url, "-npl", "1,2", "-p", "8", "-n", "3", "--requests", "2", "-o", "csv")
    assert c.code == 0, c.err
    rows = list(csv.DictReader(io.StringIO(c.out)))
    assert [row["clients"] for row in rows] == ["1", "2"] and all(row["errors"] == "" for row in rows)
    assert all(int(row["ok"]) == 2 and float(row["ttft_ms_p50"]) <= float(row["e2e_ms_p99"]) for row in rows)


def test_the_api_key(path, tmp_path, monkeypatch):
    model = Model(path, backend="numpy", ctx=128)
    url, server, thread = start(model, "tiny", api_key="secret")
    try:
        wrong = bench(url, "--api-key", "wrong", "-npl", "1", "-p", "4", "-n", "2")
        assert wrong.code == 1 and wrong.out == ""
        line = wrong.one_line_error()
        assert "401" in line and "wrong --api-key" in line and "a valid API key is required" in line
        none = bench(url, "-npl", "1", "-p", "4", "-n", "2")
        assert none.code == 1 and "this server needs --api-key" in none.one_line_error()
        ok = bench(url, "--api-key", "secret", "-npl", "1", "-p", "4", "-n", "2", "--requests", "1", "-o", "json")
        assert ok.code == 0, ok.err
        assert json.loads(ok.out)[0]["ok"] == 1
        key = tmp_path / "key"
        key.write_text("secret\n", encoding="utf-8")
        from_file = bench(url, "--api-key-file", str(key), "-npl", "1", "-p", "4", "-n", "2", "--requests", "1")
        assert from_file.code == 0, from_file.err
        monkeypatch.setenv("LLAMACLI_API_KEY", "secret")  # serve's variable: one setting for both ends
        from_env = bench(url, "-npl", "1", "-p", "4", "-n", "2", "--requests", "1")
        assert from_env.code == 0, from_env.err
        twice = bench(url, "--api-key-file", str(key))
        assert twice.code == 2 and "give the key once" in twice.one_line_error()
    finally:
        stop(server, thread)
        model.close()


def test_nothing_listening_and_a_wrong_path(served):
    url, _ = served
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    r = bench(f"http://127.0.0.1:{port}", "-p", "4", "-n", "2")
    assert r.code == 1 and r.out == ""
    line = r.one_line_error()
    assert f"cannot connect to http://127.0.0.1:{port}" in line and "refused" in line.lower()
    for args in (("--url", url + "/nope"), ("--url", url + "/nope", "-m", "tiny")):  # /v1/models; the warm-up
        r = run("bench", *args, "-p", "4", "-n", "2")
        assert r.code == 1 and "404" in r.one_line_error(), r.err


@pytest.mark.parametrize("args, words", [
    (("--clients", "1,x"), "--clients takes comma-separated positive integers"),
    (("-npl", "0"), "--clients takes comma-separated positive integers"),
    (("-npl", ""), "--clients takes comma-separated positive integers"),
    (("-npl", "1,-4"), "--clients takes comma-separated positive integers"),
    (("-p", "8,16"), "with --url, -p takes one number"),
    (("-n", "0"), "with --url, -n takes one number in 1..1048576"),
    (("-p", "2000000"), "with --url, -p takes one number in 1..1048576"),
    (("--requests", "0"), "--requests must be >= 1"),
    (("--shared-prefix", "512"), "--shared-prefix must lie in 0..511"),
    (("--timeout", "0"), "--timeout must be a number of seconds in (0, 1e+06]"),
    (("--timeout", "inf"), "--timeout must be a number of seconds"),
    (("--timeout", "nan"), "--timeout must be a number of seconds"),
    (("--api-key", "a\nb"), "--api-key must be printable text"),
    (("--api-key", "ключ"), "--api-key must be printable text"),
    (("--api-key", " "), "--api-key must be printable text"),
    (("-ngl", "99"), "-ngl measures a model here"),
    (("--profile",), "--profile measures a model here, not a server"),
    (("-d", "512"), "-d measures a model here"),
    (("-o", "xml"), "--output must be md, json or csv"),
])
def test_bad_options_are_one_line_and_exit_2(args, words):
    r = run("bench", "--url", "http://127.0.0.1:9", *args)  # (refused at once, were it ever tried)
    assert r.code == 2 and words in r.one_line_error() and r.out == ""


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:8080", "http://", "http://h:99999", "http://u:p@h:1",
                                 "http://h:1/?q=1", "http://h\x1b[31m:1"])
def test_bad_urls_exit_2(url):
    r = run("bench", "--url", url)
    assert r.code == 2 and "--url" in r.one_line_error() and "\x1b" not in r.err


def test_load_options_need_url(path):
    # (-npl without --url is llama-batched-bench's table: tests/engine/test_batched_bench.py)
    for args in (("--chat",), ("--requests", "3"), ("--shared-prefix", "4"), ("--timeout", "5")):
        r = run("bench", str(path), "--backend", "numpy", *args)
        assert r.code == 2 and "goes with --url" in r.one_line_error(), args


def test_url_forms():
    assert parse_url("127.0.0.1:8080").url == "http://127.0.0.1:8080"
    t = parse_url("https://example.org/proxy/v1/")
    assert (t.scheme, t.host, t.port, t.prefix) == ("https", "example.org", 443, "/proxy")
    assert parse_url("http://[::1]:9000").url == "http://[::1]:9000"


# -- statistics ---------------------------------------------------------------------------------------------


def test_the_histogram_is_bounded_and_near_the_exact_percentiles():
    rng = random.Random(0)
    samples = [rng.lognormvariate(-5, 1.5) for _ in range(20000)] + [1e-9, 5e4]  # below and past its range
    h = LogHistogram()
    for x in samples:
        h.add(x)
    assert len(h.counts) <= LogHistogram.BUCKETS and h.n == len(samples)
    assert h.mean == pytest.approx(sum(samples) / len(samples))
    for q in (1, 50, 90, 99):
        assert h.percentile(q) == pytest.approx(percentile(samples, q), rel=0.011)
    assert h.percentile(0) == min(samples) and h.percentile(100) == max(samples)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 50) is None


# -- a scripted server ---------------------------------------------------------------------------------------


class Scripted:
    """An OpenAI-compatible server on a loopback port whose POSTs (numbered from 0; the first two are the
    warm-ups) are answered as `script(n)` says: "ok" (three text chunks and usage), a status number, "stall"
    (no answer for 5 s), "garbage" (a chunk that is not JSON), "long" (a line past the client's bound),
    "die" (one chunk, then the server goes away)."""

    def __init__(self, script, model: str = "scripted"):
        self.script, self.posts, self.lock = script, 0, threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # (quiet)
                pass

            def do_GET(self):
                self.send_json(200, {"object": "list", "data": [{"id": model, "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    n, outer.posts = outer.posts, outer.posts + 1
                try:
                    outer.answer(self, outer.script(n), body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up on a bad answer
                    pass

            def send_json(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, h, what, body):
        if isinstance(what, int):
            h.send_json(what, {"error": {"message": f"scripted {what}", "type": "server_error"}})
            return
        if what == "stall":
            time.sleep(5)
            return
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.end_headers()

        def event(obj) -> None:
            h.wfile.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
            h.wfile.flush()

        event({"choices": [{"index": 0, "text": "one"}]})
        if what == "die":
            self.httpd.socket.close()  # new connections are refused from now on
            threading.Thread(target=self.httpd.shutdown, daemon=True).start()
            return
        if what == "garbage":
            event(b"{not json")
        if what == "long":
            event({"choices": [{"index": 0, "text": "x" * (1 << 20)}]})
        for text in ("two", "three"):
            time.sleep(0.002)
            event({"choices": [{"index": 0, "text": text}]})
        words = len(body["prompt"].split())
        event({"choices": [], "usage": {"prompt_tokens": words + 1, "completion_tokens": 3}})
        h.wfile.write(b"data: [DONE]\n\n")

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted():
    made = []

    def make(script, **kw):
        made.append(Scripted(script, **kw))
        return made[-1]

    yield make
    for s in made:
        try:
            s.close()
        except OSError:
            pass


def test_failed_requests_are_counted_by_reason(scripted):
    reasons = {3: 503, 5: "stall", 6: "garbage", 8: 429, 9: "long"}  # posts 2..11 are the level's
    s = scripted(lambda n: reasons.get(n, "ok"))
    r = bench(s.url, "-npl", "2", "-p", "10", "-n", "3", "--requests", "10", "--timeout", "1", "-o", "json")
    assert r.code == 0, r.err
    (row,) = json.loads(r.out)
    assert row["errors"] == {"429": 1, "503": 1, "stream": 2, "timeout": 1}
    assert (row["requests"], row["ok"], row["failed"]) == (10, 5, 5)
    # -p 10: the warm-ups found a token a word and one more (the "BOS"), so 9 words.
    assert row["prompt_tokens"] == 5 * 10 and row["gen_tokens"] == 5 * 3
    assert row["chunks"] == 15 and row["model"] == "scripted"
    ordered(row)


def test_a_server_that_dies_mid_run(scripted):
    """The request it dies in counts as failed (so may one that got in as it went); the next, refused, ends
    the run: the progress so far on stderr, then the error line."""
    s = scripted(lambda n: "die" if n == 5 else "ok")  # the level's 4th request
    r = bench(s.url, "-npl", "1,2", "-p", "4", "-n", "3", "--requests", "8")
    assert r.code == 1 and r.out == "" and "Traceback" not in r.err
    *progress, line = r.err.splitlines()
    assert progress[-1] == "running 1 client, 8 requests"
    assert re.fullmatch(rf"error: the server stopped answering at 1 client, after [45] of 8 requests: cannot "
                        rf"connect to {s.url}: Connection refused", line), line


def test_every_request_failing_is_an_error(scripted):
    s = scripted(lambda n: "ok" if n < 2 else 503)
    r = bench(s.url, "-npl", "2", "-p", "4", "-n", "3", "--requests", "4")
    assert r.code == 1 and r.out == "" and "Traceback" not in r.err
    assert r.err.splitlines()[-1] == "error: every request failed at 2 clients (4 x HTTP 503); the first: scripted 503"


def test_a_warm_up_refused_says_why(scripted):
    s = scripted(lambda n: 400)
    r = bench(s.url, "-p", "4", "-n", "3")
    assert r.code == 1 and "the warm-up request failed" in r.one_line_error() and "scripted 400" in r.err


def test_a_hostile_model_name_is_escaped(scripted):
    s = scripted(lambda n: "ok", model="m\x1b]0;owned\x07")
    for fmt in ("md", "json", "csv"):
        r = bench(s.url, "-npl", "1", "-p", "4", "-n", "3", "--requests", "1", "-o", fmt)
        assert r.code == 0, r.err
        assert "\x1b" not in r.out and "\x07" not in r.out and "\x1b" not in r.err
        if fmt == "json":
            assert json.loads(r.out)[0]["model"] == "m\\x1b]0;owned\\x07"
