"""Where a JSON value ends in text that arrives a piece at a time, without parsing it (tool-call arguments while
they stream: tool_parse.py), and Gemma's call syntax read into JSON.

Written here: the standard json module parses whole documents only, and a streamed call must know where its
arguments end before they are complete (to send each fragment once, and to tell the arguments from the text
that closes the call). The scan is linear in the text and keeps a few integers of state; nesting is counted,
not recursed into, so no input can exhaust the stack.
"""

from __future__ import annotations

import json
import re
from typing import Any

_SCALAR_END = re.compile(r"[\s,:\]\}\[\{\"]")  # what ends a number or a literal (true, false, null)
_STRING_STOP = re.compile(r'["\\]')


class JsonScan:
    """feed(text) -> the index in `text` just past the end of the JSON value that began at the first text fed
    (leading whitespace allowed), or -1 while it has not ended. After the end, feed() keeps returning 0 (the
    value ended before this text). `error` is set when the text cannot be JSON (a stray closing bracket or a
    value that begins with something JSON never begins with); feed() returns -1 then."""

    def __init__(self) -> None:
        self.depth = 0  # open objects and arrays
        self.started = False
        self.in_string = False
        self.escape = False
        self.scalar = False  # inside a number or literal at depth 0
        self.done = False
        self.error = False

    def feed(self, text: str) -> int:
        if self.done:
            return 0
        if self.error:
            return -1
        i, n = 0, len(text)
        while i < n:
            if self.in_string:
                if self.escape:
                    self.escape, i = False, i + 1
                    continue
                m = _STRING_STOP.search(text, i)
                if m is None:
                    return -1
                i = m.end()
                if m.group() == "\\":
                    self.escape = True
                    continue
                self.in_string = False
                if self.depth == 0:  # a string at the top level: the value itself
                    self.done = True
                    return i
                continue
            if self.scalar:
                m = _SCALAR_END.search(text, i)
                if m is None:
                    return -1
                self.done = True
                return m.start()
            ch = text[i]
            if not self.started:
                if ch.isspace():
                    i += 1
                    continue
                self.started = True
                if ch not in '{["-0123456789tfn':
                    self.error = True
                    return -1
                if ch not in '{["':
                    self.scalar = True
                    continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth < 0:
                    self.error = True
                    return -1
                if self.depth == 0:
                    self.done = True
                    return i + 1
            i += 1
        return -1


def json_end(text: str, start: int = 0) -> int:
    """The end of the JSON value at text[start:] (leading whitespace allowed), or -1."""
    at = JsonScan().feed(text[start:])
    return start + at if at >= 0 else -1


# -- Gemma's call syntax -------------------------------------------------------------------------------------
# Gemma 4 (and FunctionGemma) write a call's arguments as `{key:value,...}` with bare keys, strings between two
# quote tokens (<|"|>, or <escape>) and numbers, booleans, lists and objects as in JSON: the template's
# format_argument macro. The quote token is the one the template writes, found when the format is detected.

MAX_GEMMA_DEPTH = 64  # nesting of lists and objects in one call's arguments


class GemmaScan:
    """JsonScan's interface for Gemma's syntax: where a `{...}` that began at the first text fed ends (strings
    between `quote` tokens are stepped over)."""

    def __init__(self, quote: str):
        self.quote, self.depth, self.in_string, self.done, self.error = quote, 0, False, False, False
        self.started = False
        self.tail = ""  # the end of the previous piece, which may begin a quote token

    def feed(self, text: str) -> int:
        if self.done:
            return 0
        if self.error:
            return -1
        buf, base = self.tail + text, len(self.tail)
        i = 0
        while i < len(buf):
            if buf.startswith(self.quote, i):
                self.in_string = not self.in_string
                i += len(self.quote)
                continue
            if len(buf) - i < len(self.quote) and self.quote.startswith(buf[i:]):
                self.tail = buf[i:]
                return -1
            ch = buf[i]
            if not self.in_string:
                if not self.started:
                    if ch.isspace():
                        i += 1
                        continue
                    self.started = True
                    if ch != "{":
                        self.error = True
                        return -1
                if ch in "{[":
                    self.depth += 1
                elif ch in "}]":
                    self.depth -= 1
                    if self.depth == 0:
                        self.done = True
                        return i + 1 - base
            i += 1
        self.tail = ""
        return -1


def gemma_to_json(text: str, quote: str) -> Any:
    """The value of Gemma's `{key:value,...}` text as Python data (ValueError when it is not that syntax)."""
    value, at = _gemma_value(text, 0, quote, 0)
    if text[at:].strip():
        raise ValueError("text after the value")
    return value


_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_KEY = re.compile(r"\s*([^\s:{}\[\],]+)\s*:")


def _gemma_value(text: str, i: int, quote: str, depth: int) -> tuple[Any, int]:
    if depth > MAX_GEMMA_DEPTH:
        raise ValueError("nested too deeply")
    while i < len(text) and text[i].isspace():
        i += 1
    if text.startswith(quote, i):
        end = text.find(quote, i + len(quote))
        if end < 0:
            raise ValueError("an unterminated string")
        return text[i + len(quote) : end], end + len(quote)
    if text.startswith("{", i):
        out: dict[str, Any] = {}
        i += 1
        while True:
            while i < len(text) and text[i].isspace():
                i += 1
            if text.startswith("}", i):
                return out, i + 1
            if out:
                if not text.startswith(",", i):
                    raise ValueError("a missing comma")
                i += 1
            i = _skip(text, i)
            if text.startswith(quote, i):
                key, i = _gemma_value(text, i, quote, depth + 1)
                i = _skip(text, i)
                if not text.startswith(":", i):
                    raise ValueError("a missing colon")
                i += 1
            else:
                m = _KEY.match(text, i)
                if not m:
                    raise ValueError("a bad key")
                key, i = m.group(1), m.end()
            out[str(key)], i = _gemma_value(text, i, quote, depth + 1)
    if text.startswith("[", i):
        items: list[Any] = []
        i += 1
        while True:
            i = _skip(text, i)
            if text.startswith("]", i):
                return items, i + 1
            if items:
                if not text.startswith(",", i):
                    raise ValueError("a missing comma")
                i += 1
            item, i = _gemma_value(text, i, quote, depth + 1)
            items.append(item)
    for word, value in (("true", True), ("false", False), ("null", None)):
        if text.startswith(word, i):
            return value, i + len(word)
    m = _NUMBER.match(text, i)
    if m:
        return json.loads(m.group()), m.end()
    raise ValueError("not a value")


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
