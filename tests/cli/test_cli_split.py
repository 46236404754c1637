"""llama.cpp's --split-mode, --tensor-split, --main-gpu and -dev through the commands (issue 43): one option set
on generate, chat, run, serve and bench, hostile values refused in one line (exit 2), the NumPy backend's emulated
devices giving the one device's tokens, --keep-alive keeping a split model apart, and `inspect --gpus N`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clirun import run, run_subprocess
from llamacli.cli.generate import Task
from llamacli.cli.keep_alive import model_identity, server_key
from llamacli.cli.resident import BadRequest, read_request
from llamacli.ggufio.file import open_gguf
from llamacli.testing import write_model

NP = ("--backend", "numpy")


@pytest.fixture(scope="module")
def tiny(random_model):
    return str(random_model("tiny-llama"))


def tokens(*args: str) -> list[int]:
    r = run("generate", *NP, "-p", "Hello", "-n", "8", "--greedy", "--json", "-q", *args)
    assert r.code == 0, r.err
    return json.loads(r.out)["tokens"]


HOSTILE = [
    (("-sm", "rows"), "--split-mode takes none, layer or tensor, got 'rows'"),
    (("--split-mode", "row"), "is --split-mode tensor here"),
    (("-ts", "1,two"), "--tensor-split takes proportions such as 3,1"),
    (("-ts", "-3,1"), "finite and not negative"),
    (("-ts", "0"), "needs a positive proportion"),
    (("-ts", "1e999"), "finite and not negative"),
    (("-ts", "1," * 3000 + "1"), "characters long"),
    (("-sm", "none", "-ts", "1,1"), "give --split-mode layer or tensor with it"),
    (("-mg", "-2"), "--main-gpu takes a GPU index from 0 to 15, got -2"),
    (("-mg", "x"), "'x' is not a valid int"),
    (("-mg", "99999999999999999999999"), "--main-gpu takes a GPU index"),
    (("-dev", "CUDA0,CUDA0"), "-dev names a device twice"),
    (("-dev", "metal0"), "-dev takes devices such as CUDA0,CUDA1 (or none)"),
    (("-dev", "\x1b]0;owned\x07"), "got '\\x1b]0;owned\\x07'"),
    (("-sm", "layer", "-dev", "none"), "-dev none runs on no GPU"),
    (("-sm", "tensor"), "the NumPy backend emulates the devices --tensor-split lists"),
    (("-sm", "tensor", "-ts", "1,1,1,1,1"), "leaves device 0 no attention head"),
]


@pytest.mark.parametrize("args, words", HOSTILE, ids=[" ".join(a)[:30] for a, _ in HOSTILE])
def test_hostile_split_options_are_one_line_on_every_command(tiny, args, words):
    commands = [("generate", tiny, "-p", "hi", "-n", "1"), ("chat", tiny, "-n", "1"), ("run", tiny, "hi", "-n", "1"),
                ("bench", tiny, "-p", "4", "-n", "2", "-r", "1")]
    if words != HOSTILE[-1][1] and words != HOSTILE[-2][1]:  # (serve checks before it loads; these need the model)
        commands.append(("serve", tiny, "--port", "0"))
    for command in commands:
        r = run(*command, *NP, *args, stdin="hi\n")
        assert r.code == 2, (command, r.err)
        line = r.one_line_error()
        assert words in line and "\x1b" not in line and "\x07" not in line, (command, line)


def test_the_emulated_split_gives_one_devices_tokens(tiny):
    want = tokens(tiny)
    for args in (("-sm", "tensor", "-ts", "1,1"), ("--split-mode", "layer", "--tensor-split", "1/2"),
                 ("-dev", "CUDA0,CUDA1"), ("-sm", "tensor", "-ts", "2,1", "-mg", "1")):
        assert tokens(tiny, *args) == want, args
    r = run("run", tiny, "Hello", *NP, "-n", "8", "--greedy", "--json", "-q", "-sm", "tensor", "-ts", "1,1")
    assert r.code == 0 and json.loads(r.out)["tokens"] == want
    r = run("chat", tiny, *NP, "-n", "4", "--greedy", "-q", "-sm", "layer", "-ts", "1,1", stdin="Hi\nAgain\n")
    plain = run("chat", tiny, *NP, "-n", "4", "--greedy", "-q", stdin="Hi\nAgain\n")
    assert r.code == plain.code == 0 and r.out == plain.out and r.out
    r = run("bench", tiny, *NP, "-p", "8", "-n", "4", "-r", "1", "-o", "json", "-sm", "tensor", "-ts", "1,1")
    assert r.code == 0 and [row["test"] for row in json.loads(r.out)] == ["pp8", "tg4"]


def test_verbose_shows_the_plan_and_numpy_notes_a_gpu_choice(tiny):
    r = run("generate", tiny, *NP, "-p", "Hello", "-n", "2", "-v", "-sm", "tensor", "-ts", "1,1")
    assert r.code == 0, r.err
    assert "tensor split over 2 devices (emulated)" in r.err
    assert "device 1: query heads 2-3 of 4 (KV heads 1-1 of 2), FFN columns 64-127" in r.err
    r = run("generate", tiny, *NP, "-p", "Hello", "-n", "2", "-mg", "1")
    assert r.code == 0 and "--main-gpu and -dev choose a GPU: the NumPy backend runs on the CPU" in r.err


def test_inf_weights_on_emulated_devices_are_one_line_in_a_real_process(tmp_path):
    """inf in a shard's weights flows through the devices' sums (no numpy RuntimeWarning on any rank's thread)
    to the NaN logits the engine reports in one line (exit 1)."""
    path = write_model(tmp_path / "f16.gguf", "tiny-llama", "F16")
    g = open_gguf(path)
    info = g.tensors["blk.0.ffn_down.weight"]
    data = bytearray(path.read_bytes())
    data[info.offset : info.offset + info.n_bytes] = np.full(info.n_elements, np.inf, np.float16).tobytes()
    path.write_bytes(bytes(data))
    for split in (("-sm", "tensor", "-ts", "1,1"), ("-sm", "layer", "-ts", "1,2")):
        r = run_subprocess("generate", "-m", str(path), *NP, "-p", "hello", "-n", "4", "-q", *split)
        assert r.code == 1 and "NaN" in r.one_line_error() and r.out == "", (split, r.err)


def test_bench_url_refuses_the_split_options():
    r = run("bench", "--url", "http://127.0.0.1:9", "-sm", "layer")
    assert r.code == 2 and "--split-mode measures a model here, not a server" in r.one_line_error()


def test_keep_alive_keeps_a_split_model_apart(tiny):
    """A model kept loaded with one split answers only commands with the same split (the options are part of its
    key); without any, the key is what it was before the options existed."""
    load = {"backend": "numpy", "ctx": None, "swa_full": False}
    keys = {server_key(model_identity(Path(tiny), {**load, "split": split}, ("f16", "f16")))
            for split in (None, {"mode": "tensor", "proportions": [1.0, 1.0], "main_gpu": 0, "devices": None,
                                 "moe": "columns"},
                          {"mode": "layer", "proportions": [1.0, 1.0], "main_gpu": 0, "devices": None,
                           "moe": "columns"})}
    assert len(keys) == 3
    assert server_key(model_identity(Path(tiny), load, ("f16", "f16"))) in keys


def test_the_resident_checks_a_requests_split_options(tiny):
    task = Task("complete", {}, {"text": "hi", "max_tokens": 1, "stop": [], "raw": False, "system": None,
                                 "truncate": False, "as_json": False, "verbose": False, "quiet": True, "think": None,
                                 "logprobs": None, "ignore_eos": False}).as_json()
    load = {"path": tiny, "backend": "numpy", "ctx": None, "cache_types": ["f16", "f16"], "swa_full": False,
            "quiet": True, "gpu_layers": None, "flash_attn": False}
    for bad in ({"mode": "tensor"}, "tensor", {"mode": "row", "proportions": [], "main_gpu": 0, "devices": None,
                                                 "moe": "columns"}):
        with pytest.raises(BadRequest, match="split options"):
            read_request({"op": "run", "task": task, "load": {**load, "split": bad}}, [0, 1, 2, 3])
    for good in (None, {"mode": "layer", "proportions": [1, 2], "main_gpu": 0, "devices": None, "moe": "columns"}):
        with pytest.raises(BadRequest, match="environment"):  # (past the split options: the next check)
            read_request({"op": "run", "task": task, "load": {**load, "split": good}}, [0, 1, 2, 3])


# -- inspect --gpus N -----------------------------------------------------------------------------------------


def test_inspect_plans_the_model_over_gpus(smollm2):
    r = run("inspect", str(smollm2), "--gpus", "2", "--gpu-memory", "80G")
    assert r.code == 0, r.err
    text = r.out
    assert "split over 2 GPUs at --ctx 4096" in text and "layer: fits" in text and "tensor: fits" in text
    assert "device 0: layers 0-15 + the embeddings; weights" in text and "of 80.00 GiB free" in text
    assert "device 1: query heads 3-8 of 9 (KV heads 1-2 of 3)" in text
    r = run("inspect", str(smollm2), "--json", "--gpus", "4", "-sm", "tensor", "--ctx", "1024",
            "--gpu-memory", "40M,40M,40M,40M")
    split = json.loads(r.out)["split"]
    assert split["gpus"] == 4 and split["ctx"] == 1024 and [p["mode"] for p in split["plans"]] == ["tensor"]
    assert "no attention head" in split["plans"][0]["error"]  # 3 KV heads (9 query heads) over 4
    r = run("inspect", str(smollm2), "--json", "-sm", "layer", "-ts", "1,1,1", "--gpu-memory", "30M")
    plan = json.loads(r.out)["split"]["plans"][0]
    assert [d["layers"] for d in plan["devices"]] == [[0, 11], [11, 21], [21, 30]]
    assert plan["fits"] is (all(d["need"] <= 30 * 2**20 for d in plan["devices"]))


@pytest.mark.parametrize("args, words", [
    (("--gpus", "0"), "--gpus takes 1 to 16, got 0"),
    (("--gpus", "17"), "--gpus takes 1 to 16"),
    (("--gpus", "2", "--gpu-memory", "lots"), "--gpu-memory: not a size"),
    (("--gpus", "2", "--gpu-memory", "1G,2G,3G"), "--gpu-memory gives 3 sizes for 2 GPUs"),
    (("--gpus", "2", "--gpu-memory", "9" * 40), "a size past 2^60 bytes"),
    (("--gpus", "2", "-dev", "CUDA0,CUDA2"), "-dev names device 2, past the 2 GPUs of --gpus"),
    (("--gpus", "2", "-ts", "1,1,1"), "--tensor-split gives 3 proportions for the 2 GPUs"),
    (("-sm", "bogus"), "--split-mode takes none, layer or tensor"),
])
def test_inspect_refuses_hostile_split_values(smollm2, args, words):
    r = run("inspect", str(smollm2), *args)
    assert r.code == 2 and words in r.one_line_error()
