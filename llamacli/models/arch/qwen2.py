"""qwen2: Qwen2 / Qwen2.5 (and their R1 distills): Llama's block with Q/K/V biases and NEOX RoPE.

Tensors per layer: llama's plus attn_q.bias [Hq Dh], attn_k.bias / attn_v.bias [Hkv Dh].
"""

from ..base import ROPE_NEOX, Architecture, LayerPlan

ARCH = Architecture(name="qwen2", rope_type=ROPE_NEOX, layer=lambda info: LayerPlan(qkv_bias=True))
