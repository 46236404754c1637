"""The architectures beyond Llama (llamacli/models/arch/) against PyTorch transformers on the CPU (float32).

transformers' GGUF loader reads qwen3 files; for what it does not read (smollm3, YaRN scaling, partial
rotary) the transformers model is rebuilt from the weights it loaded from a twin file (same seed, the
architecture or keys it does read) with the config that describes the rest. Tolerance as
test_model_reference: max |ours - ref| <= 1e-3 * max |ref| on last-position logits; greedy tokens equal.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_model_reference import Ours, check, hf_logits, hf_model, run_lengths_and_decode  # noqa: E402

from llamacli.ggufio.file import open_gguf  # noqa: E402
from llamacli.models import rope  # noqa: E402
from llamacli.models.config import ModelConfig  # noqa: E402
from llamacli.testing import SHAPES, variant  # noqa: E402

STD = 0.08  # large enough weights that the logits of tiny models are far from ties


def rebuilt(twin, cls, config_cls, **changes):
    """A transformers model of class `cls` holding the weights transformers loaded from the GGUF `twin`,
    with its config's fields changed (the parts its GGUF loader does not read)."""
    src = hf_model(twin)
    fields = {k: v for k, v in src.config.to_dict().items() if k in config_cls().to_dict()}
    fields.update(pad_token_id=None, bos_token_id=None, eos_token_id=None, **changes)
    m = cls(config_cls(**fields)).eval()
    missing, unexpected = m.load_state_dict(src.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return m


def vocab_of(path) -> int:
    return len(open_gguf(path).metadata["tokenizer.ggml.tokens"])


def greedy_matches(path, m, seed, steps=32):
    """32 greedy tokens from the NumPy backend equal transformers' generate() from the same prompt."""
    from llamacli.engine.generate import Model

    ids = np.random.default_rng(seed).integers(3, vocab_of(path), size=12).tolist()
    ours = Model(path, backend="numpy", ctx=256).complete(ids, max_tokens=steps, temperature=0.0)
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=steps, eos_token_id=None, pad_token_id=0)
    ref = out[0, len(ids):].tolist()
    n = len(ours.tokens)
    assert ours.tokens == ref[:n]
    if n < steps:  # we stopped at an end-of-generation token: transformers (told no EOS) chose it too
        assert ours.finish_reason == "eos" and ref[n] in Model(path, backend="numpy", ctx=256).tokenizer.eog_ids


@pytest.mark.parametrize("qtype", ["F32", "Q6_K"])
def test_qwen3_matches_transformers(random_model, qtype):
    path = random_model("tiny-qwen3", qtype, std=STD)
    cfg = ModelConfig.from_gguf(open_gguf(path).metadata, set(open_gguf(path).tensors))
    assert cfg.architecture == "qwen3" and all(p.qk_norm and p.rope and not p.qkv_bias for p in cfg.layers)
    run_lengths_and_decode(path, vocab_of(path), seed=3)
    greedy_matches(path, hf_model(path), seed=4)


def test_qwen3_head_dim_differs_from_embd_over_heads(random_model):
    """Qwen3-0.6B's shape: 1024 = 16 heads x 64, but 128 dims per head (Hq Dh = 2048 != D)."""
    path = random_model(variant("tiny-qwen3", n_embd=64, n_head=4, n_head_kv=2, head_dim=32), "F32", std=STD)
    ours = Ours(path)
    assert (ours.cfg.head_dim, ours.cfg.q_dim, ours.cfg.n_embd) == (32, 128, 64)
    ids = list(range(5, 30))
    full = ours.prefill(ids)
    assert np.isfinite(full).all()
    ours.prefill(ids[:-1])  # the last token through the cache gives the same logits
    check(ours.decode(ids[-1], len(ids) - 1), full)


def test_smollm3_nope_layers_match_transformers(random_model):
    spec = SHAPES["tiny-smollm3"]
    path = random_model("tiny-smollm3", "F32", std=STD)
    twin = random_model(variant(spec, arch="llama"), "F32", std=STD)  # the same weights, read as llama
    cfg = Ours(path).cfg
    assert [p.rope for p in cfg.layers] == [True, True, True, False]
    m = rebuilt(twin, transformers.SmolLM3ForCausalLM, transformers.SmolLM3Config, no_rope_layer_interval=4,
                rope_theta=spec.rope_base, tie_word_embeddings=False)
    ids = list(range(3, 60))
    check(Ours(path).prefill(ids), hf_logits(m, ids)[-1])
    # and a llama that rotates every layer is measurably different, so the test can tell
    assert not np.allclose(Ours(path).prefill(ids), hf_logits(hf_model(twin), ids)[-1], atol=1e-3)
    greedy_matches(path, m, seed=5)


def test_yarn_model_matches_transformers(random_model):
    spec = variant("tiny-qwen3", rope_scaling="yarn", rope_factor=4.0, context_length=512)
    path = random_model(spec, "F32", std=STD)
    twin = random_model(variant(spec, rope_scaling="none"), "F32", std=STD)
    m = rebuilt(twin, transformers.Qwen3ForCausalLM, transformers.Qwen3Config, head_dim=128, tie_word_embeddings=True,
                rope_parameters={"rope_type": "yarn", "rope_theta": spec.rope_base, "factor": 4.0,
                                 "original_max_position_embeddings": 128})
    rng = np.random.default_rng(8)
    ids = rng.integers(0, vocab_of(path), size=200).tolist()  # past the original context of 128
    check(Ours(path, ctx=512).prefill(ids), hf_logits(m, ids)[-1])


def test_partial_rotary_matches_transformers(random_model):
    """Phi-4-mini rotates 96 of its 128 head dims; here 16 of 24."""
    spec = variant("tiny-phi3", rope_dim=16)
    path = random_model(spec, "F32", std=STD)
    twin = random_model(variant(spec, rope_dim=0), "F32", std=STD)
    assert Ours(path).cfg.rope_dim == 16
    m = rebuilt(twin, transformers.Phi3ForCausalLM, transformers.Phi3Config, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": spec.rope_base, "partial_rotary_factor": 16 / 24})
    assert m.model.rotary_emb.inv_freq.shape == (8,)
    ids = list(range(3, 80))
    check(Ours(path).prefill(ids), hf_logits(m, ids)[-1])


@pytest.mark.parametrize("seed", range(6))
def test_yarn_tables_match_transformers_rope_utils(seed):
    """inv_freq and the cos/sin magnitude against transformers' _compute_yarn_parameters on random settings."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rng = np.random.default_rng(seed)
    dims = int(rng.choice([32, 64, 96, 128]))
    base = float(rng.choice([1e4, 1e6, 5e5]))
    factor = float(rng.choice([2.0, 4.0, 8.0, 32.0]))
    orig = int(rng.choice([2048, 4096, 32768]))
    fast, slow = float(rng.choice([32.0, 16.0])), float(rng.choice([1.0, 2.0]))
    md = {"general.architecture": "qwen3", "qwen3.block_count": 1, "qwen3.embedding_length": 2 * dims,
          "qwen3.attention.head_count": 2, "qwen3.feed_forward_length": 8, "qwen3.context_length": orig * 4,
          "qwen3.attention.layer_norm_rms_epsilon": 1e-6, "qwen3.vocab_size": 8, "qwen3.rope.freq_base": base,
          "qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": factor,
          "qwen3.rope.scaling.original_context_length": orig, "qwen3.rope.scaling.yarn_beta_fast": fast,
          "qwen3.rope.scaling.yarn_beta_slow": slow}
    cfg = ModelConfig.from_gguf(md, set())
    hf_cfg = transformers.Qwen3Config(hidden_size=2 * dims, num_attention_heads=2, head_dim=dims,
                                      max_position_embeddings=orig * 4,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": base, "factor": factor,
                                                       "original_max_position_embeddings": orig,
                                                       "beta_fast": fast, "beta_slow": slow})
    ref, magnitude = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    ours = rope.inv_freq(cfg, None, orig * 4)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)
    assert cfg.rope_attn_factor == pytest.approx(magnitude, rel=1e-6)
    assert cfg.rope_attn_factor == pytest.approx(0.1 * math.log(factor) + 1)


def test_mistral3_without_temperature_scaling_is_llama(random_model):
    """mistral3 is Llama's block: the same weights read as llama give transformers' Llama logits."""
    spec = variant("tiny-llama", arch="mistral3", name="tiny-mistral3")
    path = random_model(spec, "F32", std=STD)
    twin = random_model(variant(spec, arch="llama"), "F32", std=STD)
    ids = list(range(3, 50))
    check(Ours(path).prefill(ids), hf_logits(hf_model(twin), ids)[-1])


@pytest.mark.parametrize("change,message", [
    ({"metadata": {"mistral3.attention.temperature_scale": 0.1}}, "temperature scaling"),
    ({"drop_tensors": ()}, None),
])
def test_mistral3_refuses_what_it_cannot_run(tmp_path, change, message):
    from llamacli.errors import UnknownArchitectureError
    from llamacli.testing import write_model

    path = write_model(tmp_path / "m.gguf", variant("tiny-llama", arch="mistral3"), "F32", **change)
    g = open_gguf(path)
    if message is None:
        ModelConfig.from_gguf(g.metadata, set(g.tensors))
        with pytest.raises(UnknownArchitectureError, match="output"):
            ModelConfig.from_gguf(g.metadata, set(g.tensors) | {"blk.0.attn_output.bias"})
    else:
        with pytest.raises(UnknownArchitectureError, match=message):
            ModelConfig.from_gguf(g.metadata, set(g.tensors))


@pytest.mark.parametrize("shape,qtype", [("tiny-gemma3", "F32"), ("tiny-gemma3", "Q8_0"), ("tiny-gemma2", "F32")])
def test_gemma_matches_transformers(random_model, shape, qtype):
    """Sliding windows of 8 keys under prompts of up to 130 tokens, gemma3's local/global RoPE bases, gemma2's
    soft-caps, post-norms, GeGLU, head dim 256, the embedding scale; then decode through the cache."""
    path = random_model(shape, qtype, std=STD)
    cfg = Ours(path).cfg
    windows = [p.window for p in cfg.layers]
    assert windows == ([8, 8, 8, 8, 8, 0] if shape == "tiny-gemma3" else [8, 0, 8, 0])
    assert all(p.post_norms and p.activation == "gelu_tanh" for p in cfg.layers)
    run_lengths_and_decode(path, vocab_of(path), seed=11)
    greedy_matches(path, hf_model(path), seed=12)


def test_gemma_window_and_softcap_change_the_result(random_model):
    """The reference would pass with the window or the soft-cap ignored only if they did nothing: check
    they do (the same weights with the window widened, or the caps removed, give other logits)."""
    path = random_model("tiny-gemma2", "F32", std=STD)
    wide = random_model(variant("tiny-gemma2", window=4096), "F32", std=STD)
    ids = list(range(3, 40))
    assert not np.allclose(Ours(path).prefill(ids), Ours(wide).prefill(ids), atol=1e-4)
    ours = Ours(path)
    capped = ours.prefill(ids)
    assert np.abs(capped).max() < 30.0  # the final soft-cap bounds the logits
