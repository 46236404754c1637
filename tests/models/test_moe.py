"""Mixtures of experts (qwen3moe, gpt-oss) on the NumPy backend: logits and greedy tokens against transformers'
Qwen3MoeForCausalLM and GptOssForCausalLM built on the CPU from the weights of the same GGUF (dequantized
here: transformers' GGUF loader does not read gpt-oss's tensor names nor qwen3moe's expert width), the routing
on hand-made cases, the clamped SwiGLU, attention sinks and windows, hostile expert metadata, MXFP4 blocks,
and what `inspect` and `bench` say about experts.

Tolerance as test_model_reference: max |ours - ref| <= 1e-3 * max |ref| on last-position logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT, quants as gq

from clirun import run
from llamacli.backends.numpy_backend import NumpyBackend, host_bytes
from llamacli.errors import CorruptFileError, MissingMetadataError, UnknownArchitectureError
from llamacli.ggufio.file import open_gguf
from llamacli.models.block import Moe, layer_op
from llamacli.models.config import ModelConfig
from llamacli.models.moe import route
from llamacli.models.weights import layer_tensor_names, model_specs
from llamacli.testing import SHAPES, model_metadata, random_quant_rows, variant, write_model

STD = 0.08  # as test_architectures: logits far from ties


# -- routing ----------------------------------------------------------------------------------------------------


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_route_softmax_picks_the_largest_probabilities():
    logits = np.array([[1.0, 4.0, 2.0, 3.0]])
    ids, w = route(logits, 2, "softmax", norm=False)
    p = softmax(logits[0].astype(np.float64))
    assert ids.tolist() == [[1, 3]] and ids.dtype == np.int32 and w.dtype == np.float32
    np.testing.assert_allclose(w[0], p[[1, 3]], rtol=1e-6)
    ids, w = route(logits, 2, "softmax", norm=True)
    np.testing.assert_allclose(w[0], p[[1, 3]] / p[[1, 3]].sum(), rtol=1e-6)
    assert w.sum() == pytest.approx(1.0)


def test_route_topk_softmax_is_a_softmax_over_the_chosen_logits():
    ids, w = route(np.array([[1.0, 3.0, 2.0, -5.0]]), 2, "topk_softmax", norm=False)
    assert ids.tolist() == [[1, 2]]
    np.testing.assert_allclose(w[0], softmax(np.array([3.0, 2.0])), rtol=1e-6)
    # norm does not apply to topk_softmax: its weights already sum to 1
    assert np.array_equal(route(np.array([[1.0, 3.0, 2.0, -5.0]]), 2, "topk_softmax", norm=True)[1], w)


@pytest.mark.parametrize("gating", ["softmax", "topk_softmax"])
def test_route_ties_go_to_the_lower_expert(gating):
    ids, w = route(np.array([[0.0, 5.0, 5.0, 0.0, 5.0], [7.0, 7.0, 7.0, 7.0, 7.0]]), 2, gating, norm=True)
    assert ids.tolist() == [[1, 2], [0, 1]]
    np.testing.assert_allclose(w, 0.5, rtol=1e-6)


@pytest.mark.parametrize("gating", ["softmax", "topk_softmax"])
def test_route_all_weight_on_one_expert(gating):
    ids, w = route(np.array([[0.0, 0.0, 200.0, 0.0]]), 2, gating, norm=True)
    assert ids[0, 0] == 2 and ids[0, 1] == 0  # the rest tie: the lowest id
    assert w[0, 0] == pytest.approx(1.0) and w[0, 1] == pytest.approx(0.0, abs=1e-30)


@pytest.mark.parametrize("gating,norm", [("softmax", False), ("softmax", True), ("topk_softmax", False)])
def test_route_k_equals_e_takes_every_expert_in_score_order(gating, norm):
    logits = np.array([[0.5, -1.0, 2.0, 0.0]])
    ids, w = route(logits, 4, gating, norm)
    assert ids.tolist() == [[2, 0, 3, 1]]
    np.testing.assert_allclose(w[0], softmax(logits[0])[[2, 0, 3, 1]], rtol=1e-6)  # all of them: sums to 1


def test_route_matches_transformers_routers_on_random_logits():
    torch = pytest.importorskip("torch")
    logits = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32) * 3
    t = torch.from_numpy(logits)
    for norm in (False, True):  # Qwen3MoeTopKRouter
        top, idx = torch.topk(torch.softmax(t, dim=-1), 4, dim=-1)
        if norm:
            top = top / top.sum(-1, keepdim=True)
        ids, w = route(logits, 4, "softmax", norm)
        assert np.array_equal(ids, idx.numpy()) and np.allclose(w, top.numpy(), rtol=1e-5)
    top, idx = torch.topk(t, 4, dim=-1)  # GptOssTopKRouter
    ids, w = route(logits, 4, "topk_softmax", False)
    assert np.array_equal(ids, idx.numpy()) and np.allclose(w, torch.softmax(top, dim=-1).numpy(), rtol=1e-5)


# -- the NumPy operations -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """The two tiny models, written once: qwen3moe in F32, gpt-oss as its real files are (MXFP4 experts)."""
    root = tmp_path_factory.mktemp("moe")
    return {
        "qwen3moe": write_model(root / "qwen3moe.gguf", "tiny-qwen3moe", "F32", std=STD),
        "gpt-oss": write_model(root / "gpt-oss.gguf", "tiny-gpt-oss", "MXFP4_MOE", std=STD),
    }


def load(path, ctx=512):
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    be = NumpyBackend()
    be.load(g, cfg, ctx)
    return g, cfg, be


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_moe_batches_tokens_by_expert_as_a_per_token_loop_would(tiny_moe, arch):
    """be.moe against the plainest reading of the math: every token through its k experts, one at a time."""
    _, cfg, be = load(tiny_moe[arch])
    h = np.random.default_rng(1).standard_normal((40, cfg.n_embd)).astype(np.float32)
    plan, L = cfg.layers[1], be.weights.layers[1]
    zero = lambda b, e, n: np.zeros(n, np.float32) if b is None else b[e]  # noqa: E731
    logits = h @ L.ffn_gate_inp.T + (0 if L.ffn_gate_inp_bias is None else L.ffn_gate_inp_bias)
    ids, w = route(logits, cfg.n_expert_used, plan.moe_gating, cfg.expert_weights_norm)
    ref = np.zeros_like(h)
    for t in range(h.shape[0]):
        for e, we in zip(ids[t], w[t]):
            g = L.ffn_gate_exps[e] @ h[t] + zero(L.ffn_gate_exps_bias, e, cfg.n_ff_exp)
            u = L.ffn_up_exps[e] @ h[t] + zero(L.ffn_up_exps_bias, e, cfg.n_ff_exp)
            a = be.gated(plan.activation, g[None], u[None])[0]
            ref[t] += we * (L.ffn_down_exps[e] @ a + zero(L.ffn_down_exps_bias, e, cfg.n_embd))
    assert len(np.unique(ids)) > cfg.n_expert_used  # the tokens spread over several experts
    np.testing.assert_allclose(be.moe(layer_op(cfg, 1, Moe), h), ref, rtol=1e-4, atol=1e-5)


def test_swiglu_oai_matches_transformers_clamped_gate():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers", minversion="4.55")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    gate = np.linspace(-20, 20, 401, dtype=np.float32)
    up = np.linspace(15, -15, 401, dtype=np.float32)  # beyond the clamp at +-7 on both sides
    gate_up = torch.from_numpy(np.stack([gate, up], axis=-1).reshape(1, -1))  # interleaved [g0, u0, g1, u1, ...]
    fake = type("Experts", (), {"limit": 7.0, "alpha": 1.702})()
    ref = GptOssExperts._apply_gate(fake, gate_up).numpy()[0]
    np.testing.assert_allclose(NumpyBackend().swiglu_oai(gate, up), ref, rtol=1e-6, atol=1e-6)


def test_layer_tensor_names_drive_the_loaders(tiny_moe):
    """One field -> name mapping: gpt-oss's FFN pre-norm is post_attention_norm, its experts are 3-D float32
    [E, rows, cols] on the NumPy backend, and host_bytes counts all E of them."""
    g, cfg, be = load(tiny_moe["gpt-oss"])
    names = layer_tensor_names(cfg, 0)
    assert names["ffn_norm"] == "blk.0.post_attention_norm.weight" and "attn_post_norm" not in names
    assert names["attn_sinks"] == "blk.0.attn_sinks.weight" and names["attn_output_bias"] == "blk.0.attn_output.bias"
    L = be.weights.layers[0]
    e, d, f = cfg.n_expert, cfg.n_embd, cfg.n_ff_exp
    assert L.ffn_gate_exps.shape == (e, f, d) and L.ffn_down_exps.shape == (e, d, f)
    assert L.ffn_down_exps_bias.shape == (e, d)
    assert L.ffn_gate_exps.dtype == np.float32 and L.attn_sinks.shape == (cfg.n_head,)
    np.testing.assert_array_equal(L.ffn_up_exps, g.dequantize("blk.0.ffn_up_exps.weight"))
    info = g.tensors["blk.0.ffn_up_exps.weight"]  # ggufio/file.py's view of a 3-D block tensor
    assert info.shape == (e, f, d) and info.row_bytes == d // 32 * 17 and info.n_bytes == e * f * info.row_bytes
    assert g.raw(info.name).shape == (e, f, info.row_bytes)
    weights, _ = host_bytes(cfg, 16)
    assert weights >= 4 * 3 * e * f * d * cfg.n_layer
    assert all(name in g.tensors for s in [model_specs(cfg)] for name in (x.name for x in s))
    assert layer_tensor_names(load(tiny_moe["qwen3moe"])[1], 2)["ffn_norm"] == "blk.2.ffn_norm.weight"


def test_sinks_and_window_change_the_result(tiny_moe):
    """The transformers comparisons would pass with sinks or the window ignored only if they did nothing."""
    path = tiny_moe["gpt-oss"]
    ids = np.arange(3, 43)
    _, cfg, be = load(path)
    from llamacli.models.block import run as forward

    base = forward(be, cfg, ids, be.positions(0, ids.size))
    for L in be.weights.layers:
        L.attn_sinks = np.full_like(L.attn_sinks, -1e30)  # a sink that takes nothing
    assert not np.allclose(forward(be, cfg, ids, be.positions(0, ids.size)), base, atol=1e-4)
    _, cfg_w, be_w = load(write_model(path.with_name("wide.gguf"), variant("tiny-gpt-oss", window=4096),
                                      "MXFP4_MOE", std=STD))
    assert not np.allclose(forward(be_w, cfg_w, ids, be_w.positions(0, ids.size)), base, atol=1e-4)


# -- against transformers -------------------------------------------------------------------------------------


def hf_from_gguf(path):
    """The transformers model of the file's architecture, its weights the file's, dequantized to float32."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers", minversion="4.55")
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    w = lambda name: torch.from_numpy(np.array(g.dequantize(name), dtype=np.float32))  # noqa: E731 (a writable copy)
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, num_hidden_layers=cfg.n_layer,
                  num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head_kv, head_dim=cfg.head_dim,
                  rms_norm_eps=cfg.rms_eps, max_position_embeddings=cfg.context_length,
                  num_experts_per_tok=cfg.n_expert_used,
                  tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                  attn_implementation="eager", experts_implementation="eager")
    sd = {"model.embed_tokens.weight": w("token_embd.weight"), "model.norm.weight": w("output_norm.weight"),
          "lm_head.weight": w("output.weight")}
    for i in range(cfg.n_layer):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        sd[p + "input_layernorm.weight"] = w(b + "attn_norm.weight")
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            sd[f"{p}self_attn.{theirs}.weight"] = w(f"{b}{ours}.weight")
            if cfg.architecture == "gpt-oss":
                sd[f"{p}self_attn.{theirs}.bias"] = w(f"{b}{ours}.bias")
        gate, up, down = (w(f"{b}ffn_{x}_exps.weight") for x in ("gate", "up", "down"))  # [E, F, D], [E, D, F]
        if cfg.architecture == "qwen3moe":
            sd[p + "self_attn.q_norm.weight"] = w(b + "attn_q_norm.weight")
            sd[p + "self_attn.k_norm.weight"] = w(b + "attn_k_norm.weight")
            sd[p + "post_attention_layernorm.weight"] = w(b + "ffn_norm.weight")
            sd[p + "mlp.gate.weight"] = w(b + "ffn_gate_inp.weight")
            sd[p + "mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)  # [E, 2F, D]: [gate; up]
            sd[p + "mlp.experts.down_proj"] = down
        else:
            sd[p + "self_attn.sinks"] = w(b + "attn_sinks.weight")
            sd[p + "post_attention_layernorm.weight"] = w(b + "post_attention_norm.weight")
            sd[p + "mlp.router.weight"] = w(b + "ffn_gate_inp.weight")
            sd[p + "mlp.router.bias"] = w(b + "ffn_gate_inp.bias")
            # [E, D, 2F] and [E, 2F] with gate and up interleaved (gate_up[..., ::2] is the gate)
            sd[p + "mlp.experts.gate_up_proj"] = torch.stack([gate, up], dim=-2).flatten(1, 2).transpose(1, 2).contiguous()
            sd[p + "mlp.experts.gate_up_proj_bias"] = torch.stack(
                [w(b + "ffn_gate_exps.bias"), w(b + "ffn_up_exps.bias")], dim=-1).flatten(1)
            sd[p + "mlp.experts.down_proj"] = down.transpose(1, 2).contiguous()  # [E, F, D]
            sd[p + "mlp.experts.down_proj_bias"] = w(b + "ffn_down_exps.bias")
    if cfg.architecture == "qwen3moe":
        config = transformers.Qwen3MoeConfig(
            **common, intermediate_size=cfg.n_ff, moe_intermediate_size=cfg.n_ff_exp, num_experts=cfg.n_expert,
            norm_topk_prob=cfg.expert_weights_norm,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_freq_base})
        m = transformers.Qwen3MoeForCausalLM(config)
    else:
        windows = [p.window for p in cfg.layers]
        config = transformers.GptOssConfig(
            **common, intermediate_size=cfg.n_ff_exp, num_local_experts=cfg.n_expert, sliding_window=max(windows),
            layer_types=["sliding_attention" if x else "full_attention" for x in windows],
            # llama.cpp's YaRN ramp (ggml_rope_yarn_corr_dims) rounds its ends: truncate, as transformers'
            # default, not the openai checkpoint's "truncate": false
            rope_parameters={"rope_type": "yarn", "rope_theta": cfg.rope_freq_base, "factor": cfg.rope_scaling_factor,
                             "original_max_position_embeddings": cfg.rope_original_context, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": True})
        m = transformers.GptOssForCausalLM(config)
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return m.eval()


@pytest.fixture(scope="module")
def hf_pairs(tiny_moe):
    return {arch: hf_from_gguf(path) for arch, path in tiny_moe.items()}


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_logits_match_transformers(tiny_moe, hf_pairs, arch):
    """Prompts of 1, 7 and 130 tokens (gpt-oss: 16 times its window of 8), then 10 decode steps through the
    KV cache, each against a full transformers forward."""
    from test_architectures import vocab_of
    from test_model_reference import run_lengths_and_decode

    path = tiny_moe[arch]
    worst = run_lengths_and_decode(path, vocab_of(path), seed=21, m=hf_pairs[arch])
    print(f"{arch}: worst relative error {worst:.2e}")


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_greedy_tokens_match_transformers_generate(tiny_moe, hf_pairs, arch):
    """32 greedy tokens after a 12-token prompt: gpt-oss's context passes its window of 8 at once."""
    from test_architectures import greedy_matches

    greedy_matches(tiny_moe[arch], hf_pairs[arch], seed=31, steps=32)


# -- hostile metadata --------------------------------------------------------------------------------------------


def config_with(shape, **changes):
    md = model_metadata(SHAPES[shape], 273)
    arch = md["general.architecture"]
    for key, value in changes.items():
        key = f"{arch}.{key.replace('__', '.')}"
        if value is None:
            del md[key]
        else:
            md[key] = value
    return ModelConfig.from_gguf(md, set())


@pytest.mark.parametrize("shape", ["tiny-qwen3moe", "tiny-gpt-oss"])
@pytest.mark.parametrize("changes,error,words", [
    ({"expert_used_count": 9}, CorruptFileError, "expert_used_count"),  # k > E
    ({"expert_used_count": 0}, CorruptFileError, "expert_used_count"),
    ({"expert_count": 0}, CorruptFileError, "expert_count"),
    ({"expert_count": 1 << 40}, CorruptFileError, "expert_count"),
    ({"expert_count": -3}, CorruptFileError, "expert_count"),
    ({"expert_count": "eight"}, CorruptFileError, "integer"),
    ({"expert_count": 8.0}, CorruptFileError, "integer"),
    ({"expert_count": None}, MissingMetadataError, "expert_count"),
    ({"expert_used_count": None}, MissingMetadataError, "expert_used_count"),
    ({"expert_feed_forward_length": 0}, CorruptFileError, "expert_feed_forward_length"),
    ({"expert_feed_forward_length": 1 << 40}, CorruptFileError, "expert_feed_forward_length"),
    ({"expert_weights_norm": "yes"}, CorruptFileError, "expert_weights_norm"),
    ({"expert_weights_scale": 2.5}, UnknownArchitectureError, "expert_weights_scale"),
])
def test_hostile_expert_metadata_is_refused_by_name(shape, changes, error, words):
    with pytest.raises(error, match=words):
        config_with(shape, **changes)


def test_expert_metadata_defaults_and_gpt_oss_keys():
    cfg = config_with("tiny-qwen3moe", expert_feed_forward_length=None)
    assert cfg.n_ff_exp == cfg.n_ff // cfg.n_expert_used and cfg.expert_weights_norm  # llama.cpp's fallbacks
    assert not config_with("tiny-qwen3moe", expert_weights_norm=False).expert_weights_norm
    with pytest.raises(MissingMetadataError, match="expert_feed_forward_length"):
        config_with("tiny-gpt-oss", expert_feed_forward_length=None)  # llama.cpp requires it for gpt-oss
    with pytest.raises(MissingMetadataError, match="sliding_window"):
        config_with("tiny-gpt-oss", attention__sliding_window=None)
    with pytest.raises(CorruptFileError, match="sliding window"):
        config_with("tiny-gpt-oss", attention__sliding_window=0)
    with pytest.raises(UnknownArchitectureError, match="RoPE base"):
        config_with("tiny-gpt-oss", rope__freq_base_swa=10000.0)
    cfg = config_with("tiny-gpt-oss", attention__sliding_window_pattern=4)  # llama.cpp's period key
    assert [p.window for p in cfg.layers] == [8, 8, 8, 0]
    cfg = config_with("tiny-gpt-oss")
    assert [p.window for p in cfg.layers] == [8, 0, 8, 0]  # even layers slide (transformers' layer_types too)
    assert all(p.sinks and p.o_bias and p.qkv_bias and p.moe_bias and p.moe_gating == "topk_softmax"
               and p.activation == "swiglu_oai" for p in cfg.layers)
    assert cfg.rope_scaling == "yarn" and not cfg.tied_embeddings


def test_hostile_expert_files_fail_in_one_line(tmp_path):
    """Through the CLI: a file whose k exceeds E, one with 2-D experts, one with fused gate/up experts."""
    bad = write_model(tmp_path / "k.gguf", "tiny-qwen3moe", "F32", metadata={"qwen3moe.expert_used_count": 64})
    r = run("inspect", str(bad))
    assert r.code == 2 and "expert_used_count" in r.one_line_error()
    flat = write_model(tmp_path / "flat.gguf", "tiny-qwen3moe", "F32", metadata={"qwen3moe.expert_count": 4})
    r = run("inspect", str(flat))  # the file's experts are 8: the config implies 4
    assert r.code == 2 and "shape" in r.one_line_error()
    from llamacli.models.arch.qwen3moe import check_experts

    with pytest.raises(UnknownArchitectureError, match="fused"):
        check_experts("qwen3moe", frozenset({"blk.0.ffn_gate_up_exps.weight"}))


# -- MXFP4 ----------------------------------------------------------------------------------------------------------

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # OCP MX spec: FP4 E2M1 magnitudes, bit 3 the sign


def mxfp4_reference(blocks: np.ndarray) -> np.ndarray:
    """[n, 17] blocks -> [n, 32] float32 from the OCP MX spec in float64: x = E2M1(q) * 2^(e - 127), with
    ggml's layout (ggml-common.h block_mxfp4: e, then qs[16]; value j in the low nibble of qs[j], value j + 16
    in the high one) and ggml's reading of e = 255 as 2^128 (the spec's NaN)."""
    e = blocks[:, :1].astype(np.float64)
    q = np.concatenate([blocks[:, 1:] & 0x0F, blocks[:, 1:] >> 4], axis=1)
    sign = np.where(q & 8, -1.0, 1.0)
    with np.errstate(over="ignore"):
        return (sign * E2M1[q & 7] * np.exp2(e - 127)).astype(np.float32)


def test_mxfp4_dequantization_matches_the_spec_for_every_exponent():
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, size=(256 * 4, 17), dtype=np.uint8)
    blocks[:, 0] = np.repeat(np.arange(256, dtype=np.uint8), 4)  # every E8M0 exponent, 0 and 255 included
    with np.errstate(over="ignore"):  # e = 255: 6 * 2^128 is inf in float32, as in ggml
        ours = gq.dequantize(blocks, QT.MXFP4)
    ref = mxfp4_reference(blocks)
    assert np.array_equal(ours, ref), np.argwhere(ours != ref)[:5]
    assert np.isinf(ref[blocks[:, 0] == 255]).any() and (ref[blocks[:, 0] == 0] != 0).any()  # the extremes


def test_mxfp4_writer_blocks_are_valid():
    rng = np.random.default_rng(6)
    x = random_quant_rows(QT.MXFP4, 16, 96, rng, std=0.05)  # quantized Gaussians (gguf.quants)
    assert x.shape == (16, 3 * 17) and x.dtype == np.uint8
    v = gq.dequantize(x, QT.MXFP4)
    assert np.array_equal(v, mxfp4_reference(x.reshape(-1, 17)).reshape(16, 96))
    assert 0.03 < v.std() < 0.07
    fast = random_quant_rows(QT.MXFP4, 256, 2880, rng, std=0.02, fast=True)  # the speed-run path
    v = gq.dequantize(fast, QT.MXFP4)
    assert np.isfinite(v).all() and 0.01 < v.std() < 0.04
    for t in (QT.Q8_0, QT.Q4_0, QT.Q5_1):
        v = gq.dequantize(random_quant_rows(t, 64, 256, rng, std=0.02, fast=True), t)
        assert np.isfinite(v).all() and 0.01 < v.std() < 0.04, t


# -- inspect and bench ---------------------------------------------------------------------------------------------


def test_inspect_shows_experts_and_active_parameters(tiny_moe):
    r = run("inspect", str(tiny_moe["gpt-oss"]), "--json")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    assert (info["architecture"], info["n_expert"], info["n_expert_used"], info["n_ff_exp"]) == ("gpt-oss", 8, 2, 64)
    g = open_gguf(tiny_moe["gpt-oss"])
    experts = [t for t in g.tensors.values() if "_exps." in t.name]
    emb = g.tensors["token_embd.weight"]  # untied: one row per token
    inactive = sum(t.n_elements for t in experts) * 6 // 8 + emb.n_elements - emb.shape[1]
    assert info["active_parameters"] == info["parameters"] - inactive
    inactive = sum(t.n_bytes for t in experts) * 6 // 8 + emb.n_bytes - emb.row_bytes
    assert info["active_weights_bytes"] == info["weights_bytes"] - inactive
    assert "sliding window 8 on 2 of 4 layers" in info["layers"] and "attention sinks" in info["layers"]
    text = run("inspect", str(tiny_moe["gpt-oss"])).out
    assert "8, 2 per token, feed-forward 64 each" in text and "active per token" in text
    assert "2 of 8 experts" in text and "MXFP4" in text
    dense = write_model(tiny_moe["gpt-oss"].with_name("dense.gguf"), "tiny-llama")
    assert "n_expert" not in json.loads(run("inspect", str(dense), "--json").out)


def test_bench_counts_only_the_active_experts(tiny_moe):
    from llamacli.engine.bench import decode_bytes_per_token
    from llamacli.engine.generate import Model

    r = run("bench", "-m", str(tiny_moe["qwen3moe"]), "--backend", "numpy", "-p", "8", "-n", "4", "-r", "1", "-o", "json")
    assert r.code == 0, r.err
    rows = json.loads(r.out)
    assert [x["test"] for x in rows] == ["pp8", "tg4"] and rows[1]["gb_per_s"] > 0
    model = Model(tiny_moe["qwen3moe"], backend="numpy", ctx=64)
    g, cfg = model.gguf, model.cfg
    experts = sum(t.n_bytes for t in g.tensors.values() if "_exps." in t.name)
    others = sum(t.n_bytes for t in g.tensors.values() if "_exps." not in t.name and t.name != "token_embd.weight")
    emb_row = g.tensors["token_embd.weight"].row_bytes
    assert decode_bytes_per_token(model, 0) == pytest.approx(others + emb_row + experts * 2 / 8)
    assert decode_bytes_per_token(model, 10) - decode_bytes_per_token(model, 0) == pytest.approx(10 * cfg.kv_cache_bytes(1))
    oss = Model(tiny_moe["gpt-oss"], backend="numpy", ctx=64)  # two of its four layers see a window of 8
    assert decode_bytes_per_token(oss, 10) - decode_bytes_per_token(oss, 0) == pytest.approx(
        (2 * 8 + 2 * 10) * oss.cfg.kv_cache_bytes(1) / 4)


# -- the real shapes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,qtype,size", [("qwen3-30b-a3b", "Q4_K_M", 18.6e9), ("gpt-oss-20b", "MXFP4_MOE", 12.1e9)])
def test_real_shapes_have_the_real_sizes(shape, qtype, size):
    """The speed-run shapes as their published files: Qwen3-30B-A3B Q4_K_M (18.6 GB), gpt-oss-20b MXFP4 (12.1 GB),
    their active parameters (one embedding row, k of E experts, all else) 3.0B and 3.6B (openai's figure; Qwen's
    3.3B counts the whole embedding table). From the tensor list only: nothing is written."""
    from gguf import GGML_QUANT_SIZES

    from llamacli.testing import tensor_shapes, tensor_type

    spec = SHAPES[shape]
    total = active = params = 0.0
    for name, s in tensor_shapes(spec, spec.vocab_size):
        t = tensor_type(name, s, qtype, spec.n_layer, spec.tied)
        block, nbytes = GGML_QUANT_SIZES[t]
        n = float(np.prod(s))
        share = (spec.n_expert_used / spec.n_expert if "_exps." in name
                 else 1 / s[0] if name == "token_embd.weight" else 1)  # weights.active_share
        total += n * nbytes / block
        params += n
        active += n * share
    assert abs(total - size) / size < 0.02, total
    assert abs(active - {"qwen3-30b-a3b": 3.04e9, "gpt-oss-20b": 3.61e9}[shape]) < 0.05e9, active
    assert abs(params - {"qwen3-30b-a3b": 30.5e9, "gpt-oss-20b": 20.9e9}[shape]) < 0.5e9, params
