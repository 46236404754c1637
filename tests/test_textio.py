"""Bounded reading of user-named text: files and pipes that never end are refused, not read into memory."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from clirun import ROOT
from llamacli import textio
from llamacli.engine.chat_session import ChatSession, ConversationFileError
from llamacli.errors import UsageError


class Endless(io.RawIOBase):
    """A stream that never ends and never hands out more than asked (as a pipe from `yes`)."""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), 4096)
        b[:n] = b"y\n" * (n // 2) + b"y" * (n % 2)
        return n


def test_files_up_to_the_limit_and_no_further(tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes("é\r\n".encode() * 10)  # 40 bytes, CRLF kept as written
    assert textio.read_text(str(f), "prompt file", limit=40) == "é\r\n" * 10
    with pytest.raises(UsageError, match=r"prompt file .*p\.txt is larger than 39 B"):
        textio.read_text(str(f), "prompt file", limit=39)


def test_endless_stdin_is_refused(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(Endless())))
    with pytest.raises(UsageError, match="standard input is larger than 1.00 MiB"):
        textio.read_text("-", "input file", limit=1 << 20)
    with pytest.raises(UsageError, match="longer than 1,000 characters"):
        textio.read_line(io.StringIO("x" * 5000), limit=1000)
    assert textio.read_line(io.StringIO("x" * 1000 + "\nmore"), limit=1000) == "x" * 1000 + "\n"  # at the limit
    assert textio.read_line(io.StringIO("ab\ncd"), limit=1000) == "ab\n"


def test_error_kinds(tmp_path):
    with pytest.raises(UsageError, match="no such prompt file"):
        textio.read_text(str(tmp_path / "missing"), "prompt file")
    with pytest.raises(UsageError, match="cannot read prompt file .*: Is a directory"):
        textio.read_text(str(tmp_path), "prompt file")
    (tmp_path / "b").write_bytes(b"ok\xff")
    with pytest.raises(ConversationFileError, match="not UTF-8 text .*offset 2"):
        textio.read_text(str(tmp_path / "b"), "conversation file", ConversationFileError)


def test_conversation_files_that_are_endless_or_too_deep(tmp_path, monkeypatch):
    from test_chat_session import FakeModel

    s = ChatSession(FakeModel(ctx=64))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ConversationFileError, match="nests JSON too deeply"):
        s.load(deep)
    monkeypatch.setattr(textio, "MAX_TEXT_BYTES", 1 << 16)
    if os.path.exists("/dev/zero"):
        with pytest.raises(ConversationFileError, match="larger than 64.00 KiB"):
            s.load("/dev/zero")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConversationFileError, match=r"no such conversation file: \./-"):
        s.load("-")  # a file named "-", never standard input


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
@pytest.mark.parametrize("args, words", [
    (["generate", "-m", "MODEL", "--backend", "numpy", "--prompt-file", "/dev/zero"], "prompt file /dev/zero is larger than 64.00 MiB"),
    (["generate", "-m", "MODEL", "--backend", "numpy", "--prompt-file", "-"], "standard input is larger than 64.00 MiB"),
    (["tokenize", "-m", "MODEL", "--file", "-"], "standard input is larger than 64.00 MiB"),
    (["chat", "-m", "MODEL", "--backend", "numpy"], "an input line is longer than 67,108,864 characters"),
])
def test_cli_refuses_endless_input(smollm2, args, words):
    """Through the real command, standard input from /dev/zero: exit 2 and one line, in bounded time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [a.replace("MODEL", str(smollm2)) for a in args]
    with open("/dev/zero", "rb") as zero:
        p = subprocess.run([sys.executable, "-m", "llamacli", *argv], stdin=zero, capture_output=True, text=True,
                           env=env, timeout=120)
    lines = [line for line in p.stderr.splitlines() if line.strip() and not line.startswith("backend ")]
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and lines[-1].startswith(f"error: {words}"), p.stderr[-2000:]
    assert p.stdout == ""
