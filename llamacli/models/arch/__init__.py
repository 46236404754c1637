"""One module per architecture (as mlx-lm's models/): the keys it reads beyond models/config.py's common ones,
its tensors, and its per-layer plan (models/base.py LayerPlan). Every module here with an `ARCH` is an
architecture: adding one is adding a file. `architecture(name)` is the lookup models/config.py uses."""

from __future__ import annotations

import importlib
import pkgutil

from ...errors import UnknownArchitectureError
from ..base import ROPE_NEOX, ROPE_NORMAL, Architecture, LayerInfo, LayerPlan


def _discover() -> dict[str, Architecture]:
    found = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        arch = getattr(module, "ARCH", None)
        if isinstance(arch, Architecture):
            found[arch.name] = arch
    return found


ARCHITECTURES: dict[str, Architecture] = _discover()

__all__ = ["ARCHITECTURES", "ROPE_NEOX", "ROPE_NORMAL", "Architecture", "LayerInfo", "LayerPlan", "architecture"]


def architecture(name: str) -> Architecture:
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise UnknownArchitectureError(
            f"architecture {name!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return arch
