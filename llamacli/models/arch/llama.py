"""llama: Llama 2/3/3.1/3.2, Mistral 7B and Mistral Small 3.x / Ministral files written as `llama`,
TinyLlama, SmolLM2.

Keys: only the common ones (models/config.py). RoPE: normal pairing (the converter permuted Q and K); scaling
none, linear or llama3 (rope_freqs tensor).
Tensors per layer: attn_norm [D], attn_q [Hq Dh, D], attn_k / attn_v [Hkv Dh, D], attn_output [D, Hq Dh],
ffn_norm [D], ffn_gate / ffn_up [F, D], ffn_down [D, F].
"""

from ..base import ROPE_NORMAL, Architecture

ARCH = Architecture(name="llama", rope_type=ROPE_NORMAL)
