"""Tools in a chat request, as OpenAI's chat completions take them, checked and made ready for the template.

    tools                [{"type": "function", "function": {"name", "description", "parameters"}}, ...]
    tool_choice          "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls  true (default) | false
    messages             an assistant turn's "tool_calls" ([{"id", "type", "function": {"name", "arguments"}}])
                         and "tool" turns ({"role": "tool", "tool_call_id", "content"})

Messages reach the template as transformers' apply_chat_template passes them: a call's arguments as an object
(clients send them as a JSON string; templates write them with `tojson`), `tool_calls` only on turns that have
some (Llama's template takes the key's presence for a call), a tool turn's `name` filled in from the call it
answers. A template that cannot show tools or calls (tool_format "generic") gets them as text instead: a system
message that lists the tools and says how to call one, calls as the JSON objects the model is asked to write,
results as user turns.

Everything here is checked before any of it reaches a template or a grammar: shapes, names, counts, and the
nesting depth of schemas and arguments (the template's data conversion and llguidance both recurse).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import BadInputError
from .tool_format import ToolFormat

MAX_TOOLS = 256  # tools in one request (OpenAI takes 128; agents with many MCP servers send more)
MAX_CALLS = 128  # calls in one assistant turn
MAX_DEPTH = 64  # objects and lists inside one another in a schema or a call's arguments
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # OpenAI's rule ([a-zA-Z0-9_-]{1,64}), plus '.' and ':' (MCP)
CHOICES = ("none", "auto", "required")


class ToolError(BadInputError):
    """A tools field that is not what OpenAI's API takes; `param` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # its JSON schema (an empty object's when none was given)
    entry: dict[str, Any]  # as the client sent it: what the template shows


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None

    @property
    def forced(self) -> str | None:
        """What the grammar forces: None (auto), "required", or the tool's name."""
        return None if self.mode == "auto" else "required" if self.mode == "required" else self.name


def read_tools(value: Any) -> list[Tool]:
    """The request's `tools` ([] for none or an empty list)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects", "tools")
    if len(value) > MAX_TOOLS:
        raise ToolError(f"tools holds {len(value)} tools; at most {MAX_TOOLS} are taken", "tools")
    tools, seen = [], set()
    for i, entry in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(entry, dict) or entry.get("type", "function") != "function":
            raise ToolError(f"{where} must be an object with type \"function\"", where)
        fn = entry.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function must be an object with a name", where)
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolError(f"{where}.function.name must be 1 to 128 letters, digits, '_', '-', '.' or ':'", where)
        if name in seen:
            raise ToolError(f"{where}: two tools are named {name!r}", where)
        seen.add(name)
        if not isinstance(fn.get("description", ""), (str, type(None))):
            raise ToolError(f"{where}.function.description must be a string", where)
        params = fn.get("parameters")
        if params is None:  # a function without parameters: its arguments are {}
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object", where)
        if depth(params) > MAX_DEPTH:
            raise ToolError(f"{where}.function.parameters nests more than {MAX_DEPTH} levels deep", where)
        tools.append(Tool(name, params, {"type": "function", "function": fn}))
    return tools


def read_tool_choice(value: Any, tools: list[Tool]) -> ToolChoice:
    """The request's `tool_choice` (default: auto with tools, none without)."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in CHOICES:
            raise ToolError(f"tool_choice must be one of {', '.join(CHOICES)} or a named function, got {value!r}"[:300],
                            "tool_choice")
        if value == "required" and not tools:
            raise ToolError("tool_choice \"required\" needs tools", "tool_choice")
        return ToolChoice(value if tools else "none")
    fn = value.get("function") if isinstance(value, dict) and value.get("type", "function") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}}", "tool_choice")
    if name not in {t.name for t in tools}:
        raise ToolError(f"tool_choice names {name[:130]!r}, which is not among the tools", "tool_choice")
    return ToolChoice("named", name)


def read_parallel(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    return value


def message_fields(m: dict[str, Any], where: str) -> dict[str, Any]:
    """A message's tool fields as the template takes them: `tool_calls` (checked, arguments as objects where
    they are JSON objects), `tool_call_id` and `name`."""
    out: dict[str, Any] = {}
    if m.get("function_call") is not None or m.get("role") == "function":
        raise ToolError(f"{where}: OpenAI's legacy function calling is not supported (use tool_calls and role "
                        "tool)", where)
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or len(calls) > MAX_CALLS:
            raise ToolError(f"{where}.tool_calls must be a list of at most {MAX_CALLS} calls", where)
        normal = [_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
        if normal:
            out["tool_calls"] = normal
    for key in ("tool_call_id", "name"):
        value = m.get(key)
        if value is not None:
            if not isinstance(value, str) or len(value) > 256:
                raise ToolError(f"{where}.{key} must be a string of at most 256 characters", where)
            out[key] = value
    return out


def _call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or len(fn["name"]) > 256:
        raise ToolError(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                        where)
    call_id = c.get("id")
    if call_id is not None and (not isinstance(call_id, str) or len(call_id) > 256):
        raise ToolError(f"{where}.id must be a string of at most 256 characters", where)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, dict) and depth(parsed) <= MAX_DEPTH:
            args = parsed
    elif not isinstance(args, dict):
        raise ToolError(f"{where}.function.arguments must be a JSON string or an object", where)
    elif depth(args) > MAX_DEPTH:
        raise ToolError(f"{where}.function.arguments nests more than {MAX_DEPTH} levels deep", where)
    return {"id": call_id or "", "type": "function", "function": {"name": fn["name"], "arguments": args}}


def depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deep lists and objects nest in `value` (a loop; stops counting past `limit`)."""
    stack, deepest = [(value, 1)], 0
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


# -- what the template gets ------------------------------------------------------------------------------------

GENERIC_PROMPT = (
    "You can call these functions (each with a JSON schema of its arguments):\n{tools}\n\n"
    "To call one, answer with only this JSON object and nothing else:\n"
    '{{"name": <the function\'s name>, "arguments": <an object of its arguments>}}\n'
    "{several}Otherwise answer as usual."
)


def template_messages(messages: list[dict[str, Any]], fmt: ToolFormat, tools: list[Tool],
                      show_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the template: tool turns named after the calls they answer, and for a template that
    cannot show tools or calls (fmt.kind "generic") both written as text. `show_tools` False (tool_choice
    none) keeps the tools out of the prompt."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        for c in m.get("tool_calls", ()):
            if c["id"]:
                names[c["id"]] = c["function"]["name"]
        if m.get("role") == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
        out.append(m)
    entries = [t.entry for t in tools] if show_tools and tools else None
    if fmt.kind != "generic":
        return out, entries
    return _as_text(out, tools if entries else [], fmt.parallel, fmt.system_role), None


def _as_text(messages: list[dict[str, Any]], tools: list[Tool], several: bool, system_role: bool
             ) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if m.get("tool_calls"):
            calls = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                ensure_ascii=False) for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        if role == "tool":
            role, content = "user", json.dumps({"tool_response": {"name": m.get("name", ""), "content": content}},
                                               ensure_ascii=False)
        plain = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id", "name")}
        plain.update(role=role, content=content)
        if out and out[-1]["role"] == role == "user":  # two user turns in a row: one (some templates refuse two)
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + content}
        else:
            out.append(plain)
    if tools:
        listing = "\n".join(json.dumps({"name": t.name, "description": t.entry["function"].get("description") or "",
                                        "parameters": t.parameters}, ensure_ascii=False) for t in tools)
        prompt = GENERIC_PROMPT.format(tools=listing, several="To call several, write one object per line.\n"
                                       if several else "")
        first = next((i for i, m in enumerate(out) if m.get("role") in ("system", "user")), None)
        if first is not None and (out[first]["role"] == "system" or not system_role):
            out[first] = {**out[first], "content": prompt + "\n\n" + (out[first].get("content") or "")}
        else:  # (a template without a system role gets the prompt in front of the first user turn)
            out.insert(0, {"role": "system", "content": prompt})
    return out
