"""Reading the text a user points us at (prompt files, tokenize input, saved conversations, piped chat lines),
bounded: a file or pipe that never ends (/dev/zero, `yes |`) is refused after MAX_TEXT_BYTES instead of
filling memory. The bytes reach the caller exactly as written (no newline translation)."""

from __future__ import annotations

import sys
from typing import IO

from .errors import BadInputError, UsageError
from .units import human_bytes

# 64 MiB of UTF-8 is some 16 million tokens: more than any context holds (--truncate keeps a prompt's tail).
MAX_TEXT_BYTES = 64 << 20


def read_text(path: str, what: str, error: type[BadInputError] = UsageError, limit: int | None = None) -> str:
    """The UTF-8 text of the file `path` ('-': standard input), named `what` in errors ("prompt file"), of at
    most `limit` bytes (MAX_TEXT_BYTES)."""
    limit = MAX_TEXT_BYTES if limit is None else limit
    where = "standard input" if path == "-" else f"{what} {path}"
    try:
        if path == "-":
            raw = _read_at_most(getattr(sys.stdin, "buffer", sys.stdin), limit + 1)
        else:
            with open(path, "rb") as f:
                raw = _read_at_most(f, limit + 1)
    except FileNotFoundError:
        raise error(f"no such {what}: {path}") from None
    except OSError as exc:
        raise error(f"cannot read {where}: {exc.strerror or exc}") from None
    if len(raw) > limit:
        raise error(f"{where} is larger than {human_bytes(limit)}; that is more text than any context holds")
    if isinstance(raw, str):  # a text-only stdin (tests, embedding programs)
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"cannot read {where}: it is not UTF-8 text (bad byte at offset {exc.start})") from None


def read_line(stream: IO[str], limit: int | None = None) -> str:
    """One line of a text stream ('' at the end), refused past `limit` (MAX_TEXT_BYTES) characters without a
    newline."""
    limit = MAX_TEXT_BYTES if limit is None else limit
    line = stream.readline(limit + 1)
    if len(line) > limit and not line.endswith("\n"):
        raise UsageError(f"an input line is longer than {limit:,} characters")
    return line


def _read_at_most(f: IO, n: int) -> bytes | str:
    """Up to n bytes (or characters): read() may return less than asked before the end (pipes)."""
    parts, got = [], 0
    while got < n:
        part = f.read(n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return (b"" if not parts or isinstance(parts[0], bytes) else "").join(parts)
