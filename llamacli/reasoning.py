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
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_think(prompt: str) -> bool:
    """Whether the rendered prompt leaves a <think> block open for the model to continue."""
    at = prompt.rfind(OPEN)
    return at >= 0 and CLOSE not in prompt[at:]


def template_thinks(template_source: str | None) -> bool:
    """Whether a chat template knows about think blocks (so --think / --no-think can mean something)."""
    return bool(template_source) and (OPEN in template_source or "enable_thinking" in template_source)


class ReasoningSplitter:
    """Feed text pieces as they stream; each call returns (reasoning, answer) text that is now certain.
    A piece that might be the start of a tag is held back until the next piece decides it."""

    def __init__(self, opened: bool = False):
        self.state = "think" if opened else "start"  # start -> think -> answer, or start -> answer
        self.pending = ""
        self.reasoning: list[str] = []
        self.answer: list[str] = []

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
                    keep = _partial_suffix(text, CLOSE)
                    think.append(text[: len(text) - keep])
                    self.pending, text = text[len(text) - keep :], ""
            elif self.state == "gap":  # the blank lines between </think> and the answer
                text = text.lstrip()
                if text:
                    self.state = "answer"
            else:
                answer.append(text)
                text = ""
        out = "".join(think), "".join(answer)
        self.reasoning.append(out[0])
        self.answer.append(out[1])
        return out

    def finish(self) -> tuple[str, str]:
        """The end of the stream: what was held back is released (a partial tag is just text)."""
        text, self.pending = self.pending, ""
        if not text:
            return "", ""
        if self.state == "think":
            self.reasoning.append(text)
            return text, ""
        if self.state == "gap":
            return "", ""
        self.answer.append(text)
        return "", text

    @property
    def texts(self) -> tuple[str, str]:
        """(reasoning, answer) so far; reasoning without the whitespace around it."""
        return "".join(self.reasoning).strip(), "".join(self.answer)


def split_reasoning(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a whole output."""
    s = ReasoningSplitter(opened)
    s.feed(text)
    s.finish()
    return s.texts


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReplyRouter:
    """Routes a streamed reply as `llamacli generate` / `chat` show it: the answer to `answer(text)`, the
    reasoning to `side` (stderr; dimmed on a terminal, blank lines around it dropped). The splitter is made at
    the first piece, when the completion knows whether its prompt opened a think block."""

    def __init__(self, completion, answer, side=None):  # noqa: ANN001 (Completion, callable, text stream)
        self.completion, self.answer, self.side = completion, answer, side
        self.splitter: ReasoningSplitter | None = None
        self.shown = False  # some reasoning went to `side`
        self.dimmed = False  # the terminal's dim attribute is on
        self.last = ""  # the last text written to `side`
        self.tty = bool(side is not None and getattr(side, "isatty", lambda: False)())

    def write(self, piece: str) -> None:
        if self.splitter is None:
            self.splitter = ReasoningSplitter(self.completion.think_open)
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
