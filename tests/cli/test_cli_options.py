"""Issue 46's second round of habits, through the real commands: --grammar takes text and --grammar-file a file
(llama.cpp's), --ignore-eos, -t/--threads, one option set across generate/chat/run/serve/bench/tokenize,
--debug and -v before or after the command's name, what a base model (no chat template) and the think flags do
to a prompt, and ollama's chat commands from a pipe."""

from __future__ import annotations

import json

import pytest

from clirun import run, run_subprocess
from llamacli.cpu_threads import default_threads, set_threads
from llamacli.testing import tiny_vocab, write_model

NP = ("--backend", "numpy")
GRAMMAR = 'root ::= "yes" | "no"'


@pytest.fixture(scope="module")
def tiny(random_model):
    return str(random_model("tiny-llama"))  # its vocabulary has a chat template


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A base model: the same shape, no chat template in the file."""
    vocab = tiny_vocab()
    del vocab["tokenizer.chat_template"]
    return str(write_model(tmp_path_factory.mktemp("base") / "base.gguf", "tiny-llama", "F32", vocab=vocab))


def gen_json(*args: str, stdin: str = "") -> dict:
    r = run("generate", *NP, "--json", "-q", *args, stdin=stdin)
    assert r.code == 0, r.err
    return json.loads(r.out)


# -- --grammar TEXT, --grammar-file FILE ---------------------------------------------------------------------


def test_grammar_takes_the_text_and_grammar_file_a_file(smollm2, tmp_path):
    pytest.importorskip("llguidance")
    path = tmp_path / "yes-no.gbnf"
    path.write_text(GRAMMAR + "\n", encoding="utf-8")
    args = ("-m", str(smollm2), "-p", "Is the sky blue?", "--greedy", "-n", "8")
    text = gen_json(*args, "--grammar", GRAMMAR)
    assert text["text"] in ("yes", "no") and text["finish_reason"] == "stop"
    assert gen_json(*args, "--grammar-file", str(path))["text"] == text["text"]
    # a path given to --grammar (what it took before): read, with one notice pointing to --grammar-file
    r = run("generate", *NP, *args, "--grammar", str(path))
    assert r.code == 0 and r.out.strip() == text["text"]
    assert [line for line in r.err.splitlines() if "--grammar-file" in line] == [
        f"--grammar takes the grammar's text, as llama.cpp's: read the file {path} as the grammar, as before "
        "(--grammar-file FILE says so)"]
    # run takes them too (chat: tests/sampling/test_structured.py, with a file given to --grammar)
    r = run("run", str(smollm2), "Is the sky blue?", *NP, "--greedy", "-n", "8", "-q", "--grammar", GRAMMAR)
    assert r.code == 0 and r.out.strip() == text["text"]


@pytest.mark.parametrize("args, says", [
    (["--grammar", "no-such-file.gbnf"], "--grammar takes the grammar's text; a grammar file: --grammar-file FILE"),
    (["--grammar", 'root ::= "a"', "--grammar-file", "g.gbnf"], "--grammar and --grammar-file"),
    (["--json-schema", "{}", "--grammar", 'root ::= "a"'], "--json-schema and --grammar"),
    (["--grammar-file", "/nonexistent/g.gbnf"], "no such grammar file"),
    (["--json-schema-file", "/nonexistent/s.json"], "no such JSON schema file"),
])
def test_grammar_mistakes_are_one_line(tiny, args, says):
    pytest.importorskip("llguidance")
    r = run("generate", tiny, *NP, "-p", "hi", *args)
    assert r.code == 2 and says in r.one_line_error()


def test_json_schema_file(smollm2, tmp_path):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema), encoding="utf-8")
    out = gen_json("-m", str(smollm2), "-p", "Answer in JSON.", "--greedy", "-n", "16", "-jf", str(path))
    assert set(json.loads(out["text"])) == {"ok"}


# -- --ignore-eos ----------------------------------------------------------------------------------------------


def test_ignore_eos_never_samples_an_end(tiny):
    """The tiny model's first greedy id made its end-of-text id: without --ignore-eos the reply ends at once,
    with it the reply runs to -n without that id."""
    from llamacli.engine.generate import Model

    with Model(tiny, backend="numpy", ctx=64) as m:
        first = m.complete("hi", raw=True, max_tokens=1, temperature=0).tokens[0]
        m.tokenizer.eog_ids = frozenset(m.tokenizer.eog_ids) | {first}
        assert m.complete("hi", raw=True, max_tokens=8, temperature=0).finish_reason == "eos"
        for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
            c = m.complete("hi", raw=True, max_tokens=8, ignore_eos=True, **kw)
            assert c.finish_reason == "length" and len(c.tokens) == 8
            assert not set(c.tokens) & set(m.tokenizer.eog_ids)


def test_ignore_eos_on_the_commands(smollm2):
    plain = gen_json("-m", str(smollm2), "-p", "Hi", "--greedy", "-n", "24")
    assert plain["finish_reason"] == "eos" and len(plain["tokens"]) < 24  # SmolLM2 says hello briefly
    long = gen_json("-m", str(smollm2), "-p", "Hi", "--greedy", "-n", "24", "--ignore-eos")
    assert long["finish_reason"] == "length" and len(long["tokens"]) == 24
    assert long["tokens"][: len(plain["tokens"])] == plain["tokens"]
    r = run("chat", str(smollm2), *NP, "--greedy", "-n", "24", "--ignore-eos", "--json", "-q", stdin="Hi\n")
    assert r.code == 0 and json.loads(r.out)["finish_reason"] == "length"


# -- -t/--threads ----------------------------------------------------------------------------------------------


def test_default_threads_leave_busy_cpus_alone():
    assert default_threads(cpus=2, busy=0) == 1  # half the CPUs
    assert default_threads(cpus=2, busy=1) == 1
    assert default_threads(cpus=16, busy=0) == 8
    assert default_threads(cpus=16, busy=12) == 4  # the load average's busy CPUs are left alone
    assert default_threads(cpus=16, busy=40) == 1  # at least one
    assert default_threads(cpus=1, busy=0) == 1


def test_set_threads_limits_the_blas_pool():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=None):  # whatever this test sets is undone after it
        assert set_threads(1) == 1
        blas = [i for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
        assert blas and all(i["num_threads"] == 1 for i in blas)


def test_threads_option_on_every_model_command(tiny):
    """-t N applies before numpy loads (the environment's variables where threadpoolctl is missing); -v says what
    it came to."""
    r = run_subprocess("generate", tiny, *NP, "-p", "hi", "-n", "2", "-t", "1", "-v", env={"OPENBLAS_NUM_THREADS": ""})
    assert r.code == 0, r.err
    assert "CPU threads: 1" in r.err.splitlines()
    r = run_subprocess("generate", tiny, *NP, "-p", "hi", "-n", "2", "-v", env={"OPENBLAS_NUM_THREADS": ""})
    assert "CPU threads: 1 (the default; -t N to choose)" in r.err.splitlines()  # (2 cores here: half of them)
    r = run_subprocess("generate", tiny, *NP, "-p", "hi", "-n", "2", "-t", "-1", "-v", env={"OPENBLAS_NUM_THREADS": ""})
    assert "CPU threads: 1 (the default; -t N to choose)" in r.err.splitlines()  # llama.cpp's -1
    for command in (("chat", tiny), ("run", tiny), ("bench", tiny), ("serve", tiny), ("tokenize", tiny, "hi")):
        for bad in ("0", "-2", "5000"):
            r = run(*command, "-t", bad)
            assert r.code == 2 and "--threads must be from 1 to 1024, or -1" in r.one_line_error(), (command, bad)
    r = run("tokenize", tiny, "hi", "--threads", "2")  # accepted as everywhere
    assert r.code == 0, r.err


# -- one option set ------------------------------------------------------------------------------------------


def test_run_takes_what_generate_takes(tiny, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Hello", encoding="utf-8")
    want = gen_json(tiny, "-p", "Hello", "-n", "6", "--greedy", "--raw", "--stop", "zz")
    for args in (("-m", tiny, "Hello"), ("-m", tiny, "-p", "Hello"), (tiny, "-f", str(prompt))):
        r = run("run", *args, *NP, "-n", "6", "--greedy", "--raw", "--stop", "zz", "--json", "-q")
        assert r.code == 0, r.err
        assert json.loads(r.out)["tokens"] == want["tokens"]
    r = run("run", tiny, *NP, "--raw")  # no prompt: a chat, where --raw means nothing
    assert r.code == 2 and "--raw works with a prompt" in r.one_line_error()
    r = run("run", tiny, "Hello", *NP, "-p", "Hi")
    assert r.code == 2 and "give the prompt once" in r.one_line_error()


def test_generate_takes_the_prompt_after_the_model(tiny):
    assert gen_json("-m", tiny, "Hello", "-n", "3", "--greedy")["tokens"] == gen_json(
        tiny, "-p", "Hello", "-n", "3", "--greedy")["tokens"]


def test_serve_takes_llama_cpp_options(tiny):
    """-ngl, -fa and -t parse on serve as on the other commands (the bad port is refused after them)."""
    r = run_subprocess("serve", tiny, "-ngl", "99", "-fa", "on", "-t", "1", "--port", "70000")
    assert r.code == 2 and "--port must lie in 0..65535" in r.one_line_error()
    r = run_subprocess("serve", tiny, "-ngl", "lots")
    assert r.code == 2 and "--n-gpu-layers" in r.one_line_error()


def test_tokenize_takes_model_and_text_as_llama_tokenize_does(smollm2):
    want = run("tokenize", "-m", str(smollm2), "--text", "Hello world")
    assert want.code == 0, want.err
    for args in ((str(smollm2), "Hello world"), ("-m", str(smollm2), "Hello world"),
                 ("-m", str(smollm2), "-p", "Hello world"), (str(smollm2), "--prompt", "Hello world")):
        r = run("tokenize", *args)
        assert r.code == 0 and r.out == want.out, (args, r.err)
    r = run("tokenize", "-m", str(smollm2), "-t", "Hello")  # -t is the thread count everywhere
    assert r.code == 2 and "--threads" in r.one_line_error()


def test_bench_takes_the_model_first(tiny):
    r = run("bench", tiny, *NP, "-p", "8", "-n", "4", "-r", "1", "-o", "json")
    assert r.code == 0, r.err
    assert [row["test"] for row in json.loads(r.out)] == ["pp8", "tg4"]


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_and_verbose_before_or_after_the_command(tiny, where):
    def args(flag: str, *rest: str) -> list[str]:
        return [flag, *rest] if where == "before" else [*rest, flag]

    r = run_subprocess(*args("--debug", "generate", "-m", "/no/such/model.gguf", "-p", "hi"))
    assert r.code == 2 and "Traceback" in r.err and r.err.rstrip().splitlines()[-1].startswith("error: no such file")
    r = run_subprocess(*args("-v", "generate", tiny, *NP, "-p", "hi", "-n", "1"))
    assert r.code == 0 and "backend numpy, context" in r.err
    for command in ("chat", "run"):
        r = run(*args("--verbose", command, tiny, *NP, "-n", "1", "-q"), stdin="hi\n")
        assert r.code == 0 and "chat template: gguf" in r.err, r.err
    r = run(*args("--debug", "models", "--json"))  # every command takes them
    assert r.code == 0 and json.loads(r.out)


# -- base models and the think flags ---------------------------------------------------------------------------


def test_a_base_model_says_its_prompt_is_plain_text(base, tiny):
    r = run("generate", base, *NP, "-p", "hi", "-n", "2", "-v")
    assert r.code == 0, r.err
    lines = r.err.splitlines()
    assert "chat template: none (the file has none: the prompt goes in as plain text)" in lines
    assert ("the model's file has no chat template (a base model): the prompt goes in as plain text, for the model "
            "to continue") in lines
    assert "base model" not in r.out
    r = run("generate", base, *NP, "-p", "hi", "-n", "2", "--system", "Be brief.")
    assert r.code == 0 and ("the model's file has no chat template (a base model): --system puts the prompt in the "
                            "built-in chatml format, which it may not follow") in r.err.splitlines()
    r = run("chat", base, *NP, "-n", "2", "-v", stdin="hi\n")
    assert r.code == 0 and "chat template: builtin:chatml (the file has none)" in r.err.splitlines()
    assert ("the model's file has no chat template (a base model): the conversation takes the built-in chatml "
            "format, which it may not follow") in r.err.splitlines()
    assert "base model" not in run("generate", base, *NP, "-p", "hi", "-n", "2", "-q").err
    assert "base model" not in run("generate", tiny, *NP, "-p", "hi", "-n", "2").err  # it has a template
    assert "base model" not in run("generate", base, *NP, "-p", "hi", "-n", "2", "--raw").err  # asked for


def test_think_flags_that_reach_no_template_say_so(base, tiny):
    r = run("generate", base, *NP, "-p", "hi", "-n", "2", "--think")
    notices = [line for line in r.err.splitlines() if "--think" in line]
    assert r.code == 0 and notices == [
        "the model's file has no chat template (a base model): the prompt goes in as plain text, for the model to "
        "continue; --think is ignored"]
    r = run("generate", tiny, *NP, "-p", "hi", "-n", "2", "--raw", "--no-think")
    assert r.code == 0 and "--no-think is ignored: --raw sends the prompt without the chat template" in r.err


def test_models_marks_base_models(tmp_path):
    env = {"LLAMACLI_HOME": str(tmp_path / "cache"), "LLAMACLI_MODELS": str(tmp_path / "none.toml"),
           "HF_HUB_OFFLINE": "1"}
    (tmp_path / "none.toml").write_text("", encoding="utf-8")
    rows = {row["name"]: row for row in json.loads(run_subprocess("models", "--json", env=env).out)}
    assert rows["gemma3-270m"]["base"] is True and rows["smollm2-135m-instruct"]["base"] is False
    table = run_subprocess("models", env=env).out
    line = next(line for line in table.splitlines() if line.startswith("gemma3-270m"))
    assert "[base model: continues text, no chat template]" in line
    assert "base model" not in next(line for line in table.splitlines() if line.startswith("smollm2-135m-instruct"))


# -- ollama's chat commands ------------------------------------------------------------------------------------


def test_piped_ollama_commands_are_commands(tiny):
    lines = ["hi", "/set parameter num_predict 2", "hi again", "/clear", "hi", "/bye", "never answered"]
    r = run("chat", tiny, *NP, "--greedy", "-n", "6", "--json", stdin="\n".join(lines) + "\n")
    assert r.code == 0, r.err
    replies = [json.loads(line) for line in r.out.splitlines()]
    assert len(replies) == 3  # /set, /clear and /bye reached no model
    assert replies[1]["timings"]["eval_tokens"] <= 1 < replies[0]["timings"]["eval_tokens"]  # -n 2, then -n 6
    assert replies[2]["prompt_tokens"] == replies[0]["prompt_tokens"]  # /clear: the same prompt as the first
    assert replies[2]["text"] == replies[0]["text"][: len(replies[2]["text"])]
    assert "set max_tokens to 2" in r.err and "conversation cleared" in r.err


def test_set_parameter_changes_sampling(tiny):
    base_reply = run("chat", tiny, *NP, "-n", "5", "--seed", "1", "--json", "-q", stdin="hi\n")
    greedy = run("chat", tiny, *NP, "-n", "5", "--greedy", "--json", "-q", stdin="hi\n")
    set_greedy = run("chat", tiny, *NP, "-n", "5", "--seed", "1", "--json", "-q",
                     stdin="/set parameter temperature 0\nhi\n")
    assert base_reply.code == greedy.code == set_greedy.code == 0, set_greedy.err
    assert json.loads(set_greedy.out)["text"] == json.loads(greedy.out)["text"]
    for bad in ("/set parameter temperature warm", "/set parameter top_k", "/set parameter num_ctx 64",
                "/set parameter bogus 1", "/set colour blue", "/set parameter top_p 7"):
        r = run("chat", tiny, *NP, "-n", "2", stdin=bad + "\nhi\n")
        assert r.code == 2 and r.out == "", bad
        r.one_line_error()
