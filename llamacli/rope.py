"""RoPE frequency tables (Su et al. 2021), with the scalings GGUF files use. Shared by every backend.

theta[i] = base^(-2i / rope_dim) for i < rope_dim/2, then
  linear:   theta / factor                          (positions stretched by the factor)
  llama3:   theta / rope_freqs[i]                   (per-frequency factors stored as a tensor)
  longrope: theta / rope_factors_{long|short}[i]    (phi3; long when the context exceeds the original),
            and cos/sin multiplied by the attention factor.
The angle of pair i at position p is p * theta[i].
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .gguf_file import GGUFFile


def inv_freq(cfg: ModelConfig, gguf: GGUFFile | None, ctx: int) -> np.ndarray:
    """theta [rope_dim/2] as float32 (computed in float64)."""
    half = cfg.rope_dim // 2
    theta = cfg.rope_freq_base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)
    if cfg.rope_scaling == "linear":
        theta /= cfg.rope_scaling_factor
    elif cfg.rope_scaling == "llama3" and gguf is not None:
        theta /= gguf.dequantize("rope_freqs.weight").astype(np.float64)
    elif cfg.rope_scaling == "longrope" and gguf is not None:
        # llama.cpp picks the long factors when the context in use exceeds the original training context.
        name = "rope_factors_long.weight" if ctx > cfg.rope_original_context else "rope_factors_short.weight"
        theta /= gguf.dequantize(name).astype(np.float64)
    return theta.astype(np.float32)


def cos_sin(theta: np.ndarray, pos: np.ndarray, attn_factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, rope_dim/2] float32 for positions pos [T]."""
    angles = np.asarray(pos, dtype=np.float64)[:, None] * theta.astype(np.float64)[None, :]
    return (np.cos(angles) * attn_factor).astype(np.float32), (np.sin(angles) * attn_factor).astype(np.float32)
