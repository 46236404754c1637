"""Hostile schemas and grammars (issue 46, class 1) end in one line, never a crash, a hang or a 500.

Each class from tests/hostile_grammars.py is refused by the library (GrammarError, one line) and by the CLI
(exit 2, one `error:` line; twice in a real process, where a native stack overflow used to exit 139), while
ordinary schemas and grammars, recursive ones included, still compile. Then the second guard alone, with the
static bounds lifted: a crash, a hang and a memory blow-up inside the worker process each become one line, and
its answers are cached by content. The server's side is tests/serve/test_serve_grammar.py."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid

import pytest

pytest.importorskip("llguidance")

import hostile_grammars as hostile  # noqa: E402

from clirun import run, run_subprocess  # noqa: E402
from llamacli.errors import GrammarError  # noqa: E402
from llamacli.sampling import grammar_limits, grammar_sandbox  # noqa: E402
from llamacli.sampling.structured import schema_grammar, text_grammar  # noqa: E402


def refused(fn, value) -> str:
    """The one-line message of the GrammarError fn(value) raises."""
    t0 = time.perf_counter()
    with pytest.raises(GrammarError) as info:
        fn(value)
    message = str(info.value)
    assert "\n" not in message and len(message) < 800, message
    assert time.perf_counter() - t0 < 30, "refused, but slowly"
    return message


@pytest.mark.parametrize("name", sorted(hostile.SCHEMAS))
def test_hostile_schema_is_refused_in_one_line(name):
    schema, says = hostile.SCHEMAS[name]
    message = refused(schema_grammar, schema)
    assert message.startswith("invalid JSON schema: ") and says in message, message
    assert refused(schema_grammar, json.dumps(schema)) == message  # its JSON text, as --json-schema reads it


@pytest.mark.parametrize("name", sorted(hostile.GRAMMARS))
def test_hostile_grammar_is_refused_in_one_line(name):
    text, says = hostile.GRAMMARS[name]
    message = refused(text_grammar, text)
    assert message.startswith("invalid grammar: ") and says in message, message


@pytest.mark.parametrize("name", sorted(hostile.UNUSABLE))
def test_a_schema_llguidance_accepts_but_cannot_follow_is_refused_up_front(name):
    """It used to compile and then fail at the first mask while generating (a 500 from the server)."""
    schema, says = hostile.UNUSABLE[name]
    assert says in refused(schema_grammar, schema)


@pytest.mark.parametrize("name", sorted(hostile.ORDINARY_SCHEMAS))
def test_ordinary_schemas_still_compile(name):
    assert schema_grammar(hostile.ORDINARY_SCHEMAS[name])


@pytest.mark.parametrize("name", sorted(hostile.ORDINARY_GRAMMARS))
def test_ordinary_grammars_still_compile(name):
    assert text_grammar(hostile.ORDINARY_GRAMMARS[name])


def test_the_limits_are_far_above_real_use():
    """What the bounds promise (SECURITY.md): a schema at each limit passes."""
    deep = hostile.nested_through_refs(grammar_limits.MAX_SCHEMA_DEPTH // 2 - 1, "properties")  # 2 schemas a level
    assert schema_grammar(deep)
    assert text_grammar(hostile.gbnf_chain(grammar_limits.MAX_RULE_DEPTH - 3))
    assert text_grammar(hostile.lark_alternation(grammar_limits.MAX_ALTERNATIVES))
    assert schema_grammar({"type": "string", "pattern": f"^[a-z]{{{grammar_limits.MAX_REPEAT}}}$"})


# -- the command line --------------------------------------------------------------------------------------

CLI_CASES = [
    ("--json-schema", json.dumps(hostile.SCHEMAS["ref_chain"][0]), "nest"),
    ("--json-schema", json.dumps(hostile.SCHEMAS["items_through_refs"][0]), "nest"),
    ("--json-schema", json.dumps(hostile.SCHEMAS["anyOf_literally"][0]), "nests more than"),
    ("--json-schema", json.dumps(hostile.SELF), "refers to itself"),
    ("--json-schema", json.dumps(hostile.MUTUAL), "refers to itself"),
    ("--json-schema", json.dumps(hostile.SCHEMAS["pattern_repetition"][0]), "repeats something"),
    ("--json-schema", json.dumps(hostile.UNUSABLE["optional_properties"][0]), "llguidance cannot go on"),
    ("--grammar", hostile.GRAMMARS["gbnf_chain"][0], "refer to one another"),
    ("--grammar", hostile.GRAMMARS["gbnf_many_rules"][0], "more than 5000 rules"),
    ("--grammar", hostile.GRAMMARS["gbnf_alternation"][0], "alternatives"),
    ("--grammar", hostile.GRAMMARS["lark_regex_repetition"][0], "repeats something"),
]


@pytest.mark.parametrize("option, text, says", CLI_CASES, ids=[f"{o}-{s}" for o, _, s in CLI_CASES])
def test_cli_refuses_with_exit_2_and_one_line(random_model, tmp_path, option, text, says):
    path = tmp_path / ("schema.json" if option == "--json-schema" else "grammar.gbnf")
    path.write_text(text)
    for command in ("generate", "chat"):
        extra = ["-p", "hi"] if command == "generate" else []
        r = run(command, "-m", str(random_model()), *extra, option, str(path), stdin="hi\n")
        assert r.code == 2 and says in r.one_line_error(), r.err
        assert r.out == ""


@pytest.mark.parametrize("option, name", [("--json-schema", "ref_chain"), ("--grammar", "gbnf_chain")])
def test_cli_in_a_real_process_exits_2_not_139(random_model, tmp_path, option, name):
    """What overflowed llguidance's native stack (exit 139, no message), through the real command and its
    default bounds and deadline."""
    text = json.dumps(hostile.SCHEMAS[name][0]) if option == "--json-schema" else hostile.GRAMMARS[name][0]
    path = tmp_path / "input"
    path.write_text(text)
    r = run_subprocess("generate", "-m", str(random_model()), "-p", "hi", option, str(path), timeout=60)
    assert r.code == 2, (r.code, r.err[-2000:])
    assert "invalid" in r.one_line_error()


def test_cli_ordinary_grammar_still_generates(random_model, tmp_path):
    path = tmp_path / "g.gbnf"
    path.write_text('root ::= "yes" | "no"\n')
    r = run("generate", "-m", str(random_model()), "-p", "hi", "--grammar", str(path), "-n", "8", "-q")
    assert r.code == 0 and r.out.strip() in ("yes", "no"), r.err


# -- the second guard: the worker process ------------------------------------------------------------------


@pytest.fixture
def unbounded(monkeypatch):
    """The static bounds lifted, so that what they would refuse reaches the worker."""
    for name in ("MAX_SCHEMA_DEPTH", "MAX_RULE_DEPTH", "MAX_RULES", "MAX_ALTERNATIVES", "MAX_REPEAT",
                 "MAX_EXPANSION", "MAX_WIDTH"):
        monkeypatch.setattr(grammar_limits, name, 10**12)


def bounds(monkeypatch, **kw) -> None:
    monkeypatch.setattr(grammar_sandbox, "BOUNDS", dataclasses.replace(grammar_sandbox.BOUNDS, **kw))


def test_a_stack_overflow_in_the_worker_is_one_line(unbounded):
    message = refused(schema_grammar, hostile.ref_chain(8000))
    assert "stack overflowed" in message, message
    message = refused(text_grammar, hostile.lark_chain(6000))
    assert "stack overflowed" in message, message


def test_a_compile_past_the_deadline_is_one_line(unbounded, monkeypatch):
    bounds(monkeypatch, deadline_s=1.0)
    t0 = time.perf_counter()
    message = refused(text_grammar, hostile.gbnf_chain(50000))  # (minutes, before)
    assert "took longer than 1 s" in message and time.perf_counter() - t0 < 15, message


def test_a_compile_past_the_memory_limit_is_one_line(monkeypatch):
    bounds(monkeypatch, memory_bytes=128 << 20)
    try:
        text_grammar(f'start: "{uuid.uuid4().hex}"\n')
    except GrammarError as exc:
        pytest.skip(f"this Python needs more than 128 MiB of address space to start the worker ({exc})")
    message = refused(text_grammar, 'start: "' + "ab" * 100_000 + '"\n')  # a long literal
    assert "needs more than 128 MiB of memory" in message, message


def test_answers_are_cached_by_content(monkeypatch):
    """A schema, accepted or refused, starts the worker once; the same text again does not."""
    calls = []
    real = grammar_sandbox.subprocess.run
    monkeypatch.setattr(grammar_sandbox.subprocess, "run", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ok = {"type": "object", "description": uuid.uuid4().hex}
    bad = {**hostile.UNUSABLE["optional_properties"][0], "description": uuid.uuid4().hex}
    first = schema_grammar(ok)
    one = refused(schema_grammar, bad)
    assert len(calls) == 2
    assert schema_grammar(json.dumps(ok)) == first and refused(schema_grammar, bad) == one
    assert len(calls) == 2


def test_the_local_compile_runs_on_a_large_stack():
    """compile_with_stack runs its function on its own thread (the stack it asks for) and hands back its
    value or its exception."""
    assert grammar_sandbox.compile_with_stack(lambda: threading.current_thread().name) == "llamacli-grammar"
    with pytest.raises(ZeroDivisionError):
        grammar_sandbox.compile_with_stack(lambda: 1 // 0)
