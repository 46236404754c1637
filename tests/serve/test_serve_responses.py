"""OpenAI's Responses API (`/v1/responses`) through the official `openai` client (client.responses.create, whole
and streamed) against a real server over tiny random models with each family's real chat template (the servers
and the scripted replies of test_serve_tools.py).

A forced call must parse and validate against its tool's schema; a call's output sent back (inline, or through
previous_response_id) must render the prompt transformers renders for the same conversation; a streamed reply's
events, put together, must give the whole reply's items; and every hostile request is a 4xx with the reason,
after which the server still answers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serve_runner import FamilyServers  # noqa: E402
from test_serve_tools import CLOCK, DEEP, FORCED_FAMILIES, SCHEMAS, SCRIPTS, WEATHER, Script  # noqa: E402

from llamacli.errors import NumericalError  # noqa: E402
from llamacli.serve.api import ApiError  # noqa: E402
from llamacli.serve.responses_api import ENTRY_BYTES, ResponseStore  # noqa: E402
from llamacli.testing.tool_vocab import FAMILIES  # noqa: E402

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather forecast", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "description": "The time", "parameters": CLOCK}]
ASK = "Weather in Paris for 3 days?"
NO_THINK = {"effort": "none"}  # (a random model would think forever)
FORCE = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def templates(llama_cpp_models):  # noqa: ANN001
    return llama_cpp_models / "templates"


@pytest.fixture(scope="module")
def serve_family(tmp_path_factory, templates):  # noqa: ANN001
    """serve_family(name) -> (openai client, model, the server's ResponseStore): a server over a tiny model of
    that family with its real template (one each)."""
    servers = FamilyServers(tmp_path_factory, templates)

    def get(family: str):
        client, model, server = servers.get(family, lambda url: openai.OpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120))
        return client, model, server.config.app.state.responses

    yield get
    servers.close()


def create(client, **kw):  # noqa: ANN001, ANN003
    return client.responses.create(**{"model": "tiny", "temperature": 0, "reasoning": NO_THINK, **kw})


def reassembled(events: list) -> object:
    """The final response of a stream, after checking that its events agree: sequence numbers 0, 1, ...; each
    item added, its deltas, its done events and the item done with the text the deltas made; and the items
    done are the final response's output."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    items: dict[int, dict] = {}
    for e in events[2:-1]:
        kind = e.type.removeprefix("response.")
        if kind == "output_item.added":
            assert e.output_index == len(items) and e.item.status == "in_progress"
            items[e.output_index] = {"text": "", "reasoning_text": "", "reasoning_summary_text": "",
                                     "function_call_arguments": "", "item": e.item, "done": None}
            continue
        item = items[e.output_index]
        assert item["done"] is None and getattr(e, "item_id", item["item"].id) == item["item"].id
        if kind in ("output_text.delta", "reasoning_text.delta", "reasoning_summary_text.delta",
                    "function_call_arguments.delta"):
            item[kind.split(".")[0].replace("output_text", "text")] += e.delta
        elif kind in ("output_text.done", "reasoning_text.done", "reasoning_summary_text.done"):
            assert e.text == item[kind.split(".")[0].replace("output_text", "text")]
        elif kind == "function_call_arguments.done":
            assert e.arguments == item["function_call_arguments"]
        elif kind == "output_item.done":
            done = item["done"] = e.item
            if done.type == "message":
                assert done.content[0].text == item["text"]
            elif done.type == "reasoning":
                assert done.content[0].text == item["reasoning_text"]
                assert [s.text for s in done.summary] in ([], [item["reasoning_text"]])
                assert item["reasoning_summary_text"] in ("", item["reasoning_text"])
            else:
                assert done.arguments == item["function_call_arguments"] and done.name == item["item"].name
        else:
            assert kind in ("content_part.added", "content_part.done", "reasoning_summary_part.added",
                            "reasoning_summary_part.done"), kind
    final = events[-1].response
    assert events[-1].type == f"response.{final.status}" and final.status in ("completed", "incomplete")
    assert [items[i]["done"] for i in range(len(items))] == final.output
    return final


def shape(response) -> list[dict]:  # noqa: ANN001
    """The output items without their ids (new ones in every response)."""
    return [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")} for item in response.output]


def both(client, **kw):  # noqa: ANN001, ANN003
    """The whole response, after checking that the streamed one, reassembled, has the same items and status."""
    whole = create(client, **kw)
    streamed = reassembled(list(create(client, stream=True, **kw)))
    assert shape(streamed) == shape(whole) and streamed.status == whole.status
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    return whole


def calls(response) -> list:  # noqa: ANN001
    out = [item for item in response.output if item.type == "function_call"]
    for c in out:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
        assert c.status == "completed" and c.call_id and c.id.startswith("fc_")
    assert len({c.call_id for c in out}) == len(out)
    return out


@pytest.mark.parametrize("family", FORCED_FAMILIES)
def test_a_named_tool_choice_gives_a_valid_call_streamed_or_whole(serve_family, family):
    client, *_ = serve_family(family)
    r = both(client, input=ASK, tools=TOOLS, tool_choice=FORCE, parallel_tool_calls=False, max_output_tokens=400)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    found = calls(r)
    assert len(found) >= 1 and all(c.name == "get_weather" for c in found)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens and r.usage.output_tokens > 0
    assert r.tool_choice.name == "get_weather" and [t.name for t in r.tools] == ["get_weather", "get_time"]


def test_required_calls_one_of_the_tools(serve_family):
    client, *_ = serve_family("qwen3")
    r = create(client, input=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
               max_output_tokens=400)
    assert len(calls(r)) == 1 and r.output_text == ""


@pytest.mark.parametrize("family", sorted(SCRIPTS))
def test_auto_gives_content_reasoning_and_calls_as_items(serve_family, monkeypatch, family):
    """tool_choice auto with each family's own call format (scripted replies): the text before the calls is a
    message item, gpt-oss's analysis a reasoning item, each call a function_call item, in that order."""
    client, model, _ = serve_family(family)
    text, content, reasoning, want = SCRIPTS[family]
    Script(model, text).install(monkeypatch)
    whole = create(client, input=ASK, tools=TOOLS, max_output_tokens=200)
    Script(model, text).install(monkeypatch)
    streamed = reassembled(list(create(client, input=ASK, tools=TOOLS, max_output_tokens=200, stream=True)))
    assert shape(streamed) == shape(whole)
    kinds = ["reasoning"] * bool(reasoning) + ["message"] * bool(content) + ["function_call"] * len(want)
    assert [item.type for item in whole.output] == kinds
    assert [(c.name, c.arguments) for c in calls(whole)] == want
    assert whole.output_text == content
    if reasoning:
        assert whole.output[0].content[0].text == reasoning and whole.output[0].summary == []


def test_reasoning_comes_apart_and_goes_back(serve_family, monkeypatch):
    """A thinking reply: a reasoning item (its text as reasoning_text, and as the summary when asked), then the
    message; usage counts the reasoning's tokens. Sent back as an input item, the reasoning reaches the
    template as the assistant turn's reasoning_content."""
    client, model, _ = serve_family("qwen3")
    script = "<think>\nLet me see.\n</think>\n\nParis is sunny.<|im_end|>"
    for summary in (None, "auto"):
        Script(model, script).install(monkeypatch)
        kw = {"input": ASK, "max_output_tokens": 60, "reasoning": {"effort": "high", "summary": summary}}
        whole = create(client, **kw)
        Script(model, script).install(monkeypatch)
        streamed = reassembled(list(create(client, stream=True, **kw)))
        assert shape(streamed) == shape(whole)
        thought, message = whole.output
        assert thought.type == "reasoning" and thought.content[0].text == "Let me see."
        assert [s.text for s in thought.summary] == (["Let me see."] if summary else [])
        assert message.type == "message" and whole.output_text == "Paris is sunny."
        assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    seen = rendered(model, monkeypatch)
    again = [{"role": "user", "content": ASK}, thought.model_dump(exclude_none=True),
             {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": '{"utc": true}'},
             {"type": "function_call_output", "call_id": "c1", "output": "noon"}]
    create(client, input=again, tools=TOOLS, tool_choice="none", max_output_tokens=1)
    assert "<think>\nLet me see.\n</think>" in seen[-1] and "noon" in seen[-1]


def rendered(model, monkeypatch) -> list[str]:  # noqa: ANN001
    """The prompts the server renders from now on (Model.render_chat's results)."""
    seen: list[str] = []
    real = model.render_chat

    def spy(*args, **kw):  # noqa: ANN002, ANN003
        seen.append(real(*args, **kw))
        return seen[-1]

    monkeypatch.setattr(model, "render_chat", spy)
    return seen


@pytest.mark.parametrize("family", FORCED_FAMILIES)
def test_a_function_call_output_renders_as_the_template_says(serve_family, templates, monkeypatch, family):
    """The call sent back with its output, inline (the items themselves) or through previous_response_id,
    renders one prompt: the one chat completions renders for the same conversation, and transformers' where
    the template shows tools (the call's arguments as an object, the result as a tool turn); the instructions
    are the request's own (not carried over). (Gemma 2's template refuses a system message, and so
    instructions: a 400 there, as for a system message in chat completions.)"""
    client, model, _ = serve_family(family)
    system = family != "gemma2"
    first = create(client, input=ASK, instructions="Answer briefly." if system else None, tools=TOOLS,
                   max_output_tokens=200, tool_choice={"type": "function", "name": "get_time"},
                   parallel_tool_calls=False)
    call = calls(first)[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}
    seen = rendered(model, monkeypatch)
    kw = {"tools": TOOLS, "instructions": "Be terse." if system else None, "max_output_tokens": 1}
    inline = create(client, input=[{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result], **kw)
    chained = create(client, input=[result], previous_response_id=first.id, **kw)
    assert inline.status == chained.status == "incomplete" and chained.previous_response_id == first.id
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}} for t in TOOLS]
    messages = [{"role": "system", "content": "Be terse."}] * system + [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_time", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}]
    client.chat.completions.create(model=family, messages=messages, tools=tools, max_tokens=1,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2]
    assert "Answer briefly." not in seen[0] and "12:00" in seen[0]
    assert "Be terse." in seen[0] or family in ("mistral-nemo", "gemma2")  # (Nemo's template shows the system
    #                                                  message only with the last user message, when that is last)
    if family == "gemma2":
        return  # (its template shows no tools: they and the call go in as text, chat completions' way)
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    source = (templates / FAMILIES[family][0]).read_text(encoding="utf-8")
    messages[-2] = {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function",
                    "function": {"name": "get_time", "arguments": json.loads(call.arguments)}}]}
    messages[-1]["name"] = "get_time"
    want = utils.render_jinja_template(conversations=[messages], tools=tools, chat_template=source,
                                       add_generation_prompt=True, enable_thinking=False,
                                       **model.chat_template.special_tokens)[0][0]
    assert seen[0] == want


def test_json_schema_output_follows_the_schema(serve_family, monkeypatch):
    """text.format json_schema holds the answer to the schema (scripted replies: a random model's own would be
    whitespace): a valid one goes through untouched, an invalid one is refused where it goes wrong and the
    answer that comes back validates."""
    client, model, _ = serve_family("qwen3")
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["color", "count"], "additionalProperties": False}
    kw = {"input": "A color and a count.", "max_output_tokens": 100,
          "text": {"format": {"type": "json_schema", "name": "paint", "schema": schema, "strict": True}}}
    for reply, refused in (('{"color": "green", "count": 7}<|im_end|>', False),
                           ('{"color": "purple", "count": 12}<|im_end|>', True)):
        script = Script(model, reply).install(monkeypatch)
        r = create(client, **kw)
        Script(model, reply).install(monkeypatch)
        assert shape(reassembled(list(create(client, stream=True, **kw)))) == shape(r)
        assert bool(script.refused) == refused and r.status == "completed" and r.text.format.type == "json_schema"
        jsonschema.validate(json.loads(r.output_text), schema)
    Script(model, '{"a": [1, 2]}<|im_end|>').install(monkeypatch)
    r = create(client, input="Any JSON.", text={"format": {"type": "json_object"}}, max_output_tokens=100)
    assert json.loads(r.output_text) == {"a": [1, 2]}


def test_max_output_tokens_makes_an_incomplete_response(serve_family):
    client, *_ = serve_family("qwen3")
    r = both(client, input="Tell me a story.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.max_output_tokens == 3 and r.output[-1].status == "incomplete"
    kw = {"input": ASK, "tools": TOOLS, "tool_choice": FORCE, "parallel_tool_calls": False}
    whole = create(client, max_output_tokens=400, **kw)
    cut = both(client, max_output_tokens=whole.usage.output_tokens // 2, **kw)  # (inside the arguments)
    assert cut.status == "incomplete" and cut.output[-1].type == "function_call"
    assert cut.output[-1].status == "incomplete"
    follow = create(client, input="And then?", previous_response_id=cut.id, max_output_tokens=2)
    assert follow.status == "incomplete"  # (the cut call is left out of the conversation: it cannot be rendered)


def test_stored_responses_can_be_read_deleted_and_continued(serve_family):
    client, *_ = serve_family("qwen3")
    r = create(client, input="Hi.", max_output_tokens=2, metadata={"task": "greeting"}, user="u1")
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output == r.output and got.metadata == {"task": "greeting"}
    client.responses.delete(r.id)
    for gone in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError, match="no response with id"):
            gone()
    with pytest.raises(openai.BadRequestError, match="previous_response_id") as e:
        create(client, input="Again.", previous_response_id=r.id, max_output_tokens=1)
    assert e.value.body["code"] == "previous_response_not_found"
    streamed = list(create(client, input="Hi.", max_output_tokens=2, stream=True))[-1].response
    assert client.responses.retrieve(streamed.id).output == streamed.output
    unstored = create(client, input="Hi.", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_stored_responses_stay_within_their_bounds(serve_family, monkeypatch):
    """The store keeps the most recently used responses, at most max_items of them and max_bytes of their text
    (the server's own store, its bounds lowered); a response larger than the whole store is not kept."""
    client, model, store = serve_family("qwen3")
    monkeypatch.setattr(store, "max_items", 4)
    ids = [create(client, input=f"Turn {i}.", max_output_tokens=1).id for i in range(7)]
    client.responses.retrieve(ids[3])  # (used: kept over ids[4])
    ids.append(create(client, input="Turn 7.", max_output_tokens=1).id)
    assert len(store) == 4 and store.bytes <= store.max_bytes
    for i, rid in enumerate(ids):
        if i in (3, 5, 6, 7):
            client.responses.retrieve(rid)
        else:
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(rid)
    monkeypatch.setattr(store, "max_items", 1000)
    monkeypatch.setattr(store, "max_bytes", 6_000)
    for i in range(3):
        kept = create(client, input=f"{i} " + "é" * 400, max_output_tokens=1)  # (stored as \u00e9: 6 bytes)
        assert store.bytes <= 6_000 and client.responses.retrieve(kept.id).id == kept.id
    assert len(store) == 1  # (each takes over half of the bound)
    big = create(client, input="é" * 1000, max_output_tokens=1)
    assert big.status == "incomplete" and store.bytes <= 6_000
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(big.id)


def test_a_failure_mid_stream_is_an_error_event(serve_family, monkeypatch):
    client, model, store = serve_family("qwen3")

    def failing(*args, **kw):  # noqa: ANN002, ANN003
        yield "Hel"
        raise NumericalError("the logits hold NaN")

    monkeypatch.setattr(model, "run", failing)
    events = list(create(client, input="Hi.", max_output_tokens=5, stream=True))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert "NaN" in events[-2].message and events[-1].response.status == "failed"
    with pytest.raises(openai.InternalServerError, match="NaN"):
        create(client, input="Hi.", max_output_tokens=5)
    monkeypatch.undo()
    assert create(client, input="Hi.", max_output_tokens=1).status == "incomplete"


# -- hostile requests: 4xx with the reason, and the server stays up ----------------------------------------------


def raw(client, body: bytes | dict, method: str = "POST", path: str = "responses") -> tuple[int, dict]:  # noqa: ANN001
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(str(client.base_url) + path, data=data if method == "POST" else None,
                                 headers={"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


CALL = {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"}
BAD = [
    ({"input": 5}, "input"),
    ({"input": {"role": "user", "content": "hi"}}, "input"),
    ({"input": []}, "input"),
    ({"input": [5]}, "input[0]"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]"),
    ({"input": [{"content": "hi"}]}, "input[0]"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": 7}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [[{"type": "input_text", "text": "a"}]]}]}, "input[0].content[0]"),
    ({"input": [{**CALL, "call_id": 5}]}, "input[0].call_id"),
    ({"input": [{**CALL, "call_id": "x" * 300}]}, "input[0].call_id"),
    ({"input": [{**CALL, "name": ""}]}, "input[0].name"),
    ({"input": [{**CALL, "arguments": {"utc": True}}]}, "input[0].arguments"),
    ({"input": [CALL] * 200}, "input[128]"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": {"x": 1}}]}, "input[0].output"),
    ({"input": [{"type": "function_call_output", "output": "r"}]}, "input[0].call_id"),
    ({"input": [{"type": "reasoning", "summary": "thinking"}]}, "input[0].summary"),
    ({"input": [{"type": "reasoning", "content": [{"type": "output_text", "text": "x"}]}]}, "input[0].content[0]"),
    ({"instructions": 5}, "instructions"),
    ({"instructions": ["a"]}, "instructions"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0]"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "name": "f", "parameters": DEEP}]}, "tools[0]"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "object"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "name": f"f{i}"} for i in range(1000)]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2]"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": "x"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [
        {"type": "function", "name": "nope"}]}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"text": "json"}, "text"),
    ({"text": {"format": "json"}}, "text.format"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "s", "schema": {"$ref": "#"}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "s", "schema": DEEP}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "string", "pattern": "a{1000000}"}}}},
     "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": -5}, "max_output_tokens"),
    ({"max_output_tokens": "many"}, "max_output_tokens"),
    ({"max_output_tokens": 2.5}, "max_output_tokens"),
    ({"max_output_tokens": True}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": [1]}, "top_p"),
    ({"reasoning": "high"}, "reasoning"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": {"effort": 3}}, "reasoning.effort"),
    ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
    ({"stream": "yes"}, "stream"),
    ({"store": "no"}, "store"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": "x"}, "metadata"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"previous_response_id": 5}, "previous_response_id"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"previous_response_id": "x" * 100_000}, "previous_response_id"),
    ({"input": "word " * 600_000}, "input"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_bad_requests_get_a_400_naming_the_field(serve_family, body, param):
    client, *_ = serve_family("qwen3")
    status, err = raw(client, {"input": "hi", "max_output_tokens": 2, "reasoning": NO_THINK, **body})
    assert status == 400, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["param"] == param, err
    assert len(err["error"]["message"]) < 1000
    assert raw(client, {"input": "hi", "max_output_tokens": 1})[0] == 200


NAN_TOOL = (b'{"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", '
            b'"properties": {"x": {"type": "number", "maximum": NaN}}}}], "tool_choice": "none"}')


@pytest.mark.parametrize("body", [b"[]", b"null", b"{", b'{"input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                  "{\"input\": \"\ud800\"}".encode("utf-8", "surrogatepass"),
                                  b'{"input": "hi", "temperature": Infinity}', NAN_TOOL,
                                  NAN_TOOL.replace(b"NaN", b"1e999")])
def test_bodies_that_are_no_request_get_a_400(serve_family, body):
    """Not JSON, not an object, nested past any parser, text that is no UTF-8, numbers JSON has not (NaN and
    Infinity, which an answer that repeats the request's tools could not be written with)."""
    client, *_ = serve_family("qwen3")
    status, err = raw(client, body)
    assert status == 400 and err["error"]["message"], err
    assert raw(client, {"input": "hi", "max_output_tokens": 1})[0] == 200


def test_unknown_ids_and_methods(serve_family):
    client, *_ = serve_family("qwen3")
    for rid in ("resp_nope", "x" * 5000, "%00%1b[31m"):
        for method in ("GET", "DELETE"):
            status, err = raw(client, b"", method, "responses/" + rid)
            assert status == 404 and "no response with id" in err["error"]["message"], err
            assert "\x1b" not in err["error"]["message"] and len(err["error"]["message"]) < 400
    assert raw(client, b"", "GET", "responses")[0] == 405
    assert raw(client, {"input": "hi", "max_output_tokens": 1})[0] == 200


def test_the_store_is_a_bounded_lru():
    """At most max_items responses and max_bytes (each response's two JSON texts and ENTRY_BYTES); the least
    recently used go first, and one larger than the whole bound is not kept."""

    def entry(i: int, pad: int = 0) -> tuple[str, str]:
        return json.dumps({"id": f"r{i}"}), json.dumps([{"role": "user", "content": f"{i}" + "x" * pad}])

    def size(e: tuple[str, str]) -> int:
        return ENTRY_BYTES + len(e[0]) + len(e[1])

    small = size(entry(0))
    store = ResponseStore(max_items=3, max_bytes=3 * small + 10)
    for i in range(5):
        assert store.put(f"r{i}", *entry(i))
    assert list(store.entries) == ["r2", "r3", "r4"] and store.bytes == 3 * small
    assert json.loads(store.conversation("r2")) == [{"role": "user", "content": "2"}]  # (used: now the most recent)
    assert store.put("r5", *entry(5, pad=small))  # (two entries' room: r3 and r4, the least recently used, go)
    assert list(store.entries) == ["r2", "r5"] and store.bytes == 2 * small + small
    assert not store.put("huge", *entry(6, pad=3 * small)) and "huge" not in store.entries
    assert store.retrieve("r2") == {"id": "r2"}
    assert store.delete("r2") == {"id": "r2", "object": "response", "deleted": True} and store.bytes == 2 * small
    for gone in (lambda: store.retrieve("r2"), lambda: store.delete("r2")):
        with pytest.raises(ApiError) as e:
            gone()
        assert e.value.status == 404 and "r2" in str(e.value)
    with pytest.raises(ApiError) as e:
        store.conversation("r3")
    assert e.value.status == 400 and e.value.code == "previous_response_not_found"


def test_a_long_reply_builds_its_items_in_linear_time():
    """Items are built from pieces without copying what came before at every piece: a reply of 300,000
    pieces, most of them whitespace inside the reasoning, is read in seconds (and a shorter one as events too),
    and its reasoning keeps the whitespace between its words (not around them)."""
    import time
    from types import SimpleNamespace

    from llamacli.engine.generate import Completion
    from llamacli.serve.responses_api import Output, ResponseJob

    for n, stream in ((200_000, False), (20_000, True)):
        pieces = ["<think>", "\n", "a"] + [" "] * n + ["b", "\n"] * (n // 4) + ["</think>", "ok"]
        rjob = ResponseJob(SimpleNamespace(tools=None), "resp_1", 0, stream, None, "", {}, summary=stream)
        out, t0 = Output(rjob, Completion(), "tiny"), time.perf_counter()
        events = out.start() + "".join(out.feed(p) for p in pieces) + out.finish()
        assert time.perf_counter() - t0 < 8
        thought, message = out.final["output"]
        assert thought["content"][0]["text"] == "a" + " " * n + "b\n" * (n // 4 - 1) + "b"
        assert message["content"][0]["text"] == "ok" and bool(events) == stream
