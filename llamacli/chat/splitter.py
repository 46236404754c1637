"""What the two reply splitters share (reasoning.ReasoningSplitter for <think> blocks, harmony.HarmonySplitter for
gpt-oss's channels): the text held back while it may still be the start of a tag, and the record of what each
call gave."""

from __future__ import annotations


class Splitter:
    """Feed text pieces as they stream; each call returns (reasoning, answer) text that is now certain, and
    finish() what was held back. A subclass keeps a tail that may begin a tag in `pending` and returns through
    _record, so that `texts` is the whole split so far."""

    def __init__(self) -> None:
        self.pending = ""
        self.reasoning: list[str] = []
        self.answer: list[str] = []

    @property
    def texts(self) -> tuple[str, str]:
        """(reasoning, answer) so far; reasoning without the whitespace around it."""
        return "".join(self.reasoning).strip(), "".join(self.answer)

    def _record(self, think: str, answer: str) -> tuple[str, str]:
        if think:
            self.reasoning.append(think)
        if answer:
            self.answer.append(answer)
        return think, answer


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
