"""Terminal injection: a GGUF's strings (its name, any metadata key or value, tensor names, the messages of
its chat template) and the paths a user gives reach the terminal escaped, through `inspect` and through
every `error:` line; non-ASCII text stays readable, and JSON output stays valid JSON."""

from __future__ import annotations

import json
import struct

import pytest

from clirun import run, run_subprocess
from llamacli.testing import write_model
from llamacli.textio import json_text, printable

# An OSC that retitles the window, SGR red, an 8-bit CSI that clears the screen, a right-to-left override,
# a line separator, DEL.
HOSTILE = "\x1b]0;pwned\x07\x1b[31m\x9b2J\u202e\u2028\x7f"
ESCAPED = "\\x1b]0;pwned\\x07\\x1b[31m\\x9b2J\\u202e\\u2028\\x7f"
ESCAPED_LINE = ESCAPED.replace("\\u2028", " ")  # error lines fold whitespace (U+2028 is whitespace) first
# What must never reach the terminal raw: ESC, BEL, CSI, RLO, LS, DEL.
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\u2028", "\x7f")
READABLE = "café 模型 👍"
EVIL_TENSOR = b"\x1b]0;pwn\x07\x1b[31m"  # as long as b"output.weight", which it replaces


def assert_clean(text: str) -> None:
    for c in RAW:
        assert c not in text, (c, text)


def test_printable_escapes_controls_and_keeps_text():
    assert printable(READABLE + " " + HOSTILE) == READABLE + " " + ESCAPED
    assert printable("tab\tnewline\n") == "tab\\x09newline\\x0a"
    assert printable("\udcff \U000e0041") == "\\udcff \\U000e0041"  # a lone surrogate (an undecodable path byte), a tag
    assert printable("a\u200db") == "a\u200db"  # a joiner is text (emoji sequences, Indic scripts)


def test_json_text_is_json_without_raw_controls():
    value = {"name": READABLE + HOSTILE, "list": ["\U000e0041", "\udcff"]}
    text = json_text(value, indent=1)
    assert json.loads(text) == value and READABLE in text
    assert_clean(text)
    assert all(c.isprintable() or c in " \n" for c in text)


@pytest.fixture(scope="module")
def evil(tmp_path_factory) -> str:
    """A runnable model with HOSTILE in its name, a metadata key and value, a tensor name and the message its
    chat template raises."""
    path = write_model(tmp_path_factory.mktemp("escaping") / "evil.gguf", metadata={
        "general.name": READABLE + HOSTILE,
        f"x.key{HOSTILE}": f"value{HOSTILE}",
        "tokenizer.chat_template": "{{ raise_exception('" + HOSTILE + "') }}",
    })
    data = path.read_bytes()
    name = struct.pack("<Q", 13) + b"output.weight"
    assert data.count(name) == 1 and len(EVIL_TENSOR) == 13
    path.write_bytes(data.replace(name, struct.pack("<Q", 13) + EVIL_TENSOR))  # the model ties its embeddings
    return str(path)


def test_inspect_tables_escape_the_files_strings(evil):
    r = run("inspect", evil, "--metadata", "--tensors")
    assert r.code == 0, r.err
    assert_clean(r.out)
    assert READABLE + ESCAPED in r.out  # the summary's name
    assert "x.key" + ESCAPED in r.out  # a metadata key (its value is shown by repr, escaped as well)
    assert "\\x1b]0;pwn\\x07\\x1b[31m" in r.out  # the tensor name


def test_inspect_json_escapes_and_round_trips(evil):
    r = run("inspect", evil, "--metadata", "--tensors", "--json")
    assert r.code == 0, r.err
    assert_clean(r.out)
    info = json.loads(r.out)
    assert info["name"] == READABLE + HOSTILE and info["metadata"][f"x.key{HOSTILE}"] == f"value{HOSTILE}"
    assert EVIL_TENSOR.decode() in {t["name"] for t in info["tensors"]}


@pytest.mark.parametrize("argv", [
    ["tokenize", "-m", "{evil}", "--chat", "-p", "hi"],
    ["generate", "-m", "{evil}", "-p", "hi", "--backend", "numpy", "-n", "2"],
])
def test_template_messages_are_escaped_in_the_error_line(evil, argv):
    r = run(*(a.format(evil=evil) for a in argv))
    line = r.one_line_error()
    assert r.code == 2 and "template" in line and ESCAPED_LINE in line
    assert_clean(r.err)


def test_paths_are_escaped_in_the_error_line(tmp_path):
    r = run("inspect", str(tmp_path / f"{HOSTILE}.gguf"))
    assert r.code == 2 and ESCAPED_LINE in r.one_line_error()
    assert_clean(r.err)


def test_a_real_process_escapes_too(evil):
    """The console entry point, stdout and stderr as a terminal would receive them."""
    r = run_subprocess("inspect", evil)
    assert r.code == 0 and READABLE + ESCAPED in r.out
    assert_clean(r.out + r.err)
    r = run_subprocess("tokenize", "-m", evil, "--chat", "-p", "hi")
    assert r.code == 2 and ESCAPED_LINE in r.one_line_error()
