"""gpt-oss's "harmony" reply format: the analysis channel (reasoning) apart from the final channel (the answer).

gpt-oss writes its reply as messages, each a header and a body (openai/harmony; the model's chat_template.jinja):

    <|channel|>analysis<|message|>2+2 is 4.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>

The chat template ends the prompt with `<|start|>assistant`, so the reply opens with the first message's header.
A header names the channel (analysis: the chain of thought; commentary: tool calls, and preambles the user may
see; final: the answer), for a tool call the recipient (` to=functions.NAME`, before or after the channel), and
maybe a content type (` json`, `<|constrain|>json`). `<|end|>` ends a message; `<|return|>` ends the reply and
`<|call|>` a tool call: those two end generation, `<|end|>` does not (tokenizer/tokenizer.py, after llama-vocab.cpp's
o200k_harmony rule), and the detokenizer prints <|start|>, <|channel|>, <|message|>, <|constrain|> and <|end|>
(llama.cpp: "always render these tokens"), so that this splitter sees the structure.

Routing, as llama.cpp's gpt-oss parser (common/chat.cpp) and ollama's harmony parser route it:
- analysis -> reasoning;
- final, and commentary without a recipient (a preamble) -> the answer;
- a message with a recipient (a tool call; llamacli declares no tools) -> reasoning: shown on stderr, never
  taken for the answer;
- a message in another role (user, system, developer, tool or functions.NAME: the model writing the next turn)
  -> nowhere;
- the control text itself (headers, <|end|>, <|start|>) -> nowhere, so it never reaches stdout.
Two messages in one place are joined by a blank line. A reply cut off inside the analysis (max tokens) is all
reasoning. The model sometimes skips `<|end|><|start|>assistant` before its next header: a marker inside a body
ends that body. Text outside the format is never lost: words before a header (`Sure.<|channel|>final...`), after
`<|end|>` without a new header, a "header" with no `<|message|>` within MAX_HEADER characters, and a reply that
never had a header at all are the answer's. How the stream is cut never changes the split (tests/chat/test_harmony.py).

Earlier turns go back through the template as their final text only (the `content`): the template drops the
analysis of every earlier turn ("CoT is dropped during all previous turns").
"""

from __future__ import annotations

import re

from .splitter import Splitter, partial_suffix

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
REPLY_START = START + "assistant"  # how the template leaves the prompt for the reply
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
# Real headers are a few dozen characters: <|message|> must begin within this many characters of a header's start,
# or the "header" is text. A bound, not a search of the whole rest, so a stream decides as the whole text does.
MAX_HEADER = 256
OTHER_ROLES = ("user", "system", "developer", "tool")  # and functions.NAME (a tool's answer): not the reply's
SEPARATOR = "\n\n"  # between two messages that go to the same place

_HEADER_WORDS = ("assistant", *OTHER_ROLES, "to=", "functions.")  # how a header's text may begin
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")


def opens_reply(prompt_tail: str) -> bool:
    """Whether a prompt ends as the harmony template leaves it for the model's reply."""
    return prompt_tail.endswith(REPLY_START)


def route(header: str) -> tuple[str, str | None]:
    """(stray, sink) for a message's header: where its body goes ('reasoning', 'answer', or None: nowhere), and
    the words before the header that are none of it (`Sure.<|channel|>final`: the model's text, the answer's)."""
    lead = header.split(CHANNEL, 1)[0]
    role = _role(lead)
    if role in OTHER_ROLES or role.startswith("functions."):
        return "", None
    stray = ""
    if role not in ("", "assistant") and not role.startswith("to="):
        stray, header = _strip_markers(lead), header[len(lead) :]
    channel = _CHANNEL.search(header)
    if _RECIPIENT.search(header) or (channel and channel.group(1) == "analysis"):
        return stray, "reasoning"
    return stray, "answer"


class HarmonySplitter(Splitter):
    """ReasoningSplitter's interface for harmony: feed text pieces as they stream; each call returns (reasoning,
    answer) text that is now certain. A piece that might begin a marker is held back until the next decides it."""

    def __init__(self) -> None:
        super().__init__()
        self.state = "header"  # header -> body -> between -> header ...
        self.sink: str | None = None  # where the current body goes
        self.fresh = False  # the current body has sent nothing yet

    def feed(self, piece: str) -> tuple[str, str]:
        text, self.pending = self.pending + piece, ""
        out: dict[str, list[str]] = {"reasoning": [], "answer": []}
        while text:
            if self.state == "header":
                at = text.find(MESSAGE, 0, MAX_HEADER + len(MESSAGE))
                if at >= 0:
                    stray, sink = route(text[:at])
                    if stray:
                        self._open("answer")
                        self._send(out, stray)
                    self._open(sink)
                    text = text[at + len(MESSAGE) :]
                elif len(text) >= MAX_HEADER + len(MESSAGE):  # not a header: a body of the answer, read again
                    self._open("answer")
                    text = text[len(CHANNEL) :] if text.startswith(CHANNEL) else text
                else:
                    self.pending, text = text, ""
            elif self.state == "body":
                at, marker = _first_marker(text)
                if at < 0:
                    keep = _held(text)
                    self._send(out, text[: len(text) - keep])
                    self.pending, text = text[len(text) - keep :], ""
                    continue
                self._send(out, text[:at])
                rest = text[at + len(marker) :]
                if marker in (END, RETURN, CALL):
                    self.state, text = "between", rest
                elif marker == START:
                    self.state, text = "header", rest
                elif marker == CHANNEL:  # a new header without <|end|><|start|>assistant before it
                    self.state, text = "header", text[at:]
                else:  # a stray <|message|> or <|constrain|>: the same body goes on
                    text = rest
            else:  # between messages: a new header, or text the model wrote without one (the answer's)
                text = text.lstrip()
                if text.startswith(START):
                    self.state, text = "header", text[len(START) :]
                elif text.startswith(CHANNEL):
                    self.state = "header"
                elif START.startswith(text) or CHANNEL.startswith(text):  # "" or the start of a marker
                    self.pending, text = text, ""
                else:
                    self._open("answer")
        return self._record("".join(out["reasoning"]), "".join(out["answer"]))

    def finish(self) -> tuple[str, str]:
        """The end of the stream: a partial marker is text; a cut-off header is dropped, unless its words are no
        header's (a model that ignored the format: the answer)."""
        text, self.pending = self.pending, ""
        out: dict[str, list[str]] = {"reasoning": [], "answer": []}
        if self.state == "header":
            lead = text.split(CHANNEL, 1)[0]
            role = _role(lead)
            if not any(role.startswith(w) or w.startswith(role) for w in _HEADER_WORDS):  # ("assist": a header)
                text = _strip_markers(lead)
                self._open("answer")
        elif self.state == "between":
            self._open("answer")
        if self.state == "body":
            self._send(out, text)
        return self._record("".join(out["reasoning"]), "".join(out["answer"]))

    def _open(self, sink: str | None) -> None:
        self.state, self.sink, self.fresh = "body", sink, True

    def _send(self, out: dict[str, list[str]], text: str) -> None:
        if not text or self.sink is None:
            return
        if self.fresh:
            self.fresh = False
            if "".join(getattr(self, self.sink)) or "".join(out[self.sink]):
                text = SEPARATOR + text
        out[self.sink].append(text)


def split_harmony(text: str) -> tuple[str, str]:
    """(reasoning, answer) of a whole harmony reply."""
    s = HarmonySplitter()
    s.feed(text)
    s.finish()
    return s.texts


def _first_marker(text: str) -> tuple[int, str]:
    """(position, marker) of the earliest marker in `text`, or (-1, '')."""
    best, found = -1, ""
    for m in MARKERS:
        at = text.find(m)
        if at >= 0 and (best < 0 or at < best):
            best, found = at, m
    return best, found


def _held(text: str) -> int:
    """Length of the longest tail of `text` that may be the start of a marker."""
    if "<" not in text[-len(CONSTRAIN) :]:
        return 0
    return max(partial_suffix(text, m) for m in MARKERS)


def _role(lead: str) -> str:
    """The first word of a header's text before its channel: a role, `to=RECIPIENT`, or the model's own words."""
    words = _strip_markers(lead).split()
    return words[0] if words else ""


def _strip_markers(text: str) -> str:
    for m in MARKERS:
        text = text.replace(m, "")
    return text
