"""The engine on random models with real vocabularies: streamed text, stop strings, cache reuse."""

from __future__ import annotations

import pytest

from llamacli.engine.generate import Model, hold_back, split_stop
from llamacli.testing import variant


@pytest.fixture(scope="module")
def spm_model(random_model, llama_cpp_models):
    spec = variant("tiny-llama", vocab_size=32000)
    return Model(random_model(spec, "Q8_0", vocab_file=str(llama_cpp_models / "ggml-vocab-llama-spm.gguf"), std=0.2),
                 backend="numpy", ctx=128)


def test_streamed_text_continues_the_prompt(spm_model):
    """SentencePiece pieces carry their leading space ("▁there"): the streamed text must keep it, so that
    prompt + output reads as decode(prompt ids + generated ids)."""
    tok = spm_model.tokenizer
    for seed in range(3):
        c = spm_model.complete("Once upon a time", raw=True, max_tokens=12, temperature=1.0, top_k=0, top_p=1.0,
                               min_p=0.0, seed=seed)
        whole = tok.decode(c.prompt_tokens + c.tokens, special=False)
        assert whole == tok.decode(c.prompt_tokens, special=False) + c.text


def test_prefix_reuse_prefills_only_the_difference(spm_model):
    a = spm_model.complete("The quick brown fox", raw=True, max_tokens=3, temperature=0)
    b = spm_model.complete("The quick brown fox jumps over", raw=True, max_tokens=3, temperature=0)
    assert a.timings.prompt_tokens == len(a.prompt_tokens) or a.timings.prompt_tokens < len(a.prompt_tokens)
    shared = 0
    for x, y in zip(a.prompt_tokens + a.tokens, b.prompt_tokens):
        if x != y:
            break
        shared += 1
    assert b.timings.prompt_tokens == len(b.prompt_tokens) - shared
    # and the reused cache gives the same tokens as a cold start
    cold = Model(spm_model.path, backend="numpy", ctx=128).complete("The quick brown fox jumps over", raw=True,
                                                                     max_tokens=3, temperature=0)
    assert cold.tokens == b.tokens


@pytest.mark.parametrize(
    "text,stops,before,hit",
    [("hello world", ["wor"], "hello ", "wor"), ("abc", ["x"], "abc", None), ("a</s", ["</s>"], "a</s", None),
     ("one\n\ntwo", ["two", "\n\n"], "one", "\n\n"), ("", ["x"], "", None), ("xab", ["ab", "a"], "x", "ab")],
)
def test_split_stop(text, stops, before, hit):
    """The text before the earliest stop string, and which string it was (the first listed of two at one place)."""
    assert split_stop(text, stops) == (before, hit)


@pytest.mark.parametrize(
    "text,stops,emit,held",
    [("hello </", ["</s>"], "hello ", "</"), ("abc", ["x"], "abc", ""), ("ab", ["abc", "b"], "", "ab"),
     ("xyz", [], "xyz", "")],
)
def test_hold_back(text, stops, emit, held):
    assert hold_back(text, stops) == (emit, held)


def test_vocabulary_must_match_the_embedding(tmp_path):
    from llamacli.errors import ShapeMismatchError
    from llamacli.testing import tiny_vocab, variant, write_model

    small = tiny_vocab()  # 273 tokens, written over the writer's padded list; 300 embedding rows
    path = write_model(tmp_path / "m.gguf", variant("tiny-llama", vocab_size=300), "F32", metadata={
        "tokenizer.ggml.tokens": small["tokenizer.ggml.tokens"], "tokenizer.ggml.token_type": small["tokenizer.ggml.token_type"]})
    with pytest.raises(ShapeMismatchError, match="273 tokens .* 300 embedding rows"):
        Model(path, backend="numpy", ctx=64)


# -- long prompts: chunked prefill, bounded attention scratch --------------------------------------------------


def _numpy_backend(path, ctx):
    from llamacli.backends.numpy_backend import NumpyBackend
    from llamacli.ggufio.file import open_gguf
    from llamacli.models.config import ModelConfig

    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    be = NumpyBackend()
    be.load(g, cfg, ctx)
    return be, cfg


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2", "tiny-phi3"])
def test_prefill_in_chunks_equals_one_pass(random_model, shape, monkeypatch):
    """Where a backend sets prefill_chunk, block.prefill splits a prompt into passes of that many tokens
    (no pass longer; None: one pass), and the logits and KV cache equal those of one forward pass over the
    whole prompt; attention in several passes of query rows (a tiny ATT_SCRATCH) gives the same result too. Tolerances: float32 BLAS products of other
    shapes, 2e-5 relative to the largest value."""
    import numpy as np

    from llamacli.backends import numpy_backend
    from llamacli.models import block

    path = random_model(shape, "F32")
    rng = np.random.default_rng(7)
    be, cfg = _numpy_backend(path, 160)
    ids = rng.integers(0, cfg.vocab_size, size=150)
    whole = be.to_host(block.run(be, cfg, be.token_ids(ids), be.positions(0, ids.size)))
    k_whole, v_whole = np.array(be.k_cache), np.array(be.v_cache)  # [layer, ctx, Hkv, Dh] (no window: no ring)

    for chunk, att_scratch in ((16, numpy_backend.ATT_SCRATCH), (37, 300), (150, 1), (None, 5000)):
        be, cfg = _numpy_backend(path, 160)
        be.prefill_chunk = chunk
        monkeypatch.setattr(numpy_backend, "ATT_SCRATCH", att_scratch)
        lengths = []
        real_forward = block.run
        monkeypatch.setattr(block, "run", lambda b, c, i, p: lengths.append(len(i)) or real_forward(b, c, i, p))
        got = be.to_host(block.prefill(be, cfg, ids, 0))
        monkeypatch.setattr(block, "run", real_forward)
        n = chunk or ids.size
        assert lengths == [min(n, ids.size - s) for s in range(0, ids.size, n)]
        scale = float(np.abs(whole).max())
        np.testing.assert_allclose(got, whole, rtol=0, atol=2e-5 * scale)
        for a, b in ((np.array(be.k_cache), k_whole), (np.array(be.v_cache), v_whole)):
            np.testing.assert_allclose(a[:, : ids.size], b[:, : ids.size], rtol=0, atol=2e-5 * float(np.abs(b).max()))


@pytest.mark.parametrize("shape", ["small-llama", "small-qwen2", "small-phi3"])
def test_prefill_scratch_stays_within_the_estimate(random_model, shape):
    """The host-memory check counts the working set of one prefill pass (scratch_bytes); a prompt of nearly
    the whole context peaks (tracemalloc) below that figure beside the weights and the cache."""
    import tracemalloc

    import numpy as np

    from llamacli.backends.numpy_backend import scratch_bytes
    from llamacli.models.block import prefill

    ctx = 1536
    path = random_model(shape, "Q8_0")
    be, cfg = _numpy_backend(path, ctx)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, size=ctx - 1)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        prefill(be, cfg, ids, 0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    estimate = scratch_bytes(cfg, ctx, be.prefill_chunk)
    assert peak - base <= estimate, (peak - base, estimate)
    assert peak - base > estimate / 8  # the estimate is an upper bound of the right size, not a blanket


def test_host_memory_check_counts_the_scratch(random_model):
    """Weights + cache that fit, plus a prefill scratch that does not: refused, and the suggested --ctx fits."""
    import re

    from llamacli.backends import numpy_backend as nb
    from llamacli.errors import HostMemoryError
    from llamacli.ggufio.file import open_gguf
    from llamacli.models.config import ModelConfig

    g = open_gguf(random_model("small-llama", "Q8_0"))
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    ctx = 8192
    weights, kv = nb.host_bytes(cfg, ctx)
    scratch = nb.scratch_bytes(cfg, ctx)
    nb.check_host_memory(cfg, ctx, available=weights + kv + scratch)  # exactly enough: no error
    with pytest.raises(HostMemoryError, match="prefill scratch") as exc:
        nb.check_host_memory(cfg, ctx, available=weights + kv + scratch // 2)
    fit = int(re.search(r"try --ctx (\d+)", str(exc.value)).group(1))
    assert 16 <= fit < ctx
    nb.check_host_memory(cfg, fit, available=weights + kv + scratch // 2)


def test_phi3_with_split_attention_runs_as_the_fused_file(random_model, tmp_path):
    """The same phi3 weights with attn_qkv split into attn_q/k/v tensors (a layout llama.cpp also loads):
    same logits, within float32 BLAS rounding."""
    import numpy as np
    from gguf import GGUFWriter

    from llamacli.ggufio.file import open_gguf
    from llamacli.models.block import prefill
    from llamacli.testing import add_metadata

    fused = random_model("tiny-phi3", "F32")
    g = open_gguf(fused)
    q_dim = g.metadata["phi3.attention.head_count"] * (g.metadata["phi3.embedding_length"] // g.metadata["phi3.attention.head_count"])
    kv_dim = (g.tensors["blk.0.attn_qkv.weight"].shape[0] - q_dim) // 2
    split = tmp_path / "split.gguf"
    w = GGUFWriter(str(split), "phi3")
    for key, value in g.metadata.items():
        if key not in ("general.architecture", "general.alignment") and not key.startswith("GGUF."):
            add_metadata(w, key, value)
    for name in g.tensors:
        data = g.dequantize(name)
        if name.endswith("attn_qkv.weight"):
            p = name[: -len("attn_qkv.weight")]
            for part, rows in (("attn_q", data[:q_dim]), ("attn_k", data[q_dim : q_dim + kv_dim]), ("attn_v", data[q_dim + kv_dim :])):
                w.add_tensor(p + part + ".weight", np.ascontiguousarray(rows))
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ids = np.random.default_rng(5).integers(0, g.metadata["phi3.vocab_size"], size=23)
    logits = []
    for path in (fused, split):
        be, cfg = _numpy_backend(path, 64)
        assert cfg.layers[0].fused_qkv == (path == fused)
        logits.append(be.to_host(prefill(be, cfg, ids, 0)))
    np.testing.assert_allclose(logits[1], logits[0], rtol=0, atol=1e-5 * float(np.abs(logits[0]).max()))
