"""mistral3: the name newer llama.cpp converters give Mistral's text models (Ministral 3 3B/8B/14B, Mistral
Small 3.x as written after late 2025; llama.cpp's src/models/mistral3.cpp). The block is Llama's (normal
RoPE pairing, YaRN scaling read by models/config.py); what it adds and we do not run is refused by name:
- `attention.temperature_scale` (Llama-4-style query scaling that grows with the position),
- biases on the output projection or the feed-forward, and mixture-of-experts layers.
Mistral Small 3.0/3.1 files written as `llama` run as llama (models/llama.py).
"""

from typing import Any

from ...errors import UnknownArchitectureError
from ..base import ROPE_NORMAL, Architecture

_UNSUPPORTED_TENSORS = {
    "blk.0.attn_output.bias": "a bias on the attention output",
    "blk.0.ffn_up.bias": "feed-forward biases",
    "blk.0.ffn_gate_inp.weight": "mixture-of-experts layers",
}


def _check(metadata: Any, tensors: frozenset[str]) -> None:
    scale = (metadata or {}).get("mistral3.attention.temperature_scale")
    if scale:
        raise UnknownArchitectureError(
            f"this mistral3 file uses position-dependent attention temperature scaling (temperature_scale "
            f"{scale!r}, as Ministral 3 does), which llamacli does not run yet"
        )
    for name, what in _UNSUPPORTED_TENSORS.items():
        if name in tensors:
            raise UnknownArchitectureError(f"this mistral3 file has {what}, which llamacli does not run yet")


ARCH = Architecture(name="mistral3", rope_type=ROPE_NORMAL, check=_check)
