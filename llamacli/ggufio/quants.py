"""Dequantization to float32, through gguf.quants (the reference implementation of ggml's block formats).

A row of a quantized 2-D tensor is a whole number of blocks (ggml-common.h), so any subset of rows can be
dequantized alone: `gather_rows` is the embedding lookup that never touches the rest of the table.

gguf is imported when a block format is first asked about, not with this module: the CUDA backend reads its
float32 norms through here, and the `gguf` package's import is the cost ggml_types.py keeps off start-up.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UnsupportedTensorTypeError
from .ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType

_PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
}


def _gguf_quants() -> Any:
    from gguf import quants

    return quants


def can_dequantize(qtype: GGMLQuantizationType) -> bool:
    """Types gguf.quants (or a plain cast) can turn into float32."""
    if qtype in _PLAIN:
        return True
    gq = _gguf_quants()
    try:
        return gq._type_traits.get(qtype) is not None  # the classes gguf.quants registers
    except AttributeError:  # pragma: no cover - older gguf: try a one-block dequantize
        block, size = GGML_QUANT_SIZES[qtype]
        try:
            gq.dequantize(np.zeros(size, dtype=np.uint8), qtype)
            return True
        except NotImplementedError:
            return False


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`data` as GGUFFile.raw gives it (typed for plain types, uint8 [..., row_bytes] for blocks) -> float32
    with the last dim in values."""
    if qtype in _PLAIN:
        return np.asarray(data, dtype=np.float32)
    try:
        return _gguf_quants().dequantize(np.asarray(data), qtype).astype(np.float32, copy=False)
    except NotImplementedError:
        raise UnsupportedTensorTypeError(f"cannot dequantize ggml type {qtype.name}") from None


def gather_rows(data: np.ndarray, qtype: GGMLQuantizationType, ids, n_cols: int) -> np.ndarray:
    """Rows `ids` of a 2-D tensor [n_rows, n_cols] as float32 [len(ids), n_cols]."""
    idx = np.asarray(ids, dtype=np.int64).reshape(-1)
    n_rows = data.shape[0]
    if idx.size == 0:
        return np.zeros((0, n_cols), dtype=np.float32)
    if idx.min() < 0 or idx.max() >= n_rows:
        raise IndexError(f"row index out of range [0, {n_rows})")
    return dequantize(data[idx], qtype).reshape(idx.size, n_cols)


def bits_per_weight(qtype: GGMLQuantizationType) -> float:
    block, size = GGML_QUANT_SIZES[qtype]
    return size * 8 / block
