"""`serve` with cache salts (vLLM's `cache_salt` field), on the NumPy backend: a request reuses cached K/V only
from requests of the same salt (unsalted ones only from unsalted ones), whether its slot's own cache or the
prefix cache would have served it, on every API (chat/completions, completions, Messages, Responses); answers
are those of an uncached prompt; a bad salt is a 400 saying why, and the salt is never echoed or logged."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_runner import start, stop  # noqa: E402

from llamacli.engine.generate import Model  # noqa: E402
from llamacli.engine.prefix_cache import BLOCK  # noqa: E402

SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in plain words." for i in range(12))
SECRET = "tenant-7f3a9c-secret-salt"
OTHER = {"prompt": "Numbers: 1 2 3 4 5 6 7 8 9", "max_tokens": 2, "temperature": 0}  # takes the slot


@pytest.fixture(scope="module")
def path(random_model, smollm2):
    return random_model("tiny-llama", "Q8_0", vocab_file=smollm2, std=0.2)


def served(path, cache: bool):
    model = Model(path, backend="numpy", ctx=512, slots=1)
    if cache:
        model.enable_prefix_cache()
    lines: list[str] = []
    url, server, thread = start(model, "m", log=lines.append)
    return url, model, server, thread, lines


def _serving(path, prefix_cache: bool):
    url, model, server, thread, lines = served(path, prefix_cache)
    try:
        yield url, model, lines
    finally:
        stop(server, thread)
        model.close()


@pytest.fixture(scope="module")
def slot_only(path):
    """One slot, no prefix cache: whatever a request finds cached is its slot's."""
    yield from _serving(path, False)


@pytest.fixture(scope="module")
def with_cache(path):
    """One slot and the prefix cache."""
    yield from _serving(path, True)


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def post(url: str, route: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url + route, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def ask(url: str, question: str, salt: str | None, **extra) -> tuple[str, int]:
    """(the answer, its cached prompt tokens) of a greedy chat request under `salt`."""
    body = {"messages": chat(question), "max_tokens": 4, "temperature": 0, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    status, text = post(url, "/v1/chat/completions", body)
    assert status == 200, text
    assert SECRET not in text
    out = json.loads(text)
    return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_slot_filled_under_another_salt_serves_nothing(slot_only):
    """One slot, the same conversation each time: only a request of the salt that filled the slot keeps it."""
    url, _, lines = slot_only
    answers = []
    for salt, cached in ((SECRET, False), ("bob", False), ("bob", True), (None, False), (None, True),
                         (SECRET, False), (SECRET, True)):
        answer, n = ask(url, "What is two and two?", salt)
        assert (n > 0) == cached, (salt, n)
        answers.append(answer)
    assert len(set(answers)) == 1  # (greedy: cached or not, the same answer)
    body = {**OTHER, "cache_salt": "bob"}
    assert json.loads(post(url, "/v1/completions", body)[1])["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    got = json.loads(post(url, "/v1/completions", body)[1])
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert not any(SECRET in line for line in lines) and lines


def test_the_prefix_cache_serves_a_salt_only_its_own_blocks(with_cache):
    """A system prompt's blocks stored under one salt, another request taking the slot between: another salt,
    or none, finds nothing cached; the same salt finds the shared system prompt's blocks."""
    url, model, lines = with_cache
    a, b = (model.chat_ids(chat(q)) for q in ("What is two and two?", "Name a color."))
    n = 0
    while a[n] == b[n]:
        n += 1
    want = n // BLOCK * BLOCK
    assert want >= 4 * BLOCK
    ask(url, "What is two and two?", SECRET)
    answers = []
    for salt in ("bob", None, SECRET[:-1]):
        assert post(url, "/v1/completions", OTHER)[0] == 200
        answer, cached = ask(url, "Name a color.", salt)
        assert cached == 0, salt
        answers.append(answer)
    post(url, "/v1/completions", OTHER)
    answer, cached = ask(url, "Name a color.", SECRET)
    assert cached == want
    assert set(answers) == {answer}
    post(url, "/v1/completions", OTHER)
    assert ask(url, "What is two and two?", None)[1] == want  # (the unsalted "Name a color." stored it unsalted)

    # Messages and Responses take the field as chat completions does
    post(url, "/v1/completions", OTHER)
    m = {"model": "m", "max_tokens": 3, "system": SYSTEM, "messages": [{"role": "user", "content": "Name a color."}]}
    status, text = post(url, "/v1/messages", {**m, "cache_salt": "carol"})
    assert status == 200 and json.loads(text)["usage"]["cache_read_input_tokens"] == 0
    post(url, "/v1/completions", OTHER)
    status, text = post(url, "/v1/messages", {**m, "cache_salt": SECRET})
    assert status == 200 and json.loads(text)["usage"]["cache_read_input_tokens"] >= want
    assert SECRET not in text
    r = {"model": "m", "instructions": SYSTEM, "input": "Name a color.", "max_output_tokens": 3}
    post(url, "/v1/completions", OTHER)
    status, text = post(url, "/v1/responses", {**r, "cache_salt": "dave"})
    assert status == 200 and json.loads(text)["usage"]["input_tokens_details"]["cached_tokens"] == 0
    post(url, "/v1/completions", OTHER)
    status, text = post(url, "/v1/responses", {**r, "cache_salt": SECRET})
    assert status == 200 and json.loads(text)["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert SECRET not in text
    assert not any(SECRET in line for line in lines) and lines


BAD = [("", "an empty string"), (SECRET * 11, f"{len(SECRET) * 11} characters"), (7, "a number"),
       (1.5, "a number"), ([SECRET], "a list"), ({"salt": SECRET}, "an object"), (True, "a boolean")]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"])
@pytest.mark.parametrize("salt, why", BAD, ids=[w for _, w in BAD])
def test_a_bad_salt_is_refused(slot_only, route, salt, why):
    url, _, _ = slot_only
    body = {"/v1/chat/completions": {"messages": chat("Hi."), "max_tokens": 2},
            "/v1/completions": {"prompt": "Hi.", "max_tokens": 2},
            "/v1/messages": {"model": "m", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2},
            "/v1/responses": {"model": "m", "input": "Hi.", "max_output_tokens": 2}}[route]
    status, text = post(url, route, {**body, "cache_salt": salt})
    assert status == 400, text
    assert json.loads(text)["error"]["message"] == f"cache_salt must be a string of 1 to 256 characters, got {why}"
    assert SECRET not in text
    status, text = post(url, route, {**body, "cache_salt": "s" * 256})
    assert status == 200, text  # (the server is up; the longest salt taken)
