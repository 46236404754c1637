"""`llamacli inspect`: the SmolLM2 summary, JSON keys, and one-line errors for every kind of bad file."""

from __future__ import annotations

import json

from gguf import GGMLQuantizationType as QT

import gguf_bytes as gb
from clirun import run, run_subprocess

JSON_KEYS = ["architecture", "name", "parameters", "file_size", "context_length", "n_layer", "n_embd", "n_head",
             "n_head_kv", "head_dim", "n_ff", "vocab_size", "rope_type", "rope_freq_base", "rms_eps",
             "tokenizer_model", "tokenizer_pre", "bos_token_id", "eos_token_id", "has_chat_template", "quantization"]


def test_smollm2_summary(smollm2):
    r = run("inspect", str(smollm2))
    assert r.code == 0 and r.err == ""
    for text in ["llama", "30", "576", "9 / 3", "1536", "49152", "8192", "gpt2 / smollm", "Q4_1", "Q8_0", "F32"]:
        assert text in r.out, text


def test_smollm2_json(smollm2):
    r = run("inspect", str(smollm2), "--json", "--ctx", "2048", "--tensors")
    assert r.code == 0
    info = json.loads(r.out)
    for key in JSON_KEYS:
        assert key in info, key
    assert (info["architecture"], info["n_layer"], info["n_embd"], info["n_head"], info["n_head_kv"]) == ("llama", 30, 576, 9, 3)
    assert (info["n_ff"], info["vocab_size"], info["context_length"], info["head_dim"]) == (1536, 49152, 8192, 64)
    assert (info["tokenizer_model"], info["tokenizer_pre"]) == ("gpt2", "smollm")
    assert set(info["quantization"]) == {"Q4_1", "Q8_0", "F32"}
    assert info["quantization"]["Q8_0"] == {"tensors": 1, "bytes": 30081024, "bits_per_weight": 8.5}
    assert info["file_size"] == 98362432 and info["has_chat_template"] is True
    assert info["bos_token_id"] == 1 and info["eos_token_id"] == 2 and info["rope_type"] == "normal"
    assert 134_000_000 < info["parameters"] < 136_000_000
    # K and V of 30 layers x 3 KV heads x 64 dims: fp16 2 bytes a value, q8_0 34 bytes a 32-value block
    assert info["kv_cache_bytes_at_ctx"] == {"ctx": 2048, "bytes": 2 * 30 * 2048 * 192 * 2,
                                             "bytes_q8_0": 2 * 30 * 2048 * 3 * 2 * 34}
    assert len(info["tensors"]) == 272
    emb = next(t for t in info["tensors"] if t["name"] == "token_embd.weight")
    assert emb == {"name": "token_embd.weight", "type": "Q8_0", "shape": [49152, 576], "bytes": 30081024, "offset": emb["offset"]}


def test_metadata_listing_abbreviates(smollm2):
    r = run("inspect", str(smollm2), "--metadata", "--json")
    md = json.loads(r.out)["metadata"]
    assert md["llama.block_count"] == 30
    assert md["tokenizer.ggml.tokens"][-1] == "... (49152 items)"
    assert "tokenizer.ggml.tokens" in run("inspect", str(smollm2), "--metadata").out


def test_vocab_only_file(llama_cpp_models):
    r = run("inspect", str(llama_cpp_models / "ggml-vocab-llama-bpe.gguf"), "--json")
    info = json.loads(r.out)
    assert r.code == 0 and info["vocab_only"] and info["tokenizer_pre"] == "llama-bpe" and info["vocab_size"] == 128256
    assert "vocabulary-only" in run("inspect", str(llama_cpp_models / "ggml-vocab-llama-bpe.gguf")).out


def test_random_models_of_each_arch(random_model):
    for shape in ("tiny-llama", "tiny-qwen2", "tiny-phi3"):
        info = json.loads(run("inspect", str(random_model(shape, "Q8_0")), "--json").out)
        assert info["architecture"] == shape.split("-")[1]


# -- bad input: exit 2, one line on stderr, no traceback ----------------------------------------------------------


def bad(tmp_path, data: bytes, *words: str, code: int = 2):
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    r = run("inspect", str(p))
    assert r.code == code, r.err
    line = r.one_line_error()
    for w in words:
        assert w in line, line
    assert r.out == ""
    return line


def test_bad_files(tmp_path):
    bad(tmp_path, b"not a model at all", "not a GGUF file")
    bad(tmp_path, gb.gguf([], version=7), "version 7")
    bad(tmp_path, gb.f32_tensor_file()[:-3], "truncated")
    bad(tmp_path, gb.f32_tensor_file()[:30], "truncated")
    bad(tmp_path, gb.gguf([gb.kv("general.architecture", gb.STR, "llama")], n_tensors=1 << 40), "claims", str(1 << 40))
    bad(tmp_path, gb.gguf([], [gb.tensor_info("blk.0.ffn_up.weight", [32], 123, 0)], b"\0" * 64), "blk.0.ffn_up.weight", "123")


def test_missing_path(tmp_path):
    r = run("inspect", str(tmp_path / "missing.gguf"))
    assert r.code == 2 and "no such file" in r.one_line_error()


def test_unknown_architecture(tmp_path):
    line = bad(tmp_path, gb.f32_tensor_file(arch="mamba"), "'mamba'", "llama")
    assert "not supported" in line


def test_model_level_errors(tmp_path, random_model):
    from llamacli.testing import write_model

    def check(words, **kw):
        p = write_model(tmp_path / "m.gguf", "tiny-llama", "F32", **kw)
        r = run("inspect", str(p))
        assert r.code == 2, r.err
        line = r.one_line_error()
        for w in words:
            assert w in line, line

    check(["missing tensor", "blk.1.ffn_up.weight"], drop_tensors=("blk.1.ffn_up.weight",))
    check(["missing metadata key", "llama.block_count"], metadata={"llama.block_count": None})
    check(["blk.0.attn_k.weight", "[32, 64]", "[64, 64]"], metadata={"llama.attention.head_count": 2, "llama.attention.head_count_kv": 2, "llama.rope.dimension_count": 32})
    check(["token_embd.weight", "[273, 64]", "[273, 32]"], metadata={"llama.embedding_length": 32, "llama.rope.dimension_count": 8})
    check(["blk.0.attn_k.weight", "I32", "cannot run"], tensor_types={"blk.0.attn_k.weight": QT.I32})


def test_debug_shows_traceback(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"nope")
    r = run("--debug", "inspect", str(p))
    assert r.code == 2 and "Traceback" in r.err and r.err.strip().splitlines()[-1].startswith("error: ")


def test_usage_errors_are_one_line():
    for args in (["inspect"], ["inspect", "--bogus", "x"], ["nosuchcommand"], ["inspect", "x", "--ctx", "abc"]):
        r = run(*args)
        assert r.code == 2
        r.one_line_error()


def test_real_process(smollm2):
    r = run_subprocess("inspect", str(smollm2), "--json")
    assert r.code == 0 and json.loads(r.out)["n_layer"] == 30
    r = run_subprocess("inspect", "/nonexistent/model.gguf")
    assert r.code == 2 and r.one_line_error().startswith("error: no such file")


def test_sliding_window_layers_count_their_rings(tmp_path):
    """A gemma3 file with a 32k context: its five window-8 layers hold rings of 640 positions (models/kv_cache.py), the
    sixth the whole context, in the memory figure and the text."""
    from llamacli.testing import write_model

    path = write_model(tmp_path / "g.gguf", "tiny-gemma3", "F32", metadata={"gemma3.context_length": 32768})
    r = run("inspect", str(path), "--json", "--ctx", "4096")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    per_row = 2 * 1 * 256 * 2  # K and V, one KV head of 256 dims, fp16
    assert info["kv_cache_rings"] == {"layers": 5, "rows": [640]}
    assert info["kv_cache_bytes"] == (32768 + 5 * 640) * per_row
    assert info["kv_cache_bytes_at_ctx"]["bytes"] == (4096 + 5 * 640) * per_row
    r = run("inspect", str(path))
    assert "5 sliding-window layers hold 640 positions each" in r.out
