"""What llama.cpp and ollama users type, through the real command (a subprocess): -h everywhere, help with no
arguments, llama.cpp's flags (-c -s -f -n --temp -ngl -fa) and single-dash words never split into -n gl, the
verbs run/list/ls/show, a positional model for generate and chat, the warning for a context past the
trained length."""

from __future__ import annotations

import json
from typing import Annotated

import pytest
import typer

from clirun import run, run_subprocess
from llamacli.cli.parser import HabitCommand, HabitGroup
from llamacli.engine.generate import context_warning
from llamacli.models.config import config_from_metadata

NP = ("--backend", "numpy")
COMMANDS = ("inspect", "generate", "models", "pull", "rm", "tokenize", "bench", "chat", "run", "list", "ls", "show")


@pytest.fixture(scope="module")
def tiny(random_model):
    return str(random_model("tiny-llama"))  # trained context: 256 tokens, no RoPE scaling


@pytest.fixture
def home(tmp_path):
    """An empty cache and no user registry, so `models` lists only the packaged registry; offline, so that it
    does not ask Hugging Face for the sizes (a few seconds per listing, and no network in tests)."""
    (tmp_path / "empty.toml").write_text("", encoding="utf-8")
    return {"LLAMACLI_HOME": str(tmp_path / "cache"), "LLAMACLI_MODELS": str(tmp_path / "empty.toml"),
            "HF_HUB_OFFLINE": "1"}


def test_no_arguments_prints_the_help_on_stdout():
    r = run_subprocess()
    assert r.code == 0 and r.err == ""
    assert r.out.startswith("Usage:") and "Commands:" in r.out and len(r.out.splitlines()) > 10
    assert "generate" in r.out and "run" in r.out


@pytest.mark.parametrize("command", ("",) + COMMANDS)
def test_dash_h_is_help_everywhere(command):
    args = (command, "-h") if command else ("-h",)
    r = run_subprocess(*args)
    assert r.code == 0 and r.err == "", r.err
    assert r.out.startswith("Usage:") and "-h, --help" in r.out


def test_ngl_and_fa_are_accepted_with_a_notice(tiny):
    r = run_subprocess("generate", tiny, *NP, "-p", "hi", "-n", "2", "-ngl", "99", "-fa", "on")
    assert r.code == 0, r.err
    assert "-ngl 99 is ignored: the numpy backend runs on the CPU" in r.err
    assert "-fa is a no-op: the numpy backend has no fused attention to turn on" in r.err
    assert "ignored" not in r.out and "no-op" not in r.out


def test_ngl_notice_on_cuda_says_where_layers_run():
    from llamacli.cli.app import llama_cpp_notices

    (line,) = llama_cpp_notices("cuda", "0", False)
    assert line.startswith("-ngl 0 is ignored") and "every layer on the GPU" in line and "--backend cpu" in line
    assert llama_cpp_notices("cuda", None, False) == []
    assert llama_cpp_notices("cuda", None, True) == ["-fa is a no-op: the CUDA backend's attention is always "
                                                     "fused (flash-attention style)"]


def test_bad_ngl_value_is_one_line_error(tiny):
    r = run_subprocess("generate", tiny, *NP, "-p", "hi", "-ngl", "lots")
    assert r.code == 2 and "--n-gpu-layers" in r.one_line_error()


@pytest.mark.parametrize("args,unknown", [
    (("models", "-ngl", "99"), "-ngl"),  # click read this as -n with the value "gl"
    (("generate", "-ctkd", "q8_0", "-p", "hi"), "-ctkd"),  # ... and this as -c (--ctx) "tkd"
    (("generate", "-xyz", "-p", "hi"), "-xyz"),
    (("generate", "-qx", "-p", "hi"), "-qx"),  # -q is a flag, but -x is nothing
    (("tokenize", "-fa"), "-fa"),  # llama.cpp's, not --file "a"
])
def test_unknown_single_dash_word_is_reported_whole(args, unknown, home):
    r = run_subprocess(*args, env=home)
    assert r.code == 2
    line = r.one_line_error()
    assert line.startswith(f"error: No such option: {unknown}") and "Invalid value" not in line


def test_llama_cpp_spellings_mean_the_same(tiny, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello there", encoding="utf-8")
    ours = run_subprocess("generate", "-m", tiny, *NP, "--prompt-file", str(prompt), "--max-tokens", "3",
                          "--temperature", "0.9", "--seed", "5", "--ctx", "128", "--json", "-q")
    theirs = run_subprocess("generate", tiny, *NP, "-f", str(prompt), "--n-predict", "3", "--temp", "0.9",
                            "-s", "5", "--ctx-size", "128", "--json", "-q")
    short = run_subprocess("generate", tiny, *NP, "--file", str(prompt), "-n3", "--temp", "0.9", "-s", "5",
                           "-c", "128", "--json", "-q")
    assert ours.code == theirs.code == short.code == 0, ours.err + theirs.err + short.err
    assert json.loads(ours.out)["tokens"] == json.loads(theirs.out)["tokens"] == json.loads(short.out)["tokens"]
    assert len(json.loads(ours.out)["tokens"]) <= 3


def test_short_options_run_together_as_posix_has_them(tiny, tmp_path):
    """A single-dash word that is no option of its own splits as getopt would: -pHello is -p "Hello",
    -fprompt.txt is -f "prompt.txt", -qv is -q -v."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Hello", encoding="utf-8")
    spaced = run("generate", tiny, *NP, "-p", "Hello", "-n", "3", "--greedy", "--json", "-q")
    joined = run("generate", "-m" + tiny, *NP, "-pHello", "-n3", "--greedy", "--json", "-q")
    from_file = run("generate", tiny, *NP, "-f" + str(prompt), "-n3", "--greedy", "--json", "-q")
    assert spaced.code == joined.code == from_file.code == 0, joined.err + from_file.err
    tokens = [json.loads(r.out)["tokens"] for r in (spaced, joined, from_file)]
    assert tokens[0] == tokens[1] == tokens[2]
    flags = run("generate", tiny, *NP, "-pHello", "-n1", "-qv")
    assert flags.code == 0 and "backend numpy, context" in flags.err and "eval time" not in flags.err


def test_argument_names_in_usage_lines():
    for command, names in (("run", ("MODEL", "[PROMPT]")), ("inspect", ("MODEL",)), ("pull", ("MODEL",)),
                           ("rm", ("MODEL",))):
        usage = run(command, "-h").out.splitlines()[0]
        assert all(n in usage for n in names) and "model" not in usage.split(command, 1)[1], usage


def test_model_given_twice_is_an_error(tiny):
    r = run_subprocess("generate", tiny, "-m", tiny, *NP, "-p", "hi")
    assert r.code == 2 and "given twice" in r.one_line_error()
    r = run_subprocess("chat", tiny, "-m", tiny, *NP)
    assert r.code == 2 and "given twice" in r.one_line_error()


def test_run_with_a_prompt_is_generate(tiny):
    a = run_subprocess("run", tiny, "Hello", *NP, "-n", "4", "--greedy", "-q")
    b = run_subprocess("generate", tiny, "-p", "Hello", *NP, "-n", "4", "--greedy", "-q")
    assert a.code == b.code == 0, a.err + b.err
    assert a.out == b.out and a.err == ""


def test_run_without_a_prompt_is_chat(tiny):
    lines = "Hello\nHow are you?\n"
    a = run_subprocess("run", tiny, *NP, "-n", "4", "--greedy", "--json", "-q", stdin=lines)
    b = run_subprocess("chat", tiny, *NP, "-n", "4", "--greedy", "--json", "-q", stdin=lines)
    assert a.code == b.code == 0, a.err + b.err
    replies = [[(o["text"], o["prompt_tokens"]) for o in map(json.loads, r.out.splitlines())] for r in (a, b)]
    assert replies[0] == replies[1] and len(replies[0]) == 2


def test_list_ls_and_show_are_aliases(tiny, home):
    models = run_subprocess("models", "--json", env=home)
    assert models.code == 0, models.err
    for alias in ("list", "ls"):
        r = run_subprocess(alias, "--json", env=home)
        assert r.code == 0 and r.out == models.out
    a, b = run_subprocess("show", tiny, "--json"), run_subprocess("inspect", tiny, "--json")
    assert a.code == b.code == 0 and a.out == b.out and json.loads(a.out)


def test_context_past_the_trained_length_warns_once(tiny):
    r = run_subprocess("generate", tiny, *NP, "-p", "hi", "-n", "1", "--ctx", "512")
    assert r.code == 0, r.err
    warnings = [line for line in r.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1
    assert "512" in warnings[0] and "256" in warnings[0] and "no RoPE scaling" in warnings[0]
    r = run_subprocess("generate", tiny, *NP, "-p", "hi", "-n", "1", "--ctx", "256")
    assert r.code == 0 and "warning:" not in r.err


def _config(tensors=("output.weight",), **md):
    base = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
            "llama.attention.head_count": 4, "llama.feed_forward_length": 128, "llama.context_length": 4096,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 32}
    return config_from_metadata({**base, **{f"llama.{k}": v for k, v in md.items()}}, set(tensors))


def test_context_warning_names_the_scaling():
    assert context_warning(_config(), 4096) is None
    linear = context_warning(_config(**{"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}), 8192)
    assert "linear RoPE scaling (factor 4)" in linear and "4096" in linear and "8192" in linear
    llama3 = _config(("output.weight", "rope_freqs.weight"), **{"rope.scaling.original_context_length": 1024})
    assert "llama3 RoPE scaling (from 1024 tokens)" in context_warning(llama3, 8192)


def test_parser_takes_multi_letter_options_once_defined():
    """-ctk/-ctv (the KV-cache issue's) parse as whole names beside -c, and -n32 still attaches its value."""
    app = typer.Typer(cls=HabitGroup)
    seen = {}

    @app.command(cls=HabitCommand)
    def kv(ctk: Annotated[str, typer.Option("-ctk")] = "f16", ctv: Annotated[str, typer.Option("-ctv")] = "f16",
           ctx: Annotated[int, typer.Option("-c")] = 0, n: Annotated[int, typer.Option("-n")] = 0) -> None:
        seen.update(ctk=ctk, ctv=ctv, ctx=ctx, n=n)

    @app.command(cls=HabitCommand)
    def other() -> None:
        pass

    typer.main.get_command(app).main(["kv", "-ctk", "q8_0", "-ctv=q4_0", "-c", "64", "-n32"], standalone_mode=False)
    assert seen == {"ctk": "q8_0", "ctv": "q4_0", "ctx": 64, "n": 32}
