"""A reply to a request with tools, read as it streams: reasoning, content and calls apart.

    pieces -> reasoning splitter (<think> blocks) -> answer text -> CallParser (tool_parse.py) -> content, calls
    pieces -> harmony (gpt-oss) -> text before a call -> HarmonySplitter -> reasoning, answer
                                -> to=functions.NAME ... <|message|> JSON arguments -> the call

The reasoning is split first, so that a call written inside it is not taken for one. feed(piece) gives
(reasoning, content, events) as tool_parse's events; the whole reply read at once (`parse_reply`) gives what
the pieces give.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from .harmony import MAX_HEADER, MESSAGE, HarmonySplitter
from .json_scan import JsonScan
from .reasoning import make_splitter
from .splitter import partial_suffix
from .tool_format import HARMONY_RECIPIENT, ToolFormat
from .tool_parse import MAX_NAME, CallParser, ToolCall, new_call_id

# -- harmony: a call is a commentary message to=functions.NAME ---------------------------------------------------


class HarmonyCalls:
    """The harmony reply with tool calls: the text before a call goes through HarmonySplitter (reasoning and
    answer); `to=functions.NAME` begins a call, whose body after <|message|> is the JSON arguments (streamed).
    <|call|> ends generation, so a call is the reply's last message. feed() -> (reasoning, answer, events)."""

    def __init__(self, fmt: ToolFormat, new_id: Callable[[], str] | None = None):
        self.splitter = HarmonySplitter()
        self.calls: list[ToolCall] = []
        self.new_id = new_id or (lambda: new_call_id(fmt.short_ids))
        self.buf, self.state, self.scan = "", "text", JsonScan()
        self.call: ToolCall | None = None

    def feed(self, piece: str) -> tuple[str, str, list[tuple]]:
        self.buf += piece
        think, answer, out = "", "", []
        while True:
            if self.state == "text":
                at = self.buf.find(HARMONY_RECIPIENT)
                if at < 0:
                    keep = partial_suffix(self.buf, HARMONY_RECIPIENT)
                    t, a = self.splitter.feed(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    return think + t, answer + a, out
                t, a = self.splitter.feed(self.buf[:at])
                t2, a2 = self.splitter.finish()  # (the call's own header is dropped there)
                think, answer = think + t + t2, answer + a + a2
                self.buf, self.state = self.buf[at + len(HARMONY_RECIPIENT) :], "name"
            elif self.state == "name":
                m = re.search(r"[\s<]", self.buf)
                if m is None:
                    if len(self.buf) > MAX_NAME:
                        self.state = "done"
                    return think, answer, out
                self.call = ToolCall(len(self.calls), self.new_id(), self.buf[: m.start()],
                                     raw_parts=[HARMONY_RECIPIENT + self.buf])
                self.calls.append(self.call)
                out.append(("call", self.call.index))
                self.buf, self.state = self.buf[m.start() :], "header"
            elif self.state == "header":
                at = self.buf.find(MESSAGE)
                if at < 0:
                    if len(self.buf) > MAX_HEADER:  # no body follows: not a call the parser can read
                        self.state = "done"
                    return think, answer, out
                self.buf, self.state = self.buf[at + len(MESSAGE) :], "args"
            elif self.state == "args":
                piece, self.buf = self.buf, ""
                end = self.scan.feed(piece)
                text = piece if end < 0 else piece[:end]
                if self.call is not None and not self.call.args_parts:
                    text = text.lstrip()
                if text and self.call is not None:
                    self.call.args_parts.append(text)
                    out.append(("args", self.call.index, text))
                if end < 0 and not self.scan.error:
                    return think, answer, out
                if self.call is not None:
                    self.call.complete = not self.scan.error
                self.state = "done"
            else:  # after the call: nothing more is the reply's
                self.buf = ""
                return think, answer, out

    def finish(self) -> tuple[str, str, list[tuple]]:
        if self.state == "text":
            t, a = self.splitter.feed(self.buf)
            t2, a2 = self.splitter.finish()
            self.buf = ""
            return t + t2, a + a2, []
        return "", "", []


# -- the reply -------------------------------------------------------------------------------------------------


class ToolReply:
    """A reply to a request with tools: feed(piece) -> (reasoning, content, events), the reasoning split first
    (think blocks, harmony's channels) so that a call inside the reasoning is not taken for one."""

    def __init__(self, completion: Any, fmt: ToolFormat, schemas: dict[str, Any] | None = None,
                 new_id: Callable[[], str] | None = None):
        self.harmony = fmt.kind == "harmony" or getattr(completion, "reasoning_format", "think") == "harmony"
        if self.harmony:
            self.h = HarmonyCalls(fmt, new_id)
        else:
            self.splitter = make_splitter(completion)
            self.parser = CallParser(fmt, schemas, new_id)

    @property
    def calls(self) -> list[ToolCall]:
        return self.h.calls if self.harmony else self.parser.calls

    def feed(self, piece: str) -> tuple[str, str, list[tuple]]:
        think, events = self.feed_events(piece)
        return think, *_content(events)

    def finish(self) -> tuple[str, str, list[tuple]]:
        think, events = self.finish_events()
        return think, *_content(events)

    def feed_events(self, piece: str) -> tuple[str, list[tuple]]:
        """(reasoning, the events in the reply's order: ("content", text) among the call events), for a
        writer whose output keeps that order (the Responses API's items)."""
        if self.harmony:  # (a harmony call is the reply's last message: its answer comes before it)
            think, answer, events = self.h.feed(piece)
            return think, [("content", answer)] * bool(answer) + events
        think, answer = self.splitter.feed(piece)
        return think, self.parser.feed(answer) if answer else []

    def finish_events(self) -> tuple[str, list[tuple]]:
        if self.harmony:
            think, answer, events = self.h.finish()
            return think, [("content", answer)] * bool(answer) + events
        think, answer = self.splitter.finish()
        return think, (self.parser.feed(answer) if answer else []) + self.parser.finish()


def _content(events: list[tuple]) -> tuple[str, list[tuple]]:
    """(the content events' text, the call events)."""
    return "".join(e[1] for e in events if e[0] == "content"), [e for e in events if e[0] != "content"]


@dataclass
class ParsedReply:
    reasoning: str
    content: str
    calls: list[ToolCall] = field(default_factory=list)


def parse_reply(completion: Any, fmt: ToolFormat, text: str, schemas: dict[str, Any] | None = None,
                new_id: Callable[[], str] | None = None) -> ParsedReply:
    """A whole reply: reasoning, content and the complete calls. An incomplete call's text stays in the content
    (harmony's is a message to a tool, never the answer's: it is dropped)."""
    reply = ToolReply(completion, fmt, schemas, new_id)
    t1, c1, _ = reply.feed(text)
    t2, c2, _ = reply.finish()
    calls = [c for c in reply.calls if c.complete]
    cut = "" if reply.harmony else "".join(c.raw for c in reply.calls if not c.complete)
    content = c1 + c2 + cut
    return ParsedReply((t1 + t2).strip(), content, calls)
