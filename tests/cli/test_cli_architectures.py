"""inspect, tokenize, generate and chat through the real commands on every new architecture's file
(qwen3, smollm3, YaRN, partial rotary, mistral3, the hybrids qwen35 / qwen35moe / qwen3next), NumPy backend; for
the hybrids also bench, thinking through Qwen3.5's own template, broken files refused with one line, and the CUDA
backend's refusal (a GPU test)."""

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
    "qwen35": ("tiny-qwen35", "qwen35", "gated delta-net (linear attention) on 6 of 8 layers, attention on 2 of 8 "
               "layers (q/k norm, gated attention)", "8 of 32 dims, sections [11, 11, 10, 0]"),
    "qwen35moe": ("tiny-qwen35moe", "qwen35moe", "gated delta-net (linear attention) on 6 of 8 layers, attention on "
                  "2 of 8 layers (q/k norm, gated attention), shared expert, mixture of experts (softmax, top-k)",
                  "neox, base 1e+07"),
    "qwen3next": (variant("tiny-qwen3next", n_mtp=1), "qwen3next", "gated delta-net (linear attention) on 6 of 8 "
                  "layers, attention on 2 of 8 layers (q/k norm, gated attention), shared expert, mixture of experts "
                  "(softmax, top-k)", "8 of 32 dims"),
}
HYBRIDS = ("qwen35", "qwen35moe", "qwen3next")


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


@pytest.mark.parametrize("kind", HYBRIDS)
def test_hybrids_show_their_state_and_bench(random_model, kind):
    """inspect shows the recurrent state per sequence (constant in the context) beside the attention layers' KV
    cache; bench runs prefill, decode and a depth on the NumPy backend."""
    path = str(random_model(FILES[kind][0], "Q8_0"))
    info = json.loads(run("inspect", path, "--json").out)
    assert info["recurrent_layers"] == 6 and info["recurrent_state_bytes"] == 6 * 4 * (3 * 128 + 4 * 16 * 16)
    assert info["ssm"] == {"conv_kernel": 4, "state_size": 16, "key_heads": 2, "value_heads": 4}
    assert "kv_cache_rings" not in info and info["kv_cache_bytes"] == 2 * 2 * 2 * 2 * 32 * info["context_length"]
    r = run("inspect", path)
    assert "recurrent state" in r.out and "per sequence at any context (6 delta-net layers" in r.out
    b = run("bench", path, "--backend", "numpy", "-p", "8", "-n", "4", "-d", "0,8", "-r", "1", "-o", "json")
    assert b.code == 0, b.err
    assert [row["test"] for row in json.loads(b.out)] == ["pp8", "tg4", "pp8 @ d8", "tg4 @ d8"]


def test_qwen35_thinks_through_its_own_template(tmp_path, llama_cpp_models):
    """Qwen3.5's chat template (llama.cpp's models/templates/Qwen3.5-4B.jinja): --no-think closes the think block in
    the prompt, --think leaves it open so that what the model writes is reasoning, as for Qwen3."""
    from llamacli.testing import tiny_vocab, write_model

    vocab = tiny_vocab()
    vocab["tokenizer.ggml.tokens"] = vocab["tokenizer.ggml.tokens"] + ["<think>", "</think>"]
    vocab["tokenizer.ggml.token_type"] = vocab["tokenizer.ggml.token_type"] + [4, 4]
    vocab["tokenizer.chat_template"] = (llama_cpp_models / "templates" / "Qwen3.5-4B.jinja").read_text()
    path = str(write_model(tmp_path / "qwen35-chat.gguf", "tiny-qwen35", "F32", vocab=vocab, std=0.08))

    def gen(*flags):
        r = run("generate", path, "--backend", "numpy", "-p", "Why?", "-n", "8", "--greedy", "--json", "-q", *flags)
        assert r.code == 0, r.err
        return json.loads(r.out)

    on, off = gen("--think"), gen("--no-think")
    assert on["reasoning"] and off["reasoning"] == "" and off["text"]
    assert off["prompt_tokens"] > on["prompt_tokens"]  # "<think>\n\n</think>\n\n" against "<think>\n"


@pytest.mark.parametrize("metadata,drop,words", [
    ({"qwen35.ssm.conv_kernel": 0}, (), "impossible value 0 (the delta net's convolution width)"),
    ({"qwen35.ssm.inner_size": 48}, (), "the delta net's state shapes disagree"),
    ({"qwen35.ssm.group_count": None}, (), "missing metadata key 'qwen35.ssm.group_count'"),
    ({"qwen35.rope.dimension_sections": None}, (), "missing metadata key 'qwen35.rope.dimension_sections'"),
    ({}, ("blk.0.attn_gate.weight",), "missing tensor 'blk.0.attn_gate.weight'"),
    ({}, ("blk.2.ssm_beta.weight",), "missing tensor 'blk.2.ssm_beta.weight'"),
])
def test_broken_hybrid_files_are_refused_with_one_line(tmp_path, metadata, drop, words):
    from llamacli.testing import write_model

    path = str(write_model(tmp_path / "broken.gguf", "tiny-qwen35", "F32", metadata=metadata, drop_tensors=drop))
    for args in (("generate", path, "--backend", "numpy", "-p", "hi", "-n", "2"), ("inspect", path)):
        r = run(*args)
        assert r.code == 2 and words in r.one_line_error(), (args, r.err)


@pytest.mark.gpu
def test_cuda_refuses_hybrids_naming_the_cpu_backend(random_model):
    """The CUDA backend has no gated delta-net layers yet: one line, exit 1, the way to run the model named."""
    from llamacli.backends import cuda_status

    ok, why = cuda_status()
    if not ok:
        pytest.skip(why)
    path = str(random_model("tiny-qwen35", "Q8_0"))
    r = run("generate", path, "--backend", "cuda", "-p", "hi", "-n", "2")
    assert r.code == 1 and "runs on the CPU backend for now (--backend cpu)" in r.one_line_error()
