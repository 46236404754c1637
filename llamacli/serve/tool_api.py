"""Tools in `/v1/chat/completions`: the request's tools read (chat/tools.py), the conversation rendered with them
through the model's template, the call constrained while it is generated (chat/tool_grammar.py, compiled by
sampling/structured.py), and the reply's calls written back as OpenAI's `tool_calls`, whole or as stream deltas
(chat/tool_parse.py). api.py and app.py call in here; nothing here knows HTTP.

    tool_choice none       the tools stay out of the prompt and nothing is parsed (earlier calls and results
                           in the conversation are still rendered)
    auto (the default)     the model may answer or call; once it begins a call, the call is held to the
                           grammar (a lazy grammar: free text until the format's opening marker)
    required / a function  the reply is a call (to that function), held to the grammar from its first token

Without llguidance (the structured extra), auto still parses what the model writes; required and a named
function need the grammar and are refused with 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..chat import tools as chat_tools
from ..chat.reasoning import OPEN, prompt_opens_think, reply_format
from ..chat.tool_format import ToolFormat, detect
from ..chat.tool_grammar import tool_grammar
from ..chat.tool_reply import ToolReply, parse_reply
from ..chat.tools import Tool, ToolChoice, ToolError
from ..errors import BadInputError


@dataclass
class ToolRequest:
    """What a request says about tools, checked."""

    tools: list[Tool]
    choice: ToolChoice
    parallel: bool


@dataclass
class ToolJob:
    """A request whose reply is parsed for calls."""

    fmt: ToolFormat
    request: ToolRequest
    constraint: Any = None

    @property
    def schemas(self) -> dict[str, Any]:
        return {t.name: t.parameters for t in self.request.tools}

    def run_kwargs(self) -> dict[str, Any]:
        """Model.run's: the format's control-token markers printed (Mistral's [TOOL_CALLS], Llama's
        <|python_tag|>), so that the parser sees them."""
        return {"keep_special": self.fmt.special_ids} if self.fmt.special_ids else {}


def read(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools, tool_choice and parallel_tool_calls (None when it has none of them)."""
    for name, fine in (("functions", (None, [])), ("function_call", (None, "none", "auto"))):
        if body.get(name) not in fine:
            raise ToolError(f"{name} (OpenAI's legacy function calling) is not supported: use tools and "
                            "tool_choice", name)
    if all(body.get(k) is None for k in ("tools", "tool_choice", "parallel_tool_calls")):
        return None
    tools = chat_tools.read_tools(body.get("tools"))
    return ToolRequest(tools, chat_tools.read_tool_choice(body.get("tool_choice"), tools),
                       chat_tools.read_parallel(body.get("parallel_tool_calls")))


def message_fields(m: dict[str, Any], where: str) -> dict[str, Any]:
    """A message's tool_calls, tool_call_id and name, checked (chat.tools.message_fields)."""
    return chat_tools.message_fields(m, where)


def template_input(model: Any, messages: list[dict[str, Any]], request: ToolRequest | None
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render: as they are when neither the request nor the conversation has tools."""
    if request is None and not any("tool_calls" in m or m.get("role") == "tool" for m in messages):
        return messages, None
    fmt = detect(model.chat_template, model.tokenizer)
    tools = request.tools if request else []
    show = request is not None and request.choice.mode != "none"
    return chat_tools.template_messages(messages, fmt, tools, show)


def job(model: Any, request: ToolRequest | None, ids: list[int]) -> ToolJob | None:
    """The parsing and the constraint for a request with tools (None for none, or tool_choice none)."""
    if request is None or request.choice.mode == "none" or not request.tools:
        return None
    fmt = detect(model.chat_template, model.tokenizer)
    return ToolJob(fmt, request, _constraint(model, fmt, request, ids))


def _constraint(model: Any, fmt: ToolFormat, request: ToolRequest, ids: list[int]) -> Any:
    forced = request.choice.forced
    try:
        from ..sampling import structured

        structured.require_llguidance()
    except (ImportError, BadInputError):
        if forced is None:
            return None  # auto: the reply is parsed, unconstrained
        raise ToolError("tool_choice required or a named function needs llguidance: pip install "
                        "'llamacli[structured]'", "tool_choice") from None
    tok = model.tokenizer
    tail = tok.decode(ids[-16:])
    if reply_format(tail) in ("harmony", "channel"):  # (gemma4: an optional thought block first)
        prefix = reply_format(tail)
    elif prompt_opens_think(tok.decode(ids[-8:])):
        prefix = "think_open"
    elif OPEN in (model.chat_template.text or "") and "</think>" not in tail:  # a <think> block may come first
        prefix = "think"
    else:
        prefix = "none"
    tools = [(t.name, t.parameters) for t in request.tools]
    text = tool_grammar(fmt, tools, forced=forced, parallel=request.parallel, prefix=prefix)
    try:
        return structured.constraint_for(model, structured.text_grammar(text))
    except BadInputError as exc:
        raise ToolError(f"the tools' schemas cannot be followed: {exc}", "tools") from None


# -- the answer --------------------------------------------------------------------------------------------


def call_entry(call: Any) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def fill_response(answer: dict[str, Any], tool_job: ToolJob, completion: Any, text: str) -> dict[str, Any]:
    """A whole chat answer (api.response's) with the reply read for calls: content, reasoning_content,
    tool_calls and the finish reason "tool_calls" when the model called (and was not cut off inside a call)."""
    reply = parse_reply(completion, tool_job.fmt, text, tool_job.schemas)
    choice = answer["choices"][0]
    message = choice["message"]
    message.pop("reasoning_content", None)
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    message["content"] = reply.content if reply.content or not reply.calls else None
    if reply.calls:
        message["tool_calls"] = [call_entry(c) for c in reply.calls]
        if completion.finish_reason != "length":
            choice["finish_reason"] = "tool_calls"
    return answer


class ToolStream:
    """The splitter app.py streams through for a request with tools: feed(piece) -> (reasoning, content) as
    the plain splitters give, and deltas() the tool_calls deltas since the last call of it."""

    def __init__(self, tool_job: ToolJob, completion: Any):
        self.reply = ToolReply(completion, tool_job.fmt, tool_job.schemas)
        self.events: list[tuple] = []

    def feed(self, piece: str) -> tuple[str, str]:
        think, content, events = self.reply.feed(piece)
        self.events += events
        return think, content

    def finish(self) -> tuple[str, str]:
        think, content, events = self.reply.finish()
        self.events += events
        return think, content

    def deltas(self) -> list[dict[str, Any]]:
        """OpenAI's tool_calls deltas: a call's id, type and name first, then its arguments in pieces."""
        out: list[dict[str, Any]] = []
        for event in self.events:
            call = self.reply.calls[event[1]]
            if event[0] == "call":
                out.append({"index": call.index, **call_entry(call)})
                out[-1]["function"] = {"name": call.name, "arguments": ""}
            elif out and out[-1]["index"] == call.index:
                out[-1]["function"]["arguments"] += event[2]
            else:
                out.append({"index": call.index, "function": {"arguments": event[2]}})
        self.events = []
        return out

    @property
    def called(self) -> bool:
        """The reply holds a complete call."""
        calls = self.reply.calls
        return any(c.complete for c in calls)
