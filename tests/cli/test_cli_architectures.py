"""inspect, tokenize, generate and chat through the real commands on every new architecture's file
(qwen3, smollm3, YaRN, partial rotary, mistral3, the hybrids qwen35 / qwen35moe / qwen3next, gemma4), NumPy backend;
for the hybrids and gemma4 also bench, thinking through their own templates (Qwen3.5's, Gemma 4's), broken files
refused with one line, and the CUDA backend's refusal (GPU tests)."""

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
    "gemma4": ("tiny-gemma4", "gemma4", "q/k norm, local RoPE on 6 of 8 layers, post-norms, v norm, sliding window 8 on "
               "6 of 8 layers, KV shared on 2 of 8 layers, per-layer embeddings, layer output scale, GeGLU",
               "neox, base 1e+06, scaling proportional"),
    "gemma4-moe": ("tiny-gemma4-moe", "gemma4", "q/k norm, local RoPE on 6 of 8 layers, post-norms, v norm, V = K on 2 "
                   "of 8 layers, sliding window 8 on 6 of 8 layers, layer output scale, GeGLU, mixture of experts "
                   "(softmax, top-k) beside a dense FFN", "neox, base 1e+06, scaling proportional"),
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
@pytest.mark.parametrize("shape", ["tiny-qwen35", "tiny-qwen35moe", "tiny-qwen3next"])
def test_hybrids_generate_and_chat_on_cuda_as_on_numpy(random_model, shape):
    """The hybrid models run on CUDA op by op: greedy generation gives the NumPy backend's tokens, and a chat of two
    turns (the second resuming from the first's stored state) answers on CUDA."""
    from llamacli.backends import cuda_status

    ok, why = cuda_status()
    if not ok:
        pytest.skip(why)
    path = str(random_model(shape, "Q8_0"))
    args = ("-p", "hi", "-n", "8", "--greedy", "--json", "-q")
    want = run("generate", path, "--backend", "numpy", *args)
    got = run("generate", path, "--backend", "cuda", *args)
    assert got.code == 0, got.err
    assert json.loads(got.out)["tokens"] == json.loads(want.out)["tokens"]
    c = run("chat", path, "--backend", "cuda", "-n", "4", "--greedy", "-q", stdin="hi\nagain\n")
    assert c.code == 0 and c.out.count("\n") == 2, (c.out, c.err)


# -- Gemma 4 -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gemma4", "gemma4-moe"])
def test_gemma4_shows_its_layers_and_bench(random_model, kind):
    """inspect shows each attention kind (sliding layers' heads of 32 and their window, global layers' of 64 with a
    quarter of their dims rotating) and the layers that keep no KV cache, whose rows the KV cache's size leaves out;
    bench runs prefill, decode and a depth on the NumPy backend."""
    path = str(random_model(FILES[kind][0], "Q8_0"))
    info = json.loads(run("inspect", path, "--json").out)
    kinds = {k["kind"]: k for k in info["attention_kinds"]}
    assert kinds["sliding"] == {"kind": "sliding", "window": 8, "layers": 6, "head_dim": 32, "n_head_kv": 2,
                                "rope_dims": 32, "rope_base": 10000.0}
    assert kinds["global"]["head_dim"] == 64 and kinds["global"]["rope_dims"] == 16 and kinds["global"]["layers"] == 2
    ctx, moe = info["context_length"], kind == "gemma4-moe"
    own = [(6, 2, 32), (2, 1 if moe else 2, 64)] if moe else [(5, 2, 32), (1, 2, 64)]  # (layers, KV heads, Dh)
    assert info["kv_cache_bytes"] == 2 * 2 * ctx * sum(n * h * d for n, h, d in own)
    r = run("inspect", path)
    assert "attention  " in r.out and "6 sliding-window (8) layers: 2 KV heads x 32, RoPE 32 dims" in r.out
    if moe:
        assert "kv_shared" not in info and "experts" in r.out
    else:
        assert info["kv_shared"] == {"layers": [6, 7], "reads": {"4": [6], "5": [7]}}
        assert "2 layers keep no KV cache: 6 read layer 4's; 7 read layer 5's" in r.out
    b = run("bench", path, "--backend", "numpy", "-p", "8", "-n", "4", "-d", "0,8", "-r", "1", "-o", "json")
    assert b.code == 0, b.err
    assert [row["test"] for row in json.loads(b.out)] == ["pp8", "tg4", "pp8 @ d8", "tg4 @ d8"]


def gemma4_chat_model(tmp_path, llama_cpp_models) -> str:
    """tiny-gemma4 with Gemma 4's chat template (llama.cpp's models/templates/google-gemma-4-31B-it.jinja) and its
    special tokens typed as the converter types them."""
    from llamacli.testing import write_model
    from llamacli.testing.tool_vocab import gemma4_vocab

    vocab = gemma4_vocab((llama_cpp_models / "templates" / "google-gemma-4-31B-it.jinja").read_text())
    return str(write_model(tmp_path / "gemma4-chat.gguf", "tiny-gemma4", "F32", vocab=vocab, std=0.08))


def test_gemma4_thinks_through_its_own_template(tmp_path, llama_cpp_models):
    """Gemma 4's chat template: --think puts <|think|> in a system turn, --no-think (and no flag: the template's
    default) closes an empty thought block after the model's turn opens (tests/models/test_gemma4.py splits a
    scripted reply's thought block)."""
    path = gemma4_chat_model(tmp_path, llama_cpp_models)

    def gen(*flags):
        r = run("generate", path, "--backend", "numpy", "-p", "Why?", "-n", "6", "--greedy", "--json", "-q", *flags)
        assert r.code == 0, r.err
        return json.loads(r.out)

    on, off, default = gen("--think"), gen("--no-think"), gen()
    assert on["prompt_tokens"] != off["prompt_tokens"] and off["prompt_tokens"] == default["prompt_tokens"]


@pytest.mark.parametrize("metadata,drop,words", [
    ({"gemma4.attention.shared_kv_layers": 3}, (), "would read the cache of layer 4, a sliding layer"),
    ({"gemma4.attention.sliding_window_pattern": [True, False]}, (), "should hold a flag for each of the 8 layers"),
    ({"gemma4.embedding_length_per_layer_input": None}, (), "missing metadata key "
     "'gemma4.embedding_length_per_layer_input'"),
    ({"gemma4.attention.key_length_swa": None}, (), "missing metadata key 'gemma4.attention.key_length_swa'"),
    ({}, ("per_layer_token_embd.weight",), "missing tensor 'per_layer_token_embd.weight'"),
    ({}, ("blk.5.attn_k.weight",), "missing tensor 'blk.5.attn_k.weight'"),
])
def test_broken_gemma4_files_are_refused_with_one_line(tmp_path, metadata, drop, words):
    from llamacli.testing import write_model

    path = str(write_model(tmp_path / "broken.gguf", "tiny-gemma4", "F32", metadata=metadata, drop_tensors=drop))
    for args in (("generate", path, "--backend", "numpy", "-p", "hi", "-n", "2"), ("inspect", path)):
        r = run(*args)
        assert r.code == 2 and words in r.one_line_error(), (args, r.err)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["gemma4-e-p32", "tiny-gemma4-moe"])
def test_gemma4_generates_on_cuda_as_on_numpy(random_model, shape):
    """Gemma 4 runs on CUDA op by op: greedy generation gives the NumPy backend's tokens (the E-style model with
    per-layer inputs of 32, whole 32-value units in its per-layer projections, as the real files' 256)."""
    from llamacli.backends import cuda_status
    from llamacli.testing import variant

    ok, why = cuda_status()
    if not ok:
        pytest.skip(why)
    spec = variant("tiny-gemma4", n_embd_per_layer=32, name=shape) if shape == "gemma4-e-p32" else shape
    path = str(random_model(spec, "Q8_0"))
    args = ("-p", "hi", "-n", "8", "--greedy", "--json", "-q")
    want = run("generate", path, "--backend", "numpy", *args)
    got = run("generate", path, "--backend", "cuda", *args)
    assert got.code == 0, got.err
    assert json.loads(got.out)["tokens"] == json.loads(want.out)["tokens"]
