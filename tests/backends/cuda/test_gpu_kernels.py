"""Every CUDA kernel against a NumPy reference, on fresh random inputs at several shapes (odd ones too),
outputs poisoned with NaN before each launch; tolerances are atol + rtol*|ref|. Needs a GPU (marker gpu)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

cp = pytest.importorskip("cupy")

from gpu_checks import assert_close  # noqa: E402

from llamacli.backends.cuda import (  # noqa: E402
    RUNNABLE,
    CudaBackend,
    DeviceMatrix,
    constants,
    cuda_available,
    linear,  # noqa: E402
    loader as K,  # noqa: E402
)
from llamacli.backends.cuda.attention import ATT_TC_DIMS, ATT_TC_MIN_T  # noqa: E402
from llamacli.backends.cuda.device import DeviceModel  # noqa: E402
from llamacli.backends.cuda.fusion import match_layer  # noqa: E402
from llamacli.backends.cuda.linear import MV1_ACT8, MV1_MIXED  # noqa: E402
from llamacli.backends.numpy_backend import NumpyBackend  # noqa: E402
from llamacli.errors import BackendError, NumericalError  # noqa: E402
from llamacli.ggufio.quants import dequantize  # noqa: E402
from llamacli.models import rope as rope_tables  # noqa: E402
from llamacli.models.block import Attention, layer_op, layer_ops  # noqa: E402
from llamacli.models.config import ROPE_NEOX, ROPE_NORMAL, ModelConfig  # noqa: E402
from llamacli.sampling import sampling as S  # noqa: E402
from llamacli.testing import act8, act8_bound, random_quant_rows  # noqa: E402

_ok, _why = cuda_available()
if not _ok:
    pytest.skip(_why, allow_module_level=True)
pytestmark = pytest.mark.gpu


def make_cfg(**kw) -> ModelConfig:
    base = dict(
        architecture="llama", name="t", n_layer=1, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128,
        vocab_size=100, context_length=4096, rope_type=ROPE_NORMAL, rope_dim=16, rope_freq_base=10000.0,
        rope_scaling="none", rope_scaling_factor=1.0, rope_original_context=4096, rope_attn_factor=1.0,
        rms_eps=1e-5, tied_embeddings=False, bos_token_id=None, eos_token_id=None,
    )
    base.update(kw)
    return ModelConfig(**base)


def att_op(cfg: ModelConfig, i: int = 0) -> Attention:
    """Layer i's attention operation (its window, soft-cap and sinks), as the launchers take it."""
    return layer_op(cfg, i, Attention)


def att_branch(cfg: ModelConfig, i: int = 0):
    """Layer i's attention branch as the fused decode step's attention kernel takes it (fusion.py)."""
    return match_layer(layer_ops(cfg, i)).attention


def bare(cfg: ModelConfig, ctx: int, q8: bool = False) -> tuple[CudaBackend, NumpyBackend]:
    """A CUDA backend and the NumPy reference set up for op tests without a model file (`q8`: both with the
    8-bit cache, -ctk/-ctv q8_0)."""
    be = CudaBackend(use_graph=False)
    # The parts as CudaBackend.load makes them, over a model of no weights: the caches (a sliding-window layer's a
    # ring: models/kv_cache.py; the reference's a row per position), the step's inputs and argmax cells, the
    # sampler's buffers.
    inv_freq = cp.asarray(rope_tables.inv_freq(cfg, None, ctx).astype(np.float64))
    be.attach(DeviceModel(cfg, ctx, None, (), inv_freq), q8)
    shape = (cfg.n_layer, ctx, cfg.n_head_kv, cfg.head_dim)
    ref = NumpyBackend()
    ref.cfg, ref.ctx = cfg, ctx
    if q8:
        ref.cache_types = ("q8_0", "q8_0")
    ref.theta = rope_tables.inv_freq(cfg, None, ctx)
    ref.k_cache = np.zeros(shape, np.float32)
    ref.v_cache = np.zeros(shape, np.float32)
    return be, ref


def put_positions(cache, start: int, values: np.ndarray) -> None:
    """values [n, Hkv, Dh] at positions start.. into one layer's CUDA cache, row = position mod rows (of a ring
    only the last `rows` positions stay, as the backend's writers leave it)."""
    rows = cache.shape[0]
    pos = np.arange(start, start + len(values))[-rows:]
    cache[cp.asarray(pos % rows)] = cp.asarray(values[-rows:])


def upload(rows: np.ndarray, qtype: QT, n_cols: int) -> tuple[DeviceMatrix, cp.ndarray, np.ndarray]:
    """Raw rows -> (device handle, the device buffer keeping it alive, float64 dequantized reference)."""
    raw = np.ascontiguousarray(rows).view(np.uint8).reshape(rows.shape[0], -1)
    buf = cp.asarray(raw)
    ref = dequantize(rows, qtype).reshape(rows.shape[0], n_cols).astype(np.float64)
    return DeviceMatrix(buf.data.ptr, rows.shape[0], n_cols, qtype, raw.shape[1]), buf, ref


def poisoned(shape, dtype=cp.float32):
    return cp.full(shape, cp.nan, dtype=dtype)


def cols_for(qtype: QT) -> list[int]:
    from gguf import GGML_QUANT_SIZES

    block = GGML_QUANT_SIZES[qtype][0]
    if block == 1:
        return [33, 64, 100, 576]
    if block == 32:
        return [32, 96, 576, 4096]
    return [256, 768, 2816]


# -- quantized matvec, dequantize, embedding: every weight type ---------------------------------------------


@pytest.mark.parametrize("qtype", RUNNABLE, ids=lambda t: t.name)
def test_matvec_every_type(qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    be, _ = bare(make_cfg(), 16)
    for k in cols_for(qtype):
        for n in (1, 37, 300):
            w, _buf, wref = upload(random_quant_rows(qtype, n, k, rng, std=0.05), qtype, k)
            for t in (1, 3, 8):
                x = rng.standard_normal((t, k)).astype(np.float32)
                y = poisoned((t, n))
                be.linear.matvec((w,), cp.asarray(x), t, y)
                xr = act8(x[0])[0][None] if t == 1 and qtype in MV1_ACT8 else x.astype(np.float64)
                ref = xr @ wref.T
                scale = np.abs(xr) @ np.abs(wref).T
                assert_close(y.get(), ref, 1e-6 + 2e-6 * scale, 1e-5, f"{qtype.name} n={n} k={k} t={t}")


@pytest.mark.parametrize("qtype", RUNNABLE, ids=lambda t: t.name)
def test_bgemm_every_type(qtype: QT) -> None:
    """bgemm (kernels/batch_gemm.cu: fp16 rows times the quantized weight on tensor cores, the weight decoded in
    the kernel) against float64 with the weight's values rounded to fp16 as the kernel's fragments hold them:
    70 rows (two launches past BG_NMAX), widths where the K range is split across blocks (bgemm_splits > 1) and
    where it is not; the accumulating form with row scales; and a row's bits the same in any company (subsets
    of the rows take other column tiles, n8 .. n64)."""
    from gguf import GGML_QUANT_SIZES

    rng = np.random.default_rng(100 + int(qtype))
    be, _ = bare(make_cfg(), 16)
    sms = be.gpu.n_sms
    ks = [c for c in cols_for(qtype) if c % 32 == 0] + ([2048] if GGML_QUANT_SIZES[qtype][0] == 1 else [])
    split_seen = False
    for k in ks:
        for n in (1, 37, 300):
            split_seen |= linear.bgemm_splits(n, k, sms) > 1
            w, _buf, wref = upload(random_quant_rows(qtype, n, k, rng, std=0.05), qtype, k)
            w16 = wref.astype(np.float16).astype(np.float64)
            x = rng.standard_normal((70, k)).astype(np.float16)
            xd = cp.asarray(x)
            y = poisoned((70, n))
            be.linear.bgemm(xd.data.ptr, 70, w, y.data.ptr, n)
            ref = x.astype(np.float64) @ w16.T
            # The common types decode in fp16 arithmetic (kernels/batch_gemm.cu Dec: the scale and the minimum
            # rounded to fp16, then one rounding of the fused multiply-add), the sums in fp32. Per output a bound
            # of 2^-10 of sum |x w| (a weight's error is relative to d sc q and dmin m, which can exceed |w| where
            # they cancel: this bound holds on these random blocks, not for every block), and the whole within
            # 1e-3 in L2 (int8 activations, llama.cpp's MMQ, are ~4e-3)
            bound = 1e-6 + 2.0**-10 * (np.abs(x.astype(np.float64)) @ np.abs(wref).T)
            full = y.get()
            assert_close(full, ref, bound, 0.0, f"{qtype.name} n={n} k={k}")
            rel = np.linalg.norm(full - ref) / (np.linalg.norm(ref) + 1e-12)
            assert rel <= 1e-3, f"{qtype.name} n={n} k={k}: relative L2 error {rel:.3g}"
            y0 = rng.standard_normal((70, n)).astype(np.float32)
            rs = rng.uniform(0.5, 2.0, 70).astype(np.float32)
            ya = cp.asarray(y0)
            be.linear.bgemm(xd.data.ptr, 70, w, ya.data.ptr, n, accumulate=True, rs=cp.asarray(rs))
            assert_close(ya.get(), y0 + rs[:, None] * ref, bound * 2 + 1e-5, 1e-6, f"{qtype.name} += n={n} k={k}")
            for idx in ([0], [0, 1, 2], [4, 0, 9, 3, 11, 12, 13, 14, 15, 16, 17], list(range(69, 30, -1))):
                yp = poisoned((len(idx), n))
                xs = cp.asarray(x[idx])
                be.linear.bgemm(xs.data.ptr, len(idx), w, yp.data.ptr, n)
                np.testing.assert_array_equal(yp.get(), full[idx])
    assert split_seen, "no shape of the test splits its K range"


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q6_K, QT.F16, QT.Q4_K], ids=lambda t: t.name)
def test_matvec_segments_bias_resid_swiglu(qtype: QT) -> None:
    rng = np.random.default_rng(7)
    be, _ = bare(make_cfg(), 16)
    k = 512
    ws = [upload(random_quant_rows(qtype, n, k, rng, std=0.05), qtype, k) for n in (96, 32, 33)]
    x = rng.standard_normal((2, k)).astype(np.float32)
    bias = rng.standard_normal(161).astype(np.float32)
    resid = rng.standard_normal((2, 161)).astype(np.float32)
    y = cp.asarray(resid)  # resid aliases y: the fused residual add
    be.linear.matvec(tuple(w for w, _, _ in ws), cp.asarray(x), 2, y, bias=cp.asarray(bias), resid=y)
    wref = np.concatenate([r for _, _, r in ws])
    ref = x @ wref.T + bias + resid
    assert_close(y.get(), ref, 1e-4, 1e-5, "segments+bias+resid")

    (g, _bg, gref), (u, _bu, uref) = [upload(random_quant_rows(qtype, 77, k, rng, std=0.05), qtype, k) for _ in range(2)]
    y = poisoned((2, 77))
    be.linear.matvec_swiglu(g, u, cp.asarray(x), 2, y)
    a, b = x @ gref.T, x @ uref.T
    assert_close(y.get(), a / (1 + np.exp(-a)) * b, 1e-4, 1e-4, "swiglu")


@pytest.mark.parametrize("pair", list(itertools.permutations(sorted(MV1_MIXED), 2)), ids=lambda p: f"{p[0].name}+{p[1].name}")
def test_mv1_mixed_qkv_segments(pair) -> None:
    """Q and K rows of one int8-activation type with V rows of another (Q4_K_M's Q6_K V layers) in one launch
    (mv1_mixed_<a>_<b>), with bias and residual or with the norm: against the int8 emulation and the fp64
    reference, and bit for bit the rows the single-type launches give."""
    a, b = pair
    rng = np.random.default_rng(31 + 3 * int(a) + int(b))
    cfg = make_cfg()
    be, _ = bare(cfg, 16)
    k = 768
    ws = [upload(random_quant_rows(t, n, k, rng, std=0.05), t, k) for t, n in ((a, 96), (a, 32), (b, 40))]
    mats = tuple(w for w, _, _ in ws)
    wref = np.concatenate([r for _, _, r in ws])
    x = (3 * rng.standard_normal((1, k))).astype(np.float32)
    xr = act8(x[0])[0][None]
    bias = rng.standard_normal(168).astype(np.float32)
    resid = rng.standard_normal((1, 168)).astype(np.float32)
    y = cp.asarray(resid)  # resid aliases y
    be.linear.matvec(mats, cp.asarray(x), 1, y, bias=cp.asarray(bias), resid=y)
    ref = xr @ wref.T + bias + resid
    tol = 1e-6 + 2e-6 * (np.abs(xr) @ np.abs(wref).T) + 1e-6 * (np.abs(bias) + np.abs(resid))
    assert_close(y.get(), ref, tol, 1e-5, f"{a.name}+{b.name} bias+resid")

    nw = cp.asarray((1 + 0.1 * rng.standard_normal(k)).astype(np.float32))
    h = x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + cfg.rms_eps) * nw.get()
    q8 = act8_bound(h[0], wref)[None]
    y = poisoned((1, 168))
    be.linear.matvec(mats, cp.asarray(x), 1, y, norm=nw)
    got = y.get()
    assert_close(got, h @ wref.T, 1e-6 + 2e-6 * (np.abs(h) @ np.abs(wref).T) + q8, 1e-5, f"{a.name}+{b.name} norm")
    qk, v = poisoned((1, 128)), poisoned((1, 40))
    be.linear.matvec(mats[:2], cp.asarray(x), 1, qk, norm=nw)
    be.linear.matvec(mats[2:], cp.asarray(x), 1, v, norm=nw)
    assert np.array_equal(got, np.concatenate([qk.get(), v.get()], axis=1))
    with pytest.raises(BackendError):  # several tokens: no mixed kernel
        be.linear.matvec(mats, cp.asarray(np.repeat(x, 2, 0)), 2, poisoned((2, 168)))


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.F16,
                                   QT.F32], ids=lambda t: t.name)
def test_mv1_fused_norm_swiglu_argmax(qtype: QT) -> None:
    """The one-token matvec (mv1) with RMSNorm fused into its input, the fused SwiGLU, and the argmax fused
    into the LM head (id and NaN flag into step_ids, step_pos advanced, cells reset for the next launch)."""
    rng = np.random.default_rng(11 + int(qtype))
    cfg = make_cfg()
    be, _ = bare(cfg, 16)
    for k in cols_for(qtype)[-2:]:
        for n in (5, 300, 2049):
            w, _buf, wref = upload(random_quant_rows(qtype, n, k, rng, std=0.05), qtype, k)
            x = (3 * rng.standard_normal((1, k))).astype(np.float32)
            nw = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
            h = x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + cfg.rms_eps) * nw
            ref = h @ wref.T
            scale = np.abs(h) @ np.abs(wref).T
            # int8 activations: each value of the normalised x rounded to its unit's step (the kernel's own
            # float32 h may round a value the other way than h here would: the bound, not an emulation)
            q8 = act8_bound(h[0], wref)[None] if qtype in MV1_ACT8 else 0.0
            y = poisoned((1, n))
            be.linear.matvec((w,), cp.asarray(x), 1, y, norm=cp.asarray(nw))
            assert_close(y.get(), ref, 1e-6 + 2e-6 * scale + q8, 1e-5, f"norm {qtype.name} n={n} k={k}")
            if qtype in MV1_ACT8:  # and it is that rounding, not a looser error: well inside the bound
                assert np.abs(y.get() - ref).mean() < 0.25 * np.mean(q8), qtype.name
            for rep in range(2):  # twice: the cells must come back reset
                pos0 = int(be.decoder.step_pos.get()[0])
                y = poisoned((1, n))
                be.linear.matvec((w,), cp.asarray(x), 1, y, norm=cp.asarray(nw), argmax=be.decoder.am)
                got, yh = be.decoder.step_ids.get(), y.get()[0]
                assert got[0] == int(np.argmax(yh)) and got[1] == 0, (got, int(np.argmax(yh)))
                assert int(be.decoder.step_pos.get()[0]) == pos0 + 1
            if n == 300:
                u, _bu, uref = upload(random_quant_rows(qtype, n, k, rng, std=0.05), qtype, k)
                y = poisoned((1, n))
                be.linear.matvec_swiglu(w, u, cp.asarray(x), 1, y, norm=cp.asarray(nw))
                a, b = ref, h @ uref.T
                sb = scale + np.abs(h) @ np.abs(uref).T
                tol = 1e-5 + 1e-5 * sb * sb
                if qtype in MV1_ACT8:  # silu(a) * b with a, b each off by up to their bounds ea, eb
                    ea, eb = q8, act8_bound(h[0], uref)[None]
                    tol = tol + 1.1 * (np.abs(b) + eb) * ea + np.abs(a / (1 + np.exp(-a))) * eb
                assert_close(y.get(), a / (1 + np.exp(-a)) * b, tol, 1e-4, f"swiglu {qtype.name}")
    # A NaN (or an infinity) in x reaches the logits: the flag says so.
    for bad in (np.nan, np.inf):
        x[0, 3] = bad
        be.linear.matvec((w,), cp.asarray(x), 1, poisoned((1, n)), argmax=be.decoder.am)
        assert be.decoder.step_ids.get()[1] == 1, bad
    be.linear.matvec((w,), cp.asarray(np.ones_like(x)), 1, poisoned((1, n)), argmax=be.decoder.am)
    assert be.decoder.step_ids.get()[1] == 0  # and the flag was reset


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q5_0, QT.Q4_1, QT.Q4_K, QT.Q6_K, QT.F16, QT.BF16],
                         ids=lambda t: t.name)
def test_mv1_post_norm_input(qtype: QT) -> None:
    """mv1 / mv1_stream with `post` (a gemma block's pending post-norm): the input is x + RMSNorm(blk) * w,
    normalised again by the matvec's own norm; block 0 writes that new residual to out, every block computes
    it; plain, GeGLU and argmax forms, float, int8 (one and two passes) and streaming stagings (K from
    cols_for; 100 is not a multiple of 8), against float64; out poisoned, x and blk left as they were."""
    rng = np.random.default_rng(31 + int(qtype))
    cfg = make_cfg()
    be, _ = bare(cfg, 16)
    # 8448 columns: the int8 staging's sum of squares in a pass of its own (stage_xq_halves, nh > per)
    for k in cols_for(qtype)[-2:] + ([8448] if qtype in MV1_ACT8 else []):
        n = 2049
        w, _buf, wref = upload(random_quant_rows(qtype, n, k, rng, std=0.05), qtype, k)
        u, _bu, uref = upload(random_quant_rows(qtype, n, k, rng, std=0.05), qtype, k)
        x = (3 * rng.standard_normal((1, k))).astype(np.float32)
        blk = (50 * rng.standard_normal((1, k))).astype(np.float32)
        pw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float32)
        nw = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
        b64 = blk.astype(np.float64)
        xn = x + b64 / np.sqrt(np.mean(b64**2) + cfg.rms_eps) * pw  # the new residual
        h = xn / np.sqrt(np.mean(xn**2) + cfg.rms_eps) * nw
        xd, bd, pd, out = cp.asarray(x), cp.asarray(blk), cp.asarray(pw), poisoned((1, k))
        post = cp.asarray(np.asarray([bd.data.ptr, pd.data.ptr, out.data.ptr], np.uint64))
        q8 = act8_bound(h[0], wref)[None] if qtype in MV1_ACT8 else 0.0
        y = poisoned((1, n))
        be.linear.matvec((w,), xd, 1, y, norm=cp.asarray(nw), post=post)
        assert_close(out.get(), xn, 1e-5, 1e-5, f"residual {qtype.name} k={k}")
        assert np.array_equal(xd.get(), x) and np.array_equal(bd.get(), blk)
        ref = h @ wref.T
        assert_close(y.get(), ref, 1e-5 + 4e-6 * (np.abs(h) @ np.abs(wref).T) + q8, 1e-5, f"{qtype.name} k={k}")
        out[...] = cp.nan
        y = poisoned((1, n))
        be.linear.matvec((w,), xd, 1, y, norm=cp.asarray(nw), argmax=be.decoder.am, post=post)
        assert be.decoder.step_ids.get()[0] == int(np.argmax(y.get()[0]))
        assert_close(out.get(), xn, 1e-5, 1e-5, f"residual (argmax) {qtype.name}")
        out[...] = cp.nan
        y = poisoned((1, n))
        be.linear.matvec_swiglu(w, u, xd, 1, y, norm=cp.asarray(nw), act="gelu_tanh", post=post)
        a, b = ref, h @ uref.T
        sb = np.abs(h) @ np.abs(wref).T + np.abs(h) @ np.abs(uref).T
        tol = 1e-5 + 1e-5 * sb * sb
        if qtype in MV1_ACT8:
            ea, eb = q8, act8_bound(h[0], uref)[None]
            tol = tol + 1.2 * (np.abs(b) + eb) * ea + 1.2 * np.abs(a) * eb
        assert_close(y.get(), gelu_tanh(a) * b, tol, 1e-4, f"geglu {qtype.name}")
        assert_close(out.get(), xn, 1e-5, 1e-5, f"residual (geglu) {qtype.name}")


@pytest.mark.parametrize("n, k", [(32768, 640), (33001, 576), (40003, 1024), (35005, 96)],
                         ids=["whole-tiles", "tail-rows", "widest", "short"])
def test_mv1_tile_short_q8_0_rows(n: int, k: int) -> None:
    """The tiled one-token matvec (kernels/matvec.cu mv1_tile_q8_0) on LM-head-like Q8_0 matrices: every row
    (the last 8-row tile partly past N: its bytes zero-filled, its rows not written), against float64, with bias
    and the residual aliasing y, with the fused RMSNorm and post-norm input, and the argmax (a planted winner
    in the last tile, twice: the cells reset); a NaN in x reaches every row and the flag. The matrix starts
    16 bytes into its buffer: the tile copies need no more alignment than that."""
    rng = np.random.default_rng(n + k)
    cfg = make_cfg()
    be, _ = bare(cfg, 16)
    rows = random_quant_rows(QT.Q8_0, n, k, rng, std=0.05)
    x = (3 * rng.standard_normal((1, k))).astype(np.float32)
    win = n - 2
    raw = np.ascontiguousarray(rows).view(np.uint8).reshape(n, -1).copy()
    blocks = raw[win].reshape(k // 32, 34)
    blocks[:, :2] = np.full((k // 32, 1), 0.02, np.float16).view(np.uint8)
    blocks[:, 2:] = np.where(x[0] > 0, 127, -127).astype(np.int8).reshape(k // 32, 32).view(np.uint8)
    buf = cp.zeros(raw.size + 16, cp.uint8)
    buf[16:] = cp.asarray(raw.reshape(-1))
    w = DeviceMatrix(buf.data.ptr + 16, n, k, QT.Q8_0, raw.shape[1])
    assert linear.mv1_tile_ok((w,), be.gpu.smem_block)
    assert not linear.mv1_tile_ok((dataclasses.replace(w, ptr=w.ptr + 2),), be.gpu.smem_block)
    wref = dequantize(raw, QT.Q8_0).reshape(n, k).astype(np.float64)
    x64 = x.astype(np.float64)
    scale = np.abs(x64) @ np.abs(wref).T
    ref = x64 @ wref.T
    bias = rng.standard_normal(n).astype(np.float32)
    resid = rng.standard_normal((1, n)).astype(np.float32)
    yy = poisoned((1, n + 8))  # 8 more: rows past N are never written
    be.linear.matvec((w,), cp.asarray(x), 1, yy[:, :n])
    assert_close(yy[:, :n].get(), ref, 1e-6 + 2e-6 * scale, 1e-5, f"plain {n}x{k}")
    assert np.isnan(yy[:, n:].get()).all()
    y = cp.asarray(resid)
    be.linear.matvec((w,), cp.asarray(x), 1, y, bias=cp.asarray(bias), resid=y)
    assert_close(y.get(), ref + bias + resid, 1e-5 + 2e-6 * scale, 1e-5, f"bias + resid {n}x{k}")
    blk = (50 * rng.standard_normal((1, k))).astype(np.float32)
    pw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    b64 = blk.astype(np.float64)
    xn = x64 + b64 / np.sqrt(np.mean(b64**2) + cfg.rms_eps) * pw
    h = xn / np.sqrt(np.mean(xn**2) + cfg.rms_eps) * nw
    bd, pd, out = cp.asarray(blk), cp.asarray(pw), poisoned((1, k))
    post = cp.asarray(np.asarray([bd.data.ptr, pd.data.ptr, out.data.ptr], np.uint64))
    for rep in range(2):
        pos0 = int(be.decoder.step_pos.get()[0])
        y = poisoned((1, n))
        be.linear.matvec((w,), cp.asarray(x), 1, y, norm=cp.asarray(nw), argmax=be.decoder.am, post=post)
        assert_close(out.get(), xn, 1e-5, 1e-5, f"residual {n}x{k}")
        assert_close(y.get(), h @ wref.T, 1e-5 + 4e-6 * (np.abs(h) @ np.abs(wref).T), 1e-5, f"norm {n}x{k}")
        got = be.decoder.step_ids.get()
        assert got[0] == int(np.argmax(y.get()[0])) and got[1] == 0, (got, win)
        assert int(be.decoder.step_pos.get()[0]) == pos0 + 1
    y = poisoned((1, n))
    be.linear.matvec((w,), cp.asarray(x), 1, y, argmax=be.decoder.am)
    assert be.decoder.step_ids.get()[0] == win == int(np.argmax(y.get()[0]))
    xb = x.copy()
    xb[0, k - 7] = np.nan
    y = poisoned((1, n))
    be.linear.matvec((w,), cp.asarray(xb), 1, y, argmax=be.decoder.am)
    assert np.isnan(y.get()).all() and be.decoder.step_ids.get()[1] == 1
    be.linear.matvec((w,), cp.asarray(x), 1, poisoned((1, n)), argmax=be.decoder.am)
    assert be.decoder.step_ids.get()[1] == 0


@pytest.mark.parametrize("qtype", sorted(MV1_ACT8), ids=lambda t: t.name)
def test_mv1_act8_long_rows(qtype: QT) -> None:
    """x longer than one staging pass of the int8 forms (kernels/matvec.cu stage_xq_halves: 16 values per
    thread and pass with the norm, 32 without; the norm then in a pass of its own), the last pass partly past
    K; a non-finite value in a late pass still reaches the output."""
    rng = np.random.default_rng(23 + int(qtype))
    cfg = make_cfg()
    be, _ = bare(cfg, 16)
    for k in (4352, 8448, 14336):
        n = 40
        w, _buf, wref = upload(random_quant_rows(qtype, n, k, rng, std=0.05), qtype, k)
        x = (3 * rng.standard_normal((1, k))).astype(np.float32)
        xr = act8(x[0])[0][None]
        y = poisoned((1, n))
        be.linear.matvec((w,), cp.asarray(x), 1, y)
        assert_close(y.get(), xr @ wref.T, 1e-6 + 2e-6 * (np.abs(xr) @ np.abs(wref).T), 1e-5, f"{qtype.name} k={k}")
        nw = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
        h = x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + cfg.rms_eps) * nw
        ref = h @ wref.T
        q8 = act8_bound(h[0], wref)[None]
        y = poisoned((1, n))
        be.linear.matvec((w,), cp.asarray(x), 1, y, norm=cp.asarray(nw))
        assert_close(y.get(), ref, 1e-6 + 2e-6 * (np.abs(h) @ np.abs(wref).T) + q8, 1e-5, f"norm {qtype.name} k={k}")
        assert np.abs(y.get() - ref).mean() < 0.25 * np.mean(q8), qtype.name
        for bad in (np.nan, np.inf):
            xb = x.copy()
            xb[0, k - 5] = bad
            for norm in (None, cp.asarray(nw)):
                y = poisoned((1, n))
                be.linear.matvec((w,), cp.asarray(xb), 1, y, norm=norm)
                assert np.isnan(y.get()).all(), (qtype.name, k, bad)


@pytest.mark.parametrize("shape", [(4100, 8192, 2), (33000, 512, "lm"), (12300, 4096, None), (6150, 4096, "wave")],
                         ids=["long-rows", "lm-head", "many-rows", "past-one-wave"])
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.F16], ids=lambda t: t.name)
def test_mv1_row_groups_per_block(qtype: QT, shape) -> None:
    """Large matrices with long or short rows run 2 or 4 row groups per mv1 block over one staging of x (and
    the int8-activation types 4 on many 4096-column rows, 2 past one wave of blocks, 8 on short LM-head
    rows): every row (the last group partly past N), the fused SwiGLU and the argmax across groups."""
    from llamacli.backends.cuda.linear import mv1_groups

    rng = np.random.default_rng(5 + int(qtype))
    cfg = make_cfg()
    be, _ = bare(cfg, 16)
    n, k, groups = shape
    if groups is None:
        groups = 4 if qtype in MV1_ACT8 else 1
    elif groups == "lm":  # a small model's LM head: 8 for the int8 forms, 4 else
        groups = 8 if qtype in MV1_ACT8 else 4
    elif groups == "wave":  # int8 forms: 2 where one group per block needs more than one wave (4 per SM)
        groups = 2 if qtype in MV1_ACT8 and -(-n // 8) > 4 * be.gpu.n_sms else 1
    assert mv1_groups(n, k, qtype, be.gpu.n_sms) == groups
    w, _buf, wref = upload(random_quant_rows(qtype, n, k, rng, std=0.05), qtype, k)
    x = rng.standard_normal((1, k)).astype(np.float32)
    xr = act8(x[0])[0][None] if qtype in MV1_ACT8 else x.astype(np.float64)
    ref = xr @ wref.T
    scale = np.abs(xr) @ np.abs(wref).T
    y = poisoned((1, n))
    be.linear.matvec((w,), cp.asarray(x), 1, y, argmax=be.decoder.am)
    assert_close(y.get(), ref, 1e-6 + 2e-6 * scale, 1e-5, f"{qtype.name} groups")
    assert be.decoder.step_ids.get()[0] == int(np.argmax(y.get()[0]))
    u, _bu, uref = upload(random_quant_rows(qtype, n, k, rng, std=0.05), qtype, k)
    y = poisoned((1, n))
    be.linear.matvec_swiglu(w, u, cp.asarray(x), 1, y)
    b = xr @ uref.T
    sb = scale + np.abs(xr) @ np.abs(uref).T
    assert_close(y.get(), ref / (1 + np.exp(-ref)) * b, 1e-5 + 1e-5 * sb * sb, 1e-4, f"swiglu {qtype.name} groups")


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16], ids=lambda t: t.name)
def test_mv1_stream_16_bit_rows(qtype: QT) -> None:
    """mv1_stream (16-bit float rows of whole 16-byte chunks): rows shorter than one batch of a warp (8, 40
    columns), a last batch partly past the row (1032), many rows a warp (past one wave of warps); three
    segments with bias and the residual aliasing y, the fused RMSNorm, SwiGLU and argmax (cells reset); NaN
    reaching the output; against float64 and against mv1 (be.mv1_stream off)."""
    from llamacli.backends.cuda.linear import MV1_WARPS, mv1_stream_ok

    rng = np.random.default_rng(31 + int(qtype))
    cfg = make_cfg()
    be, _ = bare(cfg, 16)
    many = 2 * MV1_WARPS * 2 * be.gpu.n_sms + 3  # over two rows for some warps of a full wave
    for n, k in [(1, 8), (5, 40), (37, 264), (300, 1032), (many, 64), (70, 4096)]:
        ws = [upload(random_quant_rows(qtype, r, k, rng, std=0.05), qtype, k) for r in (n, 3, n + 1)]
        mats = tuple(w for w, _, _ in ws)
        assert mv1_stream_ok(mats)
        wref = np.concatenate([r for _, _, r in ws])
        rows = wref.shape[0]
        x = (3 * rng.standard_normal((1, k))).astype(np.float32)
        bias = rng.standard_normal(rows).astype(np.float32)
        resid = rng.standard_normal((1, rows)).astype(np.float32)
        scale = np.abs(x) @ np.abs(wref).T
        y = cp.asarray(resid)  # resid aliases y
        be.linear.matvec(mats, cp.asarray(x), 1, y, bias=cp.asarray(bias), resid=y)
        assert_close(y.get(), x @ wref.T + bias + resid, 1e-6 + 2e-6 * scale, 1e-5, f"segments n={n} k={k}")

        nw = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
        h = x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + cfg.rms_eps) * nw
        ref = h @ wref.T
        hs = np.abs(h) @ np.abs(wref).T
        outs = []
        for stream in (True, False):
            be.mv1_stream = stream
            y = poisoned((1, rows))
            be.linear.matvec(mats, cp.asarray(x), 1, y, norm=cp.asarray(nw), argmax=be.decoder.am)
            outs.append(y.get())
            assert_close(outs[-1], ref, 1e-6 + 2e-6 * hs, 1e-5, f"norm n={n} k={k} stream={stream}")
            assert be.decoder.step_ids.get()[0] == int(np.argmax(outs[-1][0])) and be.decoder.step_ids.get()[1] == 0
        be.mv1_stream = True
        assert_close(outs[0], outs[1], 2e-6 + 4e-6 * hs, 2e-5, f"stream vs mv1 n={n} k={k}")

        (g, _bg, gref), (u, _bu, uref) = [upload(random_quant_rows(qtype, n, k, rng, std=0.05), qtype, k)
                                          for _ in range(2)]
        a, b = h @ gref.T, h @ uref.T
        sb = np.abs(h) @ np.abs(gref).T + np.abs(h) @ np.abs(uref).T
        y = poisoned((1, n))
        be.linear.matvec_swiglu(g, u, cp.asarray(x), 1, y, norm=cp.asarray(nw))
        assert_close(y.get(), a / (1 + np.exp(-a)) * b, 1e-5 + 1e-5 * sb * sb, 1e-4, f"swiglu n={n} k={k}")

        xb = x.copy()
        xb[0, k - 1] = np.nan
        y = poisoned((1, rows))
        be.linear.matvec(mats, cp.asarray(xb), 1, y, argmax=be.decoder.am)
        assert np.isnan(y.get()).all() and be.decoder.step_ids.get()[1] == 1


@pytest.mark.parametrize("qtype", RUNNABLE, ids=lambda t: t.name)
def test_dequant_gemm_and_embed_every_type(qtype: QT, monkeypatch) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    be, _ = bare(make_cfg(), 16)
    k = cols_for(qtype)[1]
    n = 45
    w, _buf, wref = upload(random_quant_rows(qtype, n, k, rng, std=0.05), qtype, k)
    ids = rng.integers(0, n, size=9).astype(np.int32)
    ids[1] = ids[0]
    be.weights = type("W", (), {"token_embd": w})()
    out = be.embed(cp.asarray(ids))
    assert_close(out.get(), wref[ids], 1e-7, 1e-6, f"embed {qtype.name}")
    # Prefill path: T > 8 goes through dequant_<t> + cuBLAS fp16 (small chunk to cover the chunk loop).
    with monkeypatch.context() as m:
        m.setattr(linear, "DEQUANT_CHUNK", 16 * k)
        x = rng.standard_normal((19, k)).astype(np.float32)
        y = be.matmul(cp.asarray(x), w)
    ref = x.astype(np.float64) @ wref.T
    scale = np.abs(x) @ np.abs(wref).T
    assert_close(y.get(), ref, 2e-3 * scale + 1e-5, 1e-3, f"gemm {qtype.name}")
    # Activations and products far beyond fp16's 65504 (real models have outlier features in the thousands;
    # random 1B-shape models overflowed an fp16 GEMM output): rows scaled, fp32 output, no inf.
    x = rng.standard_normal((19, k)).astype(np.float32) * np.float32(3e4)
    x[3] *= 1e3  # one row near 3e7
    x[5, :7] = 2e5
    bias = rng.standard_normal(n).astype(np.float32)
    y = be.matmul(cp.asarray(x), w, bias=cp.asarray(bias))
    ref = x.astype(np.float64) @ wref.T + bias
    scale = np.abs(x) @ np.abs(wref).T
    assert_close(y.get(), ref, 2e-3 * scale + 1e-3, 1e-3, f"gemm large {qtype.name}")


# -- norm, elementwise ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 576), (5, 4097), (3, 33), (2, 8192)])
def test_rms_norm(shape) -> None:
    rng = np.random.default_rng(1)
    be, ref = bare(make_cfg(), 16)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    w = rng.standard_normal(shape[1]).astype(np.float32)
    got = be.rms_norm(cp.asarray(x), cp.asarray(w), 1e-5)
    assert_close(got.get(), ref.rms_norm(x, w, 1e-5), 1e-6, 1e-5, "rms_norm")


@pytest.mark.parametrize("n", [1, 31, 4097, 100_003])
def test_swiglu_add(n) -> None:
    rng = np.random.default_rng(n)
    be, ref = bare(make_cfg(), 16)
    g, u = (rng.standard_normal((1, n)) * 4).astype(np.float32), rng.standard_normal((1, n)).astype(np.float32)
    assert_close(be.swiglu(cp.asarray(g), cp.asarray(u)).get(), ref.swiglu(g, u), 1e-6, 1e-5, "swiglu")
    assert_close(be.add(cp.asarray(g), cp.asarray(u)).get(), g + u, 0, 1e-7, "add")


# -- rope ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rope_type", [ROPE_NORMAL, ROPE_NEOX])
@pytest.mark.parametrize("dh,rope_dim", [(64, 64), (96, 96), (128, 128), (128, 64)])
@pytest.mark.parametrize("scaling", ["none", "linear"])
def test_rope(rope_type, dh, rope_dim, scaling) -> None:
    rng = np.random.default_rng(dh + rope_dim)
    cfg = make_cfg(head_dim=dh, rope_dim=rope_dim, rope_type=rope_type, rope_scaling=scaling,
                   rope_scaling_factor=4.0 if scaling == "linear" else 1.0, rope_attn_factor=1.1, rope_freq_base=5e5)
    be, ref = bare(cfg, 4096)
    for t, h in ((1, 3), (7, 5), (33, 2)):
        x = rng.standard_normal((t, h, dh)).astype(np.float32)
        pos = np.sort(rng.choice(4000, size=t, replace=False)).astype(np.int32)
        got = be.rope(cp.asarray(x), cp.asarray(pos))
        assert_close(got.get(), ref.rope(x, pos), 1e-5, 1e-5, f"rope t={t}")


# -- attention: prefill (flash) and decode (split + combine), GQA groups 1, 3, 7, 8 ------------------------


@pytest.mark.parametrize("dh", [64, 96, 128])
@pytest.mark.parametrize("hkv,group", [(2, 1), (1, 3), (2, 7), (1, 8)])
def test_attention_prefill_then_decode(dh, hkv, group) -> None:
    rng = np.random.default_rng(dh * 10 + group)
    cfg = make_cfg(n_head=hkv * group, n_head_kv=hkv, head_dim=dh, rope_dim=dh, n_embd=hkv * group * dh)
    ctx = 4096  # decode splits of 64-key tiles: positions below run over several splits
    be, ref = bare(cfg, ctx)
    hq = cfg.n_head
    start = 0
    for t in (37, 1, 200, 1, 5, 1):  # prefill, decode, a second prefill chunk on top of the cache, ...
        q = rng.standard_normal((t, hq, dh)).astype(np.float32)
        k = rng.standard_normal((t, hkv, dh)).astype(np.float32)
        v = rng.standard_normal((t, hkv, dh)).astype(np.float32)
        k16, v16 = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
        pos = np.arange(start, start + t, dtype=np.int32)
        got = be.attention(att_op(be.cfg), cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(pos))
        want = ref.attention(att_op(ref.cfg), q, k16, v16, pos)
        # t >= ATT_TC_MIN_T and decode (attention_split) run on tensor cores with fp16 Q and P: looser (see
        # the tensor-core test below).
        tol = (4e-3, 1e-2) if (t >= ATT_TC_MIN_T or t == 1) and dh in ATT_TC_DIMS else (2e-4, 2e-3)
        assert_close(got.get(), want, *tol, f"attention t={t} start={start}")
        start += t


def attention_ref(q, kc, vc, pos, group):
    """float64 causal GQA attention over a cache: q [T, Hq, D], kc/vc [ctx, Hkv, D] -> [T, Hq * D]."""
    t, hq, dh = q.shape
    out = np.empty((t, hq, dh))
    k64 = np.repeat(kc.astype(np.float64), group, axis=1)  # [ctx, Hq, D]: kv head h // group
    v64 = np.repeat(vc.astype(np.float64), group, axis=1)
    for i in range(t):
        n = pos[i] + 1
        s = np.einsum("nhd,hd->hn", k64[:n], q[i].astype(np.float64)) / math.sqrt(dh)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[i] = np.einsum("hn,nhd->hd", p, v64[:n]) / p.sum(axis=1)[:, None]
    return out.reshape(t, hq * dh)


@pytest.mark.parametrize("dh", [64, 96, 128])
@pytest.mark.parametrize("hkv,group", [(2, 1), (1, 3), (2, 7), (1, 8)])
def test_attention_prefill_tensor_cores(dh, hkv, group) -> None:
    """attention_tc_d*: odd chunk lengths, a chunk continuing on a filled cache (start > 0), a row count
    that leaves a block partly empty; output poisoned with NaN; against float64 and against the fp32
    CUDA-core kernel on the same inputs."""
    assert dh in ATT_TC_DIMS
    rng = np.random.default_rng(1000 + dh * 10 + group)
    hq = hkv * group
    cfg = make_cfg(n_head=hq, n_head_kv=hkv, head_dim=dh, rope_dim=dh, n_embd=hq * dh)
    ctx = 640
    be, _ = bare(cfg, ctx)
    kc = rng.standard_normal((ctx, hkv, dh)).astype(np.float16)
    vc = rng.standard_normal((ctx, hkv, dh)).astype(np.float16)
    be.kv.k_cache[0], be.kv.v_cache[0] = cp.asarray(kc), cp.asarray(vc)
    for start, t in ((0, 37), (0, 129), (200, 77), (451, 16), (3, 300)):
        q = rng.standard_normal((t, hq, dh)).astype(np.float32)
        pos = np.arange(start, start + t, dtype=np.int32)
        want = attention_ref(q, kc.astype(np.float32), vc.astype(np.float32), pos, group)
        outs = []
        for use_tc in (True, False):
            be.attention_tc = use_tc
            out = cp.full((t, hq * dh), cp.nan, dtype=cp.float32)
            be.attn.attend(cp.asarray(q), hq * dh, be.kv.k_cache[0], be.kv.v_cache[0], cp.asarray(pos), t, out, 1, ctx,
                       None, None)
            outs.append(out.get())
        tc, cc = outs
        assert_close(tc, want, 4e-3, 1e-2, f"tensor cores t={t} start={start}")
        assert np.linalg.norm(tc - want) / np.linalg.norm(want) < 2e-3
        assert_close(cc, want, 2e-4, 2e-3, f"CUDA cores t={t} start={start}")


def test_attention_prefill_tensor_cores_unsorted_positions() -> None:
    """Positions need not be consecutive or sorted: each row masks its own keys."""
    rng = np.random.default_rng(11)
    cfg = make_cfg(n_head=6, n_head_kv=2, head_dim=64, rope_dim=64, n_embd=384)
    be, _ = bare(cfg, 300)
    kc = rng.standard_normal((300, 2, 64)).astype(np.float16)
    vc = rng.standard_normal((300, 2, 64)).astype(np.float16)
    be.kv.k_cache[0], be.kv.v_cache[0] = cp.asarray(kc), cp.asarray(vc)
    t = 45
    pos = rng.permutation(300)[:t].astype(np.int32)
    q = rng.standard_normal((t, 6, 64)).astype(np.float32)
    out = cp.full((t, 6 * 64), cp.nan, dtype=cp.float32)
    be.attn.attend(cp.asarray(q), 6 * 64, be.kv.k_cache[0], be.kv.v_cache[0], cp.asarray(pos), t, out, 1, 300, None, None)
    want = attention_ref(q, kc.astype(np.float32), vc.astype(np.float32), pos, 3)
    assert_close(out.get(), want, 4e-3, 1e-2, "unsorted positions")


@pytest.mark.parametrize("kernel", ["tc", "wg"])
@pytest.mark.parametrize("dh", ATT_TC_DIMS)
@pytest.mark.parametrize("hkv,group", [(3, 1), (2, 7)])
def test_attention_prefill_tensor_cores_fp16_io(kernel, dh, hkv, group) -> None:
    """The fused prefill's form: q already fp16 and times log2(e)/sqrt(dh) (as rope_store_pf writes it),
    fp16 output for the O-projection GEMM; both kernels (attention_tc16_d* on mma.sync, everywhere; and
    attention_wg16_d* on Hopper's wgmma, where built for sm_90a); every head dim with a kernel, row counts
    that leave the last block partly empty, a chunk on a filled cache, the cache's rows past the chunk's last
    key NaN (they must never reach the output; the last chunk ends near the cache's end, past which the
    copies read nothing); output poisoned with NaN; float64 reference on the same fp16 q. Also values near
    the fp16 limit in V: the output stays finite (a convex combination). f32 output too, on one shape."""
    from llamacli.backends.cuda.attention import ATT_TC_ROWS, ATT_WG_DIMS, tc_qscale

    rng = np.random.default_rng(2000 + dh + group)
    hq, ctx = hkv * group, 700
    cfg = make_cfg(n_head=hq, n_head_kv=hkv, head_dim=dh, rope_dim=dh, n_embd=hq * dh)
    be, _ = bare(cfg, ctx)
    if kernel == "wg" and not (be.attention_wg and dh in ATT_WG_DIMS):
        pytest.skip("no wgmma kernel for this head dim or device")
    be.attention_wg = kernel == "wg"
    kc = rng.standard_normal((ctx, hkv, dh)).astype(np.float16)
    vc = rng.standard_normal((ctx, hkv, dh)).astype(np.float16)
    qs = tc_qscale(dh)
    for start, t in ((0, ATT_TC_ROWS // group + 3), (0, 16), (131, 333), (690, 10 + 16)):
        t = min(t, ctx - start)
        kp, vp = kc.copy(), vc.copy()
        kp[start + t :], vp[start + t :] = np.nan, np.nan
        be.kv.k_cache[0], be.kv.v_cache[0] = cp.asarray(kp), cp.asarray(vp)
        q16 = (rng.standard_normal((t, hq, dh)) * qs).astype(np.float16)
        pos = np.arange(start, start + t, dtype=np.int32)
        out = cp.full((t, hq * dh), cp.nan, dtype=cp.float16)
        be.attn.attend_tc(cp.asarray(q16.reshape(t, -1)), hq * dh, be.kv.k_cache[0], be.kv.v_cache[0], cp.asarray(pos), t, out)
        # q16 / qs is the q the kernel sees in natural-log softmax units.
        want = attention_ref(q16.astype(np.float64) / qs, kc.astype(np.float32), vc.astype(np.float32), pos, group)
        got = out.get().astype(np.float64)
        assert_close(got, want, 4e-3, 1e-2, f"fp16 io t={t} start={start}")
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3
        if start == 131:  # f32 output (the op-by-op path's)
            out32 = cp.full((t, hq * dh), cp.nan, dtype=cp.float32)
            be.attn.attend_tc(cp.asarray(q16.reshape(t, -1)), hq * dh, be.kv.k_cache[0], be.kv.v_cache[0], cp.asarray(pos), t,
                          out32)
            assert_close(out32.get(), want, 4e-3, 1e-2, f"f32 out t={t} start={start}")
    big = np.full((ctx, hkv, dh), 65504.0, np.float16)
    big[::2] = -65504.0
    be.kv.v_cache[0] = cp.asarray(big)
    t = 40
    q16 = (rng.standard_normal((t, hq, dh)) * qs).astype(np.float16)
    out = cp.full((t, hq * dh), cp.nan, dtype=cp.float16)
    be.attn.attend_tc(cp.asarray(q16.reshape(t, -1)), hq * dh, be.kv.k_cache[0], be.kv.v_cache[0],
                  cp.asarray(np.arange(t, dtype=np.int32)), t, out)
    assert np.isfinite(out.get()).all()


SPLIT_TOL = (4e-3, 1e-2)  # attention_split: fp16 q and P on tensor cores, as the prefill's (atol, rtol)
# attention_split: a span of at most SP_SOLO tiles is one split (no merge)
SP_SOLO = constants.SP_SOLO


def with_probes(kc: np.ndarray, q: np.ndarray, p: int, n_split: int, group: int) -> np.ndarray:
    """A copy of the cache kc [rows, Hkv, D] whose probe keys (the first and last key of every split,
    kernels/attention_split.cu's tiles per split, of the first tiles, and p itself) are turned towards their
    group's queries q [1, Hq, D] (scores ~8 at group 1), so that each holds a visible share of the output: a
    key dropped or read twice moves it far past the tolerance."""
    hkv, dh = kc.shape[1], kc.shape[2]
    tiles = p // 64 + 1
    per = tiles if tiles <= SP_SOLO else -(-tiles // n_split)  # a short span: one split
    starts = range(0, tiles * 64, per * 64)
    probes = sorted({k for k in (0, 63, 64, 65, p, *starts, *(s + per * 64 - 1 for s in starts)) if k <= p})
    qg = q[0].reshape(hkv, group, dh).mean(axis=1)
    kp = kc.copy()
    kp[probes] = (4 * qg / np.linalg.norm(qg, axis=1, keepdims=True)).astype(kc.dtype)
    return kp


@pytest.mark.parametrize("dh,hkv,group", [(64, 3, 3), (128, 1, 8), (96, 2, 7), (64, 2, 1), (256, 1, 4), (80, 4, 5),
                                          (112, 1, 16), (128, 8, 4), (256, 4, 2), (128, 2, 1), (96, 1, 1),
                                          (80, 2, 1), (256, 1, 1)])
def test_attention_split_depths(dh, hkv, group) -> None:
    """attention_split_d*: one query over up to 20,000 keys, positions on and around 64-key tile and split
    boundaries (splits several tiles deep at the far end where the KV heads are many), every head dim and
    group sizes 1 to 16 (the merge: in several passes where a KV head has more output float4s than the block
    has threads, in 2 to 8 groups of threads where it has half as many or fewer); the cache past the position
    NaN (it must not be read), the output poisoned; float64 reference."""
    rng = np.random.default_rng(77 + dh + group)
    hq, ctx = hkv * group, 20_000
    cfg = make_cfg(n_head=hq, n_head_kv=hkv, head_dim=dh, rope_dim=dh, n_embd=hq * dh)
    be, _ = bare(cfg, ctx)
    assert be.attn.split_fits()
    n_split = be.attn.decode_splits(ctx)
    assert 1 < n_split <= K.cdiv(be.gpu.n_sms * 4, hkv)
    kc = rng.standard_normal((ctx, hkv, dh)).astype(np.float16)
    vc = rng.standard_normal((ctx, hkv, dh)).astype(np.float16)
    po = cp.empty((n_split, hq, dh), cp.float32)
    pm = cp.empty((n_split, hq, 2), cp.float32)
    for p in (0, 1, 63, 64, 65, 191, 255, 256, 700, 5000, 19_999):
        q = (rng.standard_normal((1, hq, dh)) * 2).astype(np.float32)
        kp = with_probes(kc, q, p, n_split, group)
        kd, vd = cp.asarray(kp), cp.asarray(vc)
        kd[p + 1 :] = cp.nan
        vd[p + 1 :] = cp.nan
        out = poisoned((1, hq * dh))
        be.attn.attend(cp.asarray(q), hq * dh, kd, vd, cp.asarray([p], dtype=cp.int32), 1, out, n_split, 0, po, pm)
        want = ext_attention_ref(q, kp[: p + 1].astype(np.float32), vc[: p + 1].astype(np.float32),
                                 np.array([p]), group, 1 / math.sqrt(dh), 0, 0.0)
        assert_close(out.get(), want, *SPLIT_TOL, f"decode pos {p}")
        assert not be.attn.counters.get().any()  # reset by each merging block


def test_attention_decode_long_context_splits() -> None:
    rng = np.random.default_rng(5)
    cfg = make_cfg(n_head=8, n_head_kv=2, head_dim=64, rope_dim=64, n_embd=512)
    be, ref = bare(cfg, 2048)
    t = 1500
    k = rng.standard_normal((t, 2, 64)).astype(np.float32)
    v = rng.standard_normal((t, 2, 64)).astype(np.float32)
    q = rng.standard_normal((t, 8, 64)).astype(np.float32)
    pos = np.arange(t, dtype=np.int32)
    be.attention(att_op(be.cfg), cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(pos))
    ref.attention(att_op(ref.cfg), q, k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32), pos)
    q1 = rng.standard_normal((1, 8, 64)).astype(np.float32) * 3
    k1, v1 = rng.standard_normal((1, 2, 64)).astype(np.float32), rng.standard_normal((1, 2, 64)).astype(np.float32)
    p1 = np.array([t], np.int32)
    got = be.attention(att_op(be.cfg), cp.asarray(q1), cp.asarray(k1), cp.asarray(v1), cp.asarray(p1))
    want = ref.attention(att_op(ref.cfg), q1, k1.astype(np.float16).astype(np.float32), v1.astype(np.float16).astype(np.float32), p1)
    assert_close(got.get(), want, *SPLIT_TOL, "decode over 24 tiles")


# -- sampling -------------------------------------------------------------------------------------------------


def test_argmax_ties_lowest_id() -> None:
    be, _ = bare(make_cfg(vocab_size=100_003), 16)
    rng = np.random.default_rng(3)
    params = S.SamplingParams(temperature=0.0)
    for _ in range(5):
        x = rng.standard_normal(100_003).astype(np.float32)
        top = x.max()
        idx = rng.choice(100_003, size=4, replace=False)
        x[idx] = top + 1
        got = be.sample(cp.asarray(x[None]), params, rng, [])
        assert got == int(idx.min()) == S.greedy(x)


@pytest.mark.parametrize("seed", range(6))
def test_device_sampling_matches_sampling_py(seed) -> None:
    v = 32_000 + seed
    be, _ = bare(make_cfg(vocab_size=v), 16)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(v) * 3).astype(np.float32)
    x[rng.choice(v, 50)] = x.max()  # ties at the top
    x[rng.choice(v, 20)] = -np.inf
    recent = list(rng.integers(0, v, size=80))
    recent += recent[:10]
    for params in (
        S.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1),
        S.SamplingParams(temperature=1.3, top_k=7, top_p=1.0, min_p=0.0, repeat_penalty=1.3, frequency_penalty=0.2,
                         presence_penalty=0.5, repeat_last_n=64, seed=2),
        S.SamplingParams(temperature=0.0, repeat_penalty=1.5, repeat_last_n=-1),
        S.SamplingParams(temperature=0.7, top_k=1024, top_p=0.5, seed=3),
        S.SamplingParams(temperature=0.7, top_k=0, seed=3),  # host path
        S.SamplingParams(temperature=2.0, top_k=200, top_p=0.8, min_p=0.3),
        S.SamplingParams(temperature=0.4, top_k=60, top_p=0.99, min_p=0.0),
        S.SamplingParams(temperature=1.0, top_k=1),
        S.SamplingParams(temperature=1.0, top_k=1024, top_p=1.0, min_p=1.0),  # only the best (and its ties)
    ):
        for trial in range(20):
            r1, r2 = np.random.default_rng(trial), np.random.default_rng(trial)
            want = S.sample(x, params, r1, recent)
            got = be.sample(cp.asarray(x[None]), params, r2, recent)
            assert got == want, (params, trial)
    # Only one candidate left, and none: the same answer / error as sampling.py.
    y = np.full(v, -np.inf, np.float32)
    y[seed * 7] = 1.0
    assert be.sample(cp.asarray(y[None]), S.SamplingParams(top_k=40), np.random.default_rng(0), []) == seed * 7
    for params in (S.SamplingParams(top_k=40), S.SamplingParams(temperature=0.0)):  # greedy: argmax_f32's flag 2
        with pytest.raises(NumericalError):
            be.sample(cp.asarray(np.full((1, v), -np.inf, np.float32)), params, np.random.default_rng(0), [])


def test_debug_logging_names_each_launch(caplog) -> None:
    import logging

    be, _ = bare(make_cfg(), 16)
    x = cp.ones((3, 40), cp.float32)
    with caplog.at_level(logging.DEBUG, logger="llamacli.kernels"):
        be.rms_norm(x, cp.ones(40, cp.float32), 1e-5)
    assert any("launch rms_norm_f32 grid=(3,) block=(256,) shared=0" in r.getMessage() for r in caplog.records)


# -- gemma: head dim 256, sliding windows, soft-caps, the query scale, GeGLU, post-norms, the 262k LM head ----


def ext_cfg(dh: int, hkv: int, group: int, window: int, softcap: float, attn_scale: float = 0.0) -> ModelConfig:
    """One layer with gemma's attention extras (window, soft-cap) and a local RoPE table."""
    from llamacli.models.base import LayerPlan

    plan = LayerPlan(window=window, attn_softcap=softcap, rope_local=True)
    return make_cfg(n_head=hkv * group, n_head_kv=hkv, head_dim=dh, rope_dim=dh, n_embd=hkv * group * dh,
                    attn_scale=attn_scale, layers=(plan,), rope_type=ROPE_NEOX)


def ext_attention_ref(q, kc, vc, pos, group, scale, window, softcap, sinks=None):
    """float64 causal GQA attention with a sliding window (keys k > p - window; 0: all), a soft-cap, and
    attention sinks (gpt-oss: exp(sinks[h]) in each head's denominator, no value row; None: none)."""
    t, hq, dh = q.shape
    hkv = hq // group
    out = np.empty((t, hq, dh))
    sink = np.full(hq, -np.inf) if sinks is None else np.asarray(sinks, np.float64)
    for i in range(t):
        lo = max(0, pos[i] - window + 1) if window else 0
        k64 = kc[lo : pos[i] + 1].astype(np.float64)  # [n, Hkv, D]: query head h reads kv head h // group
        qi = q[i].astype(np.float64).reshape(hkv, group, dh)
        s = np.einsum("nkd,kgd->kgn", k64, qi).reshape(hq, -1) * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        m = np.maximum(s.max(axis=1), sink)
        p = np.exp(s - m[:, None])
        o = np.einsum("kgn,nkd->kgd", p.reshape(hkv, group, -1), vc[lo : pos[i] + 1].astype(np.float64))
        out[i] = o.reshape(hq, dh) / (p.sum(axis=1) + np.exp(sink - m))[:, None]
    return out.reshape(t, hq * dh)


def check_prefill_chunks(be, cfg, rng, ctx: int, q_scale: float, window: int, softcap: float,
                         sinks: np.ndarray | None = None) -> None:
    """Prefill chunks of layer 0 on a random cache, the cache past each chunk's keys NaN and the output
    poisoned, through the tensor-core (tcx) and CUDA-core (_w) kernels, against float64 (ext_attention_ref)
    with the layer's window, soft-cap and sinks. A sliding-window layer whose ring is smaller than ctx
    (models/kv_cache.py) holds the last `rows` positions up to the chunk's, at their rows mod rows (the last chunk
    wraps), and the rows of keys before every query's window and its first tile NaN: never read."""
    hkv, dh, group = cfg.n_head_kv, cfg.head_dim, cfg.n_group
    kc = rng.standard_normal((ctx, hkv, dh)).astype(np.float16)
    vc = rng.standard_normal((ctx, hkv, dh)).astype(np.float16)
    rows = cfg.cache_rows(ctx)[0]
    for start, t in ((0, 37), (131, 333), (600, 5), (650, 50)):
        if rows < ctx:
            kr = rng.standard_normal((rows, hkv, dh)).astype(np.float16)  # rows of no position yet: finite
            vr = rng.standard_normal((rows, hkv, dh)).astype(np.float16)
            held = np.arange(max(0, start + t - rows), start + t)
            kr[held % rows], vr[held % rows] = kc[held], vc[held]
            unread = held[held < max(0, start - window + 1) // 64 * 64]
            kr[unread % rows], vr[unread % rows] = np.nan, np.nan
            kr[start + t :], vr[start + t :] = np.nan, np.nan  # (rows of no position yet, if any)
            be.kv.k_cache[0], be.kv.v_cache[0] = cp.asarray(kr), cp.asarray(vr)
        else:
            kp, vp = kc.copy(), vc.copy()
            kp[start + t :], vp[start + t :] = np.nan, np.nan
            be.kv.k_cache[0], be.kv.v_cache[0] = cp.asarray(kp), cp.asarray(vp)
        q = (rng.standard_normal((t, cfg.n_head, dh)) * q_scale).astype(np.float32)
        pos = np.arange(start, start + t, dtype=np.int32)
        want = ext_attention_ref(q, kc, vc, pos, group, cfg.query_scale, window, softcap,
                                 None if sinks is None else sinks.astype(np.float64))
        for use_tc in (True, False):
            be.attention_tc = use_tc
            out = poisoned((t, cfg.q_dim))
            be.attn.attend(cp.asarray(q), cfg.q_dim, be.kv.k_cache[0], be.kv.v_cache[0], cp.asarray(pos), t, out, 1, ctx,
                      None, None, op=att_op(be.cfg))
            tc = use_tc and t >= ATT_TC_MIN_T
            tol = (6e-3, 1e-2) if tc else (2e-4, 2e-3)
            assert_close(out.get(), want, *tol, f"tc={tc} t={t} start={start}")


@pytest.mark.parametrize("dh", [64, 128, 256])
@pytest.mark.parametrize("window,softcap", [(0, 50.0), (7, 0.0), (100, 0.0), (5000, 0.0), (64, 20.0)])
def test_attention_prefill_window_softcap(dh, window, softcap) -> None:
    """attention_tcx*_d* (tensor cores) and attention_w_npl* (CUDA cores) with windows smaller and larger than
    the chunk (and than the cache), soft-caps, a query scale that is not 1/sqrt(dh); chunks on a filled cache,
    the cache past the chunk's keys NaN, the output poisoned; against float64."""
    rng = np.random.default_rng(dh + window)
    hkv, group, ctx = 1, 4, 700
    scale = 0.3 / math.sqrt(dh) if softcap else 0.0
    cfg = ext_cfg(dh, hkv, group, window, softcap, scale)
    be, _ = bare(cfg, ctx)
    check_prefill_chunks(be, cfg, rng, ctx, 3.0, window, softcap)


@pytest.mark.parametrize("dh", [64, 256])
@pytest.mark.parametrize("hkv,group", [(1, 4), (2, 8), (1, 17)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (300, 0.0), (40, 30.0)])
def test_attention_decode_window_softcap(dh, hkv, group, window, softcap) -> None:
    """Decode (attention_split; group 17: the CUDA-core splits, attention_w_npl* + attention_combine_w)
    against the NumPy reference after prefill chunks, positions past several splits and windows that start
    inside a tile. The window layers keep rings (896 and 640 rows) that the positions wrap; the 700-token chunk
    goes into them in two passes (kv_cache.ring_span)."""
    rng = np.random.default_rng(dh * 7 + group + window)
    cfg = ext_cfg(dh, hkv, group, window, softcap)
    be, ref = bare(cfg, 4096)
    assert be.kv.k_cache[0].shape[0] == {0: 4096, 300: 896, 40: 640}[window]
    hq, start = cfg.n_head, 0
    for t in (300, 1, 1, 400, 1, 1, 700, 1, 1):
        q = rng.standard_normal((t, hq, dh)).astype(np.float32)
        k = rng.standard_normal((t, hkv, dh)).astype(np.float32)
        v = rng.standard_normal((t, hkv, dh)).astype(np.float32)
        k16, v16 = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
        pos = np.arange(start, start + t, dtype=np.int32)
        got = be.attention(att_op(be.cfg), cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(pos))
        want = ref.attention(att_op(ref.cfg), q, k16, v16, pos)
        tol = (6e-3, 1e-2) if t >= ATT_TC_MIN_T or (t == 1 and be.attn.split_fits()) else (2e-4, 2e-3)
        assert be.attn.split_fits() == (group <= 16)
        assert_close(got.get(), want, *tol, f"attention t={t} start={start}")
        start += t


def step_inputs(cfg, rng, qn=None, kn=None):
    """The fused step's QKV matvec output for one token, random, with this token's key along query head 0 (a
    row p read as zeros would show) -> (qkv [1, Q + 2 KV], q, k, v per head), q and k through the reference's
    per-head RMSNorm with qn and kn where qn is given (the kernel's input stays raw)."""
    dh, hkv = cfg.head_dim, cfg.n_head_kv
    qkv = rng.standard_normal((1, cfg.q_dim + 2 * cfg.kv_dim)).astype(np.float32)
    qkv[0, cfg.q_dim : cfg.q_dim + dh] = 3 * qkv[0, :dh]
    q = qkv[:, : cfg.q_dim].reshape(1, cfg.n_head, dh)
    k = qkv[:, cfg.q_dim : cfg.q_dim + cfg.kv_dim].reshape(1, hkv, dh)
    v = qkv[:, cfg.q_dim + cfg.kv_dim :].reshape(1, hkv, dh)
    if qn is not None:

        def head_norm(x, w):
            x = x.astype(np.float64)
            return (x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + cfg.rms_eps) * w).astype(np.float32)

        q, k = head_norm(q, qn), head_norm(k, kn)
    return qkv, q, k, v


def step_backends(cfg, ctx: int, splits, rng, q8: bool = False):
    """bare() set up for the fused step's attention of layer 0 (attend_step): random q/k norm weights, the local
    RoPE table, the split buffers; `splits` overrides the GPU's split count. -> (be, ref, qn, kn)."""
    be, ref = bare(cfg, ctx, q8)
    if splits is not None:
        be.attn.decode_splits = lambda ctx: splits  # (the instance attribute shadows the method)
    dh = cfg.head_dim
    qn = (1 + 0.3 * rng.standard_normal(dh)).astype(np.float32)
    kn = (1 + 0.3 * rng.standard_normal(dh)).astype(np.float32)
    be.model.weights = SimpleNamespace(layers=[SimpleNamespace(attn_q_norm=cp.asarray(qn), attn_k_norm=cp.asarray(kn),
                                                         attn_sinks=None)])
    be.model.inv_freq_local = cp.asarray(rope_tables.inv_freq(cfg, None, ctx, local=True).astype(np.float64))
    ref.theta_local = rope_tables.inv_freq(cfg, None, ctx, local=True)
    return be, ref, qn, kn


def attend_step(be, qkv, att) -> None:
    """The fused step's attention of layer 0 (attention_split_step_*) at be.decoder.step_pos, with split buffers
    for be.attn's split count."""
    cfg = be.cfg
    n_split = be.attn.decode_splits(be.ctx)
    part_o = cp.empty((n_split, cfg.n_head, cfg.head_dim), cp.float32)
    part_ml = cp.empty((n_split, cfg.n_head, 2), cp.float32)
    be.attn.attend_step(att_branch(cfg), qkv, att, be.decoder.step_pos, part_o, part_ml, False)


@pytest.mark.parametrize("dh,group", [(64, 3), (256, 4), (128, 16)])
@pytest.mark.parametrize("window,softcap,qk_norm", [(0, 0.0, False), (200, 0.0, True), (30, 50.0, False),
                                                    (0, 0.0, True)])
@pytest.mark.parametrize("splits", [None, 2], ids=["gpu-splits", "2-splits"])
def test_attention_step_window_local_rope(dh, group, window, softcap, qk_norm, splits) -> None:
    """The fused decode step's attention (attention_split_step_neox_d*: the per-head q/k RMSNorm, RoPE with the
    local table, K/V store, the splits of the window only, their merge by the last block) against norm, rope
    and attention of the reference, at positions on both sides of a tile boundary. The token's own tile reaches
    its stage after the store (the full cache: 2 splits several tiles deep; window 200 at positions 702-703:
    its 4 tiles one split of SP_SOLO), or was requested before the store and is patched into its stage (window
    200 at 704: 5 tiles, 2 splits of 3; window 30: 1-2 tiles). The token's key is turned towards its first
    query head, so a row p read as zeros would show."""
    from llamacli.models.base import LayerPlan

    rng = np.random.default_rng(dh + group + window)
    hkv = 1
    cfg = ext_cfg(dh, hkv, group, window, softcap)
    if qk_norm:
        cfg = dataclasses.replace(cfg, layers=(LayerPlan(window=window, attn_softcap=softcap, rope_local=True,
                                                         qk_norm=True),))
    ctx = 2048
    be, ref, qn, kn = step_backends(cfg, ctx, splits, rng)
    hist = 702  # the cache before the step: filled through both backends' op path
    k0 = rng.standard_normal((hist, hkv, dh)).astype(np.float32)
    put_positions(be.kv.k_cache[0], 0, k0.astype(np.float16))
    put_positions(be.kv.v_cache[0], 0, k0[::-1].astype(np.float16))
    rows = be.kv.k_cache[0].shape[0]  # a ring on the window layers: 768 rows (200), 640 (30: the 702 positions wrap)
    # NaN where the step writes its rows before any block reads them, and (a ring) on the rows of positions
    # before every step's window and its first tile: never read.
    n_nan = ctx - hist if rows == ctx else rows - window - 64
    for c in (be.kv.k_cache[0], be.kv.v_cache[0]):
        c[cp.asarray(np.arange(hist, hist + n_nan) % rows)] = cp.nan
    ref.k_cache[0, :hist] = k0.astype(np.float16)
    ref.v_cache[0, :hist] = k0[::-1].astype(np.float16)

    for p in (hist, hist + 1, hist + 2):  # 702, 703: tile 10; 704: the first key of tile 11
        qkv, q, k, v = step_inputs(cfg, rng, qn if qk_norm else None, kn)
        pos = np.array([p], np.int32)
        kr = ref.rope(k, pos, local=True).astype(np.float16).astype(np.float32)
        want = ref.attention(att_op(ref.cfg), ref.rope(q, pos, local=True), kr, v.astype(np.float16).astype(np.float32), pos)
        be.decoder.step_pos.set(pos)
        att = poisoned((1, cfg.q_dim))
        attend_step(be, cp.asarray(qkv), att)
        assert_close(att.get(), want, *SPLIT_TOL, f"step p={p}")
        assert_close(be.kv.k_cache[0][p % rows].get(), kr[0], 1e-3, 1e-3, f"stored k p={p}")
        assert int(be.attn.counters.sum()) == 0  # reset by the merging block


@pytest.mark.parametrize("rope_type", [ROPE_NORMAL, ROPE_NEOX])
def test_rope_head_dim_256_local_table(rope_type) -> None:
    cfg = make_cfg(head_dim=256, rope_dim=256, rope_type=rope_type, rope_freq_base=1e6, rope_scaling="linear",
                   rope_scaling_factor=8.0)
    be, ref = bare(cfg, 4096)
    be.model.inv_freq_local = cp.asarray(rope_tables.inv_freq(cfg, None, 4096, local=True).astype(np.float64))
    ref.theta_local = rope_tables.inv_freq(cfg, None, 4096, local=True)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 3, 256)).astype(np.float32)
    pos = np.sort(rng.choice(4000, size=9, replace=False)).astype(np.int32)
    for local in (False, True):
        assert_close(be.rope(cp.asarray(x), cp.asarray(pos), local).get(), ref.rope(x, pos, local), 1e-5, 1e-5,
                     f"local={local}")


def gelu_tanh(g):
    g = np.asarray(g, np.float64)
    return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))


@pytest.mark.parametrize("n", [1, 4097, 100_003])
def test_geglu_softcap_elementwise(n) -> None:
    rng = np.random.default_rng(n)
    be, ref = bare(make_cfg(), 16)
    g, u = (rng.standard_normal((1, n)) * 4).astype(np.float32), rng.standard_normal((1, n)).astype(np.float32)
    assert_close(be.geglu(cp.asarray(g), cp.asarray(u)).get(), ref.geglu(g, u), 1e-6, 1e-5, "geglu")
    x = (rng.standard_normal((1, n)) * 60).astype(np.float32)
    assert_close(be.softcap(cp.asarray(x), 30.0).get(), ref.softcap(x, 30.0), 1e-5, 1e-5, "softcap")


def test_geglu_f16_rowscale_and_rms_norm_add() -> None:
    """The fused prefill's GeGLU (geglu_f16_rowscale: fp16 output with a power-of-two row scale) and the
    post-norm residual add (rms_norm_add, with and without the GEMM's row scales)."""
    from llamacli.backends.cuda import loader as K

    rng = np.random.default_rng(3)
    t, f, d = 5, 2048, 640
    gu = (rng.standard_normal((t, 2 * f)) * 3).astype(np.float32)
    gu[1] *= 4000.0  # a row past fp16's range once multiplied: its scale must grow
    s_in = np.array([1, 2, 0.5, 4, 1], np.float32)
    y16, s_out = cp.full((t, f), cp.nan, cp.float16), poisoned(t)
    K.launch("elementwise", "geglu_f16_rowscale", (t,), (256,), gu=cp.asarray(gu), s_in=cp.asarray(s_in), F=f,
             y16=y16, s_out=s_out)
    g, u = gu[:, :f] * s_in[:, None], gu[:, f:] * s_in[:, None]
    want = gelu_tanh(g) * u
    got = y16.get().astype(np.float64) * s_out.get()[:, None]
    assert_close(got, want, 1e-3, 2e-3, "geglu_f16_rowscale")
    x = rng.standard_normal((t, d)).astype(np.float32)
    y = (rng.standard_normal((t, d)) * 7).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    for scale in (None, s_in):
        sc = np.ones(t, np.float32) if scale is None else scale
        ys = y * sc[:, None]
        want = x + ys / np.sqrt(np.mean(ys.astype(np.float64) ** 2, axis=1, keepdims=True) + 1e-6) * w
        xd = cp.asarray(x)
        K.launch("norm", "rms_norm_add", (t,), (256,), x=xd, y=cp.asarray(y),
                 s=None if scale is None else cp.asarray(scale), w=cp.asarray(w), D=d, eps=1e-6)
        assert_close(xd.get(), want, 1e-5, 1e-5, f"rms_norm_add scale={scale is not None}")


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K, QT.Q5_0, QT.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("t", [1, 3])
def test_matvec_geglu(qtype, t) -> None:
    """The _geglu forms of mv1 / mv1_stream (one token, RMSNorm fused) and matvec (3 tokens)."""
    rng = np.random.default_rng(int(qtype) + t)
    be, _ = bare(make_cfg(), 16)
    n, k = 300, 768 if qtype in MV1_ACT8 else 640  # (K-quant rows: whole 256-value blocks)
    wg, _b1, gref = upload(random_quant_rows(qtype, n, k, rng, std=0.05), qtype, k)
    wu, _b2, uref = upload(random_quant_rows(qtype, n, k, rng, std=0.05), qtype, k)
    x = (rng.standard_normal((t, k))).astype(np.float32)
    y = poisoned((t, n))
    be.linear.matvec_swiglu(wg, wu, cp.asarray(x), t, y, act="gelu_tanh")
    a, b = x @ gref.T, x @ uref.T
    sa, sb = np.abs(x) @ np.abs(gref).T, np.abs(x) @ np.abs(uref).T
    tol = 1e-5 + 2e-5 * sa * sb
    if qtype in MV1_ACT8 and t == 1:
        ea, eb = act8_bound(x[0], gref)[None], act8_bound(x[0], uref)[None]
        tol = tol + 1.2 * (np.abs(b) + eb) * ea + np.abs(gelu_tanh(a)) * eb
    assert_close(y.get(), gelu_tanh(a) * b, tol, 1e-4, f"geglu {qtype.name} t={t}")


def test_lm_head_262k_vocabulary_argmax() -> None:
    """Gemma 3's LM head: a Q8_0 [262144, 640] matrix through mv1 with RMSNorm and the fused argmax: the
    winning row near the end comes out (no grid or index overflow), rows at both ends match float64, and
    softcap_f32 over the logits keeps them finite and the argmax where it was."""
    rng = np.random.default_rng(262144)
    n, k = 262144, 640
    be, _ = bare(make_cfg(vocab_size=n), 16)
    blocks = k // 32
    raw = np.empty((n, blocks, 34), np.uint8)  # Q8_0 block: fp16 scale, 32 int8 (ggml-common.h)
    raw[:, :, :2] = np.full((n, blocks), 1e-3, np.float16).view(np.uint8).reshape(n, blocks, 2)
    raw[:, :, 2:] = rng.integers(-127, 128, size=(n, blocks, 32), dtype=np.int8).view(np.uint8)
    x = rng.standard_normal((1, k)).astype(np.float32)
    win = n - 3
    raw[win, :, 2:] = np.where(x[0] > 0, 127, -127).astype(np.int8).reshape(blocks, 32).view(np.uint8)
    rows = raw.reshape(n, blocks * 34)
    buf = cp.asarray(rows)
    w = DeviceMatrix(buf.data.ptr, n, k, QT.Q8_0, blocks * 34)
    nw = np.ones(k, np.float32)
    y = poisoned((1, n))
    be.linear.matvec((w,), cp.asarray(x), 1, y, norm=cp.asarray(nw), argmax=be.decoder.am)
    assert int(be.decoder.step_ids.get()[0]) == win and int(be.decoder.step_ids.get()[1]) == 0
    h = x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5)
    yh = y.get()
    for sub in (np.arange(0, 500), np.arange(n - 500, n)):
        wref = dequantize(rows[sub], QT.Q8_0).reshape(len(sub), k).astype(np.float64)
        ref = h @ wref.T
        q8 = act8_bound(h[0], wref)[None] if QT.Q8_0 in MV1_ACT8 else 0.0
        assert_close(yh[:, sub], ref, 1e-5 + 2e-6 * (np.abs(h) @ np.abs(wref).T) + q8, 1e-5, f"rows {sub[0]}..")
    capped = be.softcap(y, 30.0).get()
    assert np.isfinite(capped).all() and int(np.argmax(capped)) == win


# -- the 8-bit KV cache (-ctk/-ctv q8_0): kv_store_q8, attention_split's _q8 forms, the fp16 conversion ---------


def ggml_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., D] f32 -> (int8 codes [..., D], fp16 scales [..., D/32]) as gguf.quants (ggml's rounding) makes
    Q8_0 blocks."""
    from gguf import quants

    raw = quants.quantize(np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1]), QT.Q8_0).reshape(-1, 34)
    d = raw[:, :2].copy().view(np.float16).reshape(*x.shape[:-1], x.shape[-1] // 32)
    return raw[:, 2:].copy().view(np.int8).reshape(x.shape), d


def q8_cache_get(buf) -> tuple[np.ndarray, np.ndarray]:
    """One 8-bit cache (kv.KVCache) -> (codes [rows, Hkv, D] int8, scales [rows, Hkv, D/32] fp16)."""
    rows, hkv, w = buf.shape
    dh = w * 16 // 17
    b = buf.get().reshape(-1)
    n = rows * hkv * dh
    sc = b[n:].view(np.float16).reshape(hkv, rows, dh // 32).transpose(1, 0, 2)
    return b[:n].view(np.int8).reshape(rows, hkv, dh), sc


def q8_cache_set(buf, codes: np.ndarray, scales: np.ndarray) -> None:
    rows, hkv, dh = codes.shape
    b = np.concatenate([codes.astype(np.int8).reshape(-1).view(np.uint8),
                        np.ascontiguousarray(scales.astype(np.float16).transpose(1, 0, 2)).reshape(-1).view(np.uint8)])
    buf.set(b.reshape(buf.shape))


def q8_values(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Dequantized float64 [rows, Hkv, D]."""
    d = np.repeat(scales.astype(np.float64), 32, axis=-1)
    return codes.astype(np.float64) * d


@pytest.mark.parametrize("dh", [64, 96, 128, 256])
def test_kv_store_q8_matches_ggml(dh) -> None:
    """kv_store_q8: the codes and fp16 scales of every 32-value block exactly as gguf.quants rounds them
    (values of several magnitudes, an all-zero block, exact halves), at rows pos mod ring of a ring; a block
    holding NaN or inf stores a NaN scale; rows of other positions untouched."""
    rng = np.random.default_rng(dh)
    hkv, t, start = 2, 37, 620  # positions 620..656 wrap the ring of 640 rows
    cfg = ext_cfg(dh, hkv, 2, 100, 0.0)
    be, _ = bare(cfg, 4096, q8=True)
    rows = be.kv.k_cache[0].shape[0]
    assert rows < 4096 and rows % 64 == 0
    k = (rng.standard_normal((t, hkv, dh)) * rng.choice([1e-3, 1.0, 300.0], size=(t, hkv, 1))).astype(np.float32)
    v = rng.standard_normal((t, hkv, dh)).astype(np.float32)
    k[3, 1, :32] = 0.0
    k[4, 0, :32] = np.arange(32) - 12.7  # max 19.3 -> many codes land near .5
    v[5, 0, 32:64] = np.nan
    v[6, 1, :32] = np.inf
    pos = np.arange(start, start + t, dtype=np.int32)
    q = rng.standard_normal((t, cfg.q_dim)).astype(np.float32)
    be.attention(att_op(be.cfg), cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(pos))
    for cache, x in ((be.kv.k_cache[0], k), (be.kv.v_cache[0], v)):
        codes, sc = q8_cache_get(cache)
        want_c, want_s = ggml_q8_0(x)
        at = pos % rows
        finite = np.isfinite(x.reshape(t, hkv, dh // 32, 32)).all(axis=-1)
        np.testing.assert_array_equal(sc[at][finite], want_s[finite])
        got_c = codes[at].reshape(t, hkv, dh // 32, 32)
        np.testing.assert_array_equal(got_c[finite], want_c.reshape(t, hkv, dh // 32, 32)[finite])
        assert np.isnan(sc[at][~finite].astype(np.float32)).all()
        other = np.setdiff1d(np.arange(rows), at)
        assert not codes[other].any() and not sc[other].astype(np.float32).any()


@pytest.mark.parametrize("dh", [64, 96, 128, 256])
@pytest.mark.parametrize("hkv,group", [(2, 1), (1, 8), (2, 7)])
def test_attention_q8_prefill_then_decode(dh, hkv, group) -> None:
    """An 8-bit cache through the attention op against the NumPy backend's q8_0 cache: prefill chunks on
    tensor cores (the cache converted to fp16 first: readable), decode through attention_split_q8_d*, a short
    chunk on the CUDA cores, each on top of the cache before."""
    rng = np.random.default_rng(dh * 10 + group + 5)
    cfg = make_cfg(n_head=hkv * group, n_head_kv=hkv, head_dim=dh, rope_dim=dh, n_embd=hkv * group * dh)
    be, ref = bare(cfg, 4096, q8=True)
    hq, start = cfg.n_head, 0
    for t in (37, 1, 200, 1, 5, 1):
        q = rng.standard_normal((t, hq, dh)).astype(np.float32)
        k = rng.standard_normal((t, hkv, dh)).astype(np.float32)
        v = rng.standard_normal((t, hkv, dh)).astype(np.float32)
        pos = np.arange(start, start + t, dtype=np.int32)
        got = be.attention(att_op(be.cfg), cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(pos))
        want = ref.attention(att_op(ref.cfg), q, k, v, pos)
        # fp16 q and P on tensor cores (prefill, decode); the CUDA cores read the fp16 conversion of d x code
        tol = SPLIT_TOL if t >= ATT_TC_MIN_T or t == 1 else (1e-3, 4e-3)
        assert_close(got.get(), want, *tol, f"q8 attention t={t} start={start}")
        start += t


@pytest.mark.parametrize("dh,hkv,group", [(64, 3, 3), (128, 8, 4), (96, 2, 7), (256, 1, 4), (128, 1, 16), (128, 1, 1)])
def test_attention_split_q8_depths(dh, hkv, group) -> None:
    """attention_split_q8_d*: one query over up to 20,000 keys of an 8-bit cache, positions on and around tile
    and split boundaries, probe keys at every split's ends; the rows past the position hold NaN scales (never
    read); float64 reference on the dequantized cache."""
    rng = np.random.default_rng(91 + dh + group)
    hq, ctx = hkv * group, 20_000
    cfg = make_cfg(n_head=hq, n_head_kv=hkv, head_dim=dh, rope_dim=dh, n_embd=hq * dh)
    be, _ = bare(cfg, ctx, q8=True)
    assert be.attn.split_fits()
    n_split = be.attn.decode_splits(ctx)
    assert 1 < n_split
    rows = be.kv.k_cache[0].shape[0]
    kc = rng.standard_normal((rows, hkv, dh)).astype(np.float32)
    vcodes, vsc = ggml_q8_0(rng.standard_normal((rows, hkv, dh)).astype(np.float32))
    po = cp.empty((n_split, hq, dh), cp.float32)
    pm = cp.empty((n_split, hq, 2), cp.float32)
    for p in (0, 63, 64, 65, 191, 255, 256, 5000, 19_999):
        q = (rng.standard_normal((1, hq, dh)) * 2).astype(np.float32)
        kp = with_probes(kc, q, p, n_split, group)
        kcodes, ksc = ggml_q8_0(kp)
        ks, vs = ksc.copy(), vsc.copy()
        ks[p + 1 :], vs[p + 1 :] = np.nan, np.nan
        q8_cache_set(be.kv.k_cache[0], kcodes, ks)
        q8_cache_set(be.kv.v_cache[0], vcodes, vs)
        out = poisoned((1, hq * dh))
        be.attn.attend(cp.asarray(q), hq * dh, be.kv.k_cache[0], be.kv.v_cache[0], cp.asarray([p], dtype=cp.int32), 1, out,
                  n_split, 0, po, pm)
        want = ext_attention_ref(q, q8_values(kcodes, ksc)[: p + 1], q8_values(vcodes, vsc)[: p + 1], np.array([p]),
                                 group, 1 / math.sqrt(dh), 0, 0.0)
        assert_close(out.get(), want, *SPLIT_TOL, f"q8 decode pos {p}")
        assert not be.attn.counters.get().any()


@pytest.mark.parametrize("dh,group", [(64, 3), (128, 4), (256, 2)])
@pytest.mark.parametrize("window,qk_norm", [(0, False), (200, True)])
@pytest.mark.parametrize("splits", [None, 2], ids=["gpu-splits", "2-splits"])
def test_attention_step_q8(dh, group, window, qk_norm, splits) -> None:
    """The fused step's attention on an 8-bit cache (attention_split_step_q8_neox_d*): the q/k norm, RoPE,
    this token's K and V quantized into the cache by the holder block (a warp per block; patched into its
    stage when its tile was requested before the store), the splits and their merge, against norm, rope and
    the reference's q8_0 cache; two KV heads; the history written through kv_store_q8 (the op path), past a
    window's ring (768 rows: 830 positions wrap it), the scales of the positions before the first step's
    window NaN (in the ring, some in the first tile read: the conversion must mask them)."""
    from llamacli.models.base import LayerPlan
    from llamacli.models.kv_cache import q8_0_roundtrip

    rng = np.random.default_rng(dh + group + window + 3)
    hkv, ctx = 2, 2048
    cfg = ext_cfg(dh, hkv, group, window, 0.0)
    cfg = dataclasses.replace(cfg, layers=(LayerPlan(window=window, rope_local=True, qk_norm=qk_norm),))
    be, ref, qn, kn = step_backends(cfg, ctx, splits, rng, q8=True)
    hist = 830  # 830, 831: tile 12; 832: the first key of tile 13
    q0 = rng.standard_normal((hist, cfg.q_dim)).astype(np.float32)
    k0 = rng.standard_normal((hist, hkv, dh)).astype(np.float32)
    v0 = rng.standard_normal((hist, hkv, dh)).astype(np.float32)
    p0 = np.arange(hist, dtype=np.int32)
    be.attention(att_op(be.cfg), cp.asarray(q0), cp.asarray(k0), cp.asarray(v0), cp.asarray(p0))
    ref.attention(att_op(ref.cfg), q0.reshape(hist, -1, dh), k0, v0, p0)  # (q [T, Hq, Dh], as the contract says)
    rows = be.kv.k_cache[0].shape[0]
    assert rows == (768 if window else 2048)
    if window:
        old = np.arange(hist - rows, hist - window + 1)  # held, before the first step's window
        for c in (be.kv.k_cache[0], be.kv.v_cache[0]):
            codes, sc = q8_cache_get(c)
            sc[old % rows] = np.nan
            q8_cache_set(c, codes, sc)

    for p in (hist, hist + 1, hist + 2):
        qkv, q, k, v = step_inputs(cfg, rng, qn if qk_norm else None, kn)
        pos = np.array([p], np.int32)
        kr = ref.rope(k, pos, local=True)
        want = ref.attention(att_op(ref.cfg), ref.rope(q, pos, local=True), kr, v, pos)
        be.decoder.step_pos.set(pos)
        att = poisoned((1, cfg.q_dim))
        attend_step(be, cp.asarray(qkv), att)
        assert_close(att.get(), want, *SPLIT_TOL, f"q8 step p={p}")
        codes, sc = q8_cache_get(be.kv.k_cache[0])
        got_k = q8_values(codes[p % rows], sc[p % rows])
        step = np.repeat(np.abs(kr[0]).reshape(hkv, -1, 32).max(axis=-1) / 127, 32, axis=-1)
        assert (np.abs(got_k - q8_0_roundtrip(kr)[0]) <= 1.01 * step + 1e-6).all(), f"stored k p={p}"
        vc, vs = q8_cache_get(be.kv.v_cache[0])
        np.testing.assert_array_equal(q8_values(vc[p % rows], vs[p % rows]), q8_0_roundtrip(v)[0].astype(np.float64))
        assert int(be.attn.counters.sum()) == 0
