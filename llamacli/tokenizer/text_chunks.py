"""Where the tokenizer may cut a text: long texts into pieces whose ids are the ids of the whole (the engines
need some 100-500 bytes per character while they work, so a 50 MB prompt read whole would take gigabytes),
and special-token strings out of the text around them (TokenMatcher).

Both are about positions in text, not about any one vocabulary kind, so they sit apart from the BPE and
SentencePiece engines (bpe.py, spm.py) and from the Tokenizer that drives them.
"""

from __future__ import annotations

import operator
import os
import re
from bisect import bisect_right
from itertools import groupby
from typing import Callable, Iterable, Iterator

from ..errors import TokenizerError

# -- long texts in pieces ----------------------------------------------------------------------------------
# Where a text may be cut so that the ids of the pieces are the ids of the whole: before a space or line break
# that follows an ASCII letter or digit, and after a lone line break between a non-space and a letter or digit.
# Every pre-tokenizer regex (bpe.py) ends a match there and starts the next one afresh (none looks
# behind, and none lets a letter run, a digit run or a space run reach across), so BPE, which never merges
# across pre-tokens, sees the same words; tests/tokenizer/test_tokenizer.py checks it for every regex family on random texts.
# SentencePiece and gemma4 merge across spaces, so there the vocabulary has a say too (glued_pairs).
_CUT = re.compile(r"(?<=[A-Za-z0-9])[ \n]|(?<=\S\n)(?=[^\W_])")
PIECE_CHARS = 1 << 16  # a long text is tokenized in pieces of about this many characters
# A stretch with no cut is tokenized whole (100-500 bytes per character while it runs): refuse absurd ones.
MAX_STRETCH_CHARS = 1 << 21


def cut_points(text: str) -> list[int]:
    """Every position where `text` may be cut without changing its BPE pre-tokens (for tests and tools)."""
    return [m.start() for m in _CUT.finditer(text)]


def _check_stretch(n: int) -> None:
    if n > MAX_STRETCH_CHARS:
        raise TokenizerError(
            f"cannot tokenize {n:,} characters in one stretch (at most {MAX_STRETCH_CHARS:,}): long texts are "
            "tokenized in pieces cut at line breaks and at spaces after letters or digits, and this one has none"
        )


def pieces(text: str, cut_is_safe: Callable[[str, int], bool]) -> Iterator[str]:
    """`text` in pieces of about PIECE_CHARS, cut only at cut points (see cut_points) that the vocabulary
    also allows (`cut_is_safe(text, i)`), so that the pieces' ids are the whole text's."""
    start = 0
    while len(text) - start > PIECE_CHARS:
        cut = _next_cut(text, start + PIECE_CHARS, cut_is_safe)
        if cut is None:
            break
        _check_stretch(cut - start)
        yield text[start:cut]
        start = cut
    _check_stretch(len(text) - start)
    yield text[start:]


def _next_cut(text: str, pos: int, cut_is_safe: Callable[[str, int], bool]) -> int | None:
    """The first safe cut at or after `pos`, or None."""
    for m in _CUT.finditer(text, pos):
        if cut_is_safe(text, m.start()):
            return m.start()
    return None


def glued_pairs(tokens: Iterable[str]) -> frozenset[tuple[str, str]]:
    """Pairs of characters (a space as "\u2581") that a vocabulary piece holds side by side around a space or
    line break. SentencePiece and gemma4 merge across spaces and line breaks whenever a piece spans them: a
    cut is safe there only where no piece holds its two characters side by side."""
    pairs = set()
    for t in tokens:
        if "\u2581" in t or "\n" in t:
            pairs.update((a, b) for a, b in zip(t, t[1:]) if a in "\u2581\n" or b in "\u2581\n")
    return frozenset((a.replace("\u2581", " "), b.replace("\u2581", " ")) for a, b in pairs)


# -- special tokens in a text --------------------------------------------------------------------------------


class TokenMatcher:
    """Leftmost-longest search for any of a set of token strings (special and user-defined tokens), in time
    and memory proportional to the text and to the set, not to their product: one regex alternation of a
    vocabulary with millions of user-defined tokens took minutes and gigabytes to compile.

    The tokens stay in one sorted list. A character class of their first characters finds where one may start;
    a binary search finds the longest token the text continues with there: the last token <= the text is
    either a prefix of it (then the longest), or shares a prefix with it that bounds every match (search
    again for that)."""

    WINDOW = 64  # characters of text compared at first; doubled while some token is longer and still matches

    def __init__(self, texts: Iterable[str]):
        self._sorted = sorted(texts)
        if self._sorted and not self._sorted[0]:
            del self._sorted[0]  # the empty string (sorted first) matches nowhere
        # first character -> length of the longest token starting with it (tokens sharing one are adjacent)
        self._longest = {c: max(map(len, group)) for c, group in groupby(self._sorted, key=operator.itemgetter(0))}
        self._starts = re.compile(_char_class(self._longest))

    def search(self, text: str, pos: int = 0) -> tuple[int, int] | None:
        """(start, end) of the first token at or after `pos` (the longest one starting there), or None."""
        while (m := self._starts.search(text, pos)) is not None:
            start = m.start()
            end = self._longest_at(text, start)
            if end:
                return start, end
            pos = start + 1
        return None

    def _longest_at(self, text: str, start: int) -> int:
        """The end of the longest token that `text` holds at `start`, or 0."""
        limit = self._longest[text[start]]
        window = self.WINDOW
        while True:
            head = text[start : start + min(window, limit)]
            end = self._longest_prefix(head)
            if window >= limit or len(head) < window or not self._extends(head):
                return start + end if end else 0
            window *= 2

    def _longest_prefix(self, head: str) -> int:
        tokens = self._sorted
        while head:
            i = bisect_right(tokens, head) - 1
            if i < 0:
                return 0
            if head.startswith(tokens[i]):
                return len(tokens[i])
            head = head[: len(os.path.commonprefix((head, tokens[i])))]
        return 0

    def _extends(self, head: str) -> bool:
        """Whether a token longer than `head` starts with it (then a wider window may find a longer match)."""
        i = bisect_right(self._sorted, head)  # tokens that start with `head` and are longer sort right after it
        return i < len(self._sorted) and self._sorted[i].startswith(head)


def _char_class(chars: Iterable[str]) -> str:
    """A regex character class of `chars`, written as ranges (a vocabulary may start tokens with any of
    thousands of characters)."""
    points = sorted(map(ord, chars))
    parts, i = [], 0
    while i < len(points):
        j = i
        while j + 1 < len(points) and points[j + 1] == points[j] + 1:
            j += 1
        first, last = re.escape(chr(points[i])), re.escape(chr(points[j]))
        parts.append(first if i == j else f"{first}-{last}")
        i = j + 1
    return "[" + "".join(parts) + "]"

