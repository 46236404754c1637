"""Which models the CUDA backend runs op by op (fusion.op_by_op: the hybrid Qwen models, whose Gated DeltaNet layers,
gated attention and shared experts have kernels of their own, kernels/delta.cu, but no fused form), checked without a
GPU: they load with no fused layers, no other model changes its path, Gemma 4 runs op by op too (its layers of
different shapes, shared KV, per-layer embeddings and experts beside a dense FFN), and the delta kernels are compiled
for the hybrid models only."""

from __future__ import annotations

import numpy as np
import pytest

from llamacli.backends.cuda import device, fusion, loader as K
from llamacli.errors import BackendError
from llamacli.ggufio.file import open_gguf
from llamacli.models.block import layer_ops
from llamacli.models.config import ModelConfig
from llamacli.testing import variant

HYBRIDS = ["tiny-qwen35", "tiny-qwen35moe", "tiny-qwen3next"]
# A qwen35 file whose every layer is (gated) attention: no recurrent layer, still an operation only op by op runs
ALL_ATTENTION = variant("tiny-qwen35", full_attention_interval=1, name="qwen35-all-attention")
FUSED = ["tiny-llama", "tiny-qwen2", "tiny-phi3", "tiny-qwen3", "tiny-smollm3", "tiny-gemma2", "tiny-gemma3",
         "tiny-qwen3moe", "tiny-gpt-oss"]


def config(random_model, shape) -> ModelConfig:
    g = open_gguf(random_model(shape))
    try:
        return ModelConfig.from_gguf(g.metadata, set(g.tensors))
    finally:
        g.close()


@pytest.mark.parametrize("shape", HYBRIDS + [ALL_ATTENTION], ids=lambda s: s if isinstance(s, str) else s.name)
def test_the_hybrid_models_run_op_by_op_with_no_fused_layers(random_model, shape) -> None:
    cfg = config(random_model, shape)
    assert fusion.op_by_op(cfg)
    assert device.fused_layers(cfg) == ()
    # (their programs have no fused form: match_layer names the operation, not the CPU backend)
    i = next(i for i, p in enumerate(cfg.layers) if not p.recurrent) if shape is ALL_ATTENTION else 0
    with pytest.raises(fusion.Unfused, match="no (Conv|Split|Linear|Gate)|expect") as err:
        fusion.match_layer(layer_ops(cfg, i), i)
    assert "--backend cpu" not in str(err.value)


@pytest.mark.parametrize("shape", FUSED)
def test_every_other_model_keeps_its_fused_layers(random_model, shape) -> None:
    cfg = config(random_model, shape)
    assert not fusion.op_by_op(cfg)
    assert len(device.fused_layers(cfg)) == cfg.n_layer


GEMMA4 = ["tiny-gemma4", "tiny-gemma4-moe"]


@pytest.mark.parametrize("shape", GEMMA4)
def test_gemma4_runs_op_by_op_with_no_fused_layers(random_model, shape) -> None:
    """Gemma 4 (layers of their own head sizes, shared KV, per-layer embeddings, V norms, output scales, experts beside
    a dense FFN) runs op by op on CUDA: no fused layers, its experts accepted (GeGLU, their own norms), and
    match_layer, should a layer reach it, names what it lacks rather than sending the model to the CPU backend."""
    cfg = config(random_model, shape)
    assert fusion.op_by_op(cfg) and device.fused_layers(cfg) == ()
    assert fusion.uneven_layers(cfg) in ("per-layer embeddings", "attention layers of different head sizes")
    for i in range(cfg.n_layer):
        with pytest.raises(fusion.Unfused, match="no Gemma 4 layers .*runs op by op") as err:
            fusion.match_layer(layer_ops(cfg, i), i)
        assert "--backend cpu" not in str(err.value)


def test_gemma4_layers_of_one_shape_still_run_op_by_op(random_model) -> None:
    """A Gemma 4 file whose layers all have one head size and no per-layer embeddings still runs op by op: its
    programs' own operations (V norms, output scales) have no fused form."""
    shape = variant("tiny-gemma4", n_embd_per_layer=0, n_kv_shared=0, head_dim_swa=64, name="gemma4-even")
    cfg = config(random_model, shape)
    assert fusion.uneven_layers(cfg) is None
    assert fusion.op_by_op(cfg) and device.fused_layers(cfg) == ()


def test_gemma4_experts_past_the_kernels_limits_are_refused(random_model) -> None:
    """Gemma 4's experts go through check_moe as every model's do: more chosen experts than MOE_KMAX is refused at
    load, naming the limit."""
    cfg = config(random_model, "tiny-gemma4-moe")
    import dataclasses

    with pytest.raises(BackendError, match="up to 1024 experts with up to 32 per token"):
        device.fused_layers(dataclasses.replace(cfg, n_expert=64, n_expert_used=33))


def test_the_delta_kernels_are_compiled_for_the_op_by_op_models_only(random_model, monkeypatch) -> None:
    built: list[str] = []
    monkeypatch.setattr(K, "module", built.append)
    device.compile_kernels(config(random_model, "tiny-qwen35moe"))
    assert "delta" in built and "moe" in built
    built.clear()
    device.compile_kernels(config(random_model, "tiny-qwen3"))
    assert "delta" not in built and "moe" not in built and "matvec" in built



# -- delta.DeltaNet's bookkeeping, with NumPy stand-ins for its kernels ----------------------------------------------
# (the kernels themselves are tests/backends/cuda/test_gpu_delta.py's, on a GPU)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _conv_into(x, w, win, out):
    full = np.concatenate([win, x])
    out[...] = _silu(sum(full[j : j + x.shape[0]] * w[:, j] for j in range(w.shape[1])))


def _conv_window(x, win, dst, at):
    dst[...] = np.concatenate([win, x])[at : at + win.shape[0]]  # (joined before dst, which may be win, is written)


def _delta_qk(cp, qkv, hk, dk, eps):
    t = qkv.shape[0]
    q = qkv[:, : hk * dk].reshape(t, hk, dk)
    k = qkv[:, hk * dk : 2 * hk * dk].reshape(t, hk, dk)
    qn = q / np.sqrt((q**2).sum(-1, keepdims=True) + eps) / np.sqrt(dk)
    kn = k / np.sqrt((k**2).sum(-1, keepdims=True) + eps)
    return qn.astype(np.float32), kn.astype(np.float32), (qn * kn).sum(-1).astype(np.float32)


def _delta_rule_into(qn, kn, kq, qkv, a, b, ssm_a, dt, s, out, grouped):
    t, hk, dk = qn.shape
    hv, _, dv = s.shape
    for h in range(hv):  # the kernel's form: the recall and the read in one pass over the old state
        j = h // (hv // hk) if grouped else h % hk
        for i in range(t):
            decay = np.exp(ssm_a[h] * np.logaddexp(0.0, a[i, h] + dt[h]))
            beta = 1.0 / (1.0 + np.exp(-b[i, h]))
            v = qkv[i, 2 * hk * dk + h * dv : 2 * hk * dk + (h + 1) * dv]
            u = beta * (v - decay * (s[h].T @ kn[i, j]))
            out[i, h * dv : (h + 1) * dv] = decay * (s[h].T @ qn[i, j]) + u * kq[i, j]
            s[h] = decay * s[h] + np.outer(kn[i, j], u)


def test_delta_net_stores_resumes_and_rolls_back_as_the_numpy_backend(monkeypatch) -> None:
    """DeltaNet (cuda/delta.py) over NumPy arrays, its launchers replaced by NumPy stand-ins of the kernels (which write
    the live window and state in place, as the kernels do): passes of 7, 1, 1, 64, 65 and 130 positions give the
    NumPy backend's outputs and stored positions; each stored state resumes to the reference's outputs; a rollback
    after a verification restores the state at its start and hands back the ids to run again."""
    from types import SimpleNamespace

    from llamacli.backends.base import LayerWeights, ModelWeights
    from llamacli.backends.cuda import delta
    from llamacli.backends.numpy_backend import NumpyBackend
    from llamacli.models import rope as rope_tables
    from llamacli.models.base import LayerPlan
    from llamacli.models.block import Conv, DeltaRule
    from llamacli.models.config import ROPE_NEOX
    from llamacli.models.seq_cache import SNAPSHOT_EVERY

    for name, fn in (("conv_into", _conv_into), ("conv_window", _conv_window), ("delta_qk", _delta_qk),
                     ("delta_rule_into", _delta_rule_into)):
        monkeypatch.setattr(delta, name, fn)
    hk, hv, dk, kw = 2, 4, 8, 4
    cfg = ModelConfig(
        architecture="qwen35", name="t", n_layer=2, n_embd=32, n_head=2, n_head_kv=1, head_dim=16, n_ff=64,
        vocab_size=50, context_length=1024, rope_type=ROPE_NEOX, rope_dim=16, rope_freq_base=1e7, rope_scaling="none",
        rope_scaling_factor=1.0, rope_original_context=1024, rope_attn_factor=1.0, rms_eps=1e-6,
        tied_embeddings=False, bos_token_id=None, eos_token_id=None,
        layers=(LayerPlan(mixer="delta_net", ssm_heads="tiled"), LayerPlan(mixer="delta_net", ssm_heads="grouped")),
        ssm_conv_kernel=kw, ssm_state_size=dk, ssm_group_count=hk, ssm_time_step_rank=hv, ssm_inner_size=hv * dk)
    rng = np.random.default_rng(0)
    c = cfg.ssm_conv_dim
    layers = [LayerWeights(attn_norm=np.ones(32, np.float32),
                           ssm_conv1d=(0.5 * rng.standard_normal((c, kw))).astype(np.float32),
                           ssm_dt=rng.standard_normal(hv).astype(np.float32),
                           ssm_a=(-np.exp(rng.uniform(-2, 1, hv))).astype(np.float32)) for _ in range(2)]
    weights = ModelWeights(None, layers, None, None)
    ref = NumpyBackend()
    theta = rope_tables.inv_freq(cfg, None, 1024)
    ref.adopt(cfg, 1024, weights, theta, theta)
    gpu = SimpleNamespace(cp=np, f32=lambda x: np.ascontiguousarray(x, dtype=np.float32))
    net = delta.DeltaNet(gpu, SimpleNamespace(cfg=cfg, weights=weights), lambda pos: int(pos[0]))

    def run(start: int, t: int) -> None:
        pos = np.arange(start, start + t, dtype=np.int32)
        for i, plan in enumerate(cfg.layers):
            x = rng.standard_normal((t, c)).astype(np.float32)
            np.testing.assert_allclose(net.conv(Conv(i), x, pos), ref.conv(Conv(i), x, pos), rtol=1e-5, atol=1e-6)
            qkv = rng.standard_normal((t, c)).astype(np.float32)
            a, b = (rng.standard_normal((t, hv)).astype(np.float32) for _ in "ab")
            op = DeltaRule(i, plan.ssm_heads)
            np.testing.assert_allclose(net.delta_rule(op, qkv, a, b, pos), ref.delta_rule(op, qkv, a, b, pos),
                                       rtol=1e-4, atol=1e-5)

    start = 0
    for t in (7, 1, 1, 64, 65, 130):
        run(start, t)
        start += t
        assert net.snapshots(0) == ref.snapshots(0)
    held = sorted(ref.snapshots(0))
    assert held == [SNAPSHOT_EVERY, start]
    for p in reversed(held):
        net.resume(0, p)
        ref.resume(0, p)
        run(p, 20)
        assert net.snapshots(0, p + 20) == ref.snapshots(0, p + 20)
    # a verification of 5 ids at 276 (the decode step before stored 276), 2 kept: the state at 276 comes back
    run(276, 1)
    assert net.snapshots(0) == ref.snapshots(0)
    ids = np.arange(5)
    net.begin_verify(ids, 277)
    ref.recurrent_slot.verified = (277, ids.copy(), 277 in ref.recurrent_slot.pinned)  # (ref.forward_verify's record)
    ref.recurrent_slot.pinned.add(277)
    run(277, 5)
    again = net.rollback(0, 279)
    assert again is not None and again[0] == 277 and again[1].tolist() == [0, 1]
    ref.resume(0, 277)
    run(277, 2)  # (what the backend's rollback runs: the kept ids; here fresh inputs on both)
    assert net.snapshots(0) == ref.snapshots(0)
    assert net.rollback(0, 279) is None  # (nothing verified since)


def test_the_8bit_pair_holds_the_layers_own_shape(random_model) -> None:
    """An 8-bit cache whose layers share one shape other than the config's (a Gemma 4 file of sliding layers only:
    heads of 64 where head_dim says 32): the fp16 pair that kv_dequant_q8 fills holds the largest layer's values."""
    from llamacli.backends.cuda.kv import KVCache

    shape = variant("tiny-gemma4", n_embd_per_layer=0, n_kv_shared=0, head_dim=32, head_dim_swa=64,
                    swa_layers=(True,) * 8, name="gemma4-all-sliding")
    cfg = config(random_model, shape)
    kv = KVCache(np, cfg, 1024, True)
    most = max(kc.shape[0] * KVCache.heads(kc)[0] * KVCache.heads(kc)[1] for kc in kv.k_cache)
    assert all(p.size >= most for p in kv.pair)
    assert KVCache.heads(kv.k_cache[0]) == (cfg.layer_kv_heads(0), 64)


def test_the_kernel_bench_builds_its_attention_without_a_model() -> None:
    """`bench --kernels` makes the attention launchers over a bare config and no cache (kernel_bench._attention's
    way): their split counters come from the cache when there is one, else the config."""
    from types import SimpleNamespace

    from llamacli.backends.cuda.attention import AttentionKernels

    cfg = SimpleNamespace(n_head=32, n_head_kv=32, head_dim=64, n_group=1, q_dim=2048, rms_eps=1e-5)
    attn = AttentionKernels(SimpleNamespace(cp=np), None, SimpleNamespace(cfg=cfg, ctx=512), None)
    assert attn.counters.shape == (32,)


def test_heads_past_the_gpus_shared_memory_are_refused_in_one_line(random_model) -> None:
    """Gemma 4's global heads of 512 take the CUDA-core attention (131 KB of shared memory a block): a GPU that
    allows less (an RTX 4090's 99 KB) is refused before the upload, naming the CPU backend; one that allows it
    passes, and models with heads of 256 or less are not checked."""
    from types import SimpleNamespace

    cfg = config(random_model, variant("tiny-gemma4", head_dim=512, name="gemma4-512"))
    with pytest.raises(BackendError, match="--backend cpu"):
        device.check_attention_smem(SimpleNamespace(smem_block=101_376), cfg)
    device.check_attention_smem(SimpleNamespace(smem_block=232_448), cfg)
    device.check_attention_smem(SimpleNamespace(smem_block=1024), config(random_model, "tiny-llama"))
