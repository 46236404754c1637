"""Anthropic's Messages API (/v1/messages) through the official `anthropic` client against a real server, over the
tiny models of tests/serve/test_serve_tools.py: a random model with each family's real chat template and special
tokens. As there, a forced tool_choice holds the reply to a valid call from its first token, and a scripted reply
(test_serve_tools.Script: the backend's choice of each id replaced, each checked against the grammar's mask) runs
through the real engine and server where the test needs the model to write something in particular."""

from __future__ import annotations

import functools
import json
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

from serve_runner import FamilyServers, start, stop  # noqa: E402
from test_serve_tools import CLOCK, DEEP, SCRIPTS, WEATHER, Script  # noqa: E402

from llamacli.chat.template import encode_prompt  # noqa: E402
from llamacli.chat.tool_format import detect  # noqa: E402
from llamacli.engine.generate import Model  # noqa: E402
from llamacli.testing.tool_vocab import FAMILIES  # noqa: E402

TOOLS = [{"name": "get_weather", "description": "The weather forecast", "input_schema": WEATHER},
         {"name": "get_time", "description": "The time", "input_schema": CLOCK}]
AS_OPENAI = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in TOOLS]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
GREEDY = {"temperature": 0}  # (the anthropic client of 2.x no longer takes temperature as an argument)
NO_THINK = {"type": "disabled"}  # (a random model would think forever)
ERROR_KINDS = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
               "request_too_large", "overloaded_error"}


@pytest.fixture(scope="module")
def templates(llama_cpp_models: Path) -> Path:
    return llama_cpp_models / "templates"


@pytest.fixture(scope="module")
def serve_family(tmp_path_factory, templates):
    """serve_family(name) -> (anthropic client, model): a server over a tiny model of that family (one each)."""
    servers = FamilyServers(tmp_path_factory, templates)

    def get(family: str):
        client, model, _ = servers.get(family, lambda url: anthropic.Anthropic(base_url=url, api_key="unused",
                                                                              max_retries=0, timeout=120))
        return client, model

    yield get
    servers.close()


def prompts(model, monkeypatch) -> list[list[int]]:  # noqa: ANN001
    """The prompt ids of every run of `model` from now on (the server's worker calls model.run)."""
    seen: list[list[int]] = []
    run = model.run

    @functools.wraps(run)
    def spy(prompt, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.append(list(prompt))
        return run(prompt, **kw)

    monkeypatch.setattr(model, "run", spy)
    return seen


def transformers_ids(model, templates: Path, family: str, messages: list[dict], **kw) -> list[int]:  # noqa: ANN001
    """The prompt as transformers' apply_chat_template renders it (its render_jinja_template), tokenized as the
    server tokenizes a rendered prompt."""
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    source = (templates / FAMILIES[family][0]).read_text(encoding="utf-8")
    text = chat_template_utils.render_jinja_template(conversations=[messages], chat_template=source,
                                                     add_generation_prompt=True, **model.chat_template.special_tokens,
                                                     **kw)[0][0]
    return encode_prompt(model.tokenizer, text)


def same_message(a, b) -> None:  # noqa: ANN001 (two anthropic Messages)
    """Two answers to one request agree: content (but for tool ids, which are fresh each time), stop reason and
    sequence, and the counts (the prompt's tokens split between input and cache reads as the cache allows)."""
    def content(m):  # noqa: ANN001, ANN202
        return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"} for b in m.content]

    assert content(a) == content(b)
    assert (a.stop_reason, a.stop_sequence, a.usage.output_tokens) == (b.stop_reason, b.stop_sequence,
                                                                        b.usage.output_tokens)
    assert (a.usage.input_tokens + a.usage.cache_read_input_tokens
            == b.usage.input_tokens + b.usage.cache_read_input_tokens)


def both(client, **kw):  # noqa: ANN001, ANN003, ANN201
    """The whole answer, checked against the streamed one put together by the client."""
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    same_message(whole, streamed)
    return whole


FORCED_FAMILIES = ["qwen3", "qwen3.5", "llama3.1", "mistral", "mistral-nemo", "gemma4", "gemma2"]


@pytest.mark.parametrize("family", FORCED_FAMILIES)
def test_a_forced_tool_gives_a_valid_tool_use_whole_or_streamed(serve_family, family):
    client, model = serve_family(family)
    kw = {"model": family, "max_tokens": 400, "messages": ASK, "tools": TOOLS, "thinking": NO_THINK,
          "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
          "extra_body": GREEDY}
    m = both(client, **kw)
    assert (m.type, m.role, m.stop_reason, m.stop_sequence, m.model) == ("message", "assistant", "tool_use", None,
                                                                          family)
    assert m.id.startswith("msg_")
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    short = detect(model.chat_template, model.tokenizer).short_ids  # (Mistral's templates demand nine characters)
    assert re.fullmatch(r"[A-Za-z0-9]{9}" if short else r"toolu_[0-9a-f]{24}", use.id)
    count = client.messages.count_tokens(model=family, messages=ASK, tools=TOOLS, thinking=NO_THINK,
                                         tool_choice=kw["tool_choice"])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count.input_tokens > 0
    assert m.usage.output_tokens > 0


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_any_calls_one_of_the_tools(serve_family, family):
    client, _ = serve_family(family)
    m = client.messages.create(model=family, max_tokens=400, messages=ASK, tools=TOOLS, thinking=NO_THINK,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    (use,) = m.content
    assert m.stop_reason == "tool_use" and use.type == "tool_use"
    jsonschema.validate(use.input, SCHEMAS[use.name])


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5", "llama3.1", "mistral", "mistral-nemo", "gemma4"])
def test_a_tool_result_renders_as_transformers_renders_it(serve_family, templates, monkeypatch, family):
    """The answer's tool_use and a tool_result for it, sent back as the anthropic client's users send them, reach
    the template as transformers' apply_chat_template takes the same conversation in OpenAI's form."""
    client, model = serve_family(family)
    kw = {"model": family, "tools": TOOLS, "thinking": NO_THINK, "extra_body": GREEDY}
    first = client.messages.create(max_tokens=400, messages=ASK, tool_choice={
        "type": "tool", "name": "get_time", "disable_parallel_tool_use": True}, **kw)
    (use,) = first.content
    history = ASK + [{"role": "assistant", "content": first.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12:00"}]}]
    seen = prompts(model, monkeypatch)
    again = client.messages.create(max_tokens=2, messages=history, **kw)
    assert again.stop_reason in ("max_tokens", "end_turn", "tool_use")
    want = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "get_time", "arguments": use.input}}]},
        {"role": "tool", "tool_call_id": use.id, "name": "get_time", "content": "12:00"}]
    assert seen == [transformers_ids(model, templates, family, want, tools=AS_OPENAI, enable_thinking=False)]


def test_system_blocks_errors_and_thinking_sent_back_render_as_transformers_renders_them(serve_family, templates,
                                                                                      monkeypatch):
    """system as text blocks (joined by a blank line), a thinking block sent back (Qwen3 shows the reasoning of the
    turns since the last question), a tool_result with is_error and block content, and text after it in the same
    user turn (a user turn of its own after the tool's)."""
    client, model = serve_family("qwen3")
    seen = prompts(model, monkeypatch)
    called = ASK + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "The user wants the weather.", "signature": "abc"},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"unit": "celsius", "days": 3}}]}]
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
              "content": [{"type": "text", "text": "no network"}]}
    system = [{"type": "text", "text": "You are terse."},
              {"type": "text", "text": "Answer in French.", "cache_control": {"type": "ephemeral"}}]
    want = [{"role": "system", "content": "You are terse.\n\nAnswer in French."}, *ASK,
            {"role": "assistant", "content": "Let me look.", "reasoning_content": "The user wants the weather.",
             "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": {"unit": "celsius", "days": 3}}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "Error: no network"}]
    for more, shown in (([], True), ([{"type": "text", "text": "Try again?"}], False)):
        history = called + [{"role": "user", "content": [result, *more]}]
        client.messages.create(model="qwen3", max_tokens=1, system=system, messages=history, tools=TOOLS,
                               thinking={"type": "enabled", "budget_tokens": 1024}, extra_body=GREEDY)
        expected = want + ([{"role": "user", "content": "Try again?"}] if more else [])
        assert seen[-1] == transformers_ids(model, templates, "qwen3", expected, tools=AS_OPENAI, enable_thinking=True)
        assert ("The user wants the weather." in model.detokenize(seen[-1])) is shown


def test_calls_with_ids_a_template_refuses_are_given_ids_it_takes(serve_family, monkeypatch):
    """Mistral's template demands ids of nine letters and digits: a conversation begun elsewhere (toolu_ ids)
    still renders, each id made nine characters, the same for the call and its result."""
    client, model = serve_family("mistral")
    seen = prompts(model, monkeypatch)
    history = ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "get_time",
                                           "input": {"utc": True}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
                                      "content": "noon"}]}]
    m = client.messages.create(model="mistral", max_tokens=1, messages=history, tools=TOOLS, extra_body=GREEDY)
    assert m.stop_reason in ("max_tokens", "end_turn")
    shown = model.detokenize(seen[0])
    ids = re.findall(r"\[CALL_ID\]([A-Za-z0-9]{9})\[ARGS\]", shown)
    assert len(ids) == 1 and "toolu_" not in shown


# -- what the model writes: scripted replies through the real engine --------------------------------------------


def _blocks(m) -> list[tuple]:  # noqa: ANN001
    return [(b.type, b.text if b.type == "text" else b.thinking if b.type == "thinking" else (b.name, b.input))
            for b in m.content]


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5", "mistral", "gpt-oss"])
def test_a_reply_with_calls_comes_back_as_blocks(serve_family, monkeypatch, family):
    """tool_choice auto: the family's own call format, with text or reasoning before it, comes back as thinking,
    text and tool_use blocks in the reply's order, whole or streamed."""
    client, model = serve_family(family)
    text, content, reasoning, calls = SCRIPTS[family]
    want = ([("thinking", reasoning)] if reasoning else []) + ([("text", content)] if content else []) + [
        ("tool_use", (name, json.loads(args))) for name, args in calls]
    kw = {"model": family, "max_tokens": 200, "messages": ASK, "tools": TOOLS, "extra_body": GREEDY}
    if family != "gpt-oss":
        kw["thinking"] = NO_THINK
    for streamed in (False, True):
        script = Script(model, text).install(monkeypatch)
        if streamed:
            with client.messages.stream(**kw) as s:
                m = s.get_final_message()
        else:
            m = client.messages.create(**kw)
        assert script.refused == []
        assert _blocks(m) == want and m.stop_reason == "tool_use"


STOPS = [  # (scripted reply, request fields, blocks, stop_reason, stop_sequence)
    ("Paris is sunny.<|im_end|>", {}, [("text", "Paris is sunny.")], "end_turn", None),
    ("Paris is sunny. STOP and more<|im_end|>", {"stop_sequences": ["never", "STOP"]}, [("text", "Paris is sunny.")],
     "stop_sequence", "STOP"),
    ("Paris is sunny and warm today.<|im_end|>", {"max_tokens": 3},  # (the text of the script's first 3 ids)
     lambda tok: [("text", tok.decode(tok.encode("Paris is sunny", add_bos=False, add_eos=False)[:3]))],
     "max_tokens", None),
    ("<think>\nThe user asks about the weather.\n</think>\n\nSunny.<|im_end|>",
     {"thinking": {"type": "enabled", "budget_tokens": 2048}},
     [("thinking", "The user asks about the weather."), ("text", "Sunny.")], "end_turn", None),
    ("<think>\nSecret.\n</think>\n\nSunny.<|im_end|>", {"thinking": {"type": "adaptive", "display": "omitted"}},
     [("thinking", ""), ("text", "Sunny.")], "end_turn", None),
]


@pytest.mark.parametrize("reply, fields, want, reason, sequence", STOPS)
def test_stop_reasons_and_thinking_blocks(serve_family, monkeypatch, reply, fields, want, reason, sequence):
    client, model = serve_family("qwen3")
    kw = {"model": "qwen3", "max_tokens": 100, "messages": ASK, "thinking": NO_THINK, "extra_body": GREEDY, **fields}
    want = want(model.tokenizer) if callable(want) else want
    for streamed in (False, True):
        Script(model, reply).install(monkeypatch)
        seen = prompts(model, monkeypatch)
        if streamed:
            with client.messages.stream(**kw) as s:
                m = s.get_final_message()
        else:
            m = client.messages.create(**kw)
        monkeypatch.undo()
        assert (_blocks(m), m.stop_reason, m.stop_sequence) == (want, reason, sequence)
        thinks = kw["thinking"]["type"] != "disabled"
        assert model.detokenize(seen[0]).endswith("<think>\n\n</think>\n\n") is not thinks  # Qwen3's switch


def test_the_events_are_anthropics(serve_family, monkeypatch):
    """The raw stream: message_start, ping, each block's start, deltas and stop in order, message_delta with the
    stop reason and counts, message_stop; every event's name is its data's type; put together by hand, the
    blocks are the whole answer's."""
    client, model = serve_family("qwen3")
    reply = ('<think>\nNeed the weather.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"unit": "celsius", "days": 3}}\n</tool_call><|im_end|>')
    body = {"model": "qwen3", "max_tokens": 200, "messages": ASK, "tools": TOOLS, "temperature": 0,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    Script(model, reply).install(monkeypatch)
    status, whole = post(client, body)
    assert status == 200
    Script(model, reply).install(monkeypatch)
    events = stream_events(client, {**body, "stream": True})
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    blocks, open_ = [], None
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_ is None and data["index"] == len(blocks)
            blocks.append(dict(data["content_block"], _json=""))
            open_ = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_
            b, d = blocks[open_], data["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[d["type"]]
            if key == "partial_json":
                b["_json"] += d[key]
            else:
                b[key] += d[key]
        else:
            assert name == "content_block_stop" and data["index"] == open_
            open_ = None
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b["_json"])
        del b["_json"]
    ids = [b.pop("id", None) for b in blocks] + [b.pop("id", None) for b in whole["content"]]
    assert blocks == whole["content"] and [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert all(i is None or i.startswith("toolu_") for i in ids)
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "tool_use", "stop_sequence": None} == {
        "stop_reason": whole["stop_reason"], "stop_sequence": whole["stop_sequence"]}
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"] > 0


def test_output_config_holds_the_answer_to_a_json_schema(serve_family, monkeypatch):
    """output_config.format: the answer is held to the schema (a scripted reply the schema refuses is steered)."""
    client, model = serve_family("qwen3")
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"],
              "additionalProperties": False}
    body = {"model": "qwen3", "max_tokens": 100, "messages": ASK, "temperature": 0, "thinking": NO_THINK,
            "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    for reply, refused in (('{"color": "red"}<|im_end|>', False), ('{"color": "blue"}<|im_end|>', True)):
        script = Script(model, reply).install(monkeypatch)
        status, m = post(client, body)
        assert status == 200 and m["stop_reason"] == "end_turn", m
        assert bool(script.refused) is refused
        jsonschema.validate(json.loads(m["content"][0]["text"]), schema)


# -- hostile requests: a 4xx in Anthropic's shape, and the server answers the next one ----------------------------


def post(client, body, path: str = "/v1/messages", raw: bytes | None = None, headers=None) -> tuple[int, dict]:  # noqa: ANN001
    """(status, JSON answer) of a POST to the server of `client` (an anthropic client, or the server's URL)."""
    url = (client if isinstance(client, str) else str(client.base_url)).rstrip("/") + path
    req = urllib.request.Request(url, data=raw if raw is not None else json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "anthropic-version": "2023-06-01",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream_events(client, body) -> list[tuple[str, dict]]:  # noqa: ANN001
    url = str(client.base_url).rstrip("/") + "/v1/messages"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read().decode()
    events = []
    for chunk in text.split("\n\n"):
        if chunk.strip():
            lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
            events.append((lines["event"], json.loads(lines["data"])))
    return events


def anthropic_error(status: int, body: dict) -> str:
    """The error's message, once its shape is checked."""
    assert 400 <= status < 500, (status, body)
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] in ERROR_KINDS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return body["error"]["message"]


def user(*blocks) -> list[dict]:  # noqa: ANN002
    return [{"role": "user", "content": list(blocks)}]


def assistant(*blocks) -> list[dict]:  # noqa: ANN002
    return ASK + [{"role": "assistant", "content": list(blocks)}] + ASK


USE = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"utc": True}}
DEEP_INPUT: dict = {}
_node = DEEP_INPUT
for _ in range(200):
    _node["a"] = {}
    _node = _node["a"]
BAD = [  # (what the body changes, a word the message must hold)
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"model": ["x"]}, "model"),
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [1]}, "messages[0]"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "system"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user"}]}, "content"),
    ({"messages": user(5)}, "content[0]"),
    ({"messages": user({"text": "no type"})}, "content[0]"),
    ({"messages": user({"type": "text", "text": 5})}, "text"),
    ({"messages": user({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}})},
     "image"),
    ({"messages": user({"type": "document", "source": {}})}, "document"),
    ({"messages": user({"type": "video"})}, "video"),
    ({"messages": user({"type": "x" * 100_000})}, "unknown"),
    ({"messages": user(USE)}, "assistant"),
    ({"messages": assistant({"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"})}, "user"),
    ({"messages": assistant({"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}})},
     "server_tool_use"),
    ({"messages": assistant({**USE, "input": "{\"utc\": true}"})}, "input"),
    ({"messages": assistant({**USE, "input": [1]})}, "input"),
    ({"messages": assistant({**USE, "input": DEEP_INPUT})}, "deep"),
    ({"messages": assistant({**USE, "id": 7})}, "id"),
    ({"messages": assistant({**USE, "name": "n" * 300})}, "name"),
    ({"messages": assistant({"type": "thinking"})}, "thinking"),
    ({"messages": user({"type": "tool_result", "tool_use_id": None, "content": "r"})}, "tool_use_id"),
    ({"messages": user({"type": "tool_result", "tool_use_id": "t", "content": 5})}, "content"),
    ({"messages": user({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]})},
     "image"),
    ({"messages": user({"type": "tool_result", "tool_use_id": "t", "content": "r", "is_error": "yes"})}, "is_error"),
    ({"messages": ASK + [{"role": "assistant", "content": "The answer is"}]}, "prefill"),
    ({"system": 5}, "system"),
    ({"system": [{"type": "image", "source": {}}]}, "image"),
    ({"system": [{"type": "text"}]}, "system[0]"),
    ({"stop_sequences": "STOP"}, "stop_sequences"),
    ({"stop_sequences": ["a"] * 100}, "stop_sequences"),
    ({"stop_sequences": [1]}, "stop_sequences"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": [1]}, "top_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"stream": "yes"}, "stream"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [1]}, "tools[0]"),
    ({"tools": [{"name": "f"}]}, "input_schema"),
    ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "name"),
    ({"tools": [{"name": "x" * 500, "input_schema": {"type": "object"}}]}, "name"),
    ({"tools": [{"name": "f", "input_schema": "object"}]}, "input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "input_schema"),
    ({"tools": [{"name": "f", "input_schema": DEEP}]}, "deep"),
    ({"tools": [{"name": "f", "description": {"a": 1}, "input_schema": {"type": "object"}}]}, "description"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "bash_20250124"),
    ({"tools": TOOLS + TOOLS[:1]}, "two tools"),
    ({"tools": [{"name": f"f{i}", "input_schema": {"type": "object"}} for i in range(1000)]}, "at most"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}},
                                               "required": ["a"]}}], "tool_choice": {"type": "any"}}, "schema"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "rm_rf"}}, "rm_rf"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "auto", "disable_parallel_tool_use": "no"}}, "disable_parallel"),
    ({"thinking": {"type": "on"}}, "thinking"),
    ({"thinking": True}, "thinking"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": "lots"}}, "budget_tokens"),
    ({"thinking": {"type": "adaptive", "display": "loud"}}, "display"),
    ({"output_config": {"effort": "extreme"}}, "effort"),
    ({"output_config": {"effort": ["high"]}}, "effort"),
    ({"output_config": "fast"}, "output_config"),
    ({"thinking": {"type": ["enabled"]}}, "thinking"),
    ({"tools": TOOLS, "tool_choice": {"type": {"any": 1}}}, "tool_choice"),
    ({"messages": [{"role": ["user"], "content": "hi"}]}, "role"),
    ({"messages": user({"type": ["text"], "text": "hi"})}, "content[0]"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}, "tools": TOOLS},
     "output_config.format"),
    ({"messages": [{"role": "user", "content": "word " * 200_000}]}, "context"),
]


@pytest.mark.parametrize("change, word", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_requests_get_a_400_in_anthropics_shape(serve_family, change, word):
    client, _ = serve_family("qwen3")
    body = {"model": "qwen3", "max_tokens": 2, "messages": ASK, **change}
    body = {k: v for k, v in body.items() if v is not None}
    status, err = post(client, body)
    assert status == 400
    assert word.lower() in anthropic_error(status, err).lower()
    assert post(client, {"model": "qwen3", "max_tokens": 1, "messages": ASK})[0] == 200


def test_broken_bodies_and_wrong_routes_get_anthropics_shape(serve_family):
    client, _ = serve_family("qwen3")
    for raw in (b"{not json", b"[" * 100_000 + b"]" * 100_000, b"[]", b'"hi"', b"\xff\xfe"):
        status, err = post(client, None, raw=raw)
        assert status == 400 and anthropic_error(status, err)
    status, err = post(client, None, path="/v1/messages/count_tokens", raw=b"[1]")
    assert status == 400 and anthropic_error(status, err)
    status, err = post(client, {}, path="/v1/messages/batches")
    assert status == 404 and anthropic_error(status, err)
    req = urllib.request.Request(str(client.base_url).rstrip("/") + "/v1/messages", method="GET")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 405 and anthropic_error(405, json.loads(e.value.read()))
    host, port = str(client.base_url).split("//")[1].rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:  # a body too large, refused before it is read
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 104857600\r\n\r\n")
        head, _, rest = _read_response(s).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and json.loads(rest)["error"]["type"] == "request_too_large"
    status, err = post(client, {"model": "qwen3", "max_tokens": 1, "messages": ASK}, headers={"Origin": "http://evil.example"})
    assert status == 403 and anthropic_error(status, err)
    assert post(client, {"model": "qwen3", "max_tokens": 1, "messages": ASK})[0] == 200


def _read_response(s: socket.socket) -> bytes:
    data = b""
    while True:
        part = s.recv(65536)
        if not part:
            return data
        data += part
        head, sep, rest = data.partition(b"\r\n\r\n")
        n = re.search(rb"content-length: (\d+)", head, re.I)
        if sep and n and len(rest) >= int(n[1]):
            return data


def test_the_client_sees_its_errors_as_the_api_gives_them(serve_family):
    client, _ = serve_family("qwen3")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="qwen3", max_tokens=5, messages=user({"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AA=="}}))
    assert e.value.body["error"]["type"] == "invalid_request_error" and "image" in e.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.beta.messages.batches.retrieve("msgbatch_1")


@pytest.fixture(scope="module")
def keyed(random_model):
    """A server that wants the key "sekrit" (over a tiny model of its own)."""
    model = Model(random_model("tiny-llama"), backend="numpy", ctx=256)
    url, server, thread = start(model, "tiny", api_key="sekrit")
    yield url
    stop(server, thread)
    model.close()


def test_the_key_comes_as_x_api_key_or_a_bearer_token(keyed):
    ask = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    for client in (anthropic.Anthropic(base_url=keyed, api_key="sekrit", max_retries=0),
                   anthropic.Anthropic(base_url=keyed, auth_token="sekrit", api_key=None, max_retries=0)):
        assert client.messages.create(**ask).type == "message"
        assert client.messages.count_tokens(**{k: v for k, v in ask.items() if k != "max_tokens"}).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=keyed, api_key="wrong", max_retries=0).messages.create(**ask)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": e.value.body[
        "error"]["message"]}}
    status, err = post(keyed, ask)
    assert status == 401 and anthropic_error(status, err)
    assert post(keyed, ask, headers={"x-api-key": "sekrit"})[0] == 200
    assert post(keyed, ask, headers={"Authorization": "Bearer sekrit"})[0] == 200
    assert post(keyed, ask, headers={"x-api-key": "sekri"})[0] == 401
    models = urllib.request.Request(keyed + "/v1/models", headers={"x-api-key": "sekrit"})
    with urllib.request.urlopen(models, timeout=30) as r:  # (the OpenAI routes take it too)
        assert r.status == 200




def test_the_readme_agent_loop_runs_as_written(serve_family, monkeypatch, capsys):
    """README.md's example for this API, run as it stands against a server whose model is scripted to call the
    tool once and then answer: the loop sends the result back and prints the answer."""
    client, model = serve_family("qwen3")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    at = readme.index("    import anthropic\n")
    lines = []
    for line in readme[at:].splitlines():
        if line and not line.startswith("    "):
            break
        lines.append(line[4:])
    code = "\n".join(lines).replace("http://127.0.0.1:8080", str(client.base_url).rstrip("/"))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    script = Script(model, call + "It is 18 degrees and sunny in Paris.<|im_end|>").install(monkeypatch)
    seen = prompts(model, monkeypatch)
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102
    assert script.refused == [] and len(seen) == 2
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in model.detokenize(seen[1])
    assert capsys.readouterr().out == "It is 18 degrees and sunny in Paris.\n"
