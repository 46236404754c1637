"""KV cache types, as llama.cpp's --cache-type-k / --cache-type-v (-ctk / -ctv) name them.

- f16 (the default): K and V rows stored as fp16 on CUDA; the NumPy backend keeps them as float32, its
  reference arithmetic.
- q8_0: GGUF's Q8_0 blocks along the head dimension (32 values: one fp16 scale d = max|x| / 127 and 32 int8
  codes round(x / d), half away from zero), 34 bytes per 32 values: 1.89x the positions of f16 in the same
  memory. The NumPy backend stores the rows as they come back from those blocks (gguf.quants quantizes and
  dequantizes them, the reference rounding), so every read sees what an 8-bit cache holds. The CUDA backend
  keeps int8 codes and fp16 scales (cuda/kv.py KVCache), quantized from the f32 K and V by the same
  rule, and takes K and V of one type, as llama.cpp's CUDA flash attention does.

Sliding-window layers keep a ring instead of a row per position (llama.cpp's SWA cache; --swa-full, as
llama.cpp's option, keeps every position there too: ModelConfig.swa_full): a layer whose query
at p sees only keys p - window < k <= p needs `window` past rows, so it holds ring_rows(window, ctx) rows and
stores position p at row p mod rows. The ring also takes a whole pass of new positions (RING_CHUNK, the CUDA
backend's prefill chunk) without overwriting a key its own first query still needs: rows >= window +
RING_CHUNK - 1, rounded up to 128 so that no 32- or 64-key tile of the attention kernels wraps. A global layer
(or a ring no smaller than ctx) keeps ctx rows, where p mod ctx = p. Gemma 3 270M at 32k positions: 15 of its
18 layers hold 1,024 rows instead of 32,768 (604 MB -> 116 MB). A ring forgets: a cache rewound to an
earlier prefix (ring_keeps) must still hold that prefix's last window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import UsageError

if TYPE_CHECKING:  # (numpy is imported where used: the CLI checks -ctk/-ctv before anything loads it)
    import numpy as np

# type -> (values per block, bytes per block)
CACHE_TYPES: dict[str, tuple[int, int]] = {"f16": (1, 2), "q8_0": (32, 34)}
DEFAULT = ("f16", "f16")
RING_CHUNK = 512  # the most new positions one attention pass writes into a ring (CUDA: PREFILL_CHUNK)
RING_ALIGN = 128  # ring rows are a multiple of this (whole 32- and 64-key tiles)


def ring_rows(window: int, ctx: int) -> int:
    """Rows of a layer's K/V cache at a context of `ctx` positions: a ring of window + RING_CHUNK - 1 rows
    (rounded up to RING_ALIGN) for a sliding-window layer where that is smaller than ctx, else ctx."""
    if window <= 0:
        return ctx
    rows = -(-(window + RING_CHUNK - 1) // RING_ALIGN) * RING_ALIGN
    return rows if rows < ctx else ctx


def ring_span(window: int, rows: int, ctx: int) -> int:
    """The most consecutive new positions one attention pass may write into a cache of `rows` rows (a ring
    when rows < ctx) before its queries read it: rows - window + 1 keeps every key the pass's first query
    sees; a full cache (rows == ctx) takes any number."""
    return rows - window + 1 if rows < ctx else ctx


def ring_keeps(keep: int, high: int, layers: list[tuple[int, int]], ctx: int) -> bool:
    """Whether a cache whose highest written position is `high` still holds what a pass from position `keep`
    needs: on every ring (layers: (window, rows) per layer), the keys keep - window + 1 .. keep - 1, i.e. no
    later position of their rows (p + rows) was written. keep 0 needs nothing."""
    if keep <= 0:
        return True
    return all(rows >= ctx or max(0, keep - window + 1) > high - rows for window, rows in layers)


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
    import numpy as np
    from gguf import GGMLQuantizationType as QT, quants

    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    with np.errstate(all="ignore"):  # a non-finite value makes its block NaN, as the model's own checks expect
        return quants.dequantize(quants.quantize(flat, QT.Q8_0), QT.Q8_0).reshape(x.shape).astype(np.float32)
