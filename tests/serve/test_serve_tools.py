"""Tools in /v1/chat/completions through the official `openai` client against a real server: for each family a
tiny random model with that family's real chat template (llama.cpp's models/templates) and its special tokens.

With random weights the model's own choices are noise, so the tests force what they check: a named or required
tool_choice holds the reply to a valid call from its first token (the grammar), and auto mode runs a scripted
reply through the real engine and server (the backend's choice replaced by the script's ids, each checked
against the constraint's mask first). Every call must parse and validate against its tool's schema, and a
streamed reply must give what the whole one gives."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serve_runner import BACKEND, FamilyServers  # noqa: E402

from llamacli.engine.generate import Model  # noqa: E402

WEATHER = {"type": "object", "properties": {
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "exact": {"type": "boolean"}}, "required": ["unit", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}  # (a random model would think forever)


@pytest.fixture(scope="module")
def templates(llama_cpp_models: Path) -> Path:
    return llama_cpp_models / "templates"


@pytest.fixture(scope="module")
def serve_family(tmp_path_factory, templates):
    """serve_family(name) -> (openai client, model): a server over a tiny model of that family (one each)."""
    servers = FamilyServers(tmp_path_factory, templates)

    def get(family: str):
        client, model, _ = servers.get(family, lambda url: openai.OpenAI(base_url=url + "/v1", api_key="unused",
                                                                        max_retries=0, timeout=120))
        return client, model

    yield get
    servers.close()


def valid(call) -> dict:  # noqa: ANN001 (an openai tool call)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def streamed(client, **kw):  # noqa: ANN001, ANN003
    """(content, {index: [id, name, arguments]}, finish reason) of a streamed reply, its deltas put together."""
    content, calls, finish = "", {}, None
    for ev in client.chat.completions.create(stream=True, **kw):
        if not ev.choices:
            continue
        delta = ev.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, [None, None, ""])
            if tc.id:
                entry[0] = tc.id
            if tc.function and tc.function.name:
                entry[1] = tc.function.name
            entry[2] += (tc.function.arguments or "") if tc.function else ""
        finish = ev.choices[0].finish_reason or finish
    return content, calls, finish


FORCED_FAMILIES = ["qwen3", "qwen3.5", "llama3.1", "mistral", "mistral-nemo", "gemma4", "gemma2"]  # (gpt-oss: below)


@pytest.mark.parametrize("family", FORCED_FAMILIES)
def test_a_named_tool_choice_gives_a_valid_call_streamed_or_whole(serve_family, family):
    client, _ = serve_family(family)
    kw = {"model": family, "messages": ASK, "tools": TOOLS, "max_tokens": 400, "temperature": 0,
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "extra_body": NO_THINK,
          "parallel_tool_calls": False}
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (choice.message, r.usage)
    calls = choice.message.tool_calls
    assert len(calls) >= 1 and all(c.function.name == "get_weather" and c.type == "function" for c in calls)
    for c in calls:
        valid(c)
    assert len({c.id for c in calls}) == len(calls)
    content, deltas, finish = streamed(client, **kw)
    assert finish == "tool_calls"
    assert [(d[1], d[2]) for _, d in sorted(deltas.items())] == [(c.function.name, c.function.arguments)
                                                                  for c in calls]
    assert all(d[0] for d in deltas.values())
    assert content == (choice.message.content or "")


@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma4"])
def test_required_calls_one_of_the_tools(serve_family, family):
    client, _ = serve_family(family)
    r = client.chat.completions.create(model=family, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=400, temperature=0, parallel_tool_calls=False,
                                       extra_body=NO_THINK)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    valid(calls[0])


@pytest.mark.parametrize("family", ["qwen3", "llama3.1", "mistral"])
def test_the_call_goes_back_into_the_conversation(serve_family, family):
    """The reply's call and a tool result, sent back as the openai client sends them, render through the
    template (Mistral's demands nine-character ids: the server made them so) and the model answers again."""
    client, _ = serve_family(family)
    kw = {"model": family, "tools": TOOLS, "max_tokens": 400, "temperature": 0, "extra_body": NO_THINK}
    first = client.chat.completions.create(messages=ASK, tool_choice={"type": "function", "function": {
        "name": "get_time"}}, **kw).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    again = client.chat.completions.create(messages=history, tool_choice="none", **{**kw, "max_tokens": 4})
    assert again.choices[0].message.tool_calls is None and again.choices[0].finish_reason == "length"


# -- auto: a scripted reply through the real engine, each id checked against the grammar ------------------------


class Script:
    """The backend's choice of each id replaced by a scripted reply's ids. Under a constraint every scripted id
    is checked against its mask first: one the grammar refuses is recorded (its position) and an allowed id is
    taken instead (the end where it may come, else the first that is not whitespace), so that the reply goes on
    as the grammar makes it."""

    def __init__(self, model: Model, text: str):
        from llamacli.sampling.structured import unpack_words

        self.unpack, self.tok = unpack_words, model.tokenizer
        self.ids = self.tok.encode(text, special=True, add_bos=False, add_eos=False)
        self.refused: list[int] = []
        self.taken = 0

    def pick(self, words) -> int:  # noqa: ANN001
        tid = self.ids.pop(0) if self.ids else self.tok.eos_id
        if words is not None:
            allowed = self.unpack(words, self.tok.vocab_size)
            if not allowed[tid]:  # instead: the end if it may come, else the first allowed id that is no space
                self.refused.append(self.taken)
                ids = [int(i) for i in allowed.nonzero()[0]]
                ends = [i for i in ids if i in self.tok.eog_ids]
                tid = (ends or [i for i in ids if self.tok.decode([i]).strip()] or ids)[0]
        self.taken += 1
        return tid

    def install(self, monkeypatch) -> "Script":  # noqa: ANN001
        from llamacli.backends.numpy_backend import NumpyBackend

        if BACKEND != "numpy":
            pytest.skip("a scripted reply replaces the NumPy backend's choices")

        monkeypatch.setattr(NumpyBackend, "sample_allowed", lambda be, logits, words, *a: self.pick(words))
        monkeypatch.setattr(NumpyBackend, "sample", lambda be, logits, *a: self.pick(None))
        monkeypatch.setattr(NumpyBackend, "decode_greedy", lambda be, token, pos: (be.decode(token, pos),
                                                                                  self.pick(None))[1])
        return self


W, T = '{"unit": "celsius", "days": 3}', '{"utc": true}'
SCRIPTS = {  # family: (reply, content, reasoning, [(name, arguments)])
    "qwen3": (f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n<tool_call>\n'
              f'{{"name": "get_time", "arguments": {T}}}\n</tool_call><|im_end|>', "Let me check.", "",
              [("get_weather", W), ("get_time", T)]),
    "qwen3.5": ("Sure.\n\n<tool_call>\n<function=get_weather>\n<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>"
                "\n3\n</parameter>\n</function>\n</tool_call><|im_end|>", "Sure.", "", [("get_weather", W)]),
    "llama3.1": (f'{{"name": "get_weather", "parameters": {W}}}<|eom_id|>', "", "", [("get_weather", W)]),
    "mistral": (f"[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{W}[TOOL_CALLS]get_time[CALL_ID]abcDEF124[ARGS]{T}</s>",
                "", "", [("get_weather", W), ("get_time", T)]),
    "mistral-nemo": (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}, "id": "abcDEF123"}}]</s>', "", "",
                     [("get_weather", W)]),
    "gemma4": ('<|tool_call>call:get_weather{days:3,unit:<|"|>celsius<|"|>}<tool_call|><turn|>', "", "",
               [("get_weather", '{"days": 3, "unit": "celsius"}')]),
    "gemma2": (f'{{"name": "get_weather", "arguments": {W}}}<end_of_turn>', "", "", [("get_weather", W)]),
    "gpt-oss": ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                f"to=functions.get_weather <|constrain|>json<|message|>{W}<|call|>", "", "Need the weather.",
                [("get_weather", W)]),
}


@pytest.mark.parametrize("family", sorted(SCRIPTS))
def test_auto_reads_a_reply_with_calls_as_the_model_writes_them(serve_family, monkeypatch, family):
    """tool_choice auto: the family's own call format, with text before it, goes through the lazy grammar
    untouched (no scripted id refused) and comes back as content, reasoning and tool_calls, whole or streamed."""
    client, model = serve_family(family)
    text, content, reasoning, want = SCRIPTS[family]
    kw = {"model": family, "messages": ASK, "tools": TOOLS, "max_tokens": 200, "temperature": 0, "extra_body": NO_THINK}
    script = Script(model, text).install(monkeypatch)
    r = client.chat.completions.create(**kw)
    assert script.refused == []
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == want
    assert (msg.content or "") == content and (getattr(msg, "reasoning_content", None) or "") == reasoning
    for c in msg.tool_calls:
        valid(c)
    script = Script(model, text).install(monkeypatch)
    got, deltas, finish = streamed(client, **kw)
    assert script.refused == [] and finish == "tool_calls" and got == content
    assert [(d[1], d[2]) for _, d in sorted(deltas.items())] == want


def test_auto_answers_in_text_when_the_model_does(serve_family, monkeypatch):
    client, model = serve_family("qwen3")
    script = Script(model, "Paris: sunny, 20 degrees.<|im_end|>").install(monkeypatch)
    r = client.chat.completions.create(model="qwen3", messages=ASK, tools=TOOLS, max_tokens=50, temperature=0,
                                       extra_body=NO_THINK)
    assert script.refused == [] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == "Paris: sunny, 20 degrees." and r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("bad, at", [
    ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', '<tool_call>\n{"name": "'),  # no such tool
    ('<tool_call>\n{"name": "get_weather", "arguments": {"unit": "kelvin", "days": 3}}', '<tool_call>\n{"name": '
     '"get_weather", "arguments": {"unit": "'),  # not in the enum
    ('<tool_call>\n{"name": "get_weather", "arguments": {"days": 3}}', '<tool_call>\n{"name": "get_weather", '
     '"arguments": {"'),  # "unit" is required (and comes first)
])
def test_auto_holds_a_begun_call_to_its_schema(serve_family, monkeypatch, bad, at):
    """Once the model begins a call, the grammar refuses what would make it invalid, at the first token that
    would, and the call that comes back validates."""
    client, model = serve_family("qwen3")
    script = Script(model, "Checking. " + bad + "<|im_end|>").install(monkeypatch)
    r = client.chat.completions.create(model="qwen3", messages=ASK, tools=TOOLS, max_tokens=300, temperature=0,
                                       parallel_tool_calls=False, extra_body=NO_THINK)
    assert script.refused, "the grammar let an invalid call through"
    first = script.refused[0]
    assert first == len(model.tokenizer.encode("Checking. " + at, special=True, add_bos=False, add_eos=False))
    for c in r.choices[0].message.tool_calls or []:
        valid(c)


# -- hostile requests: 400 with the reason, and the server stays up ----------------------------------------------

DEEP = {"type": "object", "properties": {"a": {}}}
_node = DEEP["properties"]["a"]
for _ in range(300):
    _node["properties"] = {"a": {}}
    _node = _node["properties"]["a"]


def raw(client, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(str(client.base_url) + "chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


BAD_TOOLS = [
    {"tools": "get_weather"},
    {"tools": [1]},
    {"tools": [{"type": "retrieval"}]},
    {"tools": [{"type": "function"}]},
    {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
    {"tools": [{"type": "function", "function": {"name": "x" * 500}}]},
    {"tools": TOOLS + [TOOLS[0]]},
    {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(1000)]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "description": {"a": 1}}}]},
    {"tools": TOOLS, "tool_choice": "sometimes"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tools": TOOLS, "tool_choice": {"type": "function"}},
    {"tools": TOOLS, "tool_choice": 7},
    {"tool_choice": "required"},
    {"tools": TOOLS, "parallel_tool_calls": "yes"},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}}}],
     "tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
    {"functions": [{"name": "f"}]},
    {"function_call": {"name": "f"}},
]
BAD_MESSAGES = [
    [{"role": "assistant", "content": None, "tool_calls": "get_weather"}],
    [{"role": "assistant", "content": None, "tool_calls": [{"function": 1}]}],
    [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}],
    [{"role": "assistant", "content": None, "tool_calls": [{"id": 5, "function": {"name": "f"}}]}],
    [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}] * 500}],
    [{"role": "tool", "tool_call_id": {"x": 1}, "content": "r"}],
    [{"role": "function", "name": "f", "content": "r"}],
    [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}],
]


@pytest.mark.parametrize("body", BAD_TOOLS + [{"messages": m} for m in BAD_MESSAGES])
def test_bad_tools_get_a_400_naming_the_field(serve_family, body):
    client, _ = serve_family("qwen3")
    status, err = raw(client, {"messages": ASK, "max_tokens": 2, **body})
    assert status == 400, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["param"], err
    assert raw(client, {"messages": ASK, "max_tokens": 1})[0] == 200


def test_odd_but_valid_tool_fields_are_served(serve_family):
    """Arguments sent as a string that nests past any bound stay a string; a tool without parameters takes {};
    tools: [] is no tools; the Mistral template's demand for nine-character ids comes back as a 400."""
    client, _ = serve_family("qwen3")
    deep = "[" * 2000 + "]" * 2000  # (json.loads gives up on it: RecursionError)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    assert raw(client, {"messages": history, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1})[0] == 200
    status, body = raw(client, {"messages": ASK, "tools": [{"type": "function", "function": {"name": "ping"}}],
                                "tool_choice": "required", "max_tokens": 200, "parallel_tool_calls": False,
                                "seed": 1, **NO_THINK})  # (the grammar lets a random model pad {} with whitespace)
    assert status == 200 and json.loads(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {}
    assert raw(client, {"messages": ASK, "tools": [], "max_tokens": 1})[0] == 200
    mistral, _ = serve_family("mistral")
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_too_long_for_mistral", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]
    status, err = raw(mistral, {"messages": history, "tools": TOOLS, "max_tokens": 1})
    assert status == 400 and "nine" not in err["error"]["message"] and "length 9" in err["error"]["message"]


def test_gpt_oss_forced_call_may_reason_first(serve_family, monkeypatch):
    """gpt-oss always reasons: a named tool_choice lets its analysis message come first, then holds the reply to
    the commentary message to=functions.NAME with valid JSON (a random model would reason forever: scripted)."""
    client, model = serve_family("gpt-oss")
    kw = {"model": "gpt-oss", "messages": ASK, "tools": TOOLS, "max_tokens": 200, "temperature": 0,
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    text = SCRIPTS["gpt-oss"][0]
    script = Script(model, text).install(monkeypatch)
    msg = client.chat.completions.create(**kw).choices[0].message
    assert script.refused == [] and msg.reasoning_content == "Need the weather."
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("get_weather", W)]
    script = Script(model, text.replace("to=functions.get_weather", "to=functions.get_time")).install(monkeypatch)
    msg = client.chat.completions.create(**kw).choices[0].message
    assert script.refused and msg.tool_calls[0].function.name == "get_weather"  # the other tool is refused
    valid(msg.tool_calls[0])


def test_requests_without_tools_are_read_as_any_other(random_model):
    """`tools: []` and tool_choice "none" or "auto" with no tools offer no tool: read as any other request (no
    tool parsing, nothing kept of the control tokens)."""
    from llamacli.serve.api import read_job

    with Model(random_model("tiny-llama"), backend="numpy", ctx=64) as tiny:
        for extra in ({"tools": []}, {"tool_choice": "none"}, {"tool_choice": "auto"}, {"tools": None},
                      {"tools": TOOLS, "tool_choice": "none"}):
            job = read_job(tiny, {"messages": ASK, "max_tokens": 2, **extra}, chat=True)
            assert job.chat and job.ids and job.max_tokens == 2 and job.tools is None and job.constraint is None


def readme_block(marker: str) -> str:
    """The README's indented code block holding `marker`, unindented."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    at = readme.index(marker)
    lines = []
    for line in readme[readme.rfind("\n\n", 0, at) + 2 :].splitlines():
        if line and not line.startswith("    "):
            break
        lines.append(line[4:])
    return "\n".join(lines)


def test_the_readme_agent_loop_runs_as_written(serve_family, monkeypatch, capsys):
    """README.md's chat completions agent loop, run as it stands against a server whose model is scripted to
    call the tool once and then answer: the loop sends the result back (as a tool message the template renders)
    and prints the answer."""
    client, model = serve_family("qwen3")
    code = readme_block('    messages = [{"role": "user", "content": "Weather in Paris?"}]\n')
    code = code.replace("http://127.0.0.1:8080", str(client.base_url).rstrip("/").removesuffix("/v1"))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    script = Script(model, call + "It is sunny in Paris.<|im_end|>").install(monkeypatch)
    seen: list[list[int]] = []
    run = model.run

    @functools.wraps(run)  # (the server reads run's signature)
    def spy(prompt, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.append(list(prompt))
        return run(prompt, **kw)

    monkeypatch.setattr(model, "run", spy)
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102
    assert script.refused == [] and len(seen) == 2
    assert "<tool_response>\nParis: sunny, 21 C\n</tool_response>" in model.detokenize(seen[1])
    assert capsys.readouterr().out == "It is sunny in Paris.\n"
