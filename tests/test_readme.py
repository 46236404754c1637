"""Every `llamacli ...` command line in README.md parses: its command exists, its options are the command's and
take the values given, and the registry names it uses are in the registry. The examples download models and
some need a GPU, so they are not run here; their parsing is what a rename or a removed option would break."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import typer.main

from llamacli.cli import app
from llamacli.registry.registry import load_registry

ROOT = Path(__file__).resolve().parents[1]
OPERATORS = {"|", "||", "&&", ";", "<", ">", "<(", "$(", "(", ")"}


def readme_commands() -> list[list[str]]:
    """The argument lists of the README's `llamacli` invocations, in its indented code blocks (a line ending in
    a backslash, or inside an open quote, continues on the next; pipes and `&&` split)."""
    found, pending = [], ""
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        if not pending and (not line.startswith("    ") or line.strip().startswith("#")):
            continue
        text = pending + line.strip() if not pending.endswith("\\\n") else pending[:-2] + " " + line.strip()
        try:
            words = _words(text)
        except ValueError:  # a quote still open: the string goes on
            pending = text + "\n"
            continue
        if text.endswith("\\"):
            pending = text + "\n"
            continue
        pending = ""
        if text.startswith(("import ", "model =", "for ", "from ", "print(")):
            continue
        while "llamacli" in words:
            words = words[words.index("llamacli") + 1:]
            args = []
            while words and words[0] not in OPERATORS:
                args.append(words.pop(0))
            found.append(args)
    return found


def _words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


COMMANDS = readme_commands()


def test_the_readme_has_its_examples():
    assert len(COMMANDS) > 30
    first = COMMANDS[0]  # the set-up's: greedy, so that it shows the same good answer every time
    assert first[0] == "run" and "--greedy" in first


@pytest.mark.parametrize("args", COMMANDS, ids=[" ".join(a)[:60] for a in COMMANDS])
def test_each_readme_command_parses(args):
    root = typer.main.get_command(app)
    ctx = root.make_context("llamacli", list(args))
    rest = getattr(ctx, "_protected_args", []) + ctx.args
    name, command, sub_args = root.resolve_command(ctx, rest)
    sub = command.make_context(name, sub_args, parent=ctx)
    registry = load_registry()
    for key in ("model", "model_arg"):
        value = sub.params.get(key)
        if isinstance(value, str) and not value.startswith("hf://") and "/" not in value and not value.endswith(".gguf"):
            assert registry.get(value) is not None, f"{value} is not in the registry"
