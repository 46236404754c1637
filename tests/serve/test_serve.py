"""`llamacli serve` through the official `openai` client: a real server (uvicorn on a free loopback port, in
a background thread of this process) over SmolLM2 on the NumPy backend, one per module; replies are kept
short so that the file runs in well under a minute on two cores."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from serve_runner import start, stop  # noqa: E402

from clirun import run  # noqa: E402
from llamacli.engine.generate import Model  # noqa: E402
from llamacli.testing import tiny_vocab, write_model  # noqa: E402

KEY = "sk-test-key"
N = 5  # tokens per reply


@pytest.fixture(scope="module")
def served(smollm2):
    model = Model(smollm2, backend="numpy", ctx=512)
    url, server, thread = start(model, "smollm2", KEY)
    yield url, model, server
    stop(server, thread)
    model.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def ask(client, text: str, **kw):
    kw = {"max_tokens": N, "temperature": 0, **kw}
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": text}], **kw)


def streamed(client, **kw):
    """(the text of a stream's deltas, the last finish reason)."""
    pieces, finish = [], None
    for ev in client.chat.completions.create(model="smollm2", stream=True, **kw):
        if ev.choices:
            pieces.append(ev.choices[0].delta.content or "")
            finish = ev.choices[0].finish_reason or finish
    return "".join(pieces), finish


def raw(url: str, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, dict]:
    """A request without the openai client: (status, JSON body)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_chat_answer_usage_and_stream_agree(client):
    r = ask(client, "Say hi.")
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content and c.finish_reason == "length"
    assert r.usage.completion_tokens == N and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + N
    text, finish = streamed(client, messages=[{"role": "user", "content": "Say hi."}], max_tokens=N, temperature=0)
    assert text == c.message.content and finish == "length"


def test_completion_and_its_stream(client):
    r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=N, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text and r.usage.completion_tokens == N
    chunks = list(client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=N,
                                            temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_ends_the_reply(client):
    full = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=N, temperature=0).choices[0].text
    word = full.strip().split()[1] if len(full.split()) > 1 else full.strip()[-1]
    r = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=N, temperature=0, stop=[word])
    assert r.choices[0].text == full[: full.index(word)] and r.choices[0].finish_reason == "stop"


def test_the_same_seed_gives_the_same_sampled_text(client):
    kw = {"temperature": 1.0, "top_p": 1.0, "seed": 1234, "max_tokens": N}
    a, b = ask(client, "Name a colour.", **kw), ask(client, "Name a colour.", **kw)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_models_list_and_health(served, client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    status, health = raw(served[0], "/health")
    assert status == 200 and health["status"] == "ok" and "one request at a time" in health["scheduling"]
    assert health["queue_length"] == 0


def test_bad_requests_get_openai_errors_and_the_server_lives(served, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=[], max_tokens=N)
    assert e.value.status_code == 400
    for body in ({"messages": [{"role": "user", "content": "hi"}], "top_p": 5},
                 {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"},
                 {"messages": "hi"}, {"messages": [{"role": "user", "content": "x " * 600}]},
                 *({"messages": [{"role": "user", "content": "hi"}], name: sign * 10**400}  # 401 digits
                   for name in ("temperature", "top_p", "repeat_penalty", "top_k", "seed") for sign in (1, -1)),
                 {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -10**400}):
        status, err = raw(served[0], "/v1/chat/completions", body)
        assert status == 400 and set(err["error"]) == {"message", "type", "param", "code"}, err
    status, err = raw(served[0], "/v1/nothing", {})
    assert status == 404 and err["error"]["type"] == "not_found_error"
    assert ask(client, "Say hi.").choices[0].message.content  # still serving


def test_the_api_key_is_checked_on_every_request(served):
    url = served[0]
    for key in (None, "wrong"):
        status, err = raw(url, "/v1/models", key=key)
        assert status == 401 and err["error"]["type"] == "authentication_error"
        status, _ = raw(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, key=key)
        assert status == 401
    assert raw(url, "/v1/models")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def test_a_client_that_leaves_mid_stream_stops_its_generation(served, client):
    url, model, _ = served
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    while seen < 2:  # two chunks of text: generation is under way
        if resp.readline().startswith(b"data: {"):
            seen += 1
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 20  # 400 tokens would take far longer
    while raw(url, "/health")[1]["busy"]:
        assert time.monotonic() < deadline, "the generation went on after its client left"
        time.sleep(0.05)
    prompt = len(model.tokenize("Once upon a time"))
    assert len(model.seq) < prompt + 100
    assert ask(client, "Say hi.").choices[0].message.content


def test_concurrent_clients_each_get_their_own_answer(client):
    prompts = ["Say hi.", "Count to three."]
    alone = [ask(client, p).choices[0].message.content for p in prompts]
    together: dict[int, str] = {}

    def one(i: int) -> None:
        together[i] = ask(client, prompts[i]).choices[0].message.content

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [together.get(0), together.get(1)] == alone


def test_logprobs(client):
    import inspect

    from llamacli.engine.generate import Model as M

    if "logprobs" not in inspect.signature(M.run).parameters:
        pytest.skip("Model.run has no logprobs in this build")
    r = ask(client, "Say hi.", logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == N and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content[:1])


def test_response_format_json_schema(client):
    pytest.importorskip("llguidance")
    pytest.importorskip("llamacli.sampling.structured")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = ask(client, "Answer in JSON.", max_tokens=12,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert json.loads(r.choices[0].message.content)["ok"] in (True, False)


# -- a thinking model: reasoning_content ---------------------------------------------------------------------

THINK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)


def test_reasoning_content_of_a_thinking_model(tmp_path):
    vocab = tiny_vocab()
    vocab["tokenizer.ggml.tokens"] = vocab["tokenizer.ggml.tokens"] + ["<think>", "</think>"]
    vocab["tokenizer.ggml.token_type"] = vocab["tokenizer.ggml.token_type"] + [4, 4]
    vocab["tokenizer.chat_template"] = THINK_TEMPLATE
    path = write_model(tmp_path / "thinker.gguf", "tiny-qwen3", "F32", vocab=vocab, std=0.08)
    with Model(path, backend="numpy", ctx=128) as model:
        url, server, thread = start(model, "thinker")
        try:
            c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            kw = {"model": "thinker", "messages": [{"role": "user", "content": "Why?"}], "max_tokens": 12,
                  "temperature": 0}
            msg = c.chat.completions.create(**kw).choices[0].message
            reasoning = getattr(msg, "reasoning_content", None)
            assert reasoning and "<think>" not in reasoning
            parts = [(getattr(ev.choices[0].delta, "reasoning_content", None) or "", ev.choices[0].delta.content or "")
                     for ev in c.chat.completions.create(stream=True, **kw) if ev.choices]
            assert "".join(p[0] for p in parts).strip() == reasoning
            assert "".join(p[1] for p in parts) == (msg.content or "")
        finally:
            stop(server, thread)


# -- the command ---------------------------------------------------------------------------------------------


def test_serve_refuses_bad_options_with_one_line(tmp_path, monkeypatch):
    r = run("serve", str(tmp_path / "none.gguf"), "--port", "70000")
    assert r.code == 2 and "--port" in r.one_line_error()
    r = run("serve", str(tmp_path / "none.gguf"), "--port", "0", "--backend", "numpy")
    assert r.code == 2 and r.one_line_error()
    for host in ("", "  "):  # '' would bind every interface and print http://:PORT
        r = run("serve", str(tmp_path / "none.gguf"), "--host", host)
        assert r.code == 2 and "--host is empty" in r.one_line_error()
    empty, key = tmp_path / "empty.key", tmp_path / "k.key"
    empty.write_text("\nsecret\n")
    key.write_text("s3cret\n")
    r = run("serve", str(tmp_path / "none.gguf"), "--api-key-file", str(empty))
    assert r.code == 2 and "starts with an empty line" in r.one_line_error()
    r = run("serve", str(tmp_path / "none.gguf"), "--api-key-file", str(key), "--api-key", "x")
    assert r.code == 2 and "give the key once" in r.one_line_error()
    r = run("serve", str(tmp_path / "none.gguf"), "--api-key-file", str(tmp_path / "missing.key"))
    assert r.code == 2 and "API key file" in r.one_line_error()
    monkeypatch.setenv("LLAMACLI_API_KEY", " ")
    r = run("serve", str(tmp_path / "none.gguf"))
    assert r.code == 2 and "--api-key is empty" in r.one_line_error()  # the variable is read


@pytest.mark.parametrize("how", ["file", "env"])
def test_the_command_takes_its_key_from_a_file_or_the_environment(random_model, tmp_path, how):
    """`llamacli serve --api-key-file K` (llama-server's option) and LLAMACLI_API_KEY, so that the key need not
    show in the process list: the server they start refuses a request without it and answers one with it."""
    import os
    import re
    import subprocess
    import sys

    key = tmp_path / "k.key"
    key.write_text("s3cret-from-a-file\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "llamacli", "serve", str(random_model()), "--backend", "numpy", "--port", "0"]
    if how == "file":
        args += ["--api-key-file", str(key)]
    else:
        env["LLAMACLI_API_KEY"] = "s3cret-from-a-file"
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, deadline = None, time.monotonic() + 90
        while url is None and time.monotonic() < deadline:
            line = p.stderr.readline()
            if not line:
                break
            found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            url = found.group(1) if found else None
        assert url, "the server did not start"
        assert raw(url, "/v1/models", key=None)[0] == 401
        assert raw(url, "/v1/models", key="wrong")[0] == 401
        assert raw(url, "/v1/models", key="s3cret-from-a-file")[0] == 200
    finally:
        p.terminate()
        p.wait(timeout=30)


def test_web_pages_cannot_use_a_loopback_server(served):
    """A cross-site page's request (an Origin not the server's own: a text/plain POST needs no preflight) and a
    DNS-rebinding page's (a Host that is not this machine) get 403 before anything runs; clients that send the
    Host they dialled and no Origin, or the server's own origin, are served."""
    url = served[0]
    port = int(url.rsplit(":", 1)[1].split("/")[0])

    def send(method: str, headers: dict, body: bytes | None = None) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.putrequest(method, "/v1/models" if body is None else "/v1/completions", skip_host=True)
            for k, v in {"Authorization": f"Bearer {KEY}", **headers}.items():
                conn.putheader(k, v)
            if body is not None:
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            return conn.getresponse().status
        finally:
            conn.close()

    post = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    assert send("GET", {"Host": f"evil.example:{port}"}) == 403
    assert send("GET", {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}) == 403
    assert send("POST", {"Host": f"127.0.0.1:{port}", "Origin": "http://evil.example",
                         "Content-Type": "text/plain"}, post) == 403
    assert send("POST", {"Host": f"127.0.0.1:{port}", "Origin": "null", "Content-Type": "text/plain"}, post) == 403
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "127.0.0.1"):
        assert send("GET", {"Host": host}) == 200, host
    assert send("POST", {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}",
                         "Content-Type": "application/json"}, post) == 200
