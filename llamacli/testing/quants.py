"""Random weight data of any ggml type for tests and benchmarks, and the int8 activations the CUDA matvecs
use (in the package so the GPU machine can use it too).

- `random_quant_rows(qtype, rows, cols, rng)`: valid random blocks of any ggml type. Types gguf.quants can
  quantize (MXFP4 included) are quantized from Gaussian floats; the K- and IQ-types get random quants with
  small finite scales, rescaled so that values have about the requested standard deviation. With
  fast=True (speed-run files of billions of weights) every block type is random bytes with its scale set,
  drawn 8 bytes at a time: far faster than quantizing (Q8_0, and MXFP4 slower still; docs/perf-log.md).
  gguf.quants.dequantize is the reference for all of them.
- `tensor_type(name, shape, qtype, n_layer)`: the type of one tensor in a model of a type or of a mix
  ("Q4_K_M", "MXFP4_MOE").
- `act8(x)`, `act8_bound(h, wref)`: the int8 activations of the MV1_ACT8 kernels, and the most they move a dot.

Apart from testing/__init__.py (model shapes and the GGUF writer) because this is about blocks and bytes, not models.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, quants as _gq

# Byte offsets of the fp16 scale fields inside one block (ggml-common.h), for the types filled with
# random bytes. Everything else in those blocks (quants, sub-scales, grid indexes) is valid whatever its bits.
_F16_FIELDS: dict[QT, tuple[int, ...]] = {
    QT.Q2_K: (80, 82),  # scales[16] qs[64] d dmin
    QT.Q3_K: (108,),  # hmask[32] qs[64] scales[12] d
    QT.Q4_K: (0, 2),  # d dmin scales[12] qs[128]
    QT.Q5_K: (0, 2),  # d dmin scales[12] qh[32] qs[128]
    QT.Q6_K: (208,),  # ql[128] qh[64] scales[16] d
    QT.IQ2_XXS: (0,),
    QT.IQ2_XS: (0,),
    QT.IQ2_S: (0,),
    QT.IQ3_XXS: (0,),
    QT.IQ3_S: (0,),
    QT.IQ1_S: (0,),
    QT.IQ4_NL: (0,),
    QT.IQ4_XS: (0,),
}
_QUANTIZABLE = {QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.TQ1_0, QT.TQ2_0, QT.MXFP4}
# The fp16 scales of the quantizable block types, for the fast path (random bytes with these set).
_FAST_F16_FIELDS: dict[QT, tuple[int, ...]] = {
    QT.Q8_0: (0,),  # d qs[32]
    QT.Q4_0: (0,),  # d qs[16]
    QT.Q4_1: (0, 2),  # d m qs[16]
    QT.Q5_0: (0,),  # d qh[4] qs[16]
    QT.Q5_1: (0, 2),  # d m qh[4] qs[16]
}
MXFP4_RMS = 5.852  # rms of ggml's doubled E2M1 table kvalues_mxfp4 over 16 uniform nibbles: sqrt(274 / 8)

# Types the kernels and the reference run for model weights (GGUF files of the supported families).
WEIGHT_TYPES = (
    QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
    QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS,
)


def random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random bytes as uint8, drawn as uint64 (faster than drawing bytes)."""
    words = rng.integers(0, np.iinfo(np.uint64).max, size=-(-n // 8), dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)[:n]


def random_quant_rows(qtype: QT, n_rows: int, n_cols: int, rng: np.random.Generator, std: float = 0.02,
                      fast: bool = False) -> np.ndarray:
    """Random valid data of `qtype`, shape [n_rows, n_cols]: typed float arrays for F32/F16, else uint8
    [n_rows, row_bytes] blocks. Values have roughly standard deviation `std`. `fast`: random blocks instead
    of quantized Gaussians for the quantizable types too, and bytes drawn 8 at a time (speed-run files)."""
    block, size = GGML_QUANT_SIZES[qtype]
    if n_cols % block:
        raise ValueError(f"{qtype.name} rows need a multiple of {block} values, got {n_cols}")
    n_blocks = n_rows * n_cols // block
    if qtype == QT.MXFP4 and fast:
        # E8M0 byte e scales the doubled E2M1 values by 2^(e-128) (ggml_e8m0_to_fp32_half): pick e so that
        # 16 uniform nibbles have about `std`, then one step up or down per block.
        blocks = random_bytes(rng, n_blocks * size).reshape(n_blocks, size)
        e0 = int(round(128 + np.log2(std / MXFP4_RMS)))
        blocks[:, 0] = np.clip(e0 - 1 + blocks[:, 0] % 3, 2, 254)
        return blocks.reshape(n_rows, -1)
    if qtype in _QUANTIZABLE and not (fast and qtype in _FAST_F16_FIELDS):
        x = (rng.standard_normal((n_rows, n_cols), dtype=np.float32) * std).astype(np.float32)
        if qtype == QT.F32:
            return x
        if qtype == QT.F16:
            return x.astype(np.float16)
        return _gq.quantize(x, qtype)
    if fast:
        blocks = random_bytes(rng, n_blocks * size).reshape(n_blocks, size)
    else:
        blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    fields = _F16_FIELDS.get(qtype) or _FAST_F16_FIELDS.get(qtype, ())
    if qtype == QT.IQ1_M:
        # The fp16 super-scale is spread over the top nibbles of the four u16 scales (bytes 48..55); with
        # d ~ std/8 values come out near `std` (grid values +-1, sub-scales 1..15, delta 0.125).
        d = (rng.uniform(0.5, 1.5, n_blocks) * std / 8).astype(np.float16).view(np.uint16)
        sc = blocks[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for j in range(4):
            sc[:, j] |= ((d >> np.uint16(4 * j)) & np.uint16(0xF)) << np.uint16(12)
        blocks[:, 48:56] = sc.view(np.uint8)
    elif qtype.name == "NVFP4":  # by name: gguf knows the type from 0.19 on
        # Four unsigned e4m3 scales per 64 values; small subnormal ones (man * 2^-10) keep values near 0.02.
        blocks[:, 0:4] = rng.integers(2, 8, size=(n_blocks, 4), dtype=np.uint8)
    elif fields:
        for off in fields:
            blocks[:, off : off + 2] = rng.uniform(0.5, 1.5, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    data = blocks.reshape(n_rows, -1)
    # Rescale the fp16 scales so values have about `std` (dequantization is linear in them).
    sample = _gq.dequantize(data[: min(n_rows, 64)], qtype)
    cur = float(np.sqrt(np.mean(sample.astype(np.float64) ** 2)))
    if fields and cur > 0:
        factor = std / cur
        for off in fields:
            field = blocks[:, off : off + 2].copy().view(np.float16).astype(np.float32) * factor
            blocks[:, off : off + 2] = field.astype(np.float16).view(np.uint8)
    return blocks.reshape(n_rows, -1)



# llama.cpp's fallbacks when a row is not a whole number of 256-value super-blocks (llama-quant.cpp).
_FALLBACK = {QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.IQ4_NL, QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0, QT.IQ4_XS: QT.IQ4_NL}


MIXES = {"Q4_K_M": 15, "MXFP4_MOE": 38}  # type mixes write_model takes, with their general.file_type


def tensor_type(name: str, shape: tuple[int, ...], qtype: QT | str, n_layer: int, tied: bool = False) -> QT:
    """The type of one tensor in a model of `qtype`. "Q4_K_M" mimics llama.cpp's mix: Q6_K for the output
    and for attn_v/ffn_down (experts' too) in a few layers, Q4_K elsewhere. "MXFP4_MOE" is gpt-oss's files:
    experts MXFP4, the other matrices Q8_0. Vectors and biases (an expert bias [E, F] too) stay F32, and so
    do routers (llama.cpp never quantizes ffn_gate_inp, nor a shared expert's gate ffn_gate_inp_shexp) and a delta
    net's convolution (ssm_conv1d); fallbacks per row size."""
    if len(shape) == 1 or name.endswith(".bias") or "ffn_gate_inp" in name or "ssm_conv1d" in name:
        return QT.F32
    if qtype == "MXFP4_MOE":
        t = QT.MXFP4 if "_exps" in name else QT.Q8_0
    elif qtype == "Q4_K_M":
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        more_bits = layer >= 0 and (layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2)
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            t = QT.Q6_K  # the LM head
        elif ("attn_v" in name or "ffn_down" in name) and more_bits:
            t = QT.Q6_K
        else:
            t = QT.Q4_K
    else:
        t = QT[qtype] if isinstance(qtype, str) else qtype
    block = GGML_QUANT_SIZES[t][0]
    while shape[-1] % block:
        t = _FALLBACK.get(t, QT.F16)
        block = GGML_QUANT_SIZES[t][0]
    return t



def act8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The int8 activations the CUDA mv1 dots for the MV1_ACT8 types (kernels/matvec.cu stage_xq), computed the
    same way in float32 from x [k]: (the values they stand for, xq * xd, as float64 [k]; xd per 32-value unit)."""
    k = x.shape[-1]
    units = -(-k // 32)
    xp = np.zeros(units * 32, np.float32)
    xp[:k] = x
    u = xp.reshape(units, 32)
    amax = np.abs(u).max(axis=1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    q = np.rint(u * inv.astype(np.float32)[:, None])  # a float32 product, ties to even as __float2int_rn
    xd = amax / np.float32(127)
    return (q.astype(np.float64) * xd.astype(np.float64)[:, None]).reshape(-1)[:k], xd


def act8_bound(h: np.ndarray, wref: np.ndarray) -> np.ndarray:
    """The most int8 activations can move each row's dot: every value of h by at most half its unit's xd."""
    k = h.shape[-1]
    xd = np.abs(np.pad(h.astype(np.float64), (0, -k % 32)).reshape(-1, 32)).max(axis=1) / 127
    return np.abs(wref) @ np.repeat(xd / 2, 32)[:k] * (1 + 1e-5)

