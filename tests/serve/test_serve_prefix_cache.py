"""`serve` with the prefix cache (engine/prefix_cache.py), on the NumPy backend: the cached prompt tokens in each
API's usage (chat/completions' prompt_tokens_details.cached_tokens, Messages' cache_read_input_tokens, Responses'
input_tokens_details.cached_tokens) and in /metrics; clients sharing a system prompt get the answers a server
without the cache gives; --cache-ram and --no-prefix-cache on the command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import urllib.request

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from serve_runner import start, stop  # noqa: E402

from llamacli.engine.generate import Model  # noqa: E402
from llamacli.engine.prefix_cache import BLOCK  # noqa: E402

SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in plain words." for i in range(12))


@pytest.fixture(scope="module")
def path(random_model, smollm2):
    return random_model("tiny-llama", "Q8_0", vocab_file=smollm2, std=0.2)


def served(path, slots: int, cache: bool):
    model = Model(path, backend="numpy", ctx=512, slots=slots)
    if cache:
        model.enable_prefix_cache()
    url, server, thread = start(model, "m")
    return url, model, server, thread


@pytest.fixture(scope="module")
def one_slot(path):
    url, model, server, thread = served(path, 1, True)
    try:
        yield url, model
    finally:
        stop(server, thread)
        model.close()


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def post(url: str, route: str, body: dict) -> dict:
    req = urllib.request.Request(url + route, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_cached_tokens_in_every_apis_usage(one_slot):
    """One slot: a conversation, then a raw completion that takes the slot, then the conversation's system prompt
    with another question: its blocks come from the prefix cache, and each API reports them as cached."""
    url, model = one_slot
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    first = client.chat.completions.create(model="m", messages=chat("What is two and two?"), max_tokens=3,
                                           temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    other = post(url, "/v1/completions", {"prompt": "Numbers: 1 2 3 4 5 6 7 8 9", "max_tokens": 2, "temperature": 0})
    assert other["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    a, b = (model.chat_ids(chat(q)) for q in ("What is two and two?", "Name a color."))
    want = common(a, b) // BLOCK * BLOCK
    assert want >= 4 * BLOCK
    hits = metric(url, "llamacli_prefix_cache_hit_tokens_total")
    second = client.chat.completions.create(model="m", messages=chat("Name a color."), max_tokens=3, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == want
    assert metric(url, "llamacli_prefix_cache_hit_tokens_total") == hits + want
    assert metric(url, "llamacli_prefix_cache_tokens") > 0 and metric(url, "llamacli_prefix_cache_capacity_tokens") > 0
    streamed = [json.loads(line[6:]) for line in _stream(url, {"messages": chat("Name a color."), "max_tokens": 2,
                                                              "temperature": 0, "stream": True,
                                                              "stream_options": {"include_usage": True}})]
    assert streamed[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= want  # (its own slot held it)

    post(url, "/v1/completions", {"prompt": "Numbers: 1 2 3 4 5 6 7 8 9", "max_tokens": 2})
    r = client.responses.create(model="m", instructions=SYSTEM, input="Name a color.", max_output_tokens=3)
    assert r.usage.input_tokens_details.cached_tokens >= want - BLOCK  # (Responses' template puts it alike)
    assert r.usage.input_tokens_details.cached_tokens > 0

    post(url, "/v1/completions", {"prompt": "Numbers: 1 2 3 4 5 6 7 8 9", "max_tokens": 2})
    m = post(url, "/v1/messages", {"model": "m", "max_tokens": 3, "system": SYSTEM,
                                   "messages": [{"role": "user", "content": "Name a color."}]})
    cached = m["usage"]["cache_read_input_tokens"]  # (the chat request above stored this prompt's blocks)
    assert cached >= want and cached % BLOCK == 0
    assert m["usage"]["input_tokens"] == len(b) - cached


def _stream(url: str, body: dict) -> list[str]:
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return [line for line in r.read().decode().split("\n\n") if line.startswith("data: {")]


def test_clients_sharing_a_system_prompt_get_the_answers_of_a_server_without_it(path):
    questions = ["What is two and two?", "Name a color.", "Why is the sky blue?", "Say hi.", "Count to three.",
                 "Name a fruit."]
    kw = dict(max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    url, model, server, thread = served(path, 1, False)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        want = [client.chat.completions.create(model="m", messages=chat(q), **kw) for q in questions]
    finally:
        stop(server, thread)
        model.close()
    url, model, server, thread = served(path, 3, True)
    got: dict[int, object] = {}
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        threads = [threading.Thread(target=lambda i=i: got.update(
            {i: client.chat.completions.create(model="m", messages=chat(questions[i]), **kw)}))
            for i in range(len(questions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        hits = metric(url, "llamacli_prefix_cache_hit_tokens_total")
    finally:
        stop(server, thread)
        model.close()
    assert len(got) == len(questions)
    for i, w in enumerate(want):
        g = got[i]
        assert g.choices[0].message.content == w.choices[0].message.content
        for x, y in zip(g.choices[0].logprobs.content, w.choices[0].logprobs.content):
            assert x.token == y.token and abs(x.logprob - y.logprob) <= 1e-4
    assert sum(got[i].usage.prompt_tokens_details.cached_tokens for i in got) >= 4 * BLOCK * (len(questions) - 1)
    assert hits >= 4 * BLOCK  # (another slot than the first took the system prompt from the cache)


@pytest.mark.parametrize("args, message", [
    (["--cache-ram", "-1"], "error: --cache-ram takes MiB from 0"),
    (["--cache-ram", str(1 << 40)], "error: --cache-ram takes MiB from 0"),
    (["--no-prefix-cache", "--cache-ram", "64"], "error: --no-prefix-cache and --cache-ram"),
    (["--cache-reuse", "-1"], "error: --cache-reuse must be >= 0"),
])
def test_prefix_cache_options_on_the_command_line(path, args, message):
    """Checked before the model loads: one error line, exit 2."""
    from clirun import run

    r = run("serve", str(path), "--backend", "numpy", *args)
    assert r.code == 2 and r.one_line_error().startswith(message) and r.out == ""


def serve_lines(args: list[str], wait_for: str) -> list[str]:
    """`llamacli serve ARGS --port 0` in a subprocess: its stderr lines up to the one containing `wait_for`,
    then /health answered, then stopped."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "llamacli", "serve", *args, "--port", "0"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    try:
        while not lines or wait_for not in lines[-1]:
            line = p.stderr.readline()
            assert line, lines
            lines.append(line.rstrip("\n"))
        port = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", lines[-1])
        if port:
            with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/health", timeout=30) as r:
                assert json.loads(r.read())["status"] == "ok"
    finally:
        p.terminate()
        p.wait(timeout=30)
    return lines


def test_the_start_up_line_names_the_prefix_cache(path, random_model):
    lines = serve_lines([str(path), "--backend", "numpy", "-c", "256", "-np", "2", "--cache-ram", "3",
                         "--cache-reuse", "256"], "serving ")
    assert "2 requests at once; prefix cache 3.00 MiB (" in lines[-1]
    assert any(line.startswith("--cache-reuse 256: llamacli does not shift cached K/V") for line in lines)
    assert not any("prefix cache" in line for line in serve_lines(
        [str(path), "--backend", "numpy", "-c", "256", "--no-enable-prefix-caching"], "serving "))
    hybrid = serve_lines([str(random_model("tiny-qwen35", "F32")), "--backend", "numpy", "-c", "64"], "serving ")
    assert any(line.startswith("no prefix cache: the prefix cache is off for models with recurrent layers")
               for line in hybrid)
