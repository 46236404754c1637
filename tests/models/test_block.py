"""The layer written once (llamacli/models/block.py): each plan's program, and the CUDA backend's reading of it
into its fused forms (backends/cuda/fusion.py; no GPU needed). That the programs compute what transformers
computes is test_model_reference.py / test_architectures.py (through block.run on the NumPy backend); that the
fused CUDA paths compute what block.run computes is the GPU tests'."""

from __future__ import annotations

import pytest

from llamacli.backends.cuda.fusion import Unfused, match_layer, uneven_layers
from llamacli.models.block import (
    Add,
    Attention,
    Conv,
    DeltaRule,
    Gate,
    GatedNorm,
    Glu,
    Linear,
    Moe,
    Norm,
    Rope,
    Scale,
    Split,
    layer_op,
    layer_ops,
)
from llamacli.models.config import ModelConfig
from llamacli.testing import HYBRIDS, NUMPY_ONLY, SHAPES, model_metadata, tensor_shapes


def config(shape: str) -> ModelConfig:
    spec = SHAPES[shape]
    vocab = 300
    return ModelConfig.from_gguf(model_metadata(spec, vocab), {n for n, _ in tensor_shapes(spec, vocab)})


@pytest.mark.parametrize("shape", sorted(s for s in SHAPES if SHAPES[s].arch not in NUMPY_ONLY))
def test_every_shape_fuses_on_cuda(shape) -> None:
    """Every architecture the project runs has programs the fused CUDA paths take, layer by layer, and the
    fused branches name the same operations as the program (nothing dropped)."""
    cfg = config(shape)
    for i in range(cfg.n_layer):
        ops = layer_ops(cfg, i)
        fused = match_layer(ops, i)
        a, f = fused.attention, fused.ffn
        named = {a.norm, *a.qkv, a.attention, a.out, f.norm, *f.gate_up}
        named |= {op for op in (a.split, a.rope, a.post, f.split, f.glu, f.down, f.post, f.moe) if op is not None}
        named |= set(a.head_norms or ())
        rest = [op for op in ops if op not in named]
        # What the branches do not keep: the residual adds, and k's RoPE (it rotates as q's)
        assert all(isinstance(op, Add) or op == Rope("k", a.rope.local) for op in rest), rest


@pytest.mark.parametrize("shape", sorted(s for s in SHAPES if SHAPES[s].arch in HYBRIDS))
def test_hybrid_shapes_run_op_by_op_on_cuda(shape) -> None:
    """The CUDA paths have no fused form of the gated delta-net layers, gated attention or shared experts: the hybrid
    models run op by op there (fusion.op_by_op; no fused layers), and match_layer, should such a layer reach it,
    names the operation rather than sending the model to the CPU backend."""
    from llamacli.backends.cuda.device import fused_layers
    from llamacli.backends.cuda.fusion import op_by_op

    cfg = config(shape)
    assert op_by_op(cfg) and fused_layers(cfg) == ()
    for i in range(cfg.n_layer):
        what = "(Conv|Split)" if cfg.layers[i].recurrent else "Split"
        with pytest.raises(Unfused, match=f"no {what} operation .a model with one runs op by op."):
            match_layer(layer_ops(cfg, i), i)


@pytest.mark.parametrize("shape", sorted(s for s in SHAPES if SHAPES[s].arch == "gemma4"))
def test_gemma4_shapes_run_op_by_op_on_cuda(shape) -> None:
    """The fused CUDA paths have no Gemma 4 layers (V norms, output scales, shared KV, per-layer embeddings, experts
    beside a dense FFN) nor layers of different shapes: Gemma 4 runs op by op there (fusion.op_by_op; no fused layers),
    and match_layer, should such a layer reach it, names what it lacks."""
    from llamacli.backends.cuda.device import fused_layers
    from llamacli.backends.cuda.fusion import op_by_op

    cfg = config(shape)
    assert op_by_op(cfg) and fused_layers(cfg) == ()
    assert uneven_layers(cfg) in ("per-layer embeddings", "attention layers of different head sizes")
    for i in range(cfg.n_layer):
        with pytest.raises(Unfused, match="no Gemma 4 layers .*runs op by op"):
            match_layer(layer_ops(cfg, i), i)


def test_gemma4_programs() -> None:
    """Gemma 4's layers: a sliding one with its own KV (V normalised without a weight, no query scale), a shared-KV
    one (queries only, over an earlier layer's cache, nothing written), the per-layer input after the FFN and the
    output scale; in the MoE model a global layer's V from K's projection, and the experts beside the dense FFN, the
    router reading the scaled, normalised residual."""
    cfg = config("tiny-gemma4")
    assert cfg.query_scale == 1.0
    assert layer_ops(cfg, 0)[:10] == (
        Norm("x", "attn_norm", "h"), Linear("h", "attn_q", "q"), Linear("h", "attn_k", "k"), Linear("h", "attn_v", "v"),
        Norm("q", "attn_q_norm", "q", heads=True), Norm("v", None, "v", heads=True),
        Norm("k", "attn_k_norm", "k", heads=True), Rope("q", local=True), Rope("k", local=True), Attention(0, 8))
    shared = layer_ops(cfg, 7)
    assert shared[:5] == (Norm("x", "attn_norm", "h"), Linear("h", "attn_q", "q"),
                          Norm("q", "attn_q_norm", "q", heads=True), Rope("q"), Attention(5, store=False))
    assert shared[-6:] == (Linear("x", "per_layer_inp_gate", "pg"), Glu("gelu_tanh", "pg", "ple", "pg"),
                           Linear("pg", "per_layer_proj", "p"), Norm("p", "per_layer_post_norm", "p"), Add("p"),
                           Scale("x", "x", "layer_output_scale"))
    moe = config("tiny-gemma4-moe")
    glob = layer_ops(moe, 5)
    assert glob[1:5] == (Linear("h", "attn_q", "q"), Linear("h", "attn_k", "k"),
                         Norm("q", "attn_q_norm", "q", heads=True), Norm("k", None, "v", heads=True))
    ffn = glob[glob.index(Linear("ff", "ffn_down", "f")) + 1:]
    assert ffn == (
        Norm("f", "ffn_post_norm_1", "f"), Norm("x", "ffn_pre_norm_2", "h"), Norm("x", "ffn_gate_inp_scale", "r"),
        Scale("r", "r", factor=1 / 8), Moe(5, "softmax", "gelu_tanh", src="h", dst="e", router="r", expert_scale=True,
                                           gate_up=True),
        Norm("e", "ffn_post_norm_2", "e"), Add("e", "f"), Norm("f", "ffn_post_norm", "f"), Add("f"),
        Scale("x", "x", "layer_output_scale"))


def test_hybrid_programs() -> None:
    """A delta-net layer's program (qwen35: beta and alpha apart, value heads tiled; qwen3next: one ssm_ba split per
    key head, value heads grouped), a gated attention layer's (q and gate per head, the gate after attention), and
    the shared expert beside the experts."""
    cfg = config("tiny-qwen35")
    assert [p.recurrent for p in cfg.layers] == [True, True, True, False] * 2
    assert layer_ops(cfg, 0) == (
        Norm("x", "attn_norm", "h"), Linear("h", "attn_qkv", "qkv"), Linear("h", "attn_gate", "z"),
        Linear("h", "ssm_beta", "b"), Linear("h", "ssm_alpha", "a"), Conv(0), DeltaRule(0, "tiled"),
        GatedNorm("att", "ssm_norm", "z", "att"), Linear("att", "ssm_out", "o"), Add("o"),
        Norm("x", "ffn_norm", "h"), Linear("h", "ffn_gate", "g"), Linear("h", "ffn_up", "u"), Glu("silu"),
        Linear("ff", "ffn_down", "f"), Add("f"),
    )
    att = layer_ops(cfg, 3)
    assert att[:7] == (
        Norm("x", "attn_norm", "h"), Linear("h", "attn_q", "qg"), Split("qg", ("q", "gate"), (32, 32), 4),
        Linear("h", "attn_k", "k"), Linear("h", "attn_v", "v"), Norm("q", "attn_q_norm", "q", heads=True),
        Norm("k", "attn_k_norm", "k", heads=True))
    assert att[att.index(Attention(3)) + 1] == Gate("att", "gate", "att")
    nxt = config("tiny-qwen3next")
    ops = layer_ops(nxt, 1)
    assert Split("ba", ("b", "a"), (2, 2), 2) in ops and DeltaRule(1, "grouped") in ops
    moe = layer_ops(config("tiny-qwen35moe"), 3)
    assert moe[-8:] == (
        Add("f"), Linear("h", "ffn_gate_shexp", "g"), Linear("h", "ffn_up_shexp", "u"), Glu("silu"),
        Linear("ff", "ffn_down_shexp", "s"), Linear("h", "ffn_gate_inp_shexp", "sg"), Gate("s", "sg", "s"), Add("s"))
    assert Moe(3, "softmax", "silu") in moe


def test_llama_block_program() -> None:
    cfg = config("tiny-llama")
    assert layer_ops(cfg, 0) == (
        Norm("x", "attn_norm", "h"),
        Linear("h", "attn_q", "q"), Linear("h", "attn_k", "k"), Linear("h", "attn_v", "v"),
        Rope("q"), Rope("k"), Attention(0), Linear("att", "attn_output", "o"), Add("o"),
        Norm("x", "ffn_norm", "h"), Linear("h", "ffn_gate", "g"), Linear("h", "ffn_up", "u"), Glu("silu"),
        Linear("ff", "ffn_down", "f"), Add("f"),
    )


def test_plan_flags_become_operations() -> None:
    """Each plan flag shows up as the operation it implies, with its parameters."""
    qwen2 = layer_ops(config("tiny-qwen2"), 1)
    assert Linear("h", "attn_k", "k", "attn_k_bias") in qwen2
    phi3 = layer_ops(config("tiny-phi3"), 0)
    cfg = config("tiny-phi3")
    assert Split("qkv", ("q", "k", "v"), (cfg.q_dim, cfg.kv_dim, cfg.kv_dim)) in phi3
    assert Split("gu", ("g", "u"), (cfg.n_ff, cfg.n_ff)) in phi3
    qwen3 = layer_ops(config("tiny-qwen3"), 0)
    assert qwen3.index(Norm("q", "attn_q_norm", "q", heads=True)) < qwen3.index(Rope("q"))
    smol3 = config("tiny-smollm3")  # every fourth layer without RoPE
    assert [any(isinstance(op, Rope) for op in layer_ops(smol3, i)) for i in range(4)] == [True, True, True, False]
    g3 = config("tiny-gemma3")
    local = layer_ops(g3, 0)
    assert Rope("q", local=True) in local and layer_op(g3, 0, Attention).window == 8
    assert layer_op(g3, 5, Attention).window == 0 and Rope("q", local=False) in layer_ops(g3, 5)
    assert local[local.index(Linear("att", "attn_output", "o")) + 1] == Norm("o", "attn_post_norm", "o")
    assert Glu("gelu_tanh") in local
    assert layer_op(config("tiny-gemma2"), 0, Attention).softcap == 50.0
    oss = config("tiny-gpt-oss")
    att = layer_op(oss, 0, Attention)
    assert att.sinks and att.window == 8 and not layer_op(oss, 1, Attention).window
    assert Linear("att", "attn_output", "o", "attn_output_bias") in layer_ops(oss, 0)
    assert layer_op(oss, 0, Moe) == Moe(0, "topk_softmax", "swiglu_oai", bias=True)
    assert layer_op(config("tiny-qwen3moe"), 2, Moe) == Moe(2, "softmax", "silu")


def test_block_run_follows_the_program(random_model, monkeypatch) -> None:
    """block.run executes the programs block.programs gives, not a copy of the layer: the attention output added
    twice into the residual (one more Add in the program) is what a NumPy pass then computes, checked against
    the same pass with that layer's O projection doubled by hand. Tolerance: float32 products, 1e-5 + 1e-4."""
    import numpy as np

    from llamacli.backends.numpy_backend import NumpyBackend
    from llamacli.ggufio.file import open_gguf
    from llamacli.models import block

    g = open_gguf(random_model("tiny-llama", "F32"))
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))

    def logits(program, double_o=False):
        be = NumpyBackend()
        be.load(g, cfg, 16)
        if double_o:
            be.weights.layers[1].attn_output = be.weights.layers[1].attn_output * 2
        monkeypatch.setattr(block, "programs", program)
        return be.to_host(block.run(be, cfg, be.token_ids(np.arange(5)), be.positions(0, 5)))

    real = block.programs
    twice = lambda c: tuple(p if i != 1 else p[:9] + (Add("o"),) + p[9:] for i, p in enumerate(real(c)))  # noqa: E731
    want = logits(real, double_o=True)
    np.testing.assert_allclose(logits(twice), want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(logits(real), want, rtol=1e-3)


def test_fusion_refuses_what_it_cannot_run() -> None:
    """A program whose order or operations have no fused CUDA form is refused, naming what does not fit."""
    ops = layer_ops(config("tiny-llama"), 0)
    with pytest.raises(Unfused, match="Attention"):
        match_layer(ops[:5] + ops[6:])  # q rotated, k not
    with pytest.raises(Unfused, match="Rope"):
        match_layer(ops[:4] + (Rope("q", local=False), Rope("k", local=True)) + ops[6:])  # q and k rotate apart
    with pytest.raises(Unfused, match="post-norm"):
        o = ops.index(Linear("att", "attn_output", "o"))
        match_layer(ops[:o] + (Linear("att", "attn_output", "o", "attn_output_bias"), Norm("o", "attn_post_norm", "o"))
                    + ops[o + 1:])
    with pytest.raises(Unfused, match="activation"):
        match_layer(tuple(Glu("swiglu_oai") if isinstance(op, Glu) else op for op in ops))
    with pytest.raises(Unfused, match="goes on"):
        match_layer(ops + (Add("f"),))
    with pytest.raises(Unfused, match="projections"):
        match_layer(ops[:1] + (Linear("h", "attn_q", "q", "attn_q_bias"),) + ops[2:])  # a bias on q alone
    with pytest.raises(Unfused, match="another layer"):
        match_layer(ops, 1)  # layer 0's program where layer 1's belongs
    moe = layer_ops(config("tiny-qwen3moe"), 0)
    with pytest.raises(Unfused, match="mixture of experts"):
        match_layer(moe[:-1] + (Norm("f", "ffn_post_norm", "f"), moe[-1]))
