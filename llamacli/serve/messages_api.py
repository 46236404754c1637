"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the engine that serves the
OpenAI routes. A request is checked in Anthropic's terms and translated into a chat completions body, which
api.read_job reads as it reads any other: the chat template, the tools and the grammar that holds a call to its
schema (tool_api.py), the thinking switch, stop strings, sampling and the context bound are theirs, not a copy.

    system: a string or text blocks       -> a system message (blocks joined by a blank line)
    messages, consecutive turns of one role merged (as Anthropic merges them):
      text blocks                         -> the turn's content
      thinking (redacted_thinking)        -> the assistant turn's reasoning, as templates read it (dropped)
      tool_use {id, name, input}          -> the assistant turn's tool_calls
      tool_result {tool_use_id, content, is_error}
                                          -> a tool turn ("Error: " before the text when is_error)
      image, document, server tools' blocks, anything else -> 400 naming the block
    tools [{name, description, input_schema}]           -> function tools (Anthropic's own tool types: 400)
    tool_choice auto | any | tool {name} | none         -> auto | required | a named function | none
      disable_parallel_tool_use                         -> parallel_tool_calls false
    thinking enabled | adaptive | disabled              -> enable_thinking true | true | false
    output_config {effort, format: {json_schema}}       -> reasoning_effort ("max" is "high"), response_format
    max_tokens (required), stop_sequences, temperature, top_p, top_k, stream: as chat completions take them
    cache_salt (vLLM's extension field, as chat completions take it: K/V reused only within one salt)

The reply goes through the splitters chat completions use (reasoning, text and calls: chat/tool_reply.py), and
Blocks turns what they give into content blocks, thinking, text and tool_use, each with its leading and trailing
whitespace dropped. A whole answer runs the same Blocks over the same pieces as a stream does, so a stream's
events put together are the whole answer. stop_reason: max_tokens, else tool_use (a complete call), else
stop_sequence (with the string), else end_turn. usage: the prompt's tokens the KV cache already held are
cache_read_input_tokens and input_tokens the rest, as Anthropic counts a prompt cache's reads. A thinking
block holds whatever reasoning the model wrote (gpt-oss reasons even with thinking disabled), its signature
empty: nothing signs it, and one sent back is taken as it comes. budget_tokens turns thinking on; the reasoning
is not cut at it (max_tokens bounds the whole answer). Where the template demands call ids of nine letters and
digits (Mistral's), the answer's tool_use ids are such, and other ids sent back are made such, the same way
each time, so that a call still pairs with its result.

A final assistant turn (a "prefill" for the model to continue) is refused: the template would close that turn
and open another. Errors have Anthropic's shape, {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..chat import tools as chat_tools
from ..chat.reasoning import make_splitter
from ..chat.tool_format import detect
from ..chat.tool_parse import ToolCall, new_call_id
from ..chat.tool_reply import ToolReply
from ..engine.generate import Completion
from ..textio import brief
from .api import MAX_STOP, ApiError, Job, api_error, cached_tokens, chat_prompt_ids, read_job

ROUTE = "/v1/messages"
ERROR_KINDS = ("invalid_request_error", "authentication_error", "permission_error", "not_found_error",
               "request_too_large", "rate_limit_error", "api_error", "overloaded_error")
USER_BLOCKS = ("text", "tool_result")
ASSISTANT_BLOCKS = ("text", "thinking", "redacted_thinking", "tool_use")
MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "high"}  # Anthropic's -> a template's
_SHORT_ID = re.compile(r"[A-Za-z0-9]{9}")


def is_route(path: str) -> bool:
    """Whether a request path is one of Anthropic's (its errors take Anthropic's shape)."""
    return path == ROUTE or path.startswith(ROUTE + "/")


def error_body(exc: ApiError) -> dict[str, Any]:
    """An ApiError in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = {413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}.get(exc.status, exc.kind)
    if kind not in ERROR_KINDS:
        kind = "api_error" if exc.status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": str(exc)}}


# -- reading a request ----------------------------------------------------------------------------------------


@dataclass
class MessagesJob:
    """A Messages request, checked: the chat Job that runs it and how its answer is written."""

    job: Job
    show_thinking: bool = True  # thinking.display "omitted": thinking blocks without their text

    def new_id(self) -> str:
        """A tool_use id: Anthropic's form, or the nine letters and digits a template demands (Mistral's)."""
        tools = self.job.tools
        return new_call_id(True) if tools is not None and tools.fmt.short_ids else "toolu_" + secrets.token_hex(12)


def read_request(model: Any, body: Any, chat: bool = True) -> MessagesJob:
    """A /v1/messages body as a MessagesJob, or an ApiError naming the field (engine.prepare's reader)."""
    chat_body, show = translate(model, body)
    job = read_job(model, chat_body, chat=True)
    job.id = "msg_" + uuid.uuid4().hex[:24]
    return MessagesJob(job, show)


def read_count(model: Any, body: Any, chat: bool = True) -> int:
    """The input tokens of a /v1/messages/count_tokens body (its prompt rendered and tokenized, nothing run)."""
    chat_body, _ = translate(model, body, counting=True)
    return len(chat_prompt_ids(model, chat_body))


def translate(model: Any, body: Any, counting: bool = False) -> tuple[dict[str, Any], bool]:
    """(the chat completions body, whether thinking text is shown) of a Messages body; `counting`: a
    count_tokens body (no max_tokens)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise ApiError("model must be a string")
    out: dict[str, Any] = {}
    if not counting:
        n = body.get("max_tokens")
        if n is None:
            raise ApiError("max_tokens is required (the most tokens the answer may take)")
        if not _is_int(n) or n < 1:
            raise ApiError(f"max_tokens must be an integer >= 1, got {brief(n)}")
        out["max_tokens"] = n
        for name in ("temperature", "top_p", "top_k", "stream", "cache_salt"):
            if body.get(name) is not None:
                out[name] = body[name]
        out["stop"] = _stop_sequences(body.get("stop_sequences"))
    tools = _tools(body.get("tools"))
    tool_uses = _conversation(body, out)
    if tools is not None:
        out["tools"] = tools
    _tool_choice(body.get("tool_choice"), tools, out)
    show = _thinking(body, out)
    if "response_format" in out and tools and out.get("tool_choice") != "none":
        raise ApiError("output_config.format cannot be combined with tools here (unless tool_choice is none)")
    if tool_uses:  # a template that demands nine-character ids (Mistral's) gets ids it takes
        _fit_ids(model, out["messages"])
    return out, show


def _conversation(body: dict[str, Any], out: dict[str, Any]) -> bool:
    """system and messages as chat messages in out["messages"]; whether the conversation has tool turns."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = system if isinstance(system, str) else _texts(system, "system")
        if text:
            messages.append({"role": "system", "content": text})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    turns: list[tuple[str, list[tuple[str, dict[str, Any]]]]] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{where} must be an object with a role and content")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise ApiError(f"{where}.role must be \"user\" or \"assistant\", got {brief(role)} (a system prompt "
                           "goes in the top-level system field)")
        blocks = _blocks(m.get("content"), role, where)
        if turns and turns[-1][0] == role:  # consecutive turns of one role are one turn, as Anthropic takes them
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks))
    if turns[-1][0] == "assistant":
        raise ApiError("the last message must be the user's: continuing an assistant turn (a prefill) is not "
                       "supported")
    for role, blocks in turns:
        messages.extend([_assistant(blocks)] if role == "assistant" else _user(blocks))
    out["messages"] = messages
    return any("tool_calls" in m or m["role"] == "tool" for m in messages)


def _blocks(content: Any, role: str, where: str) -> list[tuple[str, dict[str, Any]]]:
    """A message's content as (where, block) pairs, each block checked."""
    if isinstance(content, str):
        return [(where, {"type": "text", "text": content})]
    if not isinstance(content, list):
        raise ApiError(f"{where}.content must be a string or a list of content blocks")
    allowed = USER_BLOCKS if role == "user" else ASSISTANT_BLOCKS
    out = []
    for k, b in enumerate(content):
        w = f"{where}.content[{k}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if not isinstance(kind, str):
            raise ApiError(f"{w} must be a content block (an object with a type)")
        if kind in MEDIA_BLOCKS:
            raise ApiError(f"{w}: {kind} blocks are not supported: this server's models read text only")
        if kind not in allowed:
            if kind in USER_BLOCKS + ASSISTANT_BLOCKS:
                raise ApiError(f"{w}: a {kind} block belongs in {'an assistant' if role == 'user' else 'a user'} turn")
            raise ApiError(f"{w}: unknown or unsupported content block type {brief(kind)} (a {role} turn takes "
                           f"{', '.join(allowed)})")
        _check_block(kind, b, w)
        out.append((w, b))
    return out


def _check_block(kind: str, b: dict[str, Any], w: str) -> None:
    if kind == "text" and not isinstance(b.get("text"), str):
        raise ApiError(f"{w}.text must be a string")
    if kind == "thinking" and not isinstance(b.get("thinking"), str):
        raise ApiError(f"{w}.thinking must be a string")
    if kind == "tool_use":
        for key in ("id", "name"):
            if not isinstance(b.get(key), str) or not 0 < len(b[key]) <= 256:
                raise ApiError(f"{w}.{key} must be a string of 1 to 256 characters")
        args = b.get("input")
        if not isinstance(args, dict):
            raise ApiError(f"{w}.input must be an object (the tool's arguments)")
        if chat_tools.depth(args) > chat_tools.MAX_DEPTH:
            raise ApiError(f"{w}.input nests more than {chat_tools.MAX_DEPTH} levels deep")
    if kind == "tool_result":
        if not isinstance(b.get("tool_use_id"), str) or not 0 < len(b["tool_use_id"]) <= 256:
            raise ApiError(f"{w}.tool_use_id must be a string of 1 to 256 characters")
        if b.get("is_error") is not None and not isinstance(b["is_error"], bool):
            raise ApiError(f"{w}.is_error must be true or false")
        content = b.get("content")
        if content is not None and not isinstance(content, str):
            _texts(content, f"{w}.content")


def _texts(blocks: Any, where: str) -> str:
    """Text blocks' text, joined by a blank line (system, a tool result's content)."""
    if not isinstance(blocks, list):
        raise ApiError(f"{where} must be a string or a list of text blocks")
    out = []
    for k, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind in MEDIA_BLOCKS:
            raise ApiError(f"{where}[{k}]: {kind} blocks are not supported: this server's models read text only")
        if kind != "text" or not isinstance(b.get("text"), str):
            raise ApiError(f"{where}[{k}] must be a text block ({{\"type\": \"text\", \"text\": ...}})")
        out.append(b["text"])
    return "\n\n".join(out)


def _assistant(blocks: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    text = [b["text"] for _, b in blocks if b["type"] == "text"]
    thinking = [b["thinking"] for _, b in blocks if b["type"] == "thinking"]
    calls = [{"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}}
             for _, b in blocks if b["type"] == "tool_use"]
    m: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(text)}
    if thinking:
        m["reasoning_content"] = "\n\n".join(thinking)
    if calls:
        m["tool_calls"] = calls
    return m


def _user(blocks: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool turns, its text as a user turn, in their order."""
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for w, b in blocks:
        if b["type"] == "text":
            text.append(b["text"])
            continue
        if text:
            out.append({"role": "user", "content": "\n\n".join(text)})
            text = []
        content = b.get("content")
        result = content if isinstance(content, str) else "" if content is None else _texts(content, f"{w}.content")
        if b.get("is_error"):
            result = "Error: " + result
        out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
    if text or not out:
        out.append({"role": "user", "content": "\n\n".join(text)})
    return out


def _fit_ids(model: Any, messages: list[dict[str, Any]]) -> None:
    """Where the template demands call ids of nine letters and digits (Mistral's), any other id (a `toolu_`
    one from another server) becomes nine, the same for the same id, so that calls and results still pair up."""
    if not detect(model.chat_template, model.tokenizer).short_ids:
        return

    def short(i: str) -> str:
        if _SHORT_ID.fullmatch(i):
            return i
        digest = int.from_bytes(hashlib.sha256(i.encode("utf-8", "surrogatepass")).digest(), "big")
        letters = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
        return "".join(letters[(digest >> (6 * k)) % 62] for k in range(9))

    for m in messages:
        for c in m.get("tool_calls", ()):
            c["id"] = short(c["id"])
        if m["role"] == "tool":
            m["tool_call_id"] = short(m["tool_call_id"])


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Anthropic's tools as OpenAI function tools (read_tools checks the rest: count, duplicates)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ApiError("tools must be a list of {\"name\", \"description\", \"input_schema\"} objects")
    if len(value) > chat_tools.MAX_TOOLS:
        raise ApiError(f"tools holds {len(value)} tools; at most {chat_tools.MAX_TOOLS} are taken")
    out = []
    for i, t in enumerate(value):
        w = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ApiError(f"{w} must be an object with a name and an input_schema")
        if t.get("type") not in (None, "custom"):
            raise ApiError(f"{w}: {brief(t.get('type'))} is one of Anthropic's own tools, which this server does not "
                           "have; describe the tool with name, description and input_schema")
        name = t.get("name")
        if not isinstance(name, str) or not chat_tools.NAME.fullmatch(name):
            raise ApiError(f"{w}.name must be 1 to 128 letters, digits, '_', '-', '.' or ':'")
        if not isinstance(t.get("description", ""), (str, type(None))):
            raise ApiError(f"{w}.description must be a string")
        schema = t.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise ApiError(f"{w}.input_schema must be a JSON schema of an object ({{\"type\": \"object\", ...}})")
        if chat_tools.depth(schema) > chat_tools.MAX_DEPTH:
            raise ApiError(f"{w}.input_schema nests more than {chat_tools.MAX_DEPTH} levels deep")
        fn = {"name": name, **({"description": t["description"]} if t.get("description") else {}), "parameters": schema}
        out.append({"type": "function", "function": fn})  # (in the order OpenAI's clients send: templates show it)
    return out


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None, out: dict[str, Any]) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise ApiError("tool_choice must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"tool\", "
                       "\"name\": ...} or {\"type\": \"none\"}")
    names = {t["function"]["name"] for t in tools or ()}
    if kind in ("any", "tool") and not names:
        raise ApiError(f"tool_choice {kind} needs tools")
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or name not in names:
            raise ApiError(f"tool_choice names {brief(name, 140)}, which is not among the tools")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    no_parallel = value.get("disable_parallel_tool_use")
    if no_parallel is not None:
        if not isinstance(no_parallel, bool):
            raise ApiError("tool_choice.disable_parallel_tool_use must be true or false")
        if names:
            out["parallel_tool_calls"] = not no_parallel


def _thinking(body: dict[str, Any], out: dict[str, Any]) -> bool:
    """thinking and output_config into the chat body; whether thinking text is shown."""
    value, show, think = body.get("thinking"), True, None
    if value is not None:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in ("enabled", "adaptive", "disabled"):
            raise ApiError("thinking must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"adaptive\"} "
                           "or {\"type\": \"disabled\"}")
        budget = value.get("budget_tokens")
        if kind == "enabled" and (not _is_int(budget) or budget < 1):
            raise ApiError(f"thinking.budget_tokens must be an integer >= 1, got {brief(budget)}")
        display = value.get("display")
        if display not in (None, "summarized", "omitted"):
            raise ApiError("thinking.display must be \"summarized\" or \"omitted\"")
        think, show = kind != "disabled", display != "omitted"
        out["chat_template_kwargs"] = {"enable_thinking": think}
    config = body.get("output_config")
    if config is None:
        return show
    if not isinstance(config, dict):
        raise ApiError("output_config must be an object")
    effort = config.get("effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in EFFORTS:
            raise ApiError(f"output_config.effort must be one of {', '.join(EFFORTS)}, got {brief(effort)}")
        if think is not False:
            out["reasoning_effort"] = EFFORTS[effort]
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise ApiError("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}")
        out["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
    return show


def _stop_sequences(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_STOP or not all(isinstance(s, str) for s in value):
        raise ApiError(f"stop_sequences must be a list of at most {MAX_STOP} strings")
    return [s for s in value if s]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# -- the answer -----------------------------------------------------------------------------------------------


@dataclass
class _Block:
    kind: str  # "thinking", "text" or "tool_use"
    parts: list[str] = field(default_factory=list)
    call: ToolCall | None = None


class Blocks:
    """A reply's pieces -> Anthropic's content blocks: feed(piece) and finish() give the stream's block events
    (content_block_start, _delta, _stop) and `content()` the blocks so far. A thinking or text block opens at
    its first character that is not whitespace, and whitespace at its end waits for more text (dropped when the
    block ends), so however the reply is cut, the blocks come out the same."""

    def __init__(self, mj: MessagesJob, completion: Completion):
        tools = mj.job.tools
        self.reply = ToolReply(completion, tools.fmt, tools.schemas, mj.new_id) if tools is not None else None
        self.splitter = None if tools is not None else make_splitter(completion)
        self.show = mj.show_thinking
        self.blocks: list[_Block] = []
        self.open: _Block | None = None
        self.ws = ""  # whitespace held at the end of the open block
        self.events: list[dict[str, Any]] = []

    def feed(self, piece: str) -> list[dict[str, Any]]:
        if self.reply is not None:
            self._put(*self.reply.feed_events(piece))
        else:
            think, text = self.splitter.feed(piece)
            self._put(think, [("content", text)])
        return self._take()

    def finish(self) -> list[dict[str, Any]]:
        if self.reply is not None:
            self._put(*self.reply.finish_events())
        else:
            think, text = self.splitter.finish()
            self._put(think, [("content", text)])
        self._close()
        return self._take()

    @property
    def called(self) -> bool:
        """The reply holds a complete call."""
        return any(b.call is not None and b.call.complete for b in self.blocks)

    def content(self) -> list[dict[str, Any]]:
        return [_block_json(b, self.show, whole=True) for b in self.blocks]

    def _put(self, think: str, events: list[tuple]) -> None:
        if think:
            self._text("thinking", think)
        for e in events:
            if e[0] == "content":
                self._text("text", e[1])
            elif e[0] == "call":
                call = self.reply.calls[e[1]]
                self._close()
                self._start(_Block("tool_use", call=call))
            elif self.open is not None and self.open.call is self.reply.calls[e[1]]:  # ("args", index, text)
                self._delta({"type": "input_json_delta", "partial_json": e[2]})

    def _text(self, kind: str, text: str) -> None:
        if self.open is None or self.open.kind != kind:
            text = text.lstrip()
            if not text:
                return
            self._close()
            self._start(_Block(kind))
        body = text.rstrip()
        if body:
            body, self.ws = self.ws + body, text[len(body) :]
            self.open.parts.append(body)
            if kind == "text":
                self._delta({"type": "text_delta", "text": body})
            elif self.show:
                self._delta({"type": "thinking_delta", "thinking": body})
        else:
            self.ws += text

    def _start(self, block: _Block) -> None:
        self.blocks.append(block)
        self.open, self.ws = block, ""
        self.events.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                            "content_block": _block_json(block, self.show, whole=False)})

    def _delta(self, delta: dict[str, Any]) -> None:
        self.events.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})

    def _close(self) -> None:
        if self.open is not None:
            self.events.append({"type": "content_block_stop", "index": len(self.blocks) - 1})
            self.open, self.ws = None, ""

    def _take(self) -> list[dict[str, Any]]:
        out, self.events = self.events, []
        return out


def _block_json(b: _Block, show: bool, whole: bool) -> dict[str, Any]:
    """A block as the answer holds it (`whole`), or as its content_block_start opens it (empty)."""
    if b.kind == "tool_use":
        call = b.call
        return {"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call) if whole else {}}
    text = "".join(b.parts) if whole else ""
    if b.kind == "text":
        return {"type": "text", "text": text}
    return {"type": "thinking", "thinking": text if show else "", "signature": ""}


def _input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as an object ({} for a call cut off before its arguments were whole)."""
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(c: Completion, blocks: Blocks) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if blocks.called:
        return "tool_use", None
    if c.finish_reason == "stop" and c.stop_sequence is not None:
        return "stop_sequence", c.stop_sequence
    return "end_turn", None


def usage(job: Job, c: Completion | None = None) -> dict[str, int]:
    """The counts: the prompt's tokens that the KV cache held are cache reads (none known before the prefill)."""
    total = len(job.ids)
    cached = 0 if c is None else min(total, cached_tokens(c))
    return {"input_tokens": total - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": 0 if c is None else len(c.tokens)}


def message(mj: MessagesJob, model_name: str, c: Completion | None = None, blocks: Blocks | None = None
            ) -> dict[str, Any]:
    """The whole answer; without the completion and its blocks, the message as message_start opens it."""
    reason, sequence = stop_reason(c, blocks) if c is not None and blocks is not None else (None, None)
    return {"id": mj.job.id, "type": "message", "role": "assistant", "model": model_name,
            "content": blocks.content() if blocks is not None else [], "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage(mj.job, c)}


# -- the routes -----------------------------------------------------------------------------------------------


async def create(engine: Any, request: Request, read_body: Callable, log_done: Callable) -> Response:
    """POST /v1/messages: the whole message, or its events with "stream": true."""
    t0 = time.perf_counter()
    data, held = await read_body(engine, request)
    try:
        mj = await engine.prepare(data, True, read_request)
    finally:
        engine.large_bytes -= held
        del data
    engine.room()
    if mj.job.stream:
        return StreamingResponse(_events(engine, mj, request, t0, log_done), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    c = Completion()
    pieces = []
    async for piece in engine.pieces(mj.job, c, request):
        pieces.append(piece)
    log_done(engine, request, mj.job, c, t0)
    blocks = Blocks(mj, c)
    for piece in pieces:
        blocks.feed(piece)
    blocks.finish()
    return JSONResponse(message(mj, engine.name, c, blocks))


async def count_tokens(engine: Any, request: Request, read_body: Callable) -> Response:
    """POST /v1/messages/count_tokens: {"input_tokens": N}, the prompt rendered and counted."""
    data, held = await read_body(engine, request)
    try:
        n = await engine.prepare(data, True, read_count)
    finally:
        engine.large_bytes -= held
        del data
    return JSONResponse({"input_tokens": n})


async def _events(engine: Any, mj: MessagesJob, request: Request, t0: float, log_done: Callable
                  ) -> AsyncIterator[str]:
    """Anthropic's server-sent events: message_start, a ping, each block's start, deltas and stop, then
    message_delta (the stop reason and the counts) and message_stop. A failure after the headers went out is an
    error event."""
    c = Completion()
    blocks = None
    yield _sse({"type": "message_start", "message": message(mj, engine.name)})
    yield _sse({"type": "ping"})
    try:
        async for piece in engine.pieces(mj.job, c, request):
            if blocks is None:  # (made once the run began: the completion knows its reply format then)
                blocks = Blocks(mj, c)
            for event in blocks.feed(piece):
                yield _sse(event)
        if c.finish_reason == "disconnected":
            log_done(engine, request, mj.job, c, t0)
            return
        if blocks is None:
            blocks = Blocks(mj, c)
        for event in blocks.finish():
            yield _sse(event)
        reason, sequence = stop_reason(c, blocks)
        yield _sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(mj.job, c)})
        yield _sse({"type": "message_stop"})
    except Exception as exc:  # noqa: BLE001
        engine.log(f"error in a stream: {type(exc).__name__}: {exc}")
        yield _sse(error_body(api_error(exc)))
    log_done(engine, request, mj.job, c, t0)


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: " + json.dumps(event, ensure_ascii=False) + "\n\n"
