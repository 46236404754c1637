"""inspect, tokenize, generate and chat through the real commands on every new architecture's file
(qwen3, smollm3, YaRN, partial rotary, mistral3), NumPy backend."""

from __future__ import annotations

import json

import pytest

from clirun import run
from llamacli.testing import variant

FILES = {  # kind: (shape, architecture, what inspect says of the blocks, and of RoPE)
    "qwen3": ("tiny-qwen3", "qwen3", "q/k norm", "neox, base 1e+06, scaling none"),
    "smollm3": ("tiny-smollm3", "smollm3", "no RoPE on 1 of 4 layers", "normal"),
    "yarn": (variant("tiny-qwen3", rope_scaling="yarn", rope_factor=4.0, context_length=1024, name="yarn"),
             "qwen3", "q/k norm", "scaling yarn x4 from 256"),
    "partial": (variant("tiny-phi3", rope_dim=16, name="partial"), "phi3", "fused QKV, fused gate/up", "16 of 24 dims"),
    "mistral3": (variant("tiny-llama", arch="mistral3", name="mistral3"), "mistral3", "the Llama block", "normal"),
}


@pytest.mark.parametrize("kind", FILES)
def test_commands_run_on_each_architecture(random_model, kind):
    spec, arch, blocks, rope = FILES[kind]
    path = str(random_model(spec, "Q8_0"))
    r = run("inspect", path)
    assert r.code == 0 and blocks in r.out and rope in r.out, r.out
    info = json.loads(run("inspect", path, "--json").out)
    assert info["architecture"] == arch and info["layers"] == blocks
    t = run("tokenize", "-m", path, "--text", "hello there", "--json")
    assert t.code == 0 and json.loads(t.out)
    g = run("generate", path, "--backend", "numpy", "-p", "hi", "-n", "5", "--greedy", "--json", "-q")
    assert g.code == 0, g.err
    assert len(json.loads(g.out)["tokens"]) <= 5
    c = run("chat", path, "--backend", "numpy", "-n", "4", "--greedy", "-q", stdin="hi\nagain\n")
    assert c.code == 0 and c.out.count("\n") == 2, (c.out, c.err)
