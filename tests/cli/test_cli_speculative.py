"""Speculative decoding's options through the real commands (in-process): --spec-type, --draft-max, --draft-min,
--spec-ngram-size-n and -md on generate, run, chat, serve and bench; hostile values are one line and exit 2
before anything loads; the replies are those without; --json counts the drafts; a request to serve may set
its own draft bounds (llama-server's speculative.n_max / n_min)."""

from __future__ import annotations

import json

import pytest

from clirun import run
from llamacli.testing import variant

ECHO = "a b c d a b c d a b c d a b c"


@pytest.fixture(scope="module")
def tiny(random_model):
    return str(random_model("tiny-llama", "F32"))


@pytest.mark.parametrize("args,says", [
    (["--spec-type", "bogus"], "--spec-type takes ngram-simple"),
    (["--spec-type", ""], "empty value"),
    (["--spec-type", "draft-mtp"], "multi-token-prediction heads"),
    (["--spec-type", "ngram-mod,ngram-simple"], "ngram-mod"),
    (["--spec-type", "\x1b[31mred"], "\\x1b[31mred"),
    (["--spec-type", "draft-simple"], "needs a draft model"),
    (["--draft-max", "-1"], "--draft-max must be an integer from 0 to 64"),
    (["--draft-max", "99999999999999999999"], "--draft-max"),
    (["--draft-max", "x"], "--draft-max"),
    (["--draft-min", "9", "--draft-max", "4"], "must not exceed"),
    (["--spec-ngram-size-n", "0"], "--spec-ngram-size-n"),
    (["--spec-type", "none", "-md", "whatever.gguf"], "would go unused"),
    (["-md", "/nonexistent/draft.gguf"], "no such file"),
])
@pytest.mark.parametrize("command", ["generate", "run", "chat"])
def test_hostile_speculative_options_are_one_line_and_exit_2(tiny, command, args, says):
    argv = [command, "-m", tiny, *args] + (["-p", "hi"] if command != "chat" else [])
    r = run(*argv, stdin="hi\n")
    assert r.code == 2, r.err
    assert says in r.one_line_error()


def test_generate_json_counts_the_drafts_and_the_reply_is_the_plain_one(tiny):
    common = ["generate", "-m", tiny, "-p", ECHO, "--raw", "--greedy", "-n", "24", "--ignore-eos", "--json",
              "--backend", "numpy", "-q"]
    plain = json.loads(run(*common).out)
    spec = run(*common, "--spec-type", "ngram-simple", "--spec-ngram-size-n", "2", "--draft-max", "5")
    assert spec.code == 0, spec.err
    got = json.loads(spec.out)
    assert got["tokens"] == plain["tokens"] and "speculative" not in plain
    assert got["speculative"]["drafted"] >= got["speculative"]["accepted"] > 0
    text = run(*[a for a in common if a not in ("--json", "-q")], "--spec-type", "ngram", "--spec-ngram-size-n", "2")
    assert text.code == 0 and "draft acceptance" in text.err  # (the timings' line)


def test_a_draft_model_from_the_command_line(tiny, random_model):
    other = str(random_model(variant("tiny-llama", vocab_size=300), "F32"))
    r = run("generate", "-m", tiny, "-p", "hi", "-n", "2", "--backend", "numpy", "-md", other)
    assert r.code == 2 and "vocabulary differs" in r.one_line_error()
    same = str(random_model("tiny-llama", "Q8_0"))
    common = ["generate", "-m", tiny, "-p", ECHO, "--raw", "--greedy", "-n", "16", "--ignore-eos", "--json",
              "--backend", "numpy", "-q"]
    got = json.loads(run(*common, "-md", same, "--draft-max", "3").out)
    assert got["tokens"] == json.loads(run(*common).out)["tokens"] and got["speculative"]["accepted"] > 0


def test_chat_with_speculation_gives_the_same_replies(tiny):
    common = ["chat", "-m", tiny, "--greedy", "-n", "12", "--ignore-eos", "--backend", "numpy", "-q"]
    lines = f"{ECHO}\nand again {ECHO}\n"
    plain = run(*common, stdin=lines)
    spec = run(*common, "--spec-type", "ngram-simple", "--spec-ngram-size-n", "1", stdin=lines)
    assert plain.code == spec.code == 0 and spec.out == plain.out and plain.out.count("\n") == 2


def test_bench_compares_with_and_without(tiny, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text(ECHO)
    r = run("bench", "-m", tiny, "--backend", "numpy", "--spec-type", "ngram", "--spec-ngram-size-n", "2",
            "-n", "24", "-r", "1", "-f", str(prompt), "-o", "json")
    assert r.code == 0, r.err
    plain, spec = json.loads(r.out)
    assert plain["test"] == "plain" and spec["test"] == "ngram-simple" and spec["same_as_plain"] is True
    assert spec["drafted"] > 0 and spec["tokens_per_pass"] > 1
    for args, says in ((["--url", "http://127.0.0.1:9"], "--url"), (["--profile"], "--profile"),
                       (["--draft-max", "0"], "--draft-max > 0")):
        bad = run("bench", "-m", tiny, "--spec-type", "ngram", *args)
        assert bad.code == 2 and says in bad.one_line_error()
    assert "-f gives" in run("bench", "-m", tiny, "-f", str(prompt)).one_line_error()


def test_serve_takes_a_request_s_draft_bounds(random_model):
    """A request's speculative.n_max / n_min over the server's settings; wrong ones are a 400 naming the field."""
    from llamacli.engine.generate import Model
    from llamacli.engine.speculative import SpecSettings
    from llamacli.serve.api import ApiError, read_job

    m = Model(random_model("tiny-llama", "F32"), backend="numpy", ctx=64)
    m.speculative = SpecSettings(("ngram-simple",), 8, 0, 2)
    body = {"prompt": ECHO, "max_tokens": 4}
    assert read_job(m, body, chat=False).speculative is None  # the server's own
    job = read_job(m, {**body, "speculative.n_max": 3, "speculative.n_min": 1}, chat=False)
    assert job.speculative == SpecSettings(("ngram-simple",), 3, 1, 2)
    assert job.run_kwargs()["speculative"] == job.speculative
    assert read_job(m, {**body, "speculative.n_max": 0}, chat=False).speculative.on is False
    for field, value, says in (("speculative.n_max", -1, "from 0 to 64"), ("speculative.n_max", 65, "from 0 to 64"),
                               ("speculative.n_max", "4", "must be an integer"), ("speculative.n_max", True, "integer"),
                               ("speculative.n_min", 9, "must not exceed speculative.n_max (8)")):
        with pytest.raises(ApiError) as exc:
            read_job(m, {**body, field: value}, chat=False)
        assert exc.value.status == 400 and exc.value.param == field and says in str(exc.value), exc.value


def test_a_task_carries_its_speculative_settings_checked():
    """--keep-alive hands a command's Task to the resident server as JSON: speculative settings go with it, and
    wrong ones from another process are refused (ValueError)."""
    from llamacli.cli.generate import Task, reply_task
    from llamacli.engine.speculative import SpecSettings
    from llamacli.sampling.params import SamplingParams

    task = reply_task(SamplingParams(temperature=0.0), None, text="hi", max_tokens=4, stop=(), raw=False, system=None,
                      truncate=False, as_json=False, quiet=True, think=None, logprobs=None, ignore_eos=False,
                      speculative=SpecSettings(("ngram-simple",), 8, 2, 3))
    again = Task.from_json(json.loads(json.dumps(task.as_json())))
    assert again == task and again.options["speculative"]["sources"] == ["ngram-simple"]
    off = reply_task(SamplingParams(), None, text="hi", max_tokens=4, stop=(), raw=False, system=None, truncate=False,
                     as_json=False, quiet=True, think=None, logprobs=None, ignore_eos=False, speculative=SpecSettings())
    assert "speculative" not in off.options
    good = task.as_json()
    for bad in ({"sources": ["ngram-mod"], "draft_max": 8, "draft_min": 0, "ngram_n": 3},
                {"sources": "ngram-simple", "draft_max": 8, "draft_min": 0, "ngram_n": 3},
                {"sources": ["ngram-simple"], "draft_max": 10 ** 9, "draft_min": 0, "ngram_n": 3},
                {"sources": ["ngram-simple"], "draft_max": 8, "draft_min": 0}, [1], "x"):
        with pytest.raises(ValueError):
            Task.from_json({**good, "options": {**good["options"], "speculative": bad}})


def test_a_server_with_speculation_answers_as_without(random_model):
    """A real server (two slots) whose model drafts with ngram-simple: completions with and without a request's own
    bounds are the plain replies, streamed or not, side by side; a wrong bound is a 400 and the server goes on."""
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    import urllib.error
    import urllib.request

    from serve_runner import start, stop

    from llamacli.engine.generate import Model
    from llamacli.engine.speculative import SpecSettings

    m = Model(random_model("tiny-llama", "F32"), backend="numpy", ctx=128, slots=2)
    plain = m.complete(m.tokenize(ECHO), max_tokens=16, temperature=0.0, ignore_eos=True).text
    m.speculative = SpecSettings(("ngram-simple",), 6, 0, 2)
    url, server, thread = start(m, "tiny")

    def post(body):
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        body = {"prompt": ECHO, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        for extra in ({}, {"speculative.n_max": 2}, {"speculative.n_max": 0}, {"speculative.n_min": 3}):
            status, answer = post({**body, **extra})
            assert status == 200 and answer["choices"][0]["text"] == plain, (extra, answer)
        status, answer = post({**body, "speculative.n_max": 1000})
        assert status == 400 and answer["error"]["param"] == "speculative.n_max"
        assert post(body)[0] == 200
    finally:
        stop(server, thread)
        m.close()


def test_bench_verify_cost(tiny):
    """bench --verify-cost: a verification pass of 1 + k tokens against a decode step, a row per k."""
    r = run("bench", "-m", tiny, "--backend", "numpy", "--verify-cost", "1,3", "-d", "32", "-r", "1", "-o", "json")
    assert r.code == 0, r.err
    rows = json.loads(r.out)
    assert [row["tokens"] for row in rows] == [2, 4] and all(row["ratio"] > 0 and row["depth"] == 32 for row in rows)
    for args, says in ((["--verify-cost", "0"], "from 1 to 64"), (["--verify-cost", "65"], "from 1 to 64"),
                       (["--verify-cost", "x"], "comma-separated integers"), (["--verify-cost", "2", "--profile"],
                                                                              "--profile")):
        bad = run("bench", "-m", tiny, "--backend", "numpy", *args)
        assert bad.code == 2 and says in bad.one_line_error(), bad.err
