"""What an architecture is: the per-layer plan every forward path reads, and the tensors it implies.

An architecture module (llama.py, qwen3.py, ...) builds one `Architecture`: its RoPE pairing and a function
from a layer's place in the model to a `LayerPlan`. The NumPy forward (model.py), the fused CUDA prefill and
the captured CUDA decode step all read `ModelConfig.layers` (one plan per layer), and `weights.py` derives
the tensors a layer needs from its plan, so a new architecture that only combines existing operations is one
new module here plus its tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

ROPE_NORMAL = "normal"  # dims (2i, 2i+1) rotate together (llama; the converter permuted Q/K for it)
ROPE_NEOX = "neox"  # dims (i, i + rope_dim/2) rotate together (qwen2, phi3, qwen3)


@dataclass(frozen=True)
class LayerPlan:
    """What one transformer block does, beyond the pre-norm attention + SwiGLU skeleton every block has."""

    fused_qkv: bool = False  # one attn_qkv [(Hq + 2 Hkv) Dh, D] with rows [q; k; v] (phi3)
    qkv_bias: bool = False  # attn_{q,k,v}.bias (qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE: attn_q_norm / attn_k_norm [Dh] (qwen3)
    rope: bool = True  # rotate q and k (smollm3 leaves every fourth layer unrotated)
    fused_gate_up: bool = False  # ffn_up [2F, D] holds rows [gate; up] (phi3)


@dataclass(frozen=True)
class LayerInfo:
    """What a layer's plan may depend on."""

    index: int
    n_layer: int
    tensors: frozenset[str]  # every tensor name in the file (empty when only metadata is known)
    metadata: Any = None  # the file's metadata mapping (for architectures with per-layer keys)


@dataclass(frozen=True)
class Architecture:
    name: str  # general.architecture
    rope_type: str  # ROPE_NORMAL | ROPE_NEOX
    layer: Callable[[LayerInfo], LayerPlan] = field(default=lambda info: LayerPlan())
    # Raises UnsupportedFeatureError for a file of this architecture that needs what no plan describes.
    check: Callable[[Any, frozenset[str]], None] = field(default=lambda metadata, tensors: None)

    def plans(self, n_layer: int, tensors: set[str] | frozenset[str], metadata: Any = None) -> tuple[LayerPlan, ...]:
        names = frozenset(tensors)
        self.check(metadata, names)
        return tuple(self.layer(LayerInfo(i, n_layer, names, metadata)) for i in range(n_layer))


_FEATURES = (  # (plan field, shown when the layer has it (True) or lacks it (False), label)
    ("fused_qkv", True, "fused QKV"),
    ("qkv_bias", True, "QKV bias"),
    ("qk_norm", True, "q/k norm"),
    ("rope", False, "no RoPE"),
    ("fused_gate_up", True, "fused gate/up"),
)


def describe(plans: tuple[LayerPlan, ...]) -> str:
    """What the layers do beyond the Llama block, for `inspect`: "q/k norm", "no RoPE on 9 of 36 layers"."""
    parts = []
    for name, when, label in _FEATURES:
        n = sum(getattr(p, name) == when for p in plans)
        if n:
            parts.append(label if n == len(plans) else f"{label} on {n} of {len(plans)} layers")
    return ", ".join(parts) or "the Llama block"
