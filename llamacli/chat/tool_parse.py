"""Tool calls in a model's answer text, read as it streams: CallParser (tool_reply.py puts the reasoning
splitters in front of it, and reads gpt-oss's harmony calls).

    answer text -> CallParser -> content + call events

The parser knows one ToolFormat (tool_format.py). In text it looks for what begins a call (the format's opening
marker, or a JSON object that begins the reply for Llama 3.x and the generic format) and holds back a tail that
may be the start of one; inside a call a reader for the format's kind reads the name (as soon as it is known: a
"call" event) and the arguments (JSON formats: each fragment as it arrives, an "args" event; XML and Gemma's
syntax: as JSON once the call is complete). How the text is cut into pieces never changes the result, and the
whole reply read at once gives what the pieces give, so a streamed reply and a whole one agree.

Events: ("content", text), ("call", index), ("args", index, text). `calls` holds every call begun (its name,
id, the arguments so far, whether it completed, and its raw text, which goes back to the content when a reply
ends inside a call).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Callable

from .json_scan import GemmaScan, JsonScan, gemma_to_json
from .splitter import partial_suffix
from .tool_format import ToolFormat

MAX_NAME = 256  # characters a call's name may take before the parser gives up on it
_ALNUM = string.ascii_letters + string.digits


@dataclass
class ToolCall:
    """One call: its arguments (JSON text as the model wrote it; XML and Gemma's syntax converted) and its raw
    text in the reply are kept in pieces (a long call, a file written through a tool, grows linearly)."""

    index: int
    id: str
    name: str
    complete: bool = False
    args_parts: list[str] = field(default_factory=list)
    raw_parts: list[str] = field(default_factory=list)

    @property
    def arguments(self) -> str:
        return "".join(self.args_parts)

    @property
    def raw(self) -> str:
        return "".join(self.raw_parts)


def new_call_id(short: bool = False) -> str:
    """A call id: nine letters and digits where the template demands it (Mistral), else OpenAI's call_ form."""
    if short:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + secrets.token_hex(12)


class CallParser:
    """Answer text -> content and calls, for one format. feed(text) and finish() return events."""

    def __init__(self, fmt: ToolFormat, schemas: dict[str, Any] | None = None,
                 new_id: Callable[[], str] | None = None):
        self.fmt, self.schemas = fmt, schemas or {}
        self.new_id = new_id or (lambda: new_call_id(fmt.short_ids))
        self.calls: list[ToolCall] = []
        self.buf = ""
        self.reader: _Reader | None = None
        self.spoken = False  # content other than whitespace has been given
        self.ws = ""  # whitespace at the end of the content so far, held back
        self.after_call = False  # a call ended and nothing but whitespace followed
        open_ = fmt.open.strip()
        self.triggers = tuple(t for t in ((open_,) if open_ else ()) + fmt.triggers if t)
        self.out: list[tuple] = []

    # -- driving ------------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[tuple]:
        self._run(final=True)
        if self.reader is not None:  # the reply ended inside a call
            reader, self.reader = self.reader, None
            if reader.call.index == -1:
                self._content(reader.opening + reader.call.raw)
        elif self.buf and not (self.after_call and not self.buf.strip()):
            self._content(self.buf)
        self.buf = ""
        return self._take()

    def _run(self, final: bool) -> None:
        while True:
            reader = self.reader
            if reader is not None:
                piece, self.buf = self.buf, ""
                reader.call.raw_parts.append(piece)
                rest = reader.feed(piece)
                if rest is None:
                    return
                self.reader, self.buf = None, rest
                if reader.call.index == -1:  # not a call after all: its opening and all it read are text
                    self.spoken, self.after_call = True, False
                    self._content(reader.opening)
                    self.buf = reader.call.raw
                    continue
                raw = reader.call.raw
                reader.call.raw_parts = [raw[: len(raw) - len(rest)]]
                self.after_call = True
                continue
            at, skip = self._trigger()
            if at is None:  # no call begins here: the text is content, but for a tail that may begin one
                if final:
                    return
                keep = self._held()
                if self.after_call and not self.buf[: len(self.buf) - keep].strip():
                    return
                self._content(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                return
            if at < 0:
                return
            self._content(self.buf[:at])
            opening, self.ws = self.ws + self.buf[at : at + skip], ""  # (the text a call that fails gives back)
            self.reader = _READERS[self.fmt.kind](self, opening)
            self.buf = self.buf[at + skip :]

    def _trigger(self) -> tuple[int | None, int]:
        """(where a call begins in buf, how much of it to skip), (None, 0) when no call begins in buf now, or
        (-1, 0) when the whole buffer must wait."""
        buf = self.buf
        if self.fmt.at_start and (not self.spoken or self.after_call):
            lead = len(buf) - len(buf.lstrip())
            if lead == len(buf):
                return -1, 0
            if buf[lead] == "{":
                return lead, 0
            if not self.after_call:
                self.spoken = True
        best, skip = None, 0
        for t in self.triggers:
            k = buf.find(t)
            if k >= 0 and (best is None or k < best):
                best, skip = k, len(t)
        return best, skip

    def _held(self) -> int:
        return max((partial_suffix(self.buf, t) for t in self.triggers), default=0)

    def _content(self, text: str) -> None:
        """Content, but for its trailing whitespace, which waits for more content (before a call, or at the
        end, it is dropped) and, after a call, its leading whitespace."""
        if self.after_call:
            text = text.lstrip()
        text = self.ws + text
        body = text.rstrip()
        self.ws = text[len(body) :]
        if body:
            self.spoken, self.after_call = True, False
            self.out.append(("content", body))

    def _take(self) -> list[tuple]:
        out, self.out = self.out, []
        return out

    # -- what readers report ------------------------------------------------------------------------------
    def start_call(self, name: str, raw: str = "") -> ToolCall:
        c = ToolCall(len(self.calls), self.new_id(), name, raw_parts=[raw])
        self.calls.append(c)
        self.out.append(("call", c.index))
        return c

    def args(self, call: ToolCall, text: str) -> None:
        if not call.args_parts:
            text = text.lstrip()
        if text:
            call.args_parts.append(text)
            self.out.append(("args", call.index, text))


# -- readers: one call of each kind ----------------------------------------------------------------------------


class _Reader:
    """feed(text) -> None while the call goes on, or the text after its end. `call` is the call once named (a
    placeholder with index -1 before, which collects the raw text: a reader that returns before naming its
    call found none, and everything it was fed goes back to the text)."""

    def __init__(self, parser: CallParser, opening: str):
        self.p, self.fmt, self.opening = parser, parser.fmt, opening
        self.call = ToolCall(-1, "", "")
        self.buf = ""

    def name(self, name: str) -> None:
        self.call = self.p.start_call(name, (self.opening if self.call.index == -1 else "") + self.call.raw)

    def _expect(self, marker: str) -> tuple[bool | None, str]:
        """Skip whitespace, then `marker` (its own whitespace stripped): (True, rest) when it is there, (None, '')
        while the buffer may still become it, (False, buf) when it is not."""
        need, text = marker.strip(), self.buf.lstrip()
        if not need:
            return True, self.buf
        if text.startswith(need):
            return True, text[len(need) :]
        if need.startswith(text):
            return None, ""
        return False, self.buf


class _JsonReader(_Reader):
    """A JSON call object, {"name": ..., "arguments": {...}} (or a list of them): the arguments stream as they
    come once the name is known (the first key, as llamacli's grammar writes it; another order goes out whole
    when the object closes)."""

    def __init__(self, parser: CallParser, opening: str):
        super().__init__(parser, opening)
        self.state = "object"
        self.head = re.compile(r'\s*\{\s*"' + re.escape(self.fmt.name_key) + r'"\s*:\s*"((?:[^"\\]|\\.){0,256})"'
                               r'\s*,\s*"' + re.escape(self.fmt.args_key) + r'"\s*:\s*')
        self._new_object()

    def _new_object(self) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.scan = JsonScan()
        self.args_scan: JsonScan | None = None
        self.args_done = False
        self.text = ""  # the whole object, once it closed

    def feed(self, text: str) -> str | None:
        self.buf += text
        while True:
            if self.state == "object":
                piece, self.buf = self.buf, ""
                end = self._object(piece)
                if end is None:
                    return None
                if end < 0 or not self._complete():
                    return piece  # not JSON, or no call
                self.buf = piece[end:]
                self.state = "between" if self.fmt.array else "close"
            elif self.state == "between":  # a list: ", {...}" or its end
                text = self.buf.lstrip()
                if not text:
                    return None
                if not text.startswith(","):
                    self.state = "close"
                    continue
                self.buf, self.state = text[1:], "object"
                self.call = ToolCall(-2, "", "")  # (-2: a later call of the list, not the reader's failure)
                self._new_object()
            else:
                found, rest = self._expect(self.fmt.close)
                return None if found is None else rest

    def _object(self, piece: str) -> int | None:
        """Read a piece of the object: the index in `piece` just past its end, None while it goes on, -1 when
        it cannot be JSON."""
        start = self.size
        self.parts.append(piece)
        self.size += len(piece)
        end = self.scan.feed(piece)
        if self.scan.error:
            return -1
        upto = len(piece) if end < 0 else end
        if self.args_scan is None and self.call.index < 0 and start < 1024:
            m = self.head.match("".join(self.parts))
            name = _json_string(m.group(1)) if m else None
            if name is not None:
                self.name(name)
                self.args_scan = JsonScan()
                self._args(piece[max(0, m.end() - start) : upto])
        elif self.args_scan is not None and not self.args_done:
            self._args(piece[:upto])
        if end >= 0:
            self.text = "".join(self.parts)[: start + end]
        return None if end < 0 else end

    def _args(self, text: str) -> None:
        stop = self.args_scan.feed(text)
        if stop >= 0:
            text, self.args_done = text[:stop], True
        self.p.args(self.call, text)

    def _complete(self) -> bool:
        """The object closed: a call when it holds a name (its arguments went out as they came, or go now)."""
        if self.args_scan is not None:
            self.call.complete = self.args_done
            return True
        try:
            value = json.loads(self.text)
        except (ValueError, RecursionError):
            value = None
        if not isinstance(value, dict) or not isinstance(value.get(self.fmt.name_key), str):
            return False
        args = value.get(self.fmt.args_key, {})
        if isinstance(args, str):  # arguments written as a JSON string
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                pass
        self.name(value[self.fmt.name_key])
        self.p.args(self.call, json.dumps(args, ensure_ascii=False))
        self.call.complete = True
        return True


def _json_string(body: str) -> str | None:
    try:
        value = json.loads('"' + body + '"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class _NameArgsReader(_Reader):
    """name, [id marker, id,] arguments marker, JSON arguments (streamed), close marker."""

    def __init__(self, parser: CallParser, opening: str):
        super().__init__(parser, opening)
        self.state = "name"
        self.scan = JsonScan()
        self.id_mark = (self.fmt.id_mid or "").strip()
        self.args_mark = self.fmt.args_mid.strip()

    def feed(self, text: str) -> str | None:
        self.buf += text
        while True:
            if self.state in ("name", "id"):
                marks = [m for m in ((self.id_mark,) if self.state == "name" else ()) + (self.args_mark,) if m]
                hits = sorted((self.buf.find(m), m) for m in marks if m in self.buf)
                if not hits:
                    return self.buf if len(self.buf) > MAX_NAME else None
                at, mark = hits[0]
                if self.state == "name":
                    self.name(self.buf[:at].strip())
                self.buf = self.buf[at + len(mark) :]
                self.state = "id" if mark == self.id_mark and self.state == "name" else "args"
            elif self.state == "args":
                piece, self.buf = self.buf, ""
                end = self.scan.feed(piece)
                if self.scan.error:
                    return piece
                self.p.args(self.call, piece if end < 0 else piece[:end])
                if end < 0:
                    return None
                self.call.complete, self.buf, self.state = True, piece[end:], "close"
            else:
                found, rest = self._expect(self.fmt.close)
                return None if found is None else rest


class _XmlReader(_Reader):
    """<function=name> then <parameter=key>value</parameter> blocks, then </function>: the arguments as one JSON
    object at the end, each value typed by the tool's schema (a string stays text; other types are read as
    JSON, and kept as text where they are not)."""

    def __init__(self, parser: CallParser, opening: str):
        super().__init__(parser, opening)
        self.state, self.args, self.key, self.value = "fn", {}, "", []
        fmt = self.fmt
        self.fn_open, self.fn_close = fmt.fn_open.strip(), fmt.fn_close.strip()
        self.param_open, self.param_close = fmt.param_open.strip(), fmt.param_close.strip()
        self.name_end, self.key_end = fmt.fn_name_end.strip() or ">", fmt.param_key_end.strip() or ">"
        self.value_tail = fmt.param_close[: len(fmt.param_close) - len(fmt.param_close.lstrip())]

    def feed(self, text: str) -> str | None:
        self.buf += text
        fmt = self.fmt
        while True:
            if self.state == "fn":
                found, rest = self._expect(fmt.fn_open)
                if found is None:
                    return None
                if found is False:
                    return self.buf
                self.buf, self.state = rest, "name"
            elif self.state in ("name", "key"):
                end = self.name_end if self.state == "name" else self.key_end
                at = self.buf.find(end)
                if at < 0:
                    return self.buf if len(self.buf) > MAX_NAME else None
                word = self.buf[:at].strip()
                self.buf = self.buf[at + len(end) :]
                if self.state == "name":
                    self.name(word)
                    self.state = "params"
                else:
                    self.key, self.state = word, "value"
            elif self.state == "params":
                text = self.buf.lstrip()
                if text.startswith(self.param_open):
                    self.buf, self.state = text[len(self.param_open) :], "key"
                elif text.startswith(self.fn_close):
                    self.p.args(self.call, json.dumps(self.args, ensure_ascii=False))
                    self.call.complete = True
                    self.buf, self.state = text[len(self.fn_close) :], "close"
                elif self.param_open.startswith(text) or self.fn_close.startswith(text):
                    return None
                else:
                    return self.buf
            elif self.state == "value":  # (kept in pieces: a value may be a whole file)
                at = self.buf.find(self.param_close)
                if at < 0:
                    keep = partial_suffix(self.buf, self.param_close)
                    self.value.append(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    return None
                self.value.append(self.buf[:at])
                raw = _drop_lead("".join(self.value), _after(fmt.param_key_end, self.key_end))
                self.value = []
                if self.value_tail and raw.endswith(self.value_tail):
                    raw = raw[: -len(self.value_tail)]
                self.args[self.key] = _typed(raw, self._schema(self.key))
                self.buf, self.state = self.buf[at + len(self.param_close) :], "params"
            else:
                found, rest = self._expect(fmt.close)
                return None if found is None else rest

    def _schema(self, key: str) -> Any:
        params = self.p.schemas.get(self.call.name)
        props = params.get("properties") if isinstance(params, dict) else None
        return props.get(key) if isinstance(props, dict) else None


class _GemmaReader(_Reader):
    """name{key:value,...} in Gemma's syntax: the arguments as JSON once the braces close."""

    def __init__(self, parser: CallParser, opening: str):
        super().__init__(parser, opening)
        self.state, self.scan, self.text = "name", GemmaScan(parser.fmt.quote), []

    def feed(self, text: str) -> str | None:
        self.buf += text
        while True:
            if self.state == "name":
                at = self.buf.find("{")
                if at < 0:
                    return self.buf if len(self.buf) > MAX_NAME else None
                self.name(self.buf[:at].strip())
                self.buf, self.state = self.buf[at:], "args"
            elif self.state == "args":
                piece, self.buf = self.buf, ""
                end = self.scan.feed(piece)
                if self.scan.error:
                    return piece
                self.text.append(piece if end < 0 else piece[:end])
                if end < 0:
                    return None
                try:
                    value = gemma_to_json("".join(self.text), self.fmt.quote)
                except (ValueError, RecursionError):
                    return piece[end:]
                self.p.args(self.call, json.dumps(value, ensure_ascii=False))
                self.call.complete, self.buf, self.state = True, piece[end:], "close"
            else:
                found, rest = self._expect(self.fmt.close)
                return None if found is None else rest


_READERS = {"json": _JsonReader, "generic": _JsonReader, "name_args": _NameArgsReader, "xml": _XmlReader,
            "gemma": _GemmaReader}


def _after(marker: str, core: str) -> str:
    """The whitespace a marker has after its core (">\\n" -> "\\n")."""
    at = marker.find(core)
    return marker[at + len(core) :] if at >= 0 else ""


def _drop_lead(text: str, lead: str) -> str:
    return text[len(lead) :] if lead and text.startswith(lead) else text


PYTHON_WORDS = {"True": True, "False": False, "None": None}  # how the templates' `| string` writes them


def _typed(raw: str, schema: Any) -> Any:
    """An XML parameter's value: text for a string, else the JSON it spells, or the Python word the template
    writes for a boolean or null (True, False, None); text where it is neither (Qwen3-Coder's own parser reads
    values the same way)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    if kinds == ["string"] or (isinstance(schema, dict) and isinstance(schema.get("enum"), list)
                               and all(isinstance(v, str) for v in schema["enum"])):
        return raw
    if raw.strip() in PYTHON_WORDS:
        return PYTHON_WORDS[raw.strip()]
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return raw
