"""KV cache types, as llama.cpp's --cache-type-k / --cache-type-v (-ctk / -ctv) name them.

- f16 (the default): K and V rows stored as fp16 on CUDA; the NumPy backend keeps them as float32, its
  reference arithmetic.
- q8_0: GGUF's Q8_0 blocks along the head dimension (32 values: one fp16 scale d = max|x| / 127 and 32 int8
  codes round(x / d), half away from zero), 34 bytes per 32 values: 1.89x the positions of f16 in the same
  memory. The NumPy backend stores the rows as they come back from those blocks (gguf.quants quantizes and
  dequantizes them, the reference rounding), so every read sees what an 8-bit cache holds. The CUDA backend
  does not have it yet (CudaBackend.load refuses it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import UsageError

# type -> (values per block, bytes per block)
CACHE_TYPES: dict[str, tuple[int, int]] = {"f16": (1, 2), "q8_0": (32, 34)}
DEFAULT = ("f16", "f16")


def parse_cache_type(value: Any, option: str) -> str:
    """A cache type named on the command line (any case) -> its canonical name, or UsageError naming `option`."""
    name = value.lower() if isinstance(value, str) else value
    if name not in CACHE_TYPES:
        raise UsageError(f"{option}: unsupported KV cache type {value!r} (supported: {', '.join(CACHE_TYPES)})")
    return name


def parse_cache_types(k: Any, v: Any) -> tuple[str, str]:
    """-ctk and -ctv -> their canonical names (parse_cache_type)."""
    return parse_cache_type(k, "--cache-type-k"), parse_cache_type(v, "--cache-type-v")


def cache_type_fits(head_dim: int, cache_type: str) -> bool:
    """Whether rows of `head_dim` values are whole blocks of `cache_type` (q8_0: 32 values)."""
    return head_dim % CACHE_TYPES[cache_type][0] == 0


def cache_row_bytes(cache_type: str, n_values: int) -> float:
    """Bytes of `n_values` cached values of `cache_type` (whole blocks)."""
    per, nbytes = CACHE_TYPES[cache_type]
    return -(-n_values // per) * nbytes


def check_cache_types(head_dim: int, types: tuple[str, str]) -> None:
    """UsageError unless every type can store rows of `head_dim` values (q8_0: whole 32-value blocks)."""
    for which, t in zip(("K", "V"), types):
        if not cache_type_fits(head_dim, t):
            raise UsageError(f"a {t} {which} cache needs a head dimension that is a multiple of "
                             f"{CACHE_TYPES[t][0]}; this model's is {head_dim}")


def q8_0_roundtrip(x: np.ndarray) -> np.ndarray:
    """x [..., D] (D a multiple of 32) -> float32 as stored by a q8_0 cache: Q8_0 blocks along the last axis,
    quantized and dequantized by gguf.quants (a block holding a non-finite value comes back NaN)."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants

    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    with np.errstate(all="ignore"):  # a non-finite value makes its block NaN, as the model's own checks expect
        return quants.dequantize(quants.quantize(flat, QT.Q8_0), QT.Q8_0).reshape(x.shape).astype(np.float32)
