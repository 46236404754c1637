"""`bench --kernels`: micro-benchmarks of single CUDA kernels, no model needed (`kernel_benchmarks`).

- mv1_<type> / mv1_stream_<type> (the one-token matvec of the decode step) at (N, K) shapes, random valid
  blocks made on the GPU, rotated over enough copies to exceed the 50 MB L2 so every launch reads HBM;
  GB/s = weight bytes / time.
- attention prefill (causal, head dim 64) as the fused prefill runs it: fp16 q (times log2(e)/sqrt(D), as
  RoPE writes it), fp16 K/V in our cache layout, fp16 output; batch folded into heads (each (batch, head)
  pair is its own KV head over its own 512 keys); the wgmma kernel on a Hopper GPU and the portable mma.sync
  one; against torch's scaled_dot_product_attention on fp16 [B, H, T, D] (FlashAttention / cuDNN on the
  H100), with the max abs difference of the outputs as a check.
Times: a spin kernel holds the GPU while `reps` launches are queued, CUDA events around them, per launch.
Apart from profile.py (the hooks every launcher imports), because these import the launchers.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np

from ...ggufio.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from . import loader as K
from .attention import ATT_WG_DIMS, AttentionKernels, tc_qscale
from .linear import DeviceMatrix, Linear, mv1_stream_ok

# Byte offsets of fp16 scale fields in one block (ggml-common.h); the rest of a block is valid as any bits.
_F16_FIELDS = {QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q4_K: (0, 2),
               QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.IQ4_NL: (0,), QT.IQ4_XS: (0,)}


def _random_weight(cp: Any, qtype: QT, n: int, k: int) -> Any:
    """Device bytes of a random valid [n, k] weight (small finite scales, never zeros)."""
    if qtype in (QT.F16, QT.BF16, QT.F32):
        x = cp.random.standard_normal((n, k), dtype=cp.float32) * 0.02
        return (x.astype(cp.float16) if qtype == QT.F16 else x).view(cp.uint8).reshape(n, -1)
    block, size = GGML_QUANT_SIZES[qtype]
    b = cp.random.randint(0, 256, size=(n * k // block, size), dtype=cp.uint8)
    scale = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    for off in _F16_FIELDS.get(qtype, ()):
        b[:, off], b[:, off + 1] = int(scale[0]), int(scale[1])
    if qtype == QT.MXFP4:  # the E8M0 exponent byte: 2^(118 - 128), about 1e-3
        b[:, 0] = 118
    return b.reshape(n, -1)


def _time_launches(cp: Any, launch: Any, reps: int) -> float:
    """Seconds per launch: `reps` launches queued behind a spin kernel, CUDA events around them."""
    launch(0)  # warm up (module load)
    K.launch("elementwise", "spin_ns", (1,), (1,), ns=5_000_000)
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record()
    for i in range(reps):
        launch(i)
    b.record()
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / 1e3 / reps


def kernel_benchmarks(be: Any, shapes: tuple, types: tuple, att: tuple[int, int, int, int]) -> tuple[list[dict], float]:
    """The matvec rows for each weight type and (N, K) shape, then the attention rows -> (rows, copy
    bandwidth in bytes/s). `be` is a CudaBackend with no model loaded: the launchers are made here."""
    cp = be.cp
    bandwidth = be.memory_bandwidth()
    linear = Linear(be.gpu, be.options, SimpleNamespace(rms_eps=1e-5))
    rows: list[dict] = []
    for name in types:
        qt = QT[name]
        for n, k in shapes:
            one = _random_weight(cp, qt, n, k)
            copies = max(1, math.ceil(200e6 / one.nbytes))
            bufs = [one] + [_random_weight(cp, qt, n, k) for _ in range(copies - 1)]
            mats = [DeviceMatrix(w.data.ptr, n, k, qt, w.shape[1]) for w in bufs]
            x = cp.random.standard_normal((1, k), dtype=cp.float32)
            y = cp.empty((1, n), cp.float32)
            # (ruff takes `mats` for the name `del` drops below; the lambda runs before that)
            t = _time_launches(cp, lambda i: linear.matvec((mats[i % copies],), x, 1, y), 60)  # noqa: F821
            nbytes = one.nbytes + 4 * (k + n)
            kernel = "mv1_stream" if be.mv1_stream and mv1_stream_ok(mats[:1]) else "mv1"
            rows.append({"kernel": f"{kernel}_{name.lower()}", "shape": f"{n}x{k}", "us": t * 1e6,
                         "gb_per_s": nbytes / t / 1e9, "tflops": 2 * n * k / t / 1e12, "vs": "copy bandwidth"})
            del bufs, mats, one
            cp.get_default_memory_pool().free_all_blocks()
    rows += _attention(be, *att)
    return rows, bandwidth


def _attention(be: Any, batch: int, heads: int, t: int, dh: int) -> list[dict]:
    cp = be.cp
    bh = batch * heads
    cfg = SimpleNamespace(n_head=bh, n_head_kv=bh, head_dim=dh, n_group=1, q_dim=bh * dh, rms_eps=1e-5)
    attn = AttentionKernels(be.gpu, be.options, SimpleNamespace(cfg=cfg, ctx=t), None)  # fp16 K/V: no cache
    q = cp.random.standard_normal((t, bh, dh), dtype=cp.float32)
    k = cp.random.standard_normal((t, bh, dh), dtype=cp.float32).astype(cp.float16)
    v = cp.random.standard_normal((t, bh, dh), dtype=cp.float32).astype(cp.float16)
    q16 = (q * np.float32(tc_qscale(dh))).astype(cp.float16)
    pos = cp.arange(t, dtype=cp.int32)
    flops = 4 * bh * t * t * dh / 2  # causal: half of QK^T and PV
    shape = f"B{batch} H{heads} T{t} D{dh} causal"
    # The kernel the model runs first (wgmma on a Hopper GPU), then the portable mma.sync one if different.
    default = be.attention_wg
    ours: list[tuple[dict, Any, float]] = []  # (row, output, seconds)
    for wg in [True, False] if default and dh in ATT_WG_DIMS else [False]:
        be.attention_wg = wg
        out = cp.full((t, bh * dh), cp.nan, dtype=cp.float16)
        sec = _time_launches(cp, lambda i: attn.attend_tc(q16, bh * dh, k, v, pos, t, out), 20)
        row = {"kernel": f"attention prefill (ours, {'wgmma' if wg else 'mma.sync'}, fp16 q/K/V/out)",
               "shape": shape, "us": sec * 1e6, "gb_per_s": None, "tflops": flops / sec / 1e12}
        ours.append((row, out, sec))
    be.attention_wg = default
    rows = [row for row, _, _ in ours]
    try:
        import torch
        import torch.nn.functional as F
    except Exception as exc:  # torch is optional
        for row in rows:
            row["vs"] = f"torch not importable ({type(exc).__name__})"
        return rows
    dev = torch.device("cuda")
    tq = torch.from_dlpack(q.astype(cp.float16)).to(dev).view(t, batch, heads, dh).permute(1, 2, 0, 3).contiguous()
    tk = torch.from_dlpack(k).view(t, batch, heads, dh).permute(1, 2, 0, 3).contiguous()
    tv = torch.from_dlpack(v).view(t, batch, heads, dh).permute(1, 2, 0, 3).contiguous()
    ref = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    end.record()
    end.synchronize()
    tsec = start.elapsed_time(end) / 1e3 / 20
    for row, out, sec in ours:
        got = torch.from_dlpack(out.astype(cp.float32)).view(t, batch, heads, dh).permute(1, 2, 0, 3).float()
        err = float((got - ref.float()).abs().max())
        row["vs"] = f"{tsec / sec:.2f}x torch SDPA (max abs diff {err:.2e})"
    rows.append({"kernel": "torch SDPA (fp16)", "shape": shape, "us": tsec * 1e6, "gb_per_s": None,
                 "tflops": flops / tsec / 1e12, "vs": f"torch {torch.__version__}"})
    return rows
