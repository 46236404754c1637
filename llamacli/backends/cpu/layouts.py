"""GGUF weight blocks re-packed, exactly, into the few layouts the CPU backend's kernels read (kernels.py).

Every block type the kernels take is, per block of 16 or 32 values, "scale * q + min" with small integers q and
float32 scale and min (ggml-common.h's formats, gguf.quants' dequantization):

    kind  values q (per row, [N, K])               types                           block   min
    u4    0..15, two per byte (below)              Q4_0 (min -8 d), Q4_1, Q4_K      32      yes
    u5    0..31: u4's nibbles, then 4 bytes of     Q5_1, Q5_K                       32      yes
          fifth bits (bit j: value j's)
    s5    -16..15 as u5's bytes of q + 16          Q5_0                             32      no
    u8    0..3, one per byte                       Q2_K                             16      yes
    s8    signed, one per byte                     Q8_0, IQ4_NL, IQ4_XS, MXFP4      32      no
                                                   (their value tables); Q6_K
                                                   (q - 32), Q3_K                   16

A K-quant's super-block of 256 values keeps an fp16 scale and sub-block scales of 6 or 8 bits: its sub-block's
scale d * sc (and min dmin * m) is one float32 product of the two, exact (11 by at most 8 significant bits), and
is what is stored here. The values are the file's: `dequantize` (scale * q + min in float32, in the order
gguf.quants computes it) gives gguf.quants.dequantize's floats bit for bit, which tests/backends/test_cpu_backend.py
checks for every type. (Q4_0's d * (q - 8) = d q - 8 d exactly: both terms and their difference fit float32's 24
bits.)

u4 packs a block's 32 values into 16 bytes as Q4_0 does: byte i holds value i in its low nibble and value
i + 16 in its high one (Q4_K's file order, 32 low nibbles then 32 high ones per 64 values, is re-packed to it).
Q5_0 and Q5_1's fifth bits are kept as the file has them, a 32-bit mask a block (Q5_K's gathered into that form);
Q6_K's upper two bits and Q3_K's third are folded into a byte a value (more memory than the file, and no bit planes
for the kernels to gather), and so are Q2_K's two.

Other types (F32, F16, BF16, the IQ1-IQ3 grids, TQ*) are not re-packed: the backend keeps those matrices as
float32, as the NumPy reference does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...ggufio.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType as QT

QK_K = 256


@dataclass(frozen=True)
class Packed:
    """A matrix [N, K] in one kernel layout: values `q` ([N, K / 2] uint8 for u4, [N, K / 32 * 20] for u5 and s5,
    [N, K] uint8 for u8, int8 for s8), float32 `d` and `m` [N, K / block] (m None for s5 and s8)."""

    kind: str  # "u4", "u5", "s5", "u8", "s8"
    block: int  # 16 or 32
    q: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    shape: tuple[int, int]
    qtype: QT

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes + (0 if self.m is None else self.m.nbytes)


def packable(qtype: QT) -> bool:
    return qtype in _PACKERS


def packed_bytes(qtype: QT, n_values: int) -> int:
    """Bytes `pack` keeps for n_values values of `qtype` (a packable type)."""
    kind, block = _PACKERS[qtype][0], _PACKERS[qtype][1]
    per_value = {"u4": 0.5, "u5": 20 / 32, "s5": 20 / 32}.get(kind, 1.0)
    return int(n_values * per_value) + (n_values // block) * 4 * (1 if kind in ("s5", "s8") else 2)


def pack(raw: np.ndarray, qtype: QT, shape: tuple[int, int]) -> Packed:
    """raw: the tensor's bytes as GGUFFile.raw gives them (uint8 [N, row_bytes]) -> Packed [N, K]."""
    n, k = shape
    kind, block, unpack = _PACKERS[qtype]
    bsize, bbytes = GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raw).reshape(n * (k // bsize), bbytes)
    q, d, m = unpack(blocks)
    q = q.reshape(n, k)
    if kind == "u4":
        q = _nibbles(q)
    elif kind in ("u5", "s5"):
        q = _nibbles_and_bits(q.astype(np.int16) + 16 if kind == "s5" else q)
    d = np.ascontiguousarray(d, dtype=np.float32).reshape(n, k // block)
    if m is not None:
        m = np.ascontiguousarray(m, dtype=np.float32).reshape(n, k // block)
    return Packed(kind, block, np.ascontiguousarray(q), d, m, shape, qtype)


def dequantize(p: Packed) -> np.ndarray:
    """float32 [N, K]: scale * q + min, the file's values (tests; the kernels compute the same)."""
    n, k = p.shape
    q = p.q
    if p.kind == "u4":  # [N, K/32, 16] -> [N, K/32, 32]
        b = q.reshape(n, k // 32, 16)
        q = np.concatenate([b & 15, b >> 4], axis=-1)
    elif p.kind in ("u5", "s5"):  # [N, K/32, 20] -> [N, K/32, 32]
        b = q.reshape(n, k // 32, 20)
        bits = np.unpackbits(b[..., 16:], axis=-1, bitorder="little")
        q = (np.concatenate([b[..., :16] & 15, b[..., :16] >> 4], axis=-1) | (bits << 4)).astype(np.int16)
        q = q - 16 if p.kind == "s5" else q
    v = q.reshape(n, k // p.block, p.block).astype(np.float32)
    out = p.d[..., None] * v
    if p.m is not None:
        out = out + p.m[..., None]
    return out.reshape(n, k)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Values 0..15 [N, K] -> [N, K / 2] bytes: per 32 values, byte i = value i | value i + 16 << 4."""
    n, k = q.shape
    b = q.reshape(n, k // 32, 2, 16).astype(np.uint8)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2)


def _nibbles_and_bits(q: np.ndarray) -> np.ndarray:
    """Values 0..31 [N, K] -> [N, K / 32 * 20] bytes: per 32 values, u4's 16 bytes of their low four bits, then
    their fifth bits as a little-endian 32-bit mask (bit j: value j)."""
    n, k = q.shape
    low = _nibbles((q & 15).astype(np.uint8)).reshape(n, k // 32, 16)
    bits = np.packbits(((q >> 4) & 1).astype(np.uint8).reshape(n, k // 32, 32), axis=-1, bitorder="little")
    return np.concatenate([low, bits], axis=-1).reshape(n, k // 32 * 20)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row -> float32 [rows, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _low_high(qs: np.ndarray, group: int) -> np.ndarray:
    """Bytes [rows, bytes] whose low nibbles are `group` values and high nibbles the next `group` -> values
    [rows, 2 * bytes] in order (gguf.quants' `>> [0, 4]` over groups of `group` bytes)."""
    rows = qs.shape[0]
    q = qs.reshape(rows, -1, 1, group) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(15)).reshape(rows, -1)


def _q4_0(blocks):
    d = _f16(blocks[:, :2])
    return _low_high(blocks[:, 2:], 16), d, -8 * d


def _q4_1(blocks):
    return _low_high(blocks[:, 4:], 16), _f16(blocks[:, :2]), _f16(blocks[:, 2:4])


def _q5_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's qh (4 bytes, bit j: value j's fifth bit) -> [rows, 32] of 0/16."""
    h = np.ascontiguousarray(qh).view("<u4").reshape(-1, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return ((h & np.uint32(1)).astype(np.uint8)) << np.uint8(4)


def _q5_0(blocks):
    q = _low_high(blocks[:, 6:], 16) | _q5_bits(blocks[:, 2:6])
    return q.astype(np.int8) - np.int8(16), _f16(blocks[:, :2]), None


def _q5_1(blocks):
    q = _low_high(blocks[:, 8:], 16) | _q5_bits(blocks[:, 4:8])
    return q, _f16(blocks[:, :2]), _f16(blocks[:, 2:4])


def _q8_0(blocks):
    return blocks[:, 2:].view(np.int8), _f16(blocks[:, :2]), None


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> sc, m [rows, 8] (ggml-common.h get_scale_min_k4)."""
    rows = scales.shape[0]
    s = scales.reshape(rows, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_k(blocks):
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    return _low_high(blocks[:, 16:], 32), d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q5_k(blocks):
    rows = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    qh = blocks[:, 16:48].reshape(rows, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _low_high(blocks[:, 48:], 32) | ((qh & np.uint8(1)).reshape(rows, QK_K) << np.uint8(4))
    return q, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q6_k(blocks):
    rows = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales, d = blocks[:, 192:208].view(np.int8), _f16(blocks[:, 208:210])
    low = _low_high(ql, 64).reshape(rows, -1, 32)  # [rows, 8, 32]
    high = qh.reshape(rows, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & np.uint8(3)).reshape(rows, -1, 32)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return q.reshape(rows, QK_K), d * scales.astype(np.float32), None


def _q3_k(blocks):
    rows = blocks.shape[0]
    hmask, qs, scales, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _f16(blocks[:, 108:110])
    lo = (scales[:, :8].reshape(rows, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(rows, 16)
    hi = (scales[:, 8:].reshape(rows, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(rows, 16)
    sc = ((lo & np.uint8(0x0F)) | ((hi & np.uint8(0x03)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    ql = (qs.reshape(rows, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    qh = (hmask.reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & np.uint8(1)
    q = ql.reshape(rows, QK_K).astype(np.int8) - ((qh.reshape(rows, QK_K) ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)
    return q, d * sc.astype(np.float32), None


def _q2_k(blocks):
    rows = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    q = (qs.reshape(rows, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    return (q.reshape(rows, QK_K), d * (scales & 0xF).astype(np.float32),
            -(dmin * (scales >> 4).astype(np.float32)))


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)  # e2m1, doubled


def _iq4_nl(blocks):
    return IQ4_VALUES[_low_high(blocks[:, 2:], 16)], _f16(blocks[:, :2]), None


def _iq4_xs(blocks):
    rows = blocks.shape[0]
    d = _f16(blocks[:, :2])
    sh = np.ascontiguousarray(blocks[:, 2:4]).view("<u2").reshape(rows, 1) >> (2 * np.arange(8, dtype=np.uint16))
    sl = (blocks[:, 4:8].reshape(rows, -1, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(rows, 8)
    ls = ((sl & np.uint8(0x0F)) | ((sh.astype(np.uint8) & np.uint8(0x03)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    return IQ4_VALUES[_low_high(blocks[:, 8:], 16)], d * ls.astype(np.float32), None


def _mxfp4(blocks):
    e = blocks[:, :1].astype(np.uint32)
    # ggml_e8m0_to_fp32_half: 2^(e - 128) as float32 bits (e < 2: a subnormal)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).astype(np.uint32)
    return MXFP4_VALUES[_low_high(blocks[:, 1:], 16)], bits.view(np.float32), None


# type -> (kind, block, unpack: blocks [n, bytes] -> (values [n, values], d, m))
_PACKERS = {
    QT.Q4_0: ("u4", 32, _q4_0),
    QT.Q4_1: ("u4", 32, _q4_1),
    QT.Q4_K: ("u4", 32, _q4_k),
    QT.Q5_0: ("s5", 32, _q5_0),
    QT.Q5_1: ("u5", 32, _q5_1),
    QT.Q5_K: ("u5", 32, _q5_k),
    QT.Q8_0: ("s8", 32, _q8_0),
    QT.Q6_K: ("s8", 16, _q6_k),
    QT.Q3_K: ("s8", 16, _q3_k),
    QT.Q2_K: ("u8", 16, _q2_k),
    QT.IQ4_NL: ("s8", 32, _iq4_nl),
    QT.IQ4_XS: ("s8", 32, _iq4_xs),
    QT.MXFP4: ("s8", 32, _mxfp4),
}
