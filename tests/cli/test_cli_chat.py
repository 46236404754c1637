"""`llamacli chat` on the SmolLM2 file with the NumPy backend: piped stdin (in-process) and a pseudo-terminal
(pexpect): prefix reuse across turns, commands, /save and /load, Ctrl-C, replies on stdout only."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from clirun import ROOT, run
from llamacli.ggufio.file import open_gguf
from llamacli.tokenizer.tokenizer import Tokenizer

NP = ("--backend", "numpy")
# The dim line under each reply: "9 tokens, 48.1 tokens/s; prompt 31 new + 0 reused tokens, 74.3 tokens/s"
STATS = re.compile(r"(\d+) tokens, [\d.]+ tokens/s; prompt (\d+) new \+ (\d+) reused tokens")
Q1, Q2 = "Hi", "What is the capital of France?"


def chat(model, *args, stdin=""):
    return run("chat", "-m", str(model), *NP, "--greedy", *args, stdin=stdin)


def new_ids_of_turn_2(model_path) -> int:
    """What turn 2 must prefill when turn 1's reply ended in EOS: the end of that reply, then the new user turn."""
    tok = Tokenizer.from_metadata(open_gguf(model_path).metadata)
    text = f"<|im_end|>\n<|im_start|>user\n{Q2}<|im_end|>\n<|im_start|>assistant\n"
    return len(tok.encode(text, special=True, add_bos=False))


@pytest.fixture(scope="module")
def piped(smollm2, tmp_path_factory):
    """Two greedy turns from a pipe, with a /save between them."""
    saved = tmp_path_factory.mktemp("chat") / "after-turn-1.json"
    r = chat(smollm2, "-n", "16", stdin=f"{Q1}\n/save {saved}\n{Q2}\n")
    return r, saved


def test_piped_two_turns_second_prefills_only_new_tokens(smollm2, piped):
    r, _ = piped
    assert r.code == 0, r.err
    replies = r.out.splitlines()
    assert len(replies) == 2 and r.out.endswith("\n") and not r.out.endswith("\n\n")
    assert "Paris" in replies[1]
    (n1, new1, reused1), (n2, new2, reused2) = [tuple(map(int, m)) for m in STATS.findall(r.err)]
    assert reused1 == 0 and n1 < 16  # turn 1 ended with EOS, so its whole reply sits in the cache
    assert reused2 == new1 + n1  # turn 2 read all of it back ...
    assert new2 == new_ids_of_turn_2(smollm2)  # ... and prefilled only the new tokens
    assert "tokens/s" not in r.out  # stdout carries replies only


def test_piped_json_lines_and_quiet(smollm2, piped):
    r = chat(smollm2, "-n", "16", "--json", "-q", stdin=f"{Q1}\n\n{Q2}\n")  # an empty line is skipped
    assert r.code == 0 and r.err == ""
    objs = [json.loads(line) for line in r.out.splitlines()]
    assert [o["text"].rstrip() for o in objs] == piped[0].out.splitlines()
    assert objs[0]["reused_tokens"] == 0 and objs[0]["finish_reason"] == "eos"
    assert objs[1]["prompt_tokens"] == objs[1]["reused_tokens"] + objs[1]["timings"]["prompt_tokens"]


def test_save_then_load_continues_the_same_conversation(smollm2, piped):
    r, saved = piped
    first, second = r.out.splitlines()
    assert json.loads(saved.read_text(encoding="utf-8")) == [
        {"role": "user", "content": Q1}, {"role": "assistant", "content": first},
    ]
    r2 = chat(smollm2, "-n", "16", stdin=f"/load {saved}\n{Q2}\n/stats\n")
    assert r2.code == 0, r2.err
    assert r2.out == second + "\n"  # greedy: the loaded conversation answers as the original one did
    assert "loaded 2 messages" in r2.err and "conversation: 4 messages" in r2.err


@pytest.mark.parametrize(
    "content,words",
    [("[{oops", "not valid JSON"), ('{"messages": []}', "expected a JSON list"), (None, "no such conversation file")],
)
def test_piped_bad_load_is_one_line_error(smollm2, tmp_path, content, words):
    f = tmp_path / "c.json"
    if content is not None:
        f.write_text(content, encoding="utf-8")
    r = chat(smollm2, stdin=f"/load {f}\n{Q1}\n")
    assert r.code == 2 and r.out == ""  # without a terminal the first error ends the run
    assert words in r.one_line_error()


def test_piped_hostile_save_and_load_are_one_line_errors(smollm2, tmp_path):
    """A NUL byte in a /save or /load path, and a number of thousands of digits in a conversation file:
    exit 2 with one `error:` line (they were a ValueError traceback)."""
    digits = tmp_path / "digits.json"
    digits.write_text('[{"role": "user", "content": "hi", "n": ' + "9" * 5000 + "}]", encoding="utf-8")
    for line, words in [(f"/save {tmp_path}/a\0b.json", "NUL byte"), (f"/load {digits}", "number too long")]:
        r = chat(smollm2, stdin=f"{line}\n{Q1}\n")
        assert r.code == 2 and r.out == "", r.err
        assert words in r.one_line_error()
    assert sorted(os.listdir(tmp_path)) == ["digits.json"]


def test_piped_load_of_a_long_conversation_into_a_small_context(smollm2, tmp_path):
    """2,000 exchanges /load'ed into --ctx 64: the next turn trims in a few renders and answers (it used to
    render and tokenize the conversation once per dropped exchange: minutes)."""
    f = tmp_path / "long.json"
    messages = []
    for i in range(2000):
        messages += [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
    f.write_text(json.dumps(messages), encoding="utf-8")
    t0 = time.perf_counter()
    r = chat(smollm2, "--ctx", "64", "-n", "1", stdin=f"/load {f}\n{Q2}\n/stats\n")
    assert r.code == 0, r.err
    assert time.perf_counter() - t0 < 30
    assert len(r.out.splitlines()) == 1 and "context full: dropped the" in r.err
    assert "conversation: 4002 messages" in r.err


def test_context_fills_drops_oldest_turns_with_notice(smollm2):
    qs = ["What is the capital of France?", "And of Italy?", "And of Spain?", "And of Poland?"]
    r = chat(smollm2, "--ctx", "96", "-n", "10", "--system", "Be brief.", stdin="".join(q + "\n" for q in qs) + "/stats\n")
    assert r.code == 0, r.err
    assert len(r.out.splitlines()) == len(qs)
    assert re.search(r"context full: dropped the [1-9]\d* oldest messages \(the system prompt stays\)", r.err)
    assert "dropped from the context" in r.err


def test_sampling_options_match_generate():
    import typer.main

    from llamacli.cli.app import app

    group = typer.main.get_command(app)
    opts = {name: {p.name: p for p in group.commands[name].params} for name in ("generate", "chat")}
    shared = ["temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
              "frequency_penalty", "seed", "greedy", "ctx", "backend", "model", "system", "quiet", "max_tokens"]
    for name in shared:
        g, c = opts["generate"][name], opts["chat"][name]
        assert g.opts == c.opts, name
        if name != "max_tokens":  # a chat reply gets more room by default
            assert g.default == c.default, name


@pytest.mark.parametrize("args,words", [(["--ctx", "0"], "ctx"), (["-n", "-2"], "max-tokens"), (["--top-p", "2"], "top-p")])
def test_invalid_options(smollm2, args, words):
    r = chat(smollm2, *args, stdin="hi\n")
    assert r.code == 2 and words in r.one_line_error()


# -- a pseudo-terminal ----------------------------------------------------------------------------------------

pexpect = pytest.importorskip("pexpect")


def spawn(model, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    child = pexpect.spawn(sys.executable, ["-m", "llamacli", "chat", "-m", str(model), *NP, "--greedy", *args],
                          env=env, encoding="utf-8", timeout=120, dimensions=(40, 200))
    child.expect_exact(">>> ")
    return child


def interrupt_at_prompt(child, pattern) -> None:
    """Ctrl-C while input() waits, then `pattern`. CPython's readline loses a SIGINT that lands while it is
    between two select() calls (it only checks signals when select fails with EINTR), and pexpect types far
    faster than a person: so wait until readline has echoed what was typed and sits in select(), and if the
    signal was lost anyway, send another (a lost one leaves only a pending flag, so the two make one
    KeyboardInterrupt, never two)."""
    time.sleep(0.3)
    child.sendintr()
    if child.expect([pattern, pexpect.TIMEOUT], timeout=10) == 1:
        child.sendintr()
        child.expect(pattern)


def turn_stats(child) -> tuple[int, int, int]:
    child.expect(STATS)
    stats = tuple(map(int, child.match.groups()))
    child.expect_exact(">>> ")
    return stats


def test_terminal_turns_reset_ctrl_c_and_exit(smollm2, tmp_path):
    c = spawn(smollm2, "-n", "300")
    try:
        c.sendline(Q1)
        n1, new1, reused1 = turn_stats(c)
        c.sendline(Q2)
        c.expect("Paris")
        n2, new2, reused2 = turn_stats(c)
        assert reused1 == 0 and reused2 == new1 + n1 and new2 == new_ids_of_turn_2(smollm2)

        c.sendline("/stats")
        c.expect_exact("conversation: 4 messages")
        c.expect_exact(">>> ")
        c.sendline("/frobnicate")
        c.expect_exact("unknown command /frobnicate")
        c.expect_exact(">>> ")

        c.sendline("/reset")
        c.expect_exact("conversation cleared")
        c.expect_exact(">>> ")
        c.sendline(Q1)
        n, new, reused = turn_stats(c)
        assert n == n1 and new + reused == new1  # the same first turn, from a cleared conversation

        # Ctrl-C during a reply stops it; the partial reply stays and the prompt comes back.
        c.sendline("Tell me a very long story about a dragon and a knight.")
        c.expect_exact("knight.")
        c.expect(r"\w\w\w")  # the reply has started
        c.sendintr()
        c.expect_exact("interrupted: the partial reply stays in the conversation")
        c.expect_exact(">>> ")
        saved = tmp_path / "c.json"
        c.sendline(f"/save {saved}")
        c.expect_exact("saved 4 messages")
        c.expect_exact(">>> ")
        messages = json.loads(saved.read_text(encoding="utf-8"))
        assert messages[-1]["role"] == "assistant" and 0 < len(messages[-1]["content"]) < 300 * 4

        # A bad file is one error line, and the conversation goes on.
        c.sendline(f"/load {tmp_path / 'missing.json'}")
        c.expect_exact("error: no such conversation file")
        c.expect_exact(">>> ")
        c.sendline(f"/load {saved}")
        c.expect_exact("loaded 4 messages")
        c.expect_exact(">>> ")

        # Ctrl-C at the prompt discards the line; twice in a row leaves with 130.
        c.send("half a line")
        c.expect_exact("half a line")  # readline's echo: it has read the text
        interrupt_at_prompt(c, re.escape("(Ctrl-C again, Ctrl-D or /exit to leave)"))
        c.expect_exact(">>> ")
        interrupt_at_prompt(c, pexpect.EOF)
    finally:
        c.close(force=True)
    assert c.exitstatus == 130


@pytest.mark.parametrize("leave", ["/exit", "ctrl-d"])
def test_terminal_exit_and_ctrl_d_exit_0(smollm2, leave):
    c = spawn(smollm2, "--system", "Be brief.")
    try:
        c.sendline("/system")
        c.expect_exact("system prompt: 'Be brief.'")
        c.expect_exact(">>> ")
        if leave == "/exit":
            c.sendline("/exit")
        else:
            c.sendeof()
        c.expect(pexpect.EOF)
    finally:
        c.close(force=True)
    assert c.exitstatus == 0
