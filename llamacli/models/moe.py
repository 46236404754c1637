"""Mixture-of-experts routing: which experts each token runs, and their weights (the reference the CUDA
route kernel matches).

Two gatings (models/base.py LayerPlan.moe_gating), as llama.cpp's build_moe_ffn and transformers compute them:
- "softmax" (qwen3moe): p = softmax(logits) over all E experts; the k largest p; their weights p, divided by
  their sum when `norm` (expert_weights_norm).
- "topk_softmax" (gpt-oss): the k largest logits; weights softmax over those k.
Ties in the selection go to the lower expert id, and the chosen experts come in descending order of score.
"""

from __future__ import annotations

import numpy as np

GATINGS = ("softmax", "topk_softmax")


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def route(logits: np.ndarray, k: int, gating: str, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """logits [T, E] -> (ids int32 [T, k], weights float32 [T, k])."""
    x = np.asarray(logits, dtype=np.float32)
    if gating not in GATINGS:
        raise ValueError(f"unknown expert gating {gating!r}")
    with np.errstate(all="ignore"):
        scores = _softmax(x.astype(np.float64)) if gating == "softmax" else x.astype(np.float64)
        # A stable sort of -score keeps equal scores in id order: ties go to the lower id.
        ids = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
        top = np.take_along_axis(scores, ids, axis=-1)
        if gating == "softmax":
            w = top / top.sum(axis=-1, keepdims=True) if norm else top
        else:
            w = _softmax(top)
    return ids.astype(np.int32), w.astype(np.float32)
