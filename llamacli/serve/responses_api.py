"""OpenAI's Responses API for `llamacli serve`: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.
No HTTP here (app.py does it) and no second copy of chat completions: a Responses request is translated into a
chat completions body and read by api.read_job, so the template, the tools and their grammars, the reasoning
split, structured output and every limit are those of /v1/chat/completions; the reply is then written back
as Responses output items, whole or as the API's streaming events.

    input: a string, or items     messages (user, system, developer (as system), assistant), function_call,
                                  function_call_output, reasoning; a run of reasoning, assistant message and
                                  function_call items is one assistant turn (reasoning_content, content,
                                  tool_calls), a function_call_output a tool turn
    + instructions                a system message in front (not carried over by previous_response_id)
    + previous_response_id        the stored conversation of that response, in front of the input
    tools, tool_choice, parallel_tool_calls, text.format, reasoning.effort, max_output_tokens, temperature,
    top_p, cache_salt (vLLM's)    -> tools, tool_choice, ..., response_format, reasoning_effort,
                                     max_completion_tokens, temperature, top_p, cache_salt (not repeated back)
    reply -> Output               reasoning item (the reasoning split's text as reasoning_text content, and as
                                  its summary when reasoning.summary asks), message item (output_text),
                                  function_call items (id, call_id, name, arguments), in the order they begin

A mistake names the Responses field (an error read_job reports about messages[k] names the input item that
began message k). Errors mid-stream are an `error` event and `response.failed`.

Stored responses (store, the default) live in this process's memory only, in ResponseStore: an LRU of at most
MAX_STORED responses and STORE_BYTES. Each is held as two ASCII JSON strings, the response and its whole
conversation (instructions apart), so what it holds is what it counts: parsed objects would cost several times
their text, and a conversation of many small items many times. The least recently used go first; a response
larger than the whole bound is not stored. An id not held (never stored, evicted, deleted, or from another
process) is a 400 for previous_response_id and a 404 for GET and DELETE.
"""

from __future__ import annotations

import json
import numbers
import re
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..chat import tools as chat_tools
from ..chat.reasoning import make_splitter
from ..chat.tool_reply import ToolReply
from ..errors import LlamacliError
from ..textio import brief
from .api import ApiError, Job, api_error, cached_tokens, read_job

MAX_STORED = 1000  # responses held for previous_response_id and GET
STORE_BYTES = 64 << 20  # their text at most (the conversations, counted whole for each response)
ENTRY_BYTES = 512  # what a stored response costs besides its two strings (the entry, its id, the LRU's link)
MAX_METADATA = 16  # metadata entries, as OpenAI: keys of up to 64 characters, values up to 512
SUMMARIES = ("auto", "concise", "detailed")
# Fields of OpenAI's API that this server cannot honour: refused rather than silently ignored.
UNSUPPORTED = {
    "background": "responses are generated while the request waits",
    "conversation": "this server has no Conversations API; use previous_response_id",
    "prompt": "this server keeps no prompt templates",
}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
OUTPUT_PARTS = {"input_text": "text", "output_text": "text"}
ITEM_KINDS = "message, function_call, function_call_output and reasoning items"


# -- the request ---------------------------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ApiError(f"the request body holds {name}, which JSON has no place for")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ApiError(f"the request body holds a number too large for a float: {text[:40]}")
    return value


# json.loads's options for a body: NaN and Infinity (which Python's json reads, and 1e999 becomes) refused, as
# the response repeats the request's tools and schemas, and JSON cannot write those numbers.
JSON_OPTIONS: dict[str, Any] = {"parse_constant": _no_constant, "parse_float": _finite}


@dataclass
class ResponseJob:
    """One Responses request, checked: the chat Job that runs it and what the answer repeats."""

    job: Job
    id: str
    created_at: int
    stream: bool
    store: "ResponseStore | None"  # where the finished response goes (store true)
    history: str  # the conversation, instructions apart, as JSON: what previous_response_id continues
    echo: dict[str, Any]  # the request's settings, as the response object repeats them
    summary: bool  # reasoning.summary asked for: the reasoning is its own summary (no summarizer here)


def read(model: Any, body: Any, store: "ResponseStore") -> ResponseJob:
    """A /v1/responses body as a ResponseJob, or an ApiError naming the field."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, False):
            raise ApiError(f"{name} is not supported: {why}", param=name)
    stream, keep = _flag(body, "stream", False), _flag(body, "store", True)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError("instructions must be a string", param="instructions")
    previous = body.get("previous_response_id")
    history: list[dict[str, Any]] = []
    before = "[]"
    if previous is not None:
        if not isinstance(previous, str):
            raise ApiError("previous_response_id must be a string", param="previous_response_id")
        before = store.conversation(previous)
        history = json.loads(before)
    new, origins = conversation(body.get("input"))
    if not history and not new:
        raise ApiError("input must be a non-empty string or list of items", param="input")
    chat, echo, summary = _settings(body)
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat["messages"] = system + history + new
    origins = ["instructions"] * len(system) + ["previous_response_id"] * len(history) + origins
    try:
        job = read_job(model, chat, chat=True)
    except (ApiError, LlamacliError) as exc:
        raise _renamed(api_error(exc), origins) from None
    job.id = "resp_" + secrets.token_hex(16)
    echo.update(_echo(chat, body.get("tool_choice")), instructions=instructions, previous_response_id=previous,
                store=keep,
                temperature=job.params.temperature, top_p=job.params.top_p,
                parallel_tool_calls=job.tools.request.parallel if job.tools else chat.get("parallel_tool_calls", True))
    return ResponseJob(job, job.id, job.created, stream, store if keep else None,
                       _joined(before, _ascii(new)) if keep else "", echo, summary)


def conversation(value: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """`input` as chat messages, and for each message the input item it began with ("input[3]")."""
    if value is None:
        return [], []
    if isinstance(value, str):
        return [{"role": "user", "content": value}], ["input"]
    if not isinstance(value, list):
        raise ApiError(f"input must be a string or a list of items, got {type(value).__name__}", param="input")
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    turn: dict[str, Any] | None = None  # the assistant turn being put together

    def begin(message: dict[str, Any], where: str) -> dict[str, Any]:
        messages.append(message)
        origins.append(where)
        return message

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(f"{where} must be an object (an item), got {type(item).__name__}", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise ApiError(f"{where}.role must be user, system, developer or assistant, got {brief(role)}",
                               param=f"{where}.role")
            text = _text(item.get("content"), f"{where}.content", TEXT_PARTS)
            if ROLES[role] != "assistant":
                turn = None
                begin({"role": ROLES[role], "content": text}, where)
                continue
            if turn is None or turn["content"] or "tool_calls" in turn:
                turn = begin({"role": "assistant", "content": ""}, where)
            turn["content"] = text
        elif kind == "reasoning":
            text = _text(item.get("content") or [], f"{where}.content", {"reasoning_text": "text"})
            summary = _parts(item.get("summary") or [], f"{where}.summary", {"summary_text": "text"})
            text = text or "\n\n".join(summary)
            if turn is None or turn["content"] or "tool_calls" in turn or "reasoning_content" in turn:
                turn = begin({"role": "assistant", "content": ""}, where)
            if text:
                turn["reasoning_content"] = text
        elif kind == "function_call":
            call = {"id": _call_id(item, where), "type": "function",
                    "function": {"name": _string(item, "name", where, 1, 256), "arguments": _arguments(item, where)}}
            if turn is None:
                turn = begin({"role": "assistant", "content": ""}, where)
            calls = turn.setdefault("tool_calls", [])
            if len(calls) == chat_tools.MAX_CALLS:
                raise ApiError(f"{where}: one assistant turn holds at most {chat_tools.MAX_CALLS} function calls",
                               param=where)
            calls.append(call)
        elif kind == "function_call_output":
            turn = None
            output = _text(item.get("output"), f"{where}.output", OUTPUT_PARTS)
            begin({"role": "tool", "tool_call_id": _call_id(item, where), "content": output}, where)
        else:
            hint = " (send the item itself, or use previous_response_id)" if kind == "item_reference" else ""
            raise ApiError(f"{where} has type {brief(kind)}: the input takes {ITEM_KINDS}{hint}", param=where)
    return messages, origins


def _text(content: Any, where: str, parts: dict[str, str]) -> str:
    """A string, or a list of text parts of the kinds in `parts` (type -> the key of its text), joined."""
    if isinstance(content, str):
        return content
    return "".join(_parts([] if content is None else content, where, parts))


def _parts(content: Any, where: str, parts: dict[str, str]) -> list[str]:
    """The texts of a list of text parts of the kinds in `parts`."""
    if not isinstance(content, list):
        raise ApiError(f"{where} must be a string or a list of text parts", param=where)
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = parts.get(kind) if isinstance(kind, str) else None
        if key is None or not isinstance(part.get(key), str):
            what = f"a {brief(kind)} part" if isinstance(kind, str) else "not a text part"
            raise ApiError(f"{where}[{k}] is {what}: only text is taken here ({', '.join(parts)})",
                           param=f"{where}[{k}]")
        out.append(part[key])
    return out


def _string(item: dict[str, Any], key: str, where: str, least: int, most: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not least <= len(value) <= most:
        raise ApiError(f"{where}.{key} must be a string of {least} to {most} characters", param=f"{where}.{key}")
    return value


def _call_id(item: dict[str, Any], where: str) -> str:
    return _string(item, "call_id", where, 1, 256)


def _arguments(item: dict[str, Any], where: str) -> str:
    args = item.get("arguments", "{}")
    if not isinstance(args, str):
        raise ApiError(f"{where}.arguments must be a JSON string", param=f"{where}.arguments")
    return args


def _settings(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """(the chat completions fields, the settings the response repeats, whether a reasoning summary is asked)."""
    chat: dict[str, Any] = {k: body[k] for k in ("temperature", "top_p", "parallel_tool_calls", "cache_salt")
                            if body.get(k) is not None}
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, float) and limit.is_integer():
            limit = int(limit)
        if not isinstance(limit, numbers.Integral) or isinstance(limit, bool) or limit < 1:
            raise ApiError(f"max_output_tokens must be an integer >= 1, got {brief(limit)}", param="max_output_tokens")
        chat["max_completion_tokens"] = int(limit)
    reasoning, summary = body.get("reasoning"), None
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise ApiError('reasoning must be an object ({"effort": ...})', param="reasoning")
        effort = reasoning.get("effort")
        if effort is not None:  # (read as chat completions reads reasoning_effort; "xhigh" is the most there is)
            chat["reasoning_effort"] = "high" if isinstance(effort, str) and effort.strip().lower() == "xhigh" else effort
        summary = reasoning.get("summary", reasoning.get("generate_summary"))
        if summary is not None and summary not in SUMMARIES:
            raise ApiError(f"reasoning.summary must be one of {', '.join(SUMMARIES)}", param="reasoning.summary")
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise ApiError('text must be an object ({"format": ...})', param="text")
    fmt = (text or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice, chat)
    echo = {"max_output_tokens": chat.get("max_completion_tokens"), "metadata": _metadata(body.get("metadata")),
            "reasoning": {"effort": reasoning.get("effort") if reasoning else None, "summary": summary},
            "truncation": "disabled", "user": None}
    return chat, echo, summary is not None


def _echo(chat: dict[str, Any], choice: Any) -> dict[str, Any]:
    """The text format, tool choice and tools as the response repeats them, once read_job has checked them: as
    read, never the request's own objects (whose other keys could hold anything)."""
    fmt = chat.get("response_format")
    text = {"type": "json_schema", **fmt["json_schema"]} if fmt and fmt["type"] == "json_schema" else \
        {"type": fmt["type"] if fmt else "text"}
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "name": choice["name"]}
    elif isinstance(choice, dict):  # allowed_tools
        choice = {"type": "allowed_tools", "mode": chat["tool_choice"],
                  "tools": [{"type": "function", "name": t["name"]} for t in choice["tools"]]}
    tools = []
    for tool in chat.get("tools") or []:
        fn = tool["function"]
        strict = fn.get("strict")
        tools.append({"type": "function", "name": fn["name"], "description": fn.get("description"),
                      "parameters": fn.get("parameters"), "strict": strict if isinstance(strict, bool) else None})
    return {"text": {"format": text}, "tool_choice": "auto" if choice is None else choice, "tools": tools}


def _format(fmt: Any) -> dict[str, Any]:
    """text.format as chat's response_format: text, json_object, or json_schema with the schema beside the type."""
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ApiError("text.format must be an object with a type", param="text.format")
    kind = fmt["type"]
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise ApiError(f"text.format type must be text, json_schema or json_object, got {brief(kind)}",
                       param="text.format")
    if not isinstance(fmt.get("schema"), (dict, bool)):
        raise ApiError("text.format.schema must be a JSON schema object", param="text.format.schema")
    name, strict = fmt.get("name"), fmt.get("strict")
    return {"type": "json_schema", "json_schema": {"name": name if isinstance(name, str) else None,
                                                   "schema": fmt["schema"],
                                                   "strict": strict if isinstance(strict, bool) else None}}


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Function tools ({"type": "function", "name", "description", "parameters", "strict"}) as chat's entries;
    chat/tools.py checks the rest (names, counts, schemas)."""
    if not isinstance(tools, list):
        raise ApiError('tools must be a list of {"type": "function", "name": ...} objects', param="tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            hosted = f" ({brief(kind)} is one of OpenAI's hosted tools, not served here)" if isinstance(kind, str) else ""
            raise ApiError(f'tools[{i}] must be a function tool: {{"type": "function", "name", "parameters"}}{hosted}',
                           param=f"tools[{i}]")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        if isinstance(tool.get("strict"), bool):
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, chat: dict[str, Any]) -> Any:
    """tool_choice in chat's form: a string as it is, {"type": "function", "name"} as chat's named function;
    allowed_tools keeps only the tools it lists, with its mode (auto or required)."""
    if not isinstance(choice, dict):
        return choice  # (chat/tools.py checks the string)
    kind = choice.get("type")
    if kind == "function":
        if not isinstance(choice.get("name"), str):
            raise ApiError('tool_choice {"type": "function"} must give the function\'s "name"', param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind == "allowed_tools":
        mode, allowed = choice.get("mode", "auto"), choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list) or not all(
                isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("name"), str)
                for t in allowed):
            raise ApiError('tool_choice allowed_tools takes a mode (auto or required) and tools: [{"type": '
                           '"function", "name": ...}]', param="tool_choice")
        names = {t["name"] for t in allowed}
        tools = chat.get("tools") or []
        known = {t["function"].get("name") for t in tools}
        for name in names - known:
            raise ApiError(f"tool_choice allowed_tools names {name[:130]!r}, which is not among the tools",
                           param="tool_choice")
        chat["tools"] = [t for t in tools if t["function"].get("name") in names]
        return mode
    raise ApiError(f'tool_choice must be none, auto, required, {{"type": "function", "name": ...}} or allowed_tools; '
                   f"got type {brief(kind)}", param="tool_choice")


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()):
        raise ApiError(f"metadata must be an object of at most {MAX_METADATA} strings (keys of up to 64 characters, "
                       "values up to 512)", param="metadata")
    return value


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be true or false, got {brief(value)}", param=name)
    return value


# What read_job calls a field, and what the Responses API calls it (longest first).
_RENAMES = (("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
            ("max_completion_tokens", "max_output_tokens"), ("reasoning_effort", "reasoning.effort"),
            ("messages", "input"))


def _renamed(err: ApiError, origins: list[str]) -> ApiError:
    """read_job's error in the Responses API's names: messages[k] as the input item that began message k."""

    def rename(text: str) -> str:
        text = re.sub(r"messages\[(\d+)\]", lambda m: origins[int(m[1])] if int(m[1]) < len(origins) else m[0], text)
        text = re.sub(r"tools\[(\d+)\]\.function\.", r"tools[\1].", text)
        for old, new in _RENAMES:
            text = text.replace(old, new)
        return text

    return ApiError(rename(str(err)), err.status, rename(err.param) if err.param else err.param, err.code, err.kind)


def _ascii(value: Any) -> str:
    """JSON text in ASCII (one byte a character, whatever the text: what the store counts is what it holds)."""
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"))


def _joined(first: str, second: str) -> str:
    """Two JSON lists' texts as the text of one list with the items of both."""
    if first == "[]" or second == "[]":
        return second if first == "[]" else first
    return first[:-1] + "," + second[1:]


# -- the answer ----------------------------------------------------------------------------------------------


class _Plain:
    """A reply without tools read as ToolReply reads one with them: (reasoning, [("content", text)])."""

    def __init__(self, completion: Any):
        self.splitter = make_splitter(completion)
        self.calls: list[Any] = []

    def feed_events(self, piece: str) -> tuple[str, list[tuple]]:
        think, answer = self.splitter.feed(piece)
        return think, [("content", answer)] * bool(answer)

    def finish_events(self) -> tuple[str, list[tuple]]:
        think, answer = self.splitter.finish()
        return think, [("content", answer)] * bool(answer)


class Output:
    """The reply as Responses output items, built as its text streams in: a reasoning item while the reasoning
    split gives reasoning, a message item while it gives answer text, a function_call item for each call, in
    the order they begin (an item closes when the next begins). With `stream`, feed() and finish() return the
    streaming events this makes (`event: TYPE` and `data: {...}` with its sequence_number); without, nothing, and
    response() is the whole answer. Both are made from the same pieces the same way, so a streamed reply
    reassembled is the whole one.

    Reasoning is given without the whitespace around it; answer text that is only whitespace opens no message;
    a reply with no item at all gets an empty message."""

    def __init__(self, rjob: ResponseJob, completion: Any, model_name: str):
        self.r, self.c, self.model_name = rjob, completion, model_name
        self.reply: Any = None  # made at the first piece, when the completion knows its reply format
        self.items: list[dict[str, Any]] = []
        self.texts: list[list[str]] = []  # each item's text (reasoning, output_text, arguments) in pieces
        self.calls: dict[int, int] = {}  # a call's index in the reply -> its item
        self.open: int | None = None  # the item taking text
        # Whitespace held back, in pieces (a reply of whitespace alone stays linear): at the end of the reasoning
        # so far (given if more reasoning follows), and answer text before a message has opened.
        self.held_think: list[str] = []
        self.held_text: list[str] = []
        self.reasoning_tokens = 0
        self.cut = False  # the reply ended at max_output_tokens (or a full context)
        self.seq = 0
        self.out: list[str] | None = [] if rjob.stream else None
        self.final: dict[str, Any] | None = None  # the finished response

    # -- driving -------------------------------------------------------------------------------------------
    def start(self) -> str:
        """The events before the first piece: response.created and response.in_progress."""
        self._emit("response.created", response=self.response("in_progress"))
        self._emit("response.in_progress", response=self.response("in_progress"))
        return self._flush()

    def feed(self, piece: str) -> str:
        self._take(*self._reader().feed_events(piece))
        return self._flush()

    def finish(self) -> str:
        """The end of the reply: the open item closed, the response made (and stored when asked), and its last
        event, response.completed or response.incomplete."""
        self._take(*self._reader().finish_events())
        self.cut = self.c.finish_reason == "length"
        self._close()
        if not self.items:
            self._open_message()
            self._close()
        status = "incomplete" if self.cut else "completed"
        final = self.response(status)
        if self.r.store is not None and self.c.finish_reason != "disconnected":
            self._store(final)
        self._emit(f"response.{status}", response=final)
        self.final = final
        return self._flush()

    def fail(self, err: ApiError) -> str:
        """A failure after the events began: an `error` event, then response.failed."""
        self._emit("error", code=err.code, message=str(err), param=err.param)
        failed = self.response("failed")
        failed["error"] = {"code": err.code or "server_error", "message": str(err)}
        self._emit("response.failed", response=failed)
        return self._flush()

    def _reader(self) -> Any:
        if self.reply is None:
            tools = self.r.job.tools
            self.reply = ToolReply(self.c, tools.fmt, tools.schemas) if tools else _Plain(self.c)
        return self.reply

    def _take(self, think: str, events: list[tuple]) -> None:
        if think:
            self._think(think)
            self.reasoning_tokens = len(self.c.tokens)
        for event in events:
            if event[0] == "content":
                self._text(event[1])
            elif event[0] == "call":
                self._call(event[1])
            else:
                self._args(event[1], event[2])

    # -- items ---------------------------------------------------------------------------------------------
    def _current(self, kind: str) -> int | None:
        return self.open if self.open is not None and self.items[self.open]["type"] == kind else None

    def _begin(self, item: dict[str, Any]) -> int:
        self._close()
        self.items.append(item)
        self.texts.append([])
        self.open = len(self.items) - 1
        self._emit("response.output_item.added", output_index=self.open, item=item)
        return self.open

    def _think(self, text: str) -> None:
        at = self._current("reasoning")
        if at is None:
            text = text.lstrip()
            if not text:
                return
            at = self._begin({"id": _item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                              "status": "in_progress"})
            self._part("response.content_part.added", at, {"type": "reasoning_text", "text": ""})
            if self.r.summary:
                self._summary_part("response.reasoning_summary_part.added", at, "")
        body = text.rstrip()
        if not body:
            self.held_think.append(text)
            return
        body, self.held_think = "".join(self.held_think) + body, [text[len(body):]]
        self.texts[at].append(body)
        self._emit("response.reasoning_text.delta", item_id=self.items[at]["id"], output_index=at, content_index=0,
                   delta=body)
        if self.r.summary:
            self._emit("response.reasoning_summary_text.delta", item_id=self.items[at]["id"], output_index=at,
                       summary_index=0, delta=body)

    def _text(self, text: str) -> None:
        at = self._current("message")
        if at is None:
            if not text.strip():
                self.held_text.append(text)
                return
            text, self.held_text = "".join(self.held_text) + text, []
            at = self._open_message()
        self.texts[at].append(text)
        self._emit("response.output_text.delta", item_id=self.items[at]["id"], output_index=at, content_index=0,
                   delta=text, logprobs=[])

    def _open_message(self) -> int:
        at = self._begin({"id": _item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                          "content": []})
        self._part("response.content_part.added", at, _output_text(""))
        return at

    def _call(self, index: int) -> None:
        call = self.reply.calls[index]
        self.held_text = []
        self.calls[index] = self._begin({"id": _item_id("fc"), "type": "function_call", "status": "in_progress",
                                         "call_id": call.id, "name": call.name, "arguments": ""})

    def _args(self, index: int, text: str) -> None:
        at = self.calls.get(index)
        if at is not None:
            self.texts[at].append(text)
            self._emit("response.function_call_arguments.delta", item_id=self.items[at]["id"], output_index=at,
                       delta=text)

    def _close(self) -> None:
        """The open item done: its text in place, its status, and the events that end it."""
        if self.open is None:
            return
        at, self.open = self.open, None
        item, text = self.items[at], "".join(self.texts[at])
        ended = "incomplete" if self.cut else "completed"
        if item["type"] == "reasoning":
            self.held_think = []
            self._emit("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0, text=text)
            item["content"] = [self._part("response.content_part.done", at, {"type": "reasoning_text", "text": text})]
            if self.r.summary:
                self._emit("response.reasoning_summary_text.done", item_id=item["id"], output_index=at,
                           summary_index=0, text=text)
                item["summary"] = [self._summary_part("response.reasoning_summary_part.done", at, text)]
        elif item["type"] == "message":
            self._emit("response.output_text.done", item_id=item["id"], output_index=at, content_index=0, text=text,
                       logprobs=[])
            item["content"] = [self._part("response.content_part.done", at, _output_text(text))]
        else:
            item["arguments"] = text
            self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=at, arguments=text)
            index = next(k for k, v in self.calls.items() if v == at)
            ended = "completed" if self.reply.calls[index].complete else "incomplete"
        item["status"] = ended
        self._emit("response.output_item.done", output_index=at, item=item)

    def _part(self, kind: str, at: int, part: dict[str, Any]) -> dict[str, Any]:
        self._emit(kind, item_id=self.items[at]["id"], output_index=at, content_index=0, part=part)
        return part

    def _summary_part(self, kind: str, at: int, text: str) -> dict[str, Any]:
        part = {"type": "summary_text", "text": text}
        self._emit(kind, item_id=self.items[at]["id"], output_index=at, summary_index=0, part=part)
        return part

    # -- the response --------------------------------------------------------------------------------------
    def response(self, status: str) -> dict[str, Any]:
        """The response object: `in_progress` (no output yet), `completed`, `incomplete` or `failed`."""
        r, c = self.r, self.c
        done = status in ("completed", "incomplete")
        obj: dict[str, Any] = {
            "id": r.id, "object": "response", "created_at": r.created_at, "status": status, "background": False,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model_name, **r.echo, "output": [dict(item) for item in self.items] if done else [],
            "usage": None,
        }
        if done:
            prompt, out = len(c.prompt_tokens), len(c.tokens)
            obj["completed_at"] = int(time.time()) if status == "completed" else None
            obj["usage"] = {"input_tokens": prompt,
                            "input_tokens_details": {"cached_tokens": cached_tokens(c)},
                            "output_tokens": out, "output_tokens_details": {
                                "reasoning_tokens": min(self.reasoning_tokens, out)},
                            "total_tokens": prompt + out}
        return obj

    def _store(self, final: dict[str, Any]) -> None:
        """The response kept for GET and previous_response_id, with the conversation so far: the request's (its
        instructions apart) and the reply as an assistant turn (calls cut short left out)."""
        done = [item for item in final["output"] if item.get("status") != "incomplete" or item["type"] != "function_call"]
        try:
            reply, _ = conversation(done)
        except ApiError:  # (a call whose name no later request could send back: nothing to continue from)
            return
        self.r.store.put(self.r.id, _ascii(final), _joined(self.r.history, _ascii(reply)))

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.out is not None:
            event = {"type": kind, "sequence_number": self.seq, **fields}
            self.seq += 1
            self.out.append(f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n")

    def _flush(self) -> str:
        if not self.out:
            return ""
        text, self.out = "".join(self.out), []
        return text


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# -- stored responses ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stored:
    response: str  # JSON, ASCII
    history: str  # the conversation's messages: a JSON list, ASCII

    @property
    def size(self) -> int:
        return ENTRY_BYTES + len(self.response) + len(self.history)


class ResponseStore:
    """Finished responses by id, for GET /v1/responses/{id} and previous_response_id: an LRU of at most
    `max_items` responses and `max_bytes` of counted size (see the module's docstring). Thread-safe: requests are
    read on the preparing lanes and finished on the event loop."""

    def __init__(self, max_items: int | None = None, max_bytes: int | None = None):
        self.max_items = MAX_STORED if max_items is None else max_items
        self.max_bytes = STORE_BYTES if max_bytes is None else max_bytes
        self.entries: OrderedDict[str, _Stored] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, rid: str, response: str, history: str) -> bool:
        """Keep a response and its conversation (JSON texts, ASCII; False: larger than the whole store, not
        kept); the least recently used make room."""
        entry = _Stored(response, history)
        size = entry.size
        with self.lock:
            if size > self.max_bytes:
                return False
            old = self.entries.pop(rid, None)
            if old is not None:
                self.bytes -= old.size
            self.entries[rid] = entry
            self.bytes += size
            while len(self.entries) > self.max_items or self.bytes > self.max_bytes:
                _, gone = self.entries.popitem(last=False)
                self.bytes -= gone.size
            return True

    def _get(self, rid: str) -> _Stored | None:
        with self.lock:
            entry = self.entries.get(rid)
            if entry is not None:
                self.entries.move_to_end(rid)
            return entry

    def conversation(self, rid: str) -> str:
        """The stored conversation of `rid` (a JSON list of chat messages), or a 400 for previous_response_id."""
        entry = self._get(rid)
        if entry is None:
            raise ApiError(f"previous_response_id: {self._not_held(rid)}", 400, "previous_response_id",
                           "previous_response_not_found")
        return entry.history

    def retrieve(self, rid: str) -> dict[str, Any]:
        entry = self._get(rid)
        if entry is None:
            raise ApiError(self._not_held(rid), 404, kind="invalid_request_error")
        return json.loads(entry.response)

    def delete(self, rid: str) -> dict[str, Any]:
        with self.lock:
            entry = self.entries.pop(rid, None)
            if entry is not None:
                self.bytes -= entry.size
        if entry is None:
            raise ApiError(self._not_held(rid), 404, kind="invalid_request_error")
        return {"id": rid, "object": "response", "deleted": True}

    def _not_held(self, rid: str) -> str:
        return (f"no response with id {brief(rid, 80)} is held by this server (never stored, deleted, or evicted: "
                f"it keeps the last {self.max_items} responses, {self.max_bytes >> 20} MiB of them at most)")
