"""`llamacli serve` against hostile response_format schemas (issue 46, class 1): each gets a 400 that says why,
and the server answers the next request as before. The server runs as a real process (a native stack
overflow in llguidance used to kill it, with no log line, for every client), over a tiny random model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

import hostile_grammars as hostile  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(random_model):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "llamacli", "serve", str(random_model()), "--backend", "numpy", "--port", "0",
            "--ctx", "256"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url, deadline = None, time.monotonic() + 90
    while url is None and time.monotonic() < deadline:
        line = p.stderr.readline()
        if not line:
            break
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        url = found.group(1) if found else None
    assert url, "the server did not start"
    yield url, p
    p.terminate()
    p.wait(timeout=30)


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def ask(url: str, schema=None, **kw) -> tuple[int, dict]:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, **kw}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    return post(url, body)


SERVER_CASES = {
    **{name: hostile.SCHEMAS[name] for name in (
        "ref_chain", "properties_through_refs", "anyOf_through_refs", "allOf_through_refs", "items_through_refs",
        "properties_literally", "items_literally", "ring", "self_reference", "mutual_reference", "root_reference",
        "pattern_repetition", "nested_repetition", "pattern_properties_key", "wide_any_of", "huge_enum")},
    **hostile.UNUSABLE,
}


@pytest.mark.parametrize("name", sorted(SERVER_CASES))
def test_hostile_schema_gets_400_and_the_server_lives(server, name):
    url, process = server
    schema, says = SERVER_CASES[name]
    status, body = ask(url, schema)
    assert status == 400, (status, body)
    assert body["error"]["param"] == "response_format" and says in body["error"]["message"], body
    assert "\n" not in body["error"]["message"]
    assert process.poll() is None, "the server died"
    status, body = ask(url)  # the next client is served
    assert status == 200 and body["choices"][0]["message"]["content"] is not None, body


def test_a_body_nested_past_what_json_reads_gets_400(server):
    url, process = server
    deep = '{"type":"array","items":' * 3000 + "{}" + "}" * 3000
    data = ('{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"response_format":{"type":"json_schema",'
            '"json_schema":{"name":"s","schema":' + deep + "}}}").encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    assert info.value.code == 400 and "too deeply" in json.loads(info.value.read())["error"]["message"]
    assert process.poll() is None and ask(url)[0] == 200


def test_ordinary_schemas_are_still_followed(server):
    url, _ = server
    for schema in ({"enum": ["yes", "no"]}, hostile.ORDINARY_SCHEMAS["tree"]):
        status, body = ask(url, schema, max_tokens=24)
        assert status == 200, body
        text = body["choices"][0]["message"]["content"]
        if body["choices"][0]["finish_reason"] == "stop":
            json.loads(text)
        assert text[:1] in '"{', text
