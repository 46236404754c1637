"""qwen3: Qwen3 dense models (0.6B-32B) and the DeepSeek-R1-0528-Qwen3-8B distill (llama.cpp's
src/models/qwen3.cpp): Llama's block without biases, with a per-head RMSNorm of q and k (before NEOX RoPE).
attention.key_length (the head dim, 128) may differ from n_embd / n_head, so Hq Dh may differ from D.

Tensors per layer: llama's plus attn_q_norm [Dh] and attn_k_norm [Dh].
"""

from ..base import ROPE_NEOX, Architecture, LayerPlan

ARCH = Architecture(name="qwen3", rope_type=ROPE_NEOX, layer=lambda info: LayerPlan(qk_norm=True))
