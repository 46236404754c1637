"""Text in and out of the process.

In: the text a user points us at (prompt files, tokenize input, saved conversations, piped chat lines),
bounded: a file or pipe that never ends (/dev/zero, `yes |`) is refused after MAX_TEXT_BYTES instead of
filling memory. The bytes reach the caller exactly as written (no newline translation).

Out: strings that come from a file (metadata, tensor names, template messages, paths) pass through
`printable` before they reach a terminal, so that an escape sequence in a GGUF cannot retitle the window,
recolour it or reorder the text; `json_text` does the same for JSON. `standard_streams` makes stdin,
stdout and stderr safe to use whatever state the shell left them in.
"""

from __future__ import annotations

import codecs
import io
import json
import os
import sys
from typing import IO, Any

from .errors import BadInputError, OutputError, UsageError
from .units import human_bytes

# 64 MiB of UTF-8 is some 16 million tokens: more than any context holds (--truncate keeps a prompt's tail).
MAX_TEXT_BYTES = 64 << 20


def brief(value: object, limit: int = 40) -> str:
    """repr(value) cut to `limit` characters, for a value from a request or a file in an error message (a
    number may be thousands of digits long)."""
    r = repr(value)
    return r if len(r) <= limit else f"{r[: limit - 10]}... ({len(r)} characters)"


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
    newline, or when it is not text: bytes the stream's encoding rejects, or that it smuggled through as lone
    surrogates (Python's surrogateescape on stdin), which no tokenizer takes."""
    limit = MAX_TEXT_BYTES if limit is None else limit
    encoding = getattr(stream, "encoding", None) or "UTF-8"
    try:
        line = stream.readline(limit + 1)
        line.encode("utf-8")
    except (UnicodeDecodeError, UnicodeEncodeError):
        raise UsageError(f"cannot read standard input: it is not {encoding} text") from None
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


# -- out ------------------------------------------------------------------------------------------------------

# Joiners are format characters that ordinary text needs (Persian, Indic scripts, emoji sequences) and that
# no terminal acts on; every other non-printable character is shown as an escape.
_KEEP = frozenset("\u200c\u200d")


def printable(text: str) -> str:
    """`text` with every character a terminal could act on written as a Python-style escape (\\x1b, \\u202e):
    C0 and C1 controls (ESC, BEL, CSI), DEL, bidirectional overrides and other format characters, line and
    paragraph separators, lone surrogates. Ordinary text in any script, and spaces, stay as they are."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in _KEEP else _escape(c) for c in text)


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def csv_text(rows: list[dict[str, Any]]) -> str:
    """Rows of one shape (bench's --output csv) as CSV: a header of the first row's keys, then each row's values, a
    list as its items joined by ';' and None as an empty cell; no newline after the last row."""
    import csv

    buf = io.StringIO()
    w = csv.writer(buf)
    keys = list(rows[0]) if rows else []
    w.writerow(keys)
    for r in rows:
        w.writerow([";".join(map(str, r[k])) if isinstance(r[k], list) else r[k] for k in keys])
    return buf.getvalue().rstrip("\n")


def json_text(value: Any, **kw: Any) -> str:
    """`json.dumps(value)` for stdout, with non-ASCII text kept readable, yet no character a terminal acts on:
    json escapes C0 controls itself, and C1 controls, DEL, bidirectional overrides and separators (which it
    leaves raw) become \\uXXXX escapes here. They can only occur inside strings, so the result stays JSON.
    Where stdout's encoding cannot hold all of Unicode (PYTHONIOENCODING=ascii), every non-ASCII character
    is a \\uXXXX escape, so that the JSON stays valid there too."""
    if not _holds_unicode(getattr(sys.stdout, "encoding", None)):
        return json.dumps(value, ensure_ascii=True, **kw)
    text = json.dumps(value, ensure_ascii=False, **kw)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == "\n" or c in _KEEP else _json_escape(c) for c in text)  # \n: indent


def _holds_unicode(encoding: str | None) -> bool:
    try:
        return codecs.lookup(encoding or "utf-8").name.startswith("utf")
    except LookupError:
        return False


def _json_escape(c: str) -> str:
    n = ord(c)
    if n < 0x10000:
        return f"\\u{n:04x}"
    n -= 0x10000  # a UTF-16 surrogate pair, as JSON spells characters beyond the BMP
    return f"\\u{0xD800 + (n >> 10):04x}\\u{0xDC00 + (n & 0x3FF):04x}"


def standard_streams() -> None:
    """Make the standard streams safe to use, whatever the shell left us.

    A stream the shell closed (`>&-`, `<&-`, `2>&-`) is None in Python: stdin then reads as an error (exit 2),
    stdout fails on the first write (exit 1, as `cat >&-` does), stderr swallows what is written. An encoding
    that cannot hold a character (PYTHONIOENCODING=ascii, a C locale) writes it as a backslash escape
    instead of failing."""
    if sys.stdin is None:
        _hold(0)
        sys.stdin = ClosedStream("standard input", UsageError)
    if sys.stdout is None:
        _hold(1)
        sys.stdout = ClosedStream("standard output", OutputError)
    if sys.stderr is None:
        _hold(2)
        sys.stderr = ClosedStream("standard error", None)
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (OSError, ValueError):  # a stream that cannot change any more: keep it as it is
                pass


def hold_closed_fds() -> None:
    """_hold each standard descriptor the shell closed: before any thread may open a file (llamacli.run, ahead
    of the GPU driver's start, whose own descriptors would otherwise take the free numbers)."""
    for fd in (0, 1, 2):
        _hold(fd)


def _hold(fd: int) -> None:
    """Keep a closed standard descriptor open on /dev/null, so that no file opened later (a model) gets its
    number and, with it, whatever a library writes to 'stdout' at the C level."""
    try:
        os.fstat(fd)
    except OSError:
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)


class ClosedStream(io.TextIOBase):
    """Stands in for a standard stream that the shell closed. Reading or writing raises `error` with a
    sentence that names the stream (or, with error None, writing is silently discarded)."""

    encoding = "utf-8"

    def __init__(self, name: str, error: type[Exception] | None):
        self.name = name
        self._error = error

    def _closed(self) -> Exception:
        return (self._error or OutputError)(f"{self.name} is closed")

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def read(self, size: int | None = -1) -> str:
        raise self._closed()

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        raise self._closed()

    def write(self, text: str) -> int:
        if self._error is None:
            return len(text)
        raise self._closed()
