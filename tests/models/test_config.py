"""ModelConfig from metadata: real values, derived values, and clear errors."""

from __future__ import annotations

import math

import pytest

from llamacli.errors import CorruptFileError, MissingMetadataError, UnknownArchitectureError
from llamacli.ggufio.file import open_gguf
from llamacli.models.config import ROPE_NEOX, ROPE_NORMAL, ModelConfig


def test_smollm2(smollm2):
    g = open_gguf(smollm2)
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    assert (cfg.architecture, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv) == ("llama", 30, 576, 9, 3)
    assert (cfg.head_dim, cfg.n_ff, cfg.vocab_size, cfg.context_length) == (64, 1536, 49152, 8192)
    assert cfg.rope_type == ROPE_NORMAL and cfg.rope_freq_base == 100000.0 and cfg.rope_scaling == "none"
    assert cfg.tied_embeddings and not cfg.layers[0].qkv_bias and cfg.n_group == 3 and cfg.kv_dim == 192
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert math.isclose(cfg.rms_eps, 1e-5, rel_tol=1e-6)
    assert cfg.kv_cache_bytes(2048) == 2 * 30 * 2048 * 192 * 2


def md(arch="llama", **over):
    base = {
        "general.architecture": arch,
        f"{arch}.block_count": 2, f"{arch}.embedding_length": 64, f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2, f"{arch}.feed_forward_length": 128, f"{arch}.context_length": 256,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, f"{arch}.vocab_size": 100,
    }
    for k, v in over.items():
        key = k.replace("__", ".")
        key = key if key.startswith("general") else f"{arch}.{key}"
        if v is None:
            base.pop(key, None)
        else:
            base[key] = v
    return base


def test_per_architecture_features():
    q = ModelConfig.from_gguf(md("qwen2"), {"output.weight"})
    assert q.rope_type == ROPE_NEOX and q.layers[0].qkv_bias and not q.layers[0].fused_qkv and not q.tied_embeddings
    p = ModelConfig.from_gguf(md("phi3"), {"output.weight"})
    assert p.rope_type == ROPE_NEOX and p.layers[0].fused_qkv and p.layers[0].fused_gate_up
    assert ModelConfig.from_gguf(md(), {"token_embd.weight"}).tied_embeddings


def test_rope_scaling_kinds():
    assert ModelConfig.from_gguf(md(), {"rope_freqs.weight"}).rope_scaling == "llama3"
    lin = ModelConfig.from_gguf(md(**{"rope__scaling__type": "linear", "rope__scaling__factor": 4.0}), set())
    assert lin.rope_scaling == "linear" and lin.rope_scaling_factor == 4.0
    phi = ModelConfig.from_gguf(md("phi3", **{"rope__scaling__original_context_length": 64}), {"rope_factors_long.weight"})
    assert phi.rope_scaling == "longrope" and phi.rope_attn_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    yarn = ModelConfig.from_gguf(md(**{"rope__scaling__type": "yarn", "rope__scaling__factor": 4.0}), set())
    assert yarn.rope_scaling == "yarn" and yarn.rope_attn_factor == pytest.approx(1 + 0.1 * math.log(4))
    with pytest.raises(CorruptFileError, match="dynamic"):
        ModelConfig.from_gguf(md(**{"rope__scaling__type": "dynamic", "rope__scaling__factor": 4.0}), set())
    with pytest.raises(CorruptFileError, match="YaRN"):
        ModelConfig.from_gguf(md(**{"rope__scaling__type": "yarn", "rope__scaling__yarn_beta_fast": 0.5}), set())


@pytest.mark.parametrize("keys, scaling, factor", [
    ({"rope__scaling__factor": 4.0}, "linear", 4.0),  # no type: llama.cpp's default is linear
    ({"rope__scale_linear": 2.0}, "linear", 2.0),  # the pre-2023 key (old linearly scaled Llama 2 files)
    ({"rope__scaling__type": "none", "rope__scaling__factor": 4.0}, "linear", 4.0),  # llama.cpp scales anyway
    ({"rope__scaling__factor": 0.0}, "none", 1.0),  # 0 means unset
    ({"rope__scaling__type": "linear", "rope__scaling__factor": 1.0}, "none", 1.0),
    ({"rope__scaling__factor": 8.0, "rope__scale_linear": 2.0}, "linear", 8.0),  # the new key wins
])
def test_linear_rope_scaling_as_llama_cpp_reads_it(keys, scaling, factor):
    cfg = ModelConfig.from_gguf(md(**keys), set())
    assert (cfg.rope_scaling, cfg.rope_scaling_factor) == (scaling, factor)
    with pytest.raises(CorruptFileError, match="must be positive"):
        ModelConfig.from_gguf(md(**{"rope__scaling__factor": -2.0}), set())


def test_phi3_with_separate_q_k_v():
    """llama.cpp also loads phi3 files whose attention is split into attn_q/k/v: so do we."""
    split = {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "output.weight"}
    cfg = ModelConfig.from_gguf(md("phi3"), split)
    assert not cfg.layers[0].fused_qkv and cfg.layers[0].fused_gate_up
    assert ModelConfig.from_gguf(md("phi3"), {"blk.0.attn_qkv.weight"}).layers[0].fused_qkv


def test_head_dim_from_key_length():
    cfg = ModelConfig.from_gguf(md(**{"attention__key_length": 32, "attention__value_length": 32}), set())
    assert cfg.head_dim == 32 and cfg.q_dim == 128


def test_unknown_architecture_lists_supported():
    with pytest.raises(UnknownArchitectureError) as info:
        ModelConfig.from_gguf(md("mamba"), set())
    assert "'mamba'" in str(info.value) and ("gemma2, gemma3, gemma4, gpt-oss, llama, mistral3, phi3, qwen2, qwen3, qwen35, qwen35moe, qwen3moe, qwen3next, "
                                          "smollm3") in str(info.value)


@pytest.mark.parametrize("key", ["block_count", "embedding_length", "attention__head_count", "feed_forward_length",
                                 "context_length", "attention__layer_norm_rms_epsilon"])
def test_missing_key_is_named(key):
    with pytest.raises(MissingMetadataError) as info:
        ModelConfig.from_gguf(md(**{key: None}), set())
    assert f"llama.{key.replace('__', '.')}" in str(info.value)


def test_missing_architecture():
    with pytest.raises(MissingMetadataError, match="general.architecture"):
        ModelConfig.from_gguf({}, set())


@pytest.mark.parametrize(
    "over",
    [
        {"block_count": 0}, {"block_count": -1}, {"block_count": 1 << 40}, {"block_count": "2"}, {"block_count": True},
        {"attention__head_count": 3}, {"attention__head_count_kv": 3}, {"embedding_length": 66},
        {"attention__layer_norm_rms_epsilon": float("nan")}, {"attention__layer_norm_rms_epsilon": -1.0},
        {"rope__freq_base": float("inf")}, {"rope__freq_base": 0.5}, {"attention__head_count_kv": [2, 4]},
        {"attention__key_length": 33}, {"vocab_size": 0},
        # arrays of arrays (a hostile header): refused as values, not taken apart as if hashable
        {"attention__head_count_kv": [[2], [2]]}, {"feed_forward_length": [[128], [64]]},
    ],
)
def test_impossible_values(over):
    with pytest.raises(CorruptFileError):
        ModelConfig.from_gguf(md(**over), set())


def test_per_layer_arrays_that_agree_are_accepted():
    cfg = ModelConfig.from_gguf(md(**{"attention__head_count_kv": [2, 2], "feed_forward_length": [128, 128]}), set())
    assert cfg.n_head_kv == 2 and cfg.n_ff == 128


@pytest.mark.parametrize("arch,key,value", [
    ("gemma3", "attention__sliding_window", -5), ("gemma3", "rope__freq_base_swa", 0.5),
    ("gemma2", "attention__sliding_window", 0), ("gemma2", "attn_logit_softcapping", -1.0),
    ("gemma2", "final_logit_softcapping", 1e30),
])
def test_gemma_settings_out_of_range_are_corrupt(arch, key, value):
    with pytest.raises(CorruptFileError, match="out of range"):
        ModelConfig.from_gguf(md(arch, **{key: value}), set())


def test_gemma_layer_pattern_from_the_file():
    cfg = ModelConfig.from_gguf(md("gemma3", **{"attention__sliding_window": 16, "block_count": 4,
                                                "attention__sliding_window_pattern": [True, False, True, False]}), set())
    assert [p.window for p in cfg.layers] == [16, 0, 16, 0] and cfg.embd_scale == pytest.approx(math.sqrt(64))
    two = ModelConfig.from_gguf(md("gemma2", **{"block_count": 4}), set())
    assert [p.window for p in two.layers] == [4096, 0, 4096, 0] and two.final_softcap == 30.0
    assert all(p.attn_softcap == 50.0 and not p.rope_local for p in two.layers)
