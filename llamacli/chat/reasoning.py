"""Reasoning ("thinking") text apart from the answer, for models that think before they answer.

Qwen3, SmolLM3 and the DeepSeek-R1 distills write `<think> ... </think>` before the answer, as ordinary
text (the tags are user-defined tokens, so the detokenizer prints them). Two ways it starts:
- the model opens the block itself (Qwen3 with thinking on): the output begins with `<think>`;
- the template opens it at the end of the prompt (the R1 distills: "...<｜Assistant｜><think>\\n"), and the
  output holds only the closing tag: `ReasoningSplitter(opened=prompt_opens_think(prompt))`.
With thinking off, Qwen3's template writes an empty block into the prompt, which closes it, so nothing in the
output is reasoning. Everything up to `</think>` is reasoning; the answer is what follows, without the blank
lines between. A stream that ends inside the block (max tokens reached) is all reasoning, as llama-server
reports it.

gpt-oss writes channels instead ("harmony", harmony.py), and Gemma 4 its own ("channel": `<|channel>thought\n ...
<channel|>` before the answer, ChannelSplitter below; its template ends the prompt with an empty block when thinking
is off). The prompt says which format a reply has (`reply_format`), and `make_splitter(completion)` gives the
splitter for it; all have the same interface.
"""

from __future__ import annotations

from typing import Any

from .harmony import HarmonySplitter, opens_reply, split_harmony
from .splitter import Splitter, partial_suffix

OPEN, CLOSE = "<think>", "</think>"
# Gemma 4 (its chat template; llama.cpp's common/parsers/gemma4.cpp): a channel block, named by its first word
CHANNEL_OPEN, CHANNEL_CLOSE, THOUGHT = "<|channel>", "<channel|>", "thought"
# How Gemma 4's template leaves the prompt for a reply: a new model turn (with thinking off, an empty thought block
# after it), or the same turn after tool responses
CHANNEL_REPLY_ENDS = ("<|turn>model\n", "<|turn>model\n" + CHANNEL_OPEN + THOUGHT + "\n" + CHANNEL_CLOSE,
                      "<tool_response|>")
EFFORTS = ("low", "medium", "high")  # gpt-oss's reasoning efforts ("Reasoning: ..." in its system message)
# OpenAI's reasoning_effort also takes "minimal", a level gpt-oss's template lacks: taken as its least, "low".
EFFORT_ALIASES = {"minimal": "low"}
EFFORT_NAMES = ("none", "minimal", *EFFORTS)  # what parse_effort takes


def prompt_opens_think(prompt: str) -> bool:
    """Whether the rendered prompt leaves a <think> block open for the model to continue."""
    at = prompt.rfind(OPEN)
    return at >= 0 and CLOSE not in prompt[at:]


def template_thinks(template_source: str | None) -> bool:
    """Whether a chat template knows about think blocks or reasoning efforts (so --think / --no-think can
    mean something)."""
    return bool(template_source) and (OPEN in template_source or "enable_thinking" in template_source
                                      or template_takes_effort(template_source))


def template_takes_effort(template_source: str | None) -> bool:
    """Whether a chat template reads `reasoning_effort` (gpt-oss: low, medium or high; its default is medium)."""
    return bool(template_source) and "reasoning_effort" in template_source


def parse_effort(value: object) -> bool | str:
    """A reasoning effort as given (--reasoning-effort, OpenAI's reasoning_effort), in any case and with spaces
    around: 'low', 'medium' or 'high' as it is, 'minimal' as 'low' (EFFORT_ALIASES), 'none' as False (thinking
    off). Raises ValueError naming the levels for anything else."""
    level = value.strip().lower() if isinstance(value, str) else None
    level = EFFORT_ALIASES.get(level, level)  # type: ignore[arg-type]
    if level == "none":
        return False
    if level in EFFORTS:
        return level
    raise ValueError(f"must be one of {', '.join(EFFORT_NAMES)} (minimal is low); got {value!r}")


def template_variables(template_source: str | None, think: bool | str | None) -> dict[str, Any]:
    """The template variables for --think (True), --no-think (False) or a reasoning effort ('low', 'medium',
    'high'), as transformers passes keyword arguments to a template: `enable_thinking` (Qwen3 and the like) and,
    for a template that reads it, `reasoning_effort`. gpt-oss always reasons, so False asks for its least effort
    ('low'), True leaves the template's default, and an effort reaches it as given (llama.cpp's
    --reasoning-effort, ollama's --think=LEVEL); a template without efforts takes an effort as thinking on."""
    if think is None:
        return {}
    effort = think if isinstance(think, str) else None if think else "low"
    out: dict[str, Any] = {"enable_thinking": think is not False}
    if effort is not None and template_takes_effort(template_source):
        out["reasoning_effort"] = effort
    return out


def reply_format(prompt_tail: str) -> str:
    """'harmony' when the prompt ends as gpt-oss's template leaves it for the reply, 'channel' as Gemma 4's does,
    else 'think'."""
    if opens_reply(prompt_tail):
        return "harmony"
    return "channel" if prompt_tail.endswith(CHANNEL_REPLY_ENDS) else "think"


def make_splitter(completion: Any) -> "ReasoningSplitter | HarmonySplitter | ChannelSplitter":
    """The splitter for a completion's reply format (Completion.reasoning_format, think_open)."""
    form = getattr(completion, "reasoning_format", "think")
    if form == "harmony":
        return HarmonySplitter()
    if form == "channel":
        return ChannelSplitter()
    return ReasoningSplitter(completion.think_open)


class ReasoningSplitter(Splitter):
    """Feed text pieces as they stream; each call returns (reasoning, answer) text that is now certain.
    A piece that might be the start of a tag is held back until the next piece decides it."""

    def __init__(self, opened: bool = False):
        super().__init__()
        self.state = "think" if opened else "start"  # start -> think -> answer, or start -> answer

    def feed(self, piece: str) -> tuple[str, str]:
        text, self.pending = self.pending + piece, ""
        think, answer = [], []
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    self.state, text = "think", stripped[len(OPEN) :]
                elif OPEN.startswith(stripped):  # whitespace or a partial "<think": wait for more
                    self.pending, text = text, ""
                else:
                    self.state = "answer"
            elif self.state == "think":
                at = text.find(CLOSE)
                if at >= 0:
                    think.append(text[:at])
                    self.state, text = "gap", text[at + len(CLOSE) :]
                else:
                    keep = partial_suffix(text, CLOSE)
                    think.append(text[: len(text) - keep])
                    self.pending, text = text[len(text) - keep :], ""
            elif self.state == "gap":  # the blank lines between </think> and the answer
                text = text.lstrip()
                if text:
                    self.state = "answer"
            else:
                answer.append(text)
                text = ""
        return self._record("".join(think), "".join(answer))

    def finish(self) -> tuple[str, str]:
        """The end of the stream: what was held back is released (a partial tag is just text)."""
        text, self.pending = self.pending, ""
        if self.state == "think":
            return self._record(text, "")
        if self.state == "gap":
            return "", ""
        return self._record("", text)


class ChannelSplitter(Splitter):
    """Gemma 4's reply: what a channel block holds (`<|channel>thought\n...<channel|>`) is reasoning, without the
    channel's name; the rest is the answer, without the blank lines right after a block. As llama.cpp's Gemma 4
    parser reads it: a reply may hold several blocks (joined by a blank line; the model sometimes writes an empty
    one after its answer), a `<channel|>` outside a block is dropped, and a reply cut off inside a block is all
    reasoning. A piece that may begin a marker is held back until the next decides it."""

    def __init__(self) -> None:
        super().__init__()
        self.state = "answer"  # answer -> name (the channel's name) -> think -> gap (blank lines) -> answer
        self.name = ""
        self.joined = True  # the current block's reasoning follows the earlier blocks' (or there were none)

    def feed(self, piece: str) -> tuple[str, str]:
        text, self.pending = self.pending + piece, ""
        think, answer = [], []
        while text:
            if self.state in ("answer", "gap"):
                if self.state == "gap":
                    text = text.lstrip()
                    if not text:
                        break
                    self.state = "answer"
                at = min((i for i in (text.find(CHANNEL_OPEN), text.find(CHANNEL_CLOSE)) if i >= 0), default=-1)
                if at < 0:
                    keep = max(partial_suffix(text, CHANNEL_OPEN), partial_suffix(text, CHANNEL_CLOSE))
                    answer.append(text[: len(text) - keep])
                    self.pending, text = text[len(text) - keep :], ""
                elif text.startswith(CHANNEL_CLOSE, at):  # a stray close: dropped
                    answer.append(text[:at])
                    text = text[at + len(CHANNEL_CLOSE) :]
                else:
                    answer.append(text[:at])
                    self.state, self.name, text = "name", "", text[at + len(CHANNEL_OPEN) :]
                    self.joined = not (self.reasoning or think)
            elif self.state == "name":  # the channel's name ("thought"), dropped (the whitespace after it too, as
                self.name, text = self.name + text, ""  # reasoning's edges are: Splitter.texts, ReplyRouter)
                if len(self.name) < len(THOUGHT) and THOUGHT.startswith(self.name):
                    continue  # a partial name: wait for more
                self.state, text = "think", self.name[len(THOUGHT) :] if self.name.startswith(THOUGHT) else self.name
            elif self.state == "think":
                at = text.find(CHANNEL_CLOSE)
                end = at if at >= 0 else len(text) - partial_suffix(text, CHANNEL_CLOSE)
                body = text[:end]
                if not self.joined:  # a later block: a blank line before its first words, its leading space dropped
                    body, self.joined = ("\n\n" + body.lstrip(), True) if body.strip() else ("", False)
                think.append(body)
                if at >= 0:
                    self.state, text = "gap", text[at + len(CHANNEL_CLOSE) :]
                else:
                    self.pending, text = text[end:], ""
        return self._record("".join(think), "".join(answer))

    def finish(self) -> tuple[str, str]:
        """The end of the stream: what was held back is released (a partial marker is just text)."""
        text, self.pending = self.pending, ""
        if self.state == "think":
            return self._record(text, "")
        if self.state in ("name", "gap"):
            return "", ""
        return self._record("", text)


def split_reasoning(text: str, opened: bool = False, reply: str = "think") -> tuple[str, str]:
    """(reasoning, answer) of a whole output in a reply format ('think', 'harmony' or 'channel')."""
    if reply == "harmony":
        return split_harmony(text)
    s = ChannelSplitter() if reply == "channel" else ReasoningSplitter(opened)
    s.feed(text)
    s.finish()
    return s.texts


class ReplyRouter:
    """Routes a streamed reply as `llamacli generate` / `chat` show it: the answer to `answer(text)`, the
    reasoning to `side` (stderr; dimmed on a terminal, blank lines around it dropped). The splitter is made at
    the first piece, when the completion knows its reply format (and whether its prompt opened a think block)."""

    def __init__(self, completion, answer, side=None):  # noqa: ANN001 (Completion, callable, text stream)
        self.completion, self.answer, self.side = completion, answer, side
        self.splitter: ReasoningSplitter | HarmonySplitter | ChannelSplitter | None = None
        self.shown = False  # some reasoning went to `side`
        self.dimmed = False  # the terminal's dim attribute is on
        self.last = ""  # the last text written to `side`
        self.tty = bool(side is not None and getattr(side, "isatty", lambda: False)())

    def write(self, piece: str) -> None:
        if self.splitter is None:
            self.splitter = make_splitter(self.completion)
        self._route(*self.splitter.feed(piece))

    def end(self) -> None:
        if self.splitter is not None:
            self._route(*self.splitter.finish())
        self._close_side()

    def _route(self, think: str, answer: str) -> None:
        if think and self.side is not None:
            if not self.shown:
                think = think.lstrip()
                if not think:
                    return
                self.shown = True
            if self.tty and not self.dimmed:
                self.dimmed, think = True, "\x1b[2m" + think
            self._side(think)
        if answer:
            self._close_side()
            self.answer(answer)

    def _close_side(self) -> None:
        """End the reasoning on its own line, the terminal's attributes reset."""
        if self.dimmed:
            self.dimmed = False
            self._side("\x1b[0m")
        if self.shown and not self.last.endswith("\n"):
            self._side("\n")

    def _side(self, text: str) -> None:
        plain = text.replace("\x1b[2m", "").replace("\x1b[0m", "")
        self.last = plain or self.last
        self.side.write(text)
        self.side.flush()
