"""One module per architecture (as mlx-lm's models/): the keys it reads beyond config.py's common ones, its
tensors, and its per-layer plan (base.LayerPlan). `architecture(name)` is the lookup config.py uses."""

from __future__ import annotations

from ..errors import UnknownArchitectureError
from . import gemma2, gemma3, llama, mistral3, phi3, qwen2, qwen3, smollm3
from .base import ROPE_NEOX, ROPE_NORMAL, Architecture, LayerInfo, LayerPlan

ARCHITECTURES: dict[str, Architecture] = {m.ARCH.name: m.ARCH for m in (llama, qwen2, phi3, qwen3, smollm3, mistral3, gemma2, gemma3)}

__all__ = ["ARCHITECTURES", "ROPE_NEOX", "ROPE_NORMAL", "Architecture", "LayerInfo", "LayerPlan", "architecture"]


def architecture(name: str) -> Architecture:
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise UnknownArchitectureError(
            f"architecture {name!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return arch
