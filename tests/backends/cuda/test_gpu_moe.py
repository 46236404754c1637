"""GPU tests of the mixture-of-experts kernels (kernels/moe.cu) and gpt-oss's attention sinks, against the
references: llamacli.models.moe.route and float64 attention with sinks (test_gpu_kernels.ext_attention_ref); the
whole MoE layer against the NumPy backend is in test_gpu_backend.py's architecture cases."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from llamacli.backends.cuda import cuda_available  # noqa: E402
from llamacli.backends.cuda.fusion import match_layer  # noqa: E402
from llamacli.backends.cuda.moe import Experts  # noqa: E402
from llamacli.models.block import layer_ops  # noqa: E402
from llamacli.models.moe import route  # noqa: E402

_ok, _why = cuda_available()
if not _ok:
    pytest.skip(_why, allow_module_level=True)
pytestmark = pytest.mark.gpu

from test_gpu_kernels import (  # noqa: E402
    assert_close,
    att_op,
    attend_step,
    bare,
    check_prefill_chunks,
    ext_attention_ref,
    make_cfg,
    poisoned,
    put_positions,
)

# -- routing ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_expert,k", [(8, 1), (8, 2), (60, 4), (128, 8), (1000, 32), (32, 32)])
@pytest.mark.parametrize("gating", ["softmax", "topk_softmax"])
@pytest.mark.parametrize("norm", [False, True])
def test_route_matches_reference(n_expert, k, gating, norm) -> None:
    """moe_route_f32 against llamacli.models.moe.route: random logits, logits with many exact ties (lower id first),
    one expert far ahead of the rest, -inf logits; ids exact, weights to float32 rounding."""
    from llamacli.backends.cuda import CudaBackend

    be = CudaBackend(use_graph=False)
    be.cfg = SimpleNamespace(n_expert=n_expert, n_expert_used=k, expert_weights_norm=norm)
    be.experts = Experts(be.gpu, SimpleNamespace(cfg=be.cfg, weights=None), None)  # the launchers alone
    rng = np.random.default_rng(n_expert * 31 + k)
    t = 37
    cases = [
        rng.standard_normal((t, n_expert)).astype(np.float32) * 3,
        rng.integers(-2, 3, size=(t, n_expert)).astype(np.float32),  # ties everywhere
    ]
    far = rng.standard_normal((t, n_expert)).astype(np.float32)
    far[np.arange(t), rng.integers(0, n_expert, size=t)] = 80.0  # all the weight on one expert
    cases.append(far)
    minf = rng.standard_normal((t, n_expert)).astype(np.float32)
    minf[:, ::3] = -np.inf
    if n_expert - len(range(0, n_expert, 3)) >= k:
        cases.append(minf)
    for logits in cases:
        want_ids, want_w = route(logits, k, gating, norm)
        ids = cp.full(t * k, -1, cp.int32)
        wts = poisoned(t * k)
        be.experts.route(cp.asarray(logits), t, ids, wts, gating)
        np.testing.assert_array_equal(ids.get().reshape(t, k), want_ids)
        assert_close(wts.get().reshape(t, k), want_w, 1e-6, 1e-5, "weights")


@pytest.mark.parametrize("spec,n_expert,k", [("tiny-qwen3moe", 8, 2), ("tiny-qwen3moe", 128, 8),
                                             ("tiny-qwen3moe", 1000, 32), ("tiny-gpt-oss", 32, 4)])
def test_decode_router_routes_as_the_reference(tmp_path, spec, n_expert, k) -> None:
    """The decode step's router (mv1_route_f32: the logits, then its last block ranks them, route_block)
    against llamacli.models.moe.route on the logits it wrote: router rows whose column 0 alone is nonzero (x is
    e_0), so that logits keep exact ties (lower id first); -inf logits; one expert far ahead; softmax gating
    (qwen3moe, renormalised) and top-k softmax (gpt-oss, its router bias zeroed); every block of the launch
    done and the counter reset for the next step."""
    from gguf import GGMLQuantizationType as QT
    from test_gpu_backend import loaded

    from llamacli.backends.cuda import CudaBackend
    from llamacli.testing import variant, write_model

    path = write_model(tmp_path / "m.gguf", variant(spec, n_expert=n_expert, n_expert_used=k), QT.F32)
    _g, cfg, be = loaded(path, CudaBackend(use_graph=False))
    layer = next(i for i, p in enumerate(cfg.layers) if p.moe)
    L, plan = be.weights.layers[layer], cfg.layers[layer]
    r = L.ffn_gate_inp
    assert (r.rows, r.cols) == (n_expert, cfg.n_embd)
    w = cp.ndarray((n_expert, cfg.n_embd), cp.float32,
                   cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(r.ptr, r.nbytes, be), 0))
    if L.ffn_gate_inp_bias is not None:
        L.ffn_gate_inp_bias[...] = 0
    L.ffn_norm[...] = 1
    x = cp.zeros((1, cfg.n_embd), cp.float32)
    x[0, 0] = 1.0
    rng = np.random.default_rng(n_expert * 7 + k)
    far = rng.standard_normal(n_expert)
    far[rng.integers(n_expert)] = 40.0
    minf = rng.standard_normal(n_expert)
    minf[::3] = -np.inf
    cases = [rng.standard_normal(n_expert) * 3, rng.integers(-2, 3, n_expert).astype(float), far]
    if n_expert - len(range(0, n_expert, 3)) >= k:
        cases.append(minf)
    for col in cases:
        w[...] = 0
        w[:, 0] = cp.asarray(col, cp.float32)
        be.experts.step_ids[...] = -1
        be.experts.step_wts[...] = cp.nan
        be.experts.step(match_layer(layer_ops(cfg, layer)).ffn, x, lambda section, nbytes, launch: launch(False) if section == "norm+router" else None)
        logits = be.experts.step_logits.get()
        assert (logits[0] == -np.inf).sum() == np.isneginf(col).sum()
        want_ids, want_w = route(logits, k, plan.moe_gating, cfg.expert_weights_norm)
        np.testing.assert_array_equal(be.experts.step_ids.get(), want_ids[0])
        assert_close(be.experts.step_wts.get(), want_w[0], 1e-6, 1e-5, "weights")
        assert be.experts.step_done.get()[0] == 0


@pytest.mark.parametrize("qtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("n_expert,k,cols", [(128, 8, 2048), (32, 4, 2880), (1000, 32, 100), (9, 3, 77)])
def test_decode_router_logits_against_float64(qtype, n_expert, k, cols) -> None:
    """mv1_route_<t>'s logits (a warp a router row reading 16-byte chunks across its lanes; one value a lane
    where rows are not whole chunks: 77 columns, and 100 in the 16-bit types) against float64
    RMSNorm(x) * norm_w . row (+ bias) for F32 / F16 / BF16 rows; -inf and a NaN logit through the bias, k - 1
    finite logits left, so that the k-th choice falls among them (NaN ranks as -inf, the lower id first; E = 9
    also pads the ranked row with -inf); its ids and weights against llamacli.models.moe.route on the logits it
    wrote, and bit for bit against moe_route_f32 (the same ranking by a block of 32) on them, for softmax
    gating with and without renormalising and for top-k softmax; nothing written past the E logits; a second
    launch into poisoned outputs (the counter reset by the first) gives the same bits."""
    from gguf import GGMLQuantizationType as QT

    from llamacli.backends.cuda import CudaBackend, loader as K
    from llamacli.backends.cuda.linear import MV1_WARPS, mv1_smem

    be = CudaBackend(use_graph=False)  # for its moe_route_f32 launcher
    be.cfg = SimpleNamespace(n_expert=n_expert, n_expert_used=k)
    be.experts = Experts(be.gpu, SimpleNamespace(cfg=be.cfg, weights=None), None)
    rng = np.random.default_rng(n_expert * 13 + cols)
    w = rng.standard_normal((n_expert, cols)).astype(np.float32)
    if qtype == "f16":
        w16 = w.astype(np.float16)
        w_ref, w_dev = w16.astype(np.float64), cp.asarray(w16)
    elif qtype == "bf16":
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)
        w_ref, w_dev = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64), cp.asarray(bits)
    else:
        w_ref, w_dev = w.astype(np.float64), cp.asarray(w)
    x = (rng.standard_normal(cols) * 4).astype(np.float32)
    norm_w = (1 + 0.3 * rng.standard_normal(cols)).astype(np.float32)
    eps = 1e-6
    xn = x.astype(np.float64) / np.sqrt(np.mean(x.astype(np.float64) ** 2) + eps) * norm_w
    scale = np.abs(w_ref) @ np.abs(xn)  # the size of each row's terms
    x_dev, nw_dev = cp.asarray(x), cp.asarray(norm_w)
    odd = rng.standard_normal(n_expert).astype(np.float32)
    gone = rng.permutation(n_expert)[: n_expert - k + 1]  # k - 1 finite logits: the k-th choice is among these
    odd[gone] = -np.inf
    odd[gone[0]] = np.nan
    cases = [(None, "softmax", True), (rng.standard_normal(n_expert).astype(np.float32), "topk_softmax", False),
             (odd, "softmax", False), (odd, "topk_softmax", False)]
    for bias, gating, norm in cases:
        want = w_ref @ xn + (0.0 if bias is None else bias.astype(np.float64))
        bias_dev = None if bias is None else cp.asarray(bias)
        logits, done = poisoned(n_expert + 7), cp.zeros(1, cp.uint32)  # 7 cells past the row stay NaN
        runs = []
        for _ in range(2):
            ids, wts = cp.full(k, -1, cp.int32), poisoned(k)
            logits[:n_expert] = cp.nan
            K.launch("moe", f"mv1_route_{qtype}", (K.cdiv(n_expert, MV1_WARPS),), (32 * MV1_WARPS,),
                     shared=mv1_smem(QT[qtype.upper()], cols), w=w_dev, E=n_expert, K=cols, x=x_dev, logits=logits,
                     bias=bias_dev, norm_w=nw_dev, eps=eps, k=k, gating=0 if gating == "softmax" else 1,
                     norm=int(norm), done=done, ids=ids, wts=wts)
            runs.append((logits.get(), ids.get(), wts.get()))
            assert done.get()[0] == 0
        got, got_ids, got_w = runs[0]
        assert np.isnan(got[n_expert:]).all(), "written past the router's rows"
        got = got[:n_expert]
        fin = np.isfinite(want)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
        err = np.abs(got[fin].astype(np.float64) - want[fin])
        # float32 sums of K terms: a tolerance some 10-100x the errors seen, far below a misread chunk or bias
        assert (err <= 2e-6 * scale[fin] + 1e-6).all(), f"logits: max err / scale {np.max(err / scale[fin]):.3g}"
        want_ids, want_w = route(np.where(np.isnan(got), -np.inf, got)[None], k, gating, norm)
        np.testing.assert_array_equal(got_ids, want_ids[0])
        assert_close(got_w, want_w[0], 1e-6, 1e-5, "weights")
        be.cfg.expert_weights_norm = norm
        ids_r, wts_r = cp.full(k, -1, cp.int32), poisoned(k)
        be.experts.route(cp.asarray(got[None]), 1, ids_r, wts_r, gating)
        np.testing.assert_array_equal(got_ids, ids_r.get())
        np.testing.assert_array_equal(got_w.view(np.uint32), wts_r.get().view(np.uint32))  # moe_route_f32's bits
        for a, b in zip(runs[0], runs[1]):
            np.testing.assert_array_equal(a.view(np.uint32) if a.dtype == np.float32 else a,
                                          b.view(np.uint32) if b.dtype == np.float32 else b)


# -- attention sinks (gpt-oss) ------------------------------------------------------------------------------


def sink_cfg(dh: int, hkv: int, group: int, window: int):
    from llamacli.models.base import LayerPlan
    from llamacli.models.config import ROPE_NEOX

    plan = LayerPlan(window=window, sinks=True)
    return make_cfg(n_head=hkv * group, n_head_kv=hkv, head_dim=dh, rope_dim=dh, n_embd=hkv * group * dh,
                    layers=(plan,), rope_type=ROPE_NEOX)


@pytest.mark.parametrize("dh", [64, 128])
@pytest.mark.parametrize("window", [0, 7, 128])
def test_attention_sinks_prefill(dh, window) -> None:
    """attention_tcx*_d* (tensor cores) and attention_w_npl* (CUDA cores) with sinks: large positive and
    negative sink logits, windows, chunks on a filled cache whose positions past the chunk are NaN."""
    rng = np.random.default_rng(dh + window)
    hkv, group, ctx = 2, 4, 700
    cfg = sink_cfg(dh, hkv, group, window)
    be, _ = bare(cfg, ctx)
    sinks = np.concatenate([rng.standard_normal(cfg.n_head - 2) * 2, [9.0, -30.0]]).astype(np.float32)
    be.model.weights = SimpleNamespace(layers=[SimpleNamespace(attn_sinks=cp.asarray(sinks))])
    check_prefill_chunks(be, cfg, rng, ctx, 0.5, window, 0.0, sinks)


@pytest.mark.parametrize("dh,group", [(64, 8), (64, 3), (128, 4)])
@pytest.mark.parametrize("window", [0, 128])
def test_attention_sinks_decode_and_step(dh, group, window) -> None:
    """Decode with sinks: the op path (attention_split) and the fused step's kernel (attention_split_step_neox:
    RoPE, K/V store, splits, merge) at positions past several splits."""
    rng = np.random.default_rng(dh * 3 + group + window)
    hkv, ctx = 2, 2048
    cfg = sink_cfg(dh, hkv, group, window)
    be, ref = bare(cfg, ctx)
    sinks = (rng.standard_normal(cfg.n_head) * 3).astype(np.float32)
    be.model.weights = SimpleNamespace(layers=[SimpleNamespace(attn_sinks=cp.asarray(sinks))])
    hist = 700
    k0 = rng.standard_normal((hist, hkv, dh)).astype(np.float16)
    v0 = rng.standard_normal((hist, hkv, dh)).astype(np.float16)
    put_positions(be.kv.k_cache[0], 0, k0)
    put_positions(be.kv.v_cache[0], 0, v0)
    kc, vc = k0.astype(np.float32), v0.astype(np.float32)
    # The op path: one query at position hist - 1 over the cache (its own K/V rewritten as they are).
    q = rng.standard_normal((1, cfg.n_head, dh)).astype(np.float32)
    pos = np.array([hist - 1], np.int32)
    got = be.attention(att_op(be.cfg), cp.asarray(q), cp.asarray(kc[hist - 1 : hist]),
                       cp.asarray(vc[hist - 1 : hist]),
                       cp.asarray(pos))
    want = ext_attention_ref(q, kc, vc, pos, group, cfg.query_scale, window, 0.0, sinks.astype(np.float64))
    assert_close(got.get(), want, 4e-3, 1e-2, "decode op path")  # fp16 q and P (test_gpu_kernels.SPLIT_TOL)
    # The fused step: RoPE of q and k at the position, K/V stored, splits merged by the last block.
    for p in (hist, hist + 1):
        qkv = rng.standard_normal((1, cfg.q_dim + 2 * cfg.kv_dim)).astype(np.float32)
        qs = qkv[:, : cfg.q_dim].reshape(1, cfg.n_head, dh)
        ks = qkv[:, cfg.q_dim : cfg.q_dim + cfg.kv_dim].reshape(1, hkv, dh)
        vs = qkv[:, cfg.q_dim + cfg.kv_dim :].reshape(1, hkv, dh)
        ppos = np.array([p], np.int32)
        kr = ref.rope(ks, ppos).astype(np.float16).astype(np.float32)
        kc = np.concatenate([kc, kr])
        vc = np.concatenate([vc, vs.astype(np.float16).astype(np.float32)])
        want = ext_attention_ref(ref.rope(qs, ppos), kc, vc, ppos, group, cfg.query_scale, window, 0.0,
                                 sinks.astype(np.float64))
        be.decoder.step_pos.set(ppos)
        att = poisoned((1, cfg.q_dim))
        attend_step(be, cp.asarray(qkv), att)
        assert_close(att.get(), want, 4e-3, 1e-2, f"step p={p}")
        assert int(be.attn.counters.sum()) == 0
