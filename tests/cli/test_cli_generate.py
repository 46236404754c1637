"""`llamacli generate` on the SmolLM2 file with the NumPy backend: text, JSON, sampling, stops, errors, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from clirun import ROOT, run

NP = ("--backend", "numpy")


def gen(model, *args):
    return run("generate", "-m", str(model), *NP, *args)


def test_capital_of_france(smollm2):
    r = gen(smollm2, "--prompt", "The capital of France is", "-n", "16", "--greedy", "--raw")
    assert r.code == 0, r.err
    assert "Paris" in r.out
    assert "prompt eval time" in r.err and "eval time" in r.err  # timings on stderr, not stdout
    assert "eval time" not in r.out


def test_json_output(smollm2):
    r = gen(smollm2, "-p", "The capital of France is", "-n", "8", "--greedy", "--raw", "--json", "--quiet")
    assert r.code == 0 and r.err == ""
    obj = json.loads(r.out)
    assert set(obj) >= {"text", "tokens", "prompt_tokens", "finish_reason", "timings"}
    assert obj["finish_reason"] == "length" and len(obj["tokens"]) == 8
    assert obj["prompt_tokens"] == [504, 3575, 282, 4649, 314]
    assert set(obj["timings"]) >= {"load_ms", "prompt_ms", "prompt_tokens_per_s", "eval_ms", "eval_tokens_per_s"}
    assert "Paris" in obj["text"]


def test_chat_template_is_default_and_eos_stops(smollm2):
    r = gen(smollm2, "-p", "What is the capital of France? Answer in one word.", "-n", "64", "--greedy", "--json", "-q")
    obj = json.loads(r.out)
    assert obj["prompt_tokens"][:2] == [1, 9690]  # <|im_start|>system (SmolLM2's template adds a system turn)
    assert obj["finish_reason"] in ("eos", "length")
    assert "Paris" in obj["text"]


def test_seed_reproducibility(smollm2):
    args = ("-p", "Once upon a time", "-n", "12", "--raw", "--temp", "1.0", "--json", "-q")
    a = json.loads(gen(smollm2, *args, "--seed", "42").out)
    b = json.loads(gen(smollm2, *args, "--seed", "42").out)
    c = json.loads(gen(smollm2, *args, "--seed", "7").out)
    assert a["tokens"] == b["tokens"]
    assert a["tokens"] != c["tokens"]


def test_stop_string(smollm2):
    base = json.loads(gen(smollm2, "-p", "The capital of France is", "-n", "16", "--greedy", "--raw", "--json", "-q").out)
    text = base["text"]
    assert "Paris" in text
    r = gen(smollm2, "-p", "The capital of France is", "-n", "16", "--greedy", "--raw", "--stop", "Paris", "--json", "-q")
    obj = json.loads(r.out)
    assert obj["finish_reason"] == "stop" and obj["text"] == text[: text.index("Paris")]
    r = gen(smollm2, "-p", "The capital of France is", "-n", "16", "--greedy", "--raw", "--stop", "Paris", "-q")
    assert "Paris" not in r.out and r.out.rstrip("\n") == text[: text.index("Paris")].rstrip("\n")


def test_prompt_from_file_and_stdin(smollm2, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("The capital of France is", encoding="utf-8")
    a = gen(smollm2, "--prompt-file", str(f), "-n", "4", "--greedy", "--raw", "-q")
    b = run("generate", "-m", str(smollm2), *NP, "--prompt-file", "-", "-n", "4", "--greedy", "--raw", "-q",
            stdin="The capital of France is")
    assert a.code == b.code == 0 and a.out == b.out and a.out.strip()


@pytest.mark.parametrize(
    "args,words",
    [
        (["-n", "-2"], "max-tokens"),
        (["--top-p", "0"], "top-p"),
        (["--top-p", "1.5"], "top-p"),
        (["--temp", "-1"], "temperature"),
        (["--min-p", "2"], "min-p"),
        (["--top-k", "-3"], "top-k"),
        (["--ctx", "0"], "ctx"),
        (["--backend", "tpu"], "backend"),
    ],
)
def test_invalid_values(smollm2, args, words):
    r = gen(smollm2, "-p", "hi", *args)
    assert r.code == 2
    assert words in r.one_line_error()


def test_prompt_errors(smollm2, tmp_path):
    r = gen(smollm2, "--prompt-file", str(tmp_path / "missing.txt"))
    assert r.code == 2 and "no such prompt file" in r.one_line_error()
    r = gen(smollm2)
    assert r.code == 2 and "--prompt" in r.one_line_error()
    r = run("generate", "-m", str(tmp_path / "nope.gguf"), "-p", "x")
    assert r.code == 2 and r.one_line_error()


def test_context_overflow_and_truncate(smollm2):
    long = "word " * 300
    r = gen(smollm2, "-p", long, "--raw", "--ctx", "64", "-n", "2")
    assert r.code == 2 and "context" in r.one_line_error()
    r = gen(smollm2, "-p", long, "--raw", "--ctx", "64", "-n", "2", "--truncate", "--json", "-q")
    obj = json.loads(r.out)
    assert r.code == 0 and len(obj["prompt_tokens"]) == 63


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(random_model, smollm2, tmp_path):
    """-f with tens of megabytes (tokenizing them whole took a second a megabyte before the context check):
    refused at once, plain (--raw) and through the chat template, with one line; a prompt that fits the
    context but not at the first glance of its length is refused partway; --truncate still keeps the tail."""
    model = random_model("tiny-llama", vocab_file=smollm2)  # SmolLM2's tokenizer, quick weights
    sentence = "The quick brown fox jumps over the lazy dog. "
    for size, extra in ((40 << 20, ("--raw",)), (6 << 20, ())):
        big = tmp_path / f"prompt-{size}.txt"
        big.write_text(sentence * (size // len(sentence)))
        t0 = time.monotonic()
        r = gen(model, "-f", str(big), "--ctx", "256", "-n", "1", *extra)
        seconds = time.monotonic() - t0
        assert seconds < 8, f"{size >> 20} MiB refused after {seconds:.1f} s"
        assert r.code == 2 and "the prompt has more than 255 tokens" in r.one_line_error()
    r = gen(model, "-p", sentence * 60, "--raw", "--ctx", "256", "-n", "1")  # 600 tokens in 2.7 KB
    assert r.code == 2 and "the prompt has more than 255 tokens" in r.one_line_error()
    r = gen(model, "-p", sentence * 60, "--raw", "--ctx", "256", "-n", "1", "--truncate", "--json", "-q")
    assert r.code == 0 and len(json.loads(r.out)["prompt_tokens"]) == 255


def test_context_full_is_length(smollm2):
    r = gen(smollm2, "-p", "The capital of France is", "--raw", "--ctx", "12", "-n", "100", "--greedy", "--json", "-q")
    obj = json.loads(r.out)
    assert obj["finish_reason"] == "length" and len(obj["prompt_tokens"]) + len(obj["tokens"]) == 13


def test_ctrl_c_while_the_cli_imports_is_one_line_and_130():
    """A Ctrl-C that lands while `llamacli` is still importing typer, rich and numpy (simulated by an import
    hook that raises KeyboardInterrupt when llamacli.cli is imported) ends like any later one."""
    code = (
        "import sys\n"
        "class Hook:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'llamacli.cli': raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Hook())\n"
        "import llamacli; llamacli.run()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (130, "", "error: interrupted\n")


def test_verbose_start_up_on_numpy_names_only_real_stages_and_loads_no_ssl(tmp_path):
    """`generate --verbose` of a local file, run as the console script runs it: the start-up line parts the
    imports from the model's lookup and lists no stage the NumPy backend lacks (decode graphs, decode set-up);
    and nothing on the way imports ssl (urllib.request, ~20 ms): no download is needed."""
    from llamacli.testing import write_model

    model = write_model(tmp_path / "tiny.gguf", "tiny-llama", "F32")
    code = (
        "import os, sys\n"
        "leave = os._exit\n"  # the CLI leaves through os._exit after a model command (llamacli.run)
        "os._exit = lambda s: (sys.stderr.write('ssl imported: %s\\n' % ('ssl' in sys.modules)), leave(s))\n"
        f"sys.argv = ['llamacli', 'generate', '-m', {str(model)!r}, '--backend', 'numpy', '-p', 'hi', '-n', '2',"
        " '--raw', '--verbose']\n"
        "import llamacli; llamacli.run()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0, r.stderr
    startup = next(line for line in r.stderr.splitlines() if line.startswith("start-up: "))
    assert startup.startswith("start-up: imports, options ") and ", model lookup " in startup
    assert "decode graphs" not in startup and "decode set-up" not in r.stderr
    assert "ssl imported: False" in r.stderr


def test_ctrl_c_exits_130_with_text_and_timings(smollm2):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        [sys.executable, "-m", "llamacli", "generate", "-m", str(smollm2), "--backend", "numpy", "-p",
         "Write a very long story about a dragon.", "-n", "2000", "--temp", "0.8", "--seed", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )
    first = p.stdout.read(1)  # wait until text is streaming
    assert first
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "Traceback" not in err
    assert (first + out).strip()
    assert "eval time" in err
    assert err.strip().splitlines()[-1] == "error: interrupted"


def test_n_minus_one_generates_until_the_end_or_a_full_context(random_model):
    """-n -1 (llama.cpp's): no limit of its own; the reply ends at an end-of-generation id or when the context
    is full (here a 24-position context and a random model, which rarely says end)."""
    import json

    r = run("generate", "-m", str(random_model()), *NP, "-p", "hi there", "--raw", "--greedy", "-n", "-1",
            "--ctx", "24", "--json")
    assert r.code == 0, r.err
    done = json.loads(r.out)
    assert done["finish_reason"] in ("length", "eos")
    used = len(done["prompt_tokens"]) + len(done["tokens"])  # the last id is sampled, never written: ctx + 1
    assert used <= 25 and (done["finish_reason"] == "eos" or used == 25)
