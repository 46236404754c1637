"""RoPE frequency tables (Su et al. 2021), with the scalings GGUF files use. Shared by every backend.

theta[i] = base^(-2i / rope_dim) for i < rope_dim/2, then
  linear:   theta / factor                          (positions stretched by the factor)
  llama3:   theta / rope_freqs[i]                   (per-frequency factors stored as a tensor; gemma4's global
                                                    layers' "proportional" RoPE is written so: factors 1e30 on
                                                    the pairs that do not rotate)
  longrope: theta / rope_factors_{long|short}[i]    (phi3; long when the context exceeds the original),
            and cos/sin multiplied by the attention factor.
  yarn:     theta / factor * (1 - r[i]) + theta * r[i] (Peng et al. 2023, as ggml's rope_yarn and
            transformers' _compute_yarn_parameters): r[i] = 1 - clamp((i - lo) / max(hi - lo, 0.001), 0, 1),
            where lo / hi are the pair indices that turn beta_fast / beta_slow times over the original
            context; cos/sin multiplied by the magnitude factor config.py computes.
The angle of pair i at position p is p * theta[i]. Only the first rope_dim dims of a head rotate.

Multi-section RoPE (qwen35's "imrope", ggml's rope_multi with GGML_ROPE_TYPE_IMROPE): pair i takes the position of
one of four streams (time, height, width, extra), interleaved by the sections [t, h, w, e]. A text token has the
same position on the first three and 0 on the fourth (llama.cpp's llm_graph_input_pos), so for text this is the
plain table with theta[i] = 0 on the pairs the fourth stream owns: none with the released sections [11, 11, 10, 0].
"""

from __future__ import annotations

import math

import numpy as np

from ..ggufio.file import GGUFFile
from .config import FREQ_FACTORS, ModelConfig


def inv_freq(cfg: ModelConfig, gguf: GGUFFile | None, ctx: int, local: bool = False) -> np.ndarray:
    """theta [rope_dim/2] as float32 (computed in float64). `local`: the table of the layers whose plan has
    rope_local (gemma's sliding-window layers): base cfg.rope_local_base, cfg.local_rope_dim dims, no scaling."""
    dims = cfg.local_rope_dim if local else cfg.rope_dim
    half = dims // 2
    base = cfg.rope_local_base if local else cfg.rope_freq_base
    theta = base ** (-np.arange(half, dtype=np.float64) * 2.0 / dims)
    if local:
        return theta.astype(np.float32)
    if cfg.rope_scaling == "linear":
        theta /= cfg.rope_scaling_factor
    elif cfg.rope_scaling in FREQ_FACTORS and gguf is not None:
        theta /= gguf.dequantize("rope_freqs.weight").astype(np.float64)
    elif cfg.rope_scaling == "yarn":
        theta *= _yarn_blend(cfg, half)
    elif cfg.rope_scaling == "longrope" and gguf is not None:
        # llama.cpp picks the long factors when the context in use exceeds the original training context.
        name = "rope_factors_long.weight" if ctx > cfg.rope_original_context else "rope_factors_short.weight"
        theta /= gguf.dequantize(name).astype(np.float64)
    if cfg.rope_sections:
        theta[~text_pairs(cfg.rope_sections, half)] = 0.0
    return theta.astype(np.float32)


def text_pairs(sections: tuple[int, ...], half: int) -> np.ndarray:
    """bool [half]: the pairs that rotate at a text token's position under interleaved multi-section RoPE with
    `sections` [t, h, w, e] (ggml_mrope_cache_init's is_imrope branch): pair i's sector i % sum(sections) belongs to
    t, h or w when sector % 3 == 0, 1, 2 and sector < 3 * that section; else to e (position 0 for text)."""
    t, h, w = sections[:3]
    sector = np.arange(half) % sum(sections)
    return ((sector % 3 == 0) & (sector < 3 * t)) | ((sector % 3 == 1) & (sector < 3 * h)) | \
        ((sector % 3 == 2) & (sector < 3 * w))


def _yarn_blend(cfg: ModelConfig, half: int) -> np.ndarray:
    """Per-pair multipliers [rope_dim/2] on theta: 1/factor for slow (interpolated) pairs, 1 for fast ones,
    a linear ramp between."""
    dims, base, orig = cfg.rope_dim, cfg.rope_freq_base, cfg.rope_original_context

    def corr_dim(rotations: float) -> float:  # the pair index that turns `rotations` times over `orig`
        return dims * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo = max(0.0, math.floor(corr_dim(cfg.rope_yarn_beta_fast)))
    hi = min(dims - 1.0, math.ceil(corr_dim(cfg.rope_yarn_beta_slow)))
    keep = 1.0 - np.clip((np.arange(half, dtype=np.float64) - lo) / max(hi - lo, 0.001), 0.0, 1.0)
    return (1.0 - keep) / cfg.rope_scaling_factor + keep


def cos_sin(theta: np.ndarray, pos: np.ndarray, attn_factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, rope_dim/2] float32 for positions pos [T]."""
    angles = np.asarray(pos, dtype=np.float64)[:, None] * theta.astype(np.float64)[None, :]
    return (np.cos(angles) * attn_factor).astype(np.float32), (np.sin(angles) * attn_factor).astype(np.float32)
