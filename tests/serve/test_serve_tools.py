"""Tools are not supported yet (the agents' issue will add them): a request that offers tools, asks for a tool
call or carries a tool's turn gets a 400 saying so, not an answer that ignored them; the server stays up."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from test_serve import raw, start, stop  # noqa: E402

from llamacli.engine.generate import Model  # noqa: E402
from llamacli.serve.api import ApiError, read_job  # noqa: E402

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}

REFUSED = [
    ({"messages": USER, "tools": [TOOL]}, "tools"),
    ({"messages": USER, "tools": "weather"}, "tools"),
    ({"messages": USER, "functions": [TOOL["function"]]}, "functions"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tool_choice"),
    ({"messages": USER, "function_call": {"name": "weather"}}, "function_call"),
    ({"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}]}, "messages[1]"),
    ({"messages": USER + [{"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}, "messages[1]"),
]


@pytest.mark.parametrize("body, param", REFUSED)
def test_requests_with_tools_are_refused(body, param):
    with pytest.raises(ApiError) as info:
        read_job(None, body, chat=True)  # refused before the model is asked anything
    assert info.value.status == 400 and info.value.param == param
    assert "tools are not supported yet" in str(info.value)


@pytest.fixture(scope="module")
def tiny(random_model):
    with Model(random_model("tiny-llama"), backend="numpy", ctx=64) as model:
        yield model


def test_requests_without_tools_are_not_refused_for_them(tiny):
    """`tools: []` and tool_choice "none" or "auto" offer no tool: those requests are read as any other."""
    for extra in ({"tools": []}, {"tool_choice": "none"}, {"tool_choice": "auto"}, {"tools": None}):
        job = read_job(tiny, {"messages": USER, "max_tokens": 2, **extra}, chat=True)
        assert job.chat and job.ids and job.max_tokens == 2


def test_the_server_answers_400_and_stays_up(tiny):
    url, server, thread = start(tiny, "tiny")
    try:
        status, body = raw(url, "/v1/chat/completions", {"messages": USER, "tools": [TOOL], "max_tokens": 2},
                           key=None)
        assert status == 400 and body["error"]["message"] == "tools are not supported yet"
        assert body["error"]["param"] == "tools" and body["error"]["type"] == "invalid_request_error"
        status, body = raw(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 2}, key=None)
        assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    finally:
        stop(server, thread)
