"""phi3: Phi-3 / Phi-3.5-mini, Phi-4-mini: one attn_qkv matrix, ffn_up holding [gate; up], NEOX RoPE with
longrope factors (rope_factors_long / rope_factors_short); Phi-4-mini rotates only rope.dimension_count
(96) of its 128 head dims.

Tensors per layer: attn_norm [D], attn_qkv [(Hq + 2 Hkv) Dh, D], attn_output [D, Hq Dh], ffn_norm [D],
ffn_up [2F, D], ffn_down [D, F]. llama.cpp also takes separate attn_q/k/v, and so do we.
"""

from ..base import ROPE_NEOX, Architecture, LayerInfo, LayerPlan


def _layer(info: LayerInfo) -> LayerPlan:
    split = "blk.0.attn_q.weight" in info.tensors and "blk.0.attn_qkv.weight" not in info.tensors
    return LayerPlan(fused_qkv=not split, fused_gate_up=True)


ARCH = Architecture(name="phi3", rope_type=ROPE_NEOX, layer=_layer)
